"""Every error about a file names the file and what to do, and a refusal is one line: a head or export file that is
truncated, garbled or whose header claims an absurd length (with no checksum manifest to catch it, or one rewritten
after the damage) is refused naming the file and where a good copy comes from (the training checkpoint, the native
head it was exported from); an absurd header length is refused before anything is allocated, by every reader
(headers, a store's shards, a target's weights, heads); a full disk while writing a head, an export or a store shard
names the path and leaves no partial file; and a stage run from the command line that refuses (a setting, a missing
file, a damaged head) prints one line with no traceback, unless HYDRA_FULL_ERROR=1 asks for it."""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from artifacts.checkpoint import load_native, save_native
from artifacts.export import export_head, load_any, probe_logits
from artifacts.integrity import MANIFEST, DamagedFileError, IntegrityError, write_manifest
from artifacts.validate import validate_export
from core.files import DiskFull
from core.safetensors_io import SafetensorsError, load_safetensors_dir, read_safetensors_header, scan_tensors
from data.store import FeatureStore, StoreError, StoreWriter
from inference_eval.model import tied_target
from tests.conftest import ROOT, compose_config
from tests.test_head_integrity import _head
from tests.test_store import FP, _samples

ABSURD = 2**60  # bytes a damaged 8-byte header length may claim: never to be allocated


def damage(path: Path, how: str) -> None:
    """Damage a safetensors file as a disk or a copy would: cut in half, its header bytes garbled, or its header
    length replaced by an absurd one."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "garbled":
        data[8:40] = b"\xff" * 32
    else:
        data[:8] = ABSURD.to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _after_damage(directory: Path, manifest: str) -> None:
    """What keeps the checksum check from catching the damage first: no manifest, or one written after it."""
    if manifest == "removed":
        (directory / MANIFEST).unlink()
    else:
        write_manifest(directory)


@pytest.fixture(scope="module")
def mtp(tiny_target):
    return _head(tiny_target, {"type": "mtp"})


# ---- a damaged head or export file ---------------------------------------------------------------------------
WHAT = {"truncated": "(truncated)", "garbled": "corrupt header", "absurd": f"header length {ABSURD} does not fit"}


@pytest.mark.unit
@pytest.mark.parametrize("manifest", ["removed", "rewritten"])
@pytest.mark.parametrize("how", list(WHAT))
def test_a_damaged_head_file_names_itself_and_the_checkpoint_it_came_from(how, manifest, mtp, tiny_target, tmp_path,
                                                                         tiny_overrides):
    """Before: safetensors' own message ("Error while deserializing header: incomplete metadata, file not fully
    covered", "header too large"), naming no file."""
    from types import SimpleNamespace

    from evaluation.evaluate import load_proposers
    from scripts.export import run_export

    tied, args, _ = tied_target(tiny_target)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"  # what training records as the head's source
    out = save_native(mtp, tmp_path / "head", marker={"checkpoint": str(ckpt)})
    weights = out / "model.safetensors"
    damage(weights, how)
    _after_damage(out, manifest)
    heads = SimpleNamespace(heads={"mine": str(out)}, draft_models={})  # what evaluation loads heads from
    et = SimpleNamespace(tied=tied, model=SimpleNamespace(args=args), config=SimpleNamespace(fingerprint=None),
                         device="cpu")
    export_cfg = compose_config([*tiny_overrides, f"export.source={out}", f"export.root={tmp_path / 'export'}"])
    for load in (lambda: load_native(out, tied, args), lambda: load_any(out, tied, args),
                 lambda: load_proposers(heads, et), lambda: run_export(export_cfg)):
        with pytest.raises(DamagedFileError) as e:
            load()
        msg = str(e.value)
        assert msg.startswith(f"{weights}: ") and WHAT[how] in msg, msg
        assert f"train.resume={ckpt}" in msg and "retrain it" in msg, msg
    assert isinstance(e.value, IntegrityError)  # caught wherever a changed file is
    assert not (tmp_path / "export").exists()


@pytest.mark.unit
@pytest.mark.parametrize("how", list(WHAT))
def test_a_damaged_export_file_names_itself_and_the_head_it_was_exported_from(how, mtp, tiny_target, tmp_path):
    tied, args, _ = tied_target(tiny_target)
    native = save_native(mtp, tmp_path / "head")
    out = export_head(mtp, {"mtp-vllm": tmp_path / "mtp-vllm"}, tiny_target, source=native)["mtp-vllm"]
    assert torch.equal(probe_logits(load_any(out, tied, args)), probe_logits(mtp))
    weights = out / "model.safetensors"
    damage(weights, how)
    _after_damage(out, "rewritten")
    with pytest.raises(DamagedFileError) as e:
        load_any(out, tied, args)
    msg = str(e.value)
    assert msg.startswith(f"{weights}: ") and WHAT[how] in msg and f"export.source={native}" in msg, msg
    problems = validate_export(out, "mtp-vllm", tiny_target)  # the validator lists it instead of failing
    assert len(problems) == 1 and problems[0].startswith(f"{weights}: ") and WHAT[how] in problems[0], problems


# ---- an absurd header length, wherever headers are read ------------------------------------------------------
@pytest.mark.unit
def test_an_absurd_header_length_is_refused_by_every_reader_naming_the_file(mtp, tiny_target, tmp_path):
    """Read, the claimed length would be a 1 EiB allocation (MemoryError, or the machine swapping): every reader
    refuses it from the 8 bytes, naming the file."""
    target = tmp_path / "target"
    target.mkdir()
    for f in tiny_target.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    weights = target / "model.safetensors"
    damage(weights, "absurd")
    for read in (read_safetensors_header, lambda p: scan_tensors(p.parent), lambda p: load_safetensors_dir(p.parent)):
        with pytest.raises(SafetensorsError, match=f"^{weights}: header length {ABSURD} does not fit"):
            read(weights)
    store = tmp_path / "store"
    w = StoreWriter(store, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples():
        w.add(s)
    w.close()
    shard = sorted((store / "shards").glob("*.safetensors"))[1]
    damage(shard, "absurd")
    with pytest.raises(StoreError, match=f"^{shard}: header length {ABSURD} does not fit"):
        FeatureStore(store, FP)


# ---- a full disk -------------------------------------------------------------------------------------------
def full_disk(flavour: str, after: int = 1, real=None):
    """A stand-in for safetensors' save_file (or `real`, e.g. the store's `write_safetensors`) on a disk that fills:
    the first `after` writes succeed, the next writes some bytes and fails as the OS (an OSError ENOSPC) or
    safetensors (its own error, the OS's words in its text) reports it."""
    from safetensors.torch import save_file

    real = real or (lambda tensors, path, metadata=None: save_file(tensors, path, metadata=metadata))

    calls = []

    def write(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) <= after:
            return real(tensors, path, metadata)
        Path(path).write_bytes(b"\0" * 64)
        if flavour == "os":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return write


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.unit
@pytest.mark.parametrize("flavour", ["os", "safetensors"])
def test_a_full_disk_names_what_was_written_and_leaves_the_previous_head(flavour, mtp, tiny_target, tmp_path,
                                                                         monkeypatch):
    """Before: "[Errno 28] No space left on device" or safetensors' "Error while serializing: ...", naming no file."""
    import artifacts.checkpoint
    import artifacts.formats.mtp_vllm

    tied, args, _ = tied_target(tiny_target)
    out = save_native(mtp, tmp_path / "head")
    export = export_head(mtp, {"mtp-vllm": tmp_path / "mtp-vllm"}, tiny_target)["mtp-vllm"]
    before = _listing(tmp_path)
    other = _head(tiny_target, {"type": "mtp"}, seed=1)
    for module, save in ((artifacts.checkpoint, lambda: save_native(other, out)),
                         (artifacts.formats.mtp_vllm, lambda: export_head(other, {"mtp-vllm": export}, tiny_target))):
        monkeypatch.setattr(module, "save_file", full_disk(flavour, after=0))
        with pytest.raises(DiskFull) as e:
            save()
        msg = str(e.value)
        assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
        assert msg.startswith(f"{out if module is artifacts.checkpoint else export}: cannot be written: the disk is "
                              "full"), msg
        assert "nothing partial was kept" in msg and "MiB free there now" in msg, msg
        assert _listing(tmp_path) == before  # no temp dir, nothing half-written, the previous artifacts in place
    assert torch.equal(probe_logits(load_native(out, tied, args)), probe_logits(mtp))
    assert torch.equal(probe_logits(load_any(export, tied, args)), probe_logits(mtp))


@pytest.mark.unit
@pytest.mark.parametrize("flavour", ["os", "safetensors"])
def test_a_full_disk_while_writing_a_store_shard_names_it_and_the_store_resumes(flavour, tmp_path, monkeypatch):
    import data.store

    samples = _samples()
    monkeypatch.setattr(data.store, "write_safetensors", full_disk(flavour, after=1, real=data.store.write_safetensors))
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    with pytest.raises(DiskFull) as e:
        for s in samples:
            w.add(s)
    shard = tmp_path / "shards" / "shard-00001.safetensors"
    assert str(e.value).startswith(f"{shard}: cannot be written: the disk is full"), str(e.value)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["shard-00000.safetensors"]  # no partial one
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shards/shard-00000.safetensors"] and not manifest["complete"]
    monkeypatch.undo()  # space freed: the rerun resumes after the finished shard
    w2 = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in samples:
        if s.sample_id not in w2.done_ids:
            w2.add(s)
    w2.close()
    store = FeatureStore(tmp_path, FP)
    assert [store[i]["input_ids"].tolist() for i in range(len(store))] == [s.input_ids.tolist() for s in samples]


# ---- one line per refusal --------------------------------------------------------------------------------------
@pytest.mark.unit
def test_every_refusal_class_is_the_projects_named_error():
    """`REFUSALS` is the one list of what refuses without a traceback: each entry is an exception class of that
    module (a renamed class would otherwise drop out of the list unnoticed)."""
    from scripts.runtime import REFUSALS

    for module, name in REFUSALS:
        cls = getattr(importlib.import_module(module), name)
        assert isinstance(cls, type) and issubclass(cls, Exception), (module, name)


def _stage(stage: str, overrides: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, "-m", f"scripts.{stage}", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**environ, "WANDB_MODE": "disabled", **env})


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


def test_a_refused_stage_prints_one_line_and_no_traceback(tiny_overrides, mtp, tmp_path):
    """Before: each refusal's line came with hydra's "Error executing job" and a Python traceback (and `threads=abc`
    raised before the stage's status was even started)."""
    bad_setting = _stage("precompute", [*tiny_overrides, "precompute.batch_tokens=0"])
    line = "precompute refused: precompute.batch_tokens=0: expected a whole number of tokens ≥ 1"
    assert bad_setting.returncode == 1 and _last_line(bad_setting) == line, bad_setting.stderr[-3000:]
    assert "Traceback" not in bad_setting.stderr and "Error executing job" not in bad_setting.stderr
    status = json.loads((tmp_path / "run" / "status.json").read_text())["precompute"]
    assert status["state"] == "failed" and "precompute.batch_tokens=0" in status["error"]

    threads = _stage("train", [*tiny_overrides, "threads=abc"])
    assert threads.returncode == 1 and _last_line(threads).startswith("train refused: threads='abc': expected")
    assert "Traceback" not in threads.stderr

    no_store = _stage("train", [*tiny_overrides, f"store_dir={tmp_path / 'gone'}"])
    assert no_store.returncode == 1 and "Traceback" not in no_store.stderr, no_store.stderr[-3000:]
    assert _last_line(no_store) == (f"train refused: {tmp_path / 'gone'}: no manifest.json — not a feature store "
                                    "(run precompute first)")

    out = save_native(mtp, tmp_path / "head", marker={"checkpoint": str(tmp_path / "last.ckpt")})
    damage(out / "model.safetensors", "truncated")
    (out / MANIFEST).unlink()
    damaged = _stage("export", [*tiny_overrides, f"export.source={out}", f"export.root={tmp_path / 'export'}"])
    assert damaged.returncode == 1 and "Traceback" not in damaged.stderr, damaged.stderr[-3000:]
    assert _last_line(damaged).startswith(f"export refused: {out / 'model.safetensors'}: the header describes")
    assert f"train.resume={tmp_path / 'last.ckpt'}" in _last_line(damaged)

    full = _stage("precompute", [*tiny_overrides, "precompute.batch_tokens=0"], HYDRA_FULL_ERROR="1")
    assert full.returncode == 1 and "Traceback" in full.stderr
    assert "ConfigError: precompute.batch_tokens=0" in full.stderr
