"""Issue 17, "nothing lost, nothing silently wrong", for the artifacts spechead writes (artifacts/checkpoint.py
`atomic_artifact_dir`, used by `save_native` and every engine export):

- a save never replaces a directory that is not a spechead artifact of the same kind (marker
  `.spechead-artifact.json`; a legacy native checkpoint counts as a native head; an empty dir may go);
- leftovers of an interrupted swap (`.<name>.old`, `.<name>.XXXXXXXX[.tmp]`) are restored or removed;
- a save SIGKILLed before any of its file-system steps (forked child, every step in turn) leaves the old
  or the new artifact byte for byte, and the next save succeeds and leaves nothing else;
- heads load and export only against the target (fingerprint and compute dtype) they were trained for.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import core.files as atomic_files
from inference_eval.model import target_fingerprint
from artifacts.checkpoint import (ARTIFACT_MARKER, ArtifactError, TargetMismatchError, atomic_artifact_dir,
                                  check_target_fingerprint, export_kind, load_native, save_native)
from heads.registry import build_head
from core.files import recover_interrupted_save
from artifacts.export import export_head, load_any, load_export, probe_logits
from artifacts.formats import FORMATS
from inference_eval.model import tied_target

KILL_STEPS = ("mkdir", "fsync", "replace", "rename", "unlink", "rmdir")  # os functions a save goes through


def _head(target, kind: str, seed: int):
    tied, args, parts = tied_target(target)
    head = build_head({"type": kind, **({"bias": False} if kind == "eagle1" else {})}, args, tied)
    head.reset_parameters(seed, parts.first_input_norm)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head


@pytest.fixture(scope="module")
def mtp_heads(tiny_target):
    return [_head(tiny_target, "mtp", s) for s in range(3)]


@pytest.fixture(scope="module")
def fp(tiny_target):
    return target_fingerprint(tiny_target, "tiny", "float32")


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every file under `d` (relative path → bytes)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _user_dir(path: Path) -> dict[str, bytes]:
    (path / "data").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes")
    (path / "data" / "results.csv").write_text("a,b\n1,2\n")
    return _snapshot(path)


# ---- refusing to replace what is not ours ------------------------------------------------------------
@pytest.mark.unit
def test_save_refuses_a_foreign_directory_and_keeps_it(mtp_heads, tmp_path):
    out = tmp_path / "head"
    before = _user_dir(out)
    with pytest.raises(ArtifactError) as e:
        save_native(mtp_heads[0], out)
    msg = str(e.value)
    assert str(out) in msg and "not a spechead artifact" in msg and "notes.txt" in msg and "data" in msg
    assert _snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["head"]  # no temp dir left behind


@pytest.mark.unit
def test_save_refuses_a_file_a_symlink_and_an_artifact_of_another_kind(mtp_heads, tmp_path, tiny_target):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArtifactError, match=r"/f: exists and is not a directory"):
        save_native(mtp_heads[0], tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"
    real = tmp_path / "real"
    save_native(mtp_heads[0], real)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ArtifactError, match=r"/link: is a symbolic link"):
        save_native(mtp_heads[1], tmp_path / "link")
    eagle = _head(tiny_target, "eagle1", 0)
    export_head(eagle, {"eagle1-vllm": tmp_path / "vllm"}, tiny_target)
    snap = _snapshot(tmp_path / "vllm")
    with pytest.raises(ArtifactError, match=r"/vllm: refusing .* it is a spechead 'export:eagle1-vllm' artifact, "
                                            r"not 'native-head'"):
        save_native(mtp_heads[0], tmp_path / "vllm")
    with pytest.raises(ArtifactError, match=r"/real: refusing .* 'native-head' artifact, not 'export:eagle1-sglang'"):
        export_head(eagle, {"eagle1-sglang": real}, tiny_target)
    assert _snapshot(tmp_path / "vllm") == snap
    assert json.loads((real / ARTIFACT_MARKER).read_text())["kind"] == "native-head"


@pytest.mark.unit
def test_save_replaces_an_empty_dir_the_same_kind_and_a_legacy_native_head(mtp_heads, tmp_path, tiny_target):
    tied, args, _ = tied_target(tiny_target)
    out = tmp_path / "head"
    out.mkdir()
    save_native(mtp_heads[0], out)
    assert torch.equal(probe_logits(load_native(out, tied, args)), probe_logits(mtp_heads[0]))
    save_native(mtp_heads[1], out)  # same kind
    assert torch.equal(probe_logits(load_native(out, tied, args)), probe_logits(mtp_heads[1]))
    (out / ARTIFACT_MARKER).unlink()  # a checkpoint written before markers: config.json has spechead_format
    save_native(mtp_heads[2], out)
    assert torch.equal(probe_logits(load_native(out, tied, args)), probe_logits(mtp_heads[2]))
    assert sorted(os.listdir(tmp_path)) == ["head"]
    assert sorted(os.listdir(out)) == [ARTIFACT_MARKER, "checksums.json", "config.json", "model.safetensors"]


@pytest.mark.unit
def test_export_checks_every_directory_before_writing_any(tiny_target, tmp_path):
    eagle = _head(tiny_target, "eagle1", 0)
    before = _user_dir(tmp_path / "sglang")
    with pytest.raises(ArtifactError, match=r"/sglang: refusing .* not a spechead artifact .* notes.txt"):
        export_head(eagle, {"native": tmp_path / "native", "eagle1-vllm": tmp_path / "vllm",
                            "eagle1-sglang": tmp_path / "sglang"}, tiny_target)
    assert sorted(os.listdir(tmp_path)) == ["sglang"] and _snapshot(tmp_path / "sglang") == before
    with pytest.raises(ValueError, match=r"formats 'eagle1-vllm' and 'eagle1-sglang' would both be written there"):
        export_head(eagle, {"eagle1-vllm": tmp_path / "x", "eagle1-sglang": tmp_path / "x"}, tiny_target)
    # an export of the same format is replaced: re-exporting another head over it
    export_head(eagle, {"eagle1-vllm": tmp_path / "vllm"}, tiny_target)
    other = _head(tiny_target, "eagle1", 1)
    export_head(other, {"eagle1-vllm": tmp_path / "vllm"}, tiny_target)
    tied, args, _ = tied_target(tiny_target)
    back = load_export(tmp_path / "vllm", "eagle1-vllm", tied, args)
    assert torch.equal(probe_logits(back), probe_logits(other))
    assert not torch.equal(probe_logits(back), probe_logits(eagle))
    assert sorted(os.listdir(tmp_path)) == ["sglang", "vllm"]


# ---- leftovers of an interrupted swap ---------------------------------------------------------------
@pytest.mark.unit
def test_recovery_restores_a_parked_old_artifact_and_removes_temp_dirs(mtp_heads, tmp_path, tiny_target):
    runs = tmp_path / "runs"
    save_native(mtp_heads[0], runs / "head")
    old = _snapshot(runs / "head")
    os.replace(runs / "head", runs / ".head.old")  # a kill between the two renames of the park-old swap
    (runs / ".head.k3j_9x0a.tmp").mkdir()  # an unfinished save's temp dir, half written
    (runs / ".head.k3j_9x0a.tmp" / "model.safetensors").write_bytes(b"\0" * 10)
    (runs / ".head.ab12cd34").mkdir()  # a temp dir of the code before this change (no suffix)
    (runs / ".head.backup").mkdir()  # not a name spechead makes: left alone
    (runs / "other").mkdir()
    tied, args, _ = tied_target(tiny_target)
    with pytest.raises(FileNotFoundError, match=r"/head: .*interrupted save left the previous version in .*\.head\.old"):
        load_native(runs / "head", tied, args)
    recover_interrupted_save(runs / "head")
    assert _snapshot(runs / "head") == old
    assert sorted(os.listdir(runs)) == [".head.backup", "head", "other"]
    # the same, done by the next save itself; and a stale .old next to a complete artifact is removed
    shutil.copytree(runs / "head", runs / ".head.old")
    (runs / ".head.zzzzzzzz.tmp").mkdir()
    save_native(mtp_heads[1], runs / "head")
    assert sorted(os.listdir(runs)) == [".head.backup", "head", "other"]
    assert torch.equal(probe_logits(load_native(runs / "head", tied, args)), probe_logits(mtp_heads[1]))


# ---- killed saves ----------------------------------------------------------------------------------
def _run_killed(fn, kill_at: int, exchange: bool) -> str:
    """Run `fn()` in a forked child that SIGKILLs itself right before its `kill_at`-th file-system step
    (os.mkdir / fsync / replace / rename / unlink / rmdir, or the RENAME_EXCHANGE call). With
    `exchange=False` the kernel's RENAME_EXCHANGE is reported unsupported (the park-old swap runs).
    Returns "killed", or "done" when `fn` finished with fewer steps."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = 0

            def hook(real):
                def step(*a, **k):
                    nonlocal count
                    count += 1
                    if count == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*a, **k)
                return step

            for name in KILL_STEPS:
                setattr(os, name, hook(getattr(os, name)))
            if not exchange:
                def unsupported(a, b):
                    raise OSError(errno.ENOSYS, "renameat2 unsupported (test)")
                atomic_files._rename_exchange = hook(unsupported)
            else:
                atomic_files._rename_exchange = hook(atomic_files._rename_exchange)
            fn()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(3)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the save child hung (kill point {kill_at})")
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return "killed"
    assert os.WEXITSTATUS(status) == 0, f"the save child failed (kill point {kill_at}): see its traceback above"
    return "done"


def _kill_matrix(tmp_path, prepare, child_save, new_snap, next_save, next_snap, exchange, monkeypatch):
    """Kill `child_save(out)` at every step in turn, each time on a fresh `prepare(out)` (returns the old
    snapshot). After each kill `out` must hold the old or the new artifact byte for byte — or, on the
    park-old path only, be missing with the old one parked at `.head.old`, which recovery moves back — and
    `next_save(out)` must then succeed and leave `out` alone in its directory. Returns the outcomes."""
    if not exchange:  # the parent's recovery and next save take the park-old path too
        monkeypatch.setattr(atomic_files, "_rename_exchange", lambda a, b: (_ for _ in ()).throw(OSError(errno.ENOSYS, "x")))
    outcomes = []
    for n in itertools.count(1):
        runs = tmp_path / "runs"
        shutil.rmtree(runs, ignore_errors=True)
        runs.mkdir()
        out = runs / "head"
        old_snap = prepare(out)
        assert old_snap != new_snap
        if _run_killed(lambda: child_save(out), n, exchange) == "done":
            assert _snapshot(out) == new_snap and sorted(os.listdir(runs)) == ["head"]
            break
        if out.is_dir():
            snap = _snapshot(out)
            assert snap in (old_snap, new_snap), f"kill point {n}: {out} holds neither the old nor the new artifact"
            outcomes.append("old" if snap == old_snap else "new")
        else:
            assert not exchange, f"kill point {n}: {out} is missing"
            assert _snapshot(runs / ".head.old") == old_snap, f"kill point {n}"
            recover_interrupted_save(out)
            assert _snapshot(out) == old_snap
            outcomes.append("parked")
        next_save(out)
        assert _snapshot(out) == next_snap, f"kill point {n}: the next save did not land"
        assert sorted(os.listdir(runs)) == ["head"], f"kill point {n}: leftovers {sorted(os.listdir(runs))}"
        assert n < 60, "the save never finished"
    return outcomes


def _assert_old_then_new(outcomes, exchange):
    """The artifact switches once, from old to new, and both sides of the switch were killed."""
    first_new = outcomes.index("new")
    assert set(outcomes[:first_new]) <= {"old", "parked"} and set(outcomes[first_new:]) == {"new"}
    assert outcomes.count("old") >= 3 and outcomes.count("new") >= 3, outcomes  # before the swap / in the cleanup
    assert ("parked" in outcomes) == (not exchange), outcomes


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "park-old"])
def test_killed_native_save_leaves_old_or_new(mtp_heads, fp, tmp_path, exchange, monkeypatch):
    ref = tmp_path / "ref"
    snaps = []
    for i, h in enumerate(mtp_heads):
        save_native(h, ref / str(i), fp)
        snaps.append(_snapshot(ref / str(i)))

    def prepare(out):
        save_native(mtp_heads[0], out, fp)
        return _snapshot(out)

    outcomes = _kill_matrix(tmp_path, prepare, lambda out: save_native(mtp_heads[1], out, fp), snaps[1],
                            lambda out: save_native(mtp_heads[2], out, fp), snaps[2], exchange, monkeypatch)
    _assert_old_then_new(outcomes, exchange)


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "park-old"])
def test_killed_export_leaves_old_or_new(tiny_target, fp, tmp_path, exchange, monkeypatch):
    """The export's write-and-swap (what export_head runs for an engine format) killed at every step."""
    heads = [_head(tiny_target, "eagle1", s) for s in range(3)]

    def write(head, out):
        with atomic_artifact_dir(out, export_kind("eagle1-sglang"), {"target_fingerprint": fp}) as tmp:
            FORMATS["eagle1-sglang"].write(head, tmp, tiny_target)

    snaps = []
    for i, h in enumerate(heads):
        write(h, tmp_path / "ref" / str(i))
        snaps.append(_snapshot(tmp_path / "ref" / str(i)))

    def prepare(out):  # the old artifact is a full export_head output
        export_head(heads[0], {"eagle1-sglang": out}, tiny_target, fp)
        return _snapshot(out)

    outcomes = _kill_matrix(tmp_path, prepare, lambda out: write(heads[1], out), snaps[1],
                            lambda out: export_head(heads[2], {"eagle1-sglang": out}, tiny_target, fp), snaps[2],
                            exchange, monkeypatch)
    _assert_old_then_new(outcomes, exchange)


def test_killed_save_that_is_recovering_a_parked_artifact(mtp_heads, tmp_path, monkeypatch):
    """A save that starts by restoring `.head.old` (a previous kill) is itself killed at every step: the
    old artifact is never lost (in place or still parked), and the one after it cleans up."""
    ref = tmp_path / "ref"
    snaps = []
    for i, h in enumerate(mtp_heads):
        save_native(h, ref / str(i))
        snaps.append(_snapshot(ref / str(i)))
    outcomes = []
    for n in itertools.count(1):
        runs = tmp_path / "runs"
        shutil.rmtree(runs, ignore_errors=True)
        runs.mkdir()
        out = runs / "head"
        save_native(mtp_heads[0], out)
        os.replace(out, runs / ".head.old")
        (runs / ".head.abcdefgh.tmp").mkdir()
        (runs / ".head.abcdefgh.tmp" / "config.json").write_text("{")
        if _run_killed(lambda: save_native(mtp_heads[1], out), n, exchange=True) == "done":
            assert _snapshot(out) == snaps[1] and sorted(os.listdir(runs)) == ["head"]
            break
        if out.is_dir():
            snap = _snapshot(out)
            assert snap in (snaps[0], snaps[1]), f"kill point {n}"
            outcomes.append("old" if snap == snaps[0] else "new")
        else:
            assert _snapshot(runs / ".head.old") == snaps[0], f"kill point {n}"
            outcomes.append("parked")
        save_native(mtp_heads[2], out)
        assert _snapshot(out) == snaps[2] and sorted(os.listdir(runs)) == ["head"], f"kill point {n}"
    assert outcomes[0] == "parked" and "old" in outcomes and "new" in outcomes, outcomes


# ---- the target fingerprint -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_target(tiny_target, tmp_path_factory):
    """The tiny target with one weight changed: same shapes, another model (what a shape check misses)."""
    path = tmp_path_factory.mktemp("other_target")
    shutil.copytree(tiny_target, path, dirs_exist_ok=True)
    state = load_file(path / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 0.5
    save_file(state, path / "model.safetensors", metadata={"format": "pt", "finetuned": "yes"})  # another header
    return path


@pytest.fixture(scope="module")
def retrained_target(tiny_target, tmp_path_factory):
    """The tiny target with one weight's values changed and the very same safetensors header: only a
    `full` fingerprint (the weights' bytes) tells it apart."""
    path = tmp_path_factory.mktemp("retrained_target")
    shutil.copytree(tiny_target, path, dirs_exist_ok=True)
    state = load_file(path / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 0.5
    with open(tiny_target / "model.safetensors", "rb") as fh:
        raw = fh.read()
    header_len = 8 + int.from_bytes(raw[:8], "little")
    norm = load_file(tiny_target / "model.safetensors")["model.norm.weight"].numpy().tobytes()
    changed = state["model.norm.weight"].numpy().tobytes()
    assert raw.count(norm) == 1
    (path / "model.safetensors").write_bytes(raw[:header_len] + raw[header_len:].replace(norm, changed))
    return path


@pytest.mark.unit
def test_fingerprint_check_compares_identity_keys_generically(tmp_path, caplog):
    stored = {"name": "a", "config_sha256": "c1", "weights_sha256": "w1", "compute_dtype": "bfloat16",
              "versions": {"torch": "2.1"}, "only_stored": 1}
    same = {**{k: v for k, v in stored.items() if k != "only_stored"}, "name": "b", "versions": {"torch": "9.9"}}
    check_target_fingerprint(stored, same, tmp_path)  # the name and library versions are not identity
    check_target_fingerprint(stored, None, tmp_path)  # no expectation: no check
    with pytest.raises(TargetMismatchError) as e:
        check_target_fingerprint(stored, {**same, "weights_sha256": "w2", "compute_dtype": "float32",
                                          "only_expected": 2}, tmp_path / "ckpt")
    msg = str(e.value)
    assert str(tmp_path / "ckpt") in msg and "stored target 'a', configured 'b'" in msg
    assert "weights_sha256: stored 'w1', configured 'w2'" in msg
    assert "compute_dtype: stored 'bfloat16', configured 'float32'" in msg
    assert "config_sha256" not in msg and "only_" not in msg
    with caplog.at_level(logging.WARNING, logger="artifacts.checkpoint"):
        check_target_fingerprint(stored, {**same, "only_expected": 2}, tmp_path / "ckpt")
    assert "['only_expected', 'only_stored'] recorded on one side only" in caplog.text


@pytest.mark.unit
def test_fingerprint_check_across_weight_hash_methods(tmp_path, caplog):
    """data/store.py: `weights_sha256` hashes the safetensors headers (`weights_hash: header`), plus the
    bytes as `weights_content_sha256` with `full`; a fingerprint without `weights_hash` is older and its
    `weights_sha256` hashes the bytes."""
    base = {"name": "t", "config_sha256": "c", "tokenizer_sha256": "k", "compute_dtype": "float32"}
    header = {**base, "weights_sha256": "H1", "weights_bytes": 10, "weights_hash": "header"}
    full = {**header, "weights_hash": "full", "weights_content_sha256": "B1"}
    legacy = {**base, "weights_sha256": "B1"}
    check_target_fingerprint(full, header, tmp_path)  # same headers: the method is not identity
    check_target_fingerprint(legacy, full, tmp_path)  # the old bytes hash equals the new content hash
    with pytest.raises(TargetMismatchError, match=r"weights_sha256 \(stored\) vs weights_content_sha256 "
                                                  r"\(configured\): stored 'B1', configured 'B2'"):
        check_target_fingerprint(legacy, {**full, "weights_content_sha256": "B2"}, tmp_path)
    with pytest.raises(TargetMismatchError, match=r"weights_content_sha256: stored 'B1', configured 'B2'"):
        check_target_fingerprint(full, {**full, "weights_content_sha256": "B2"}, tmp_path)
    with pytest.raises(TargetMismatchError, match=r"weights_sha256: stored 'H1', configured 'H2'"):
        check_target_fingerprint(header, {**full, "weights_sha256": "H2"}, tmp_path)
    with caplog.at_level(logging.WARNING, logger="artifacts.checkpoint"):  # bytes vs headers: cannot tell
        check_target_fingerprint(legacy, header, tmp_path / "old-head")
    assert "old-head" in caplog.text and "set target.fingerprint=full to compare them" in caplog.text
    with pytest.raises(TargetMismatchError, match=r"config_sha256: stored 'c', configured 'c2'"):
        check_target_fingerprint(legacy, {**header, "config_sha256": "c2"}, tmp_path)


@pytest.mark.unit
def test_load_native_refuses_another_target_and_dtype(mtp_heads, fp, tiny_target, other_target, retrained_target,
                                                      tmp_path, caplog):
    tied, args, _ = tied_target(tiny_target)
    out = save_native(mtp_heads[0], tmp_path / "head", fp)
    same = target_fingerprint(tiny_target, "renamed", "float32")
    assert torch.equal(probe_logits(load_native(out, tied, args, expected_fingerprint=same)),
                       probe_logits(mtp_heads[0]))
    other = target_fingerprint(other_target, "tiny", "float32")
    with pytest.raises(TargetMismatchError) as e:
        load_native(out, tied, args, expected_fingerprint=other)
    msg = str(e.value)
    assert msg.startswith(f"{out}:") and "weights_bytes: stored " in msg
    assert f"stored {fp['weights_sha256']!r}, configured {other['weights_sha256']!r}" in msg
    assert "config_sha256" not in msg and "tokenizer_sha256" not in msg  # only what differs
    with pytest.raises(TargetMismatchError, match=r"compute_dtype: stored 'float32', configured 'bfloat16'"):
        load_any(out, tied, args, expected_fingerprint=target_fingerprint(tiny_target, "tiny", "bfloat16"))
    # same header, other bytes: a full fingerprint on both sides refuses it, naming the content hashes
    full = save_native(mtp_heads[0], tmp_path / "full", target_fingerprint(tiny_target, "tiny", "float32", True))
    retrained = target_fingerprint(retrained_target, "tiny", "float32", True)
    assert retrained["weights_sha256"] == fp["weights_sha256"]  # the headers agree
    with pytest.raises(TargetMismatchError, match=rf"{full}: .*differing: weights_content_sha256: stored '[0-9a-f]+', "
                                                  rf"configured '{retrained['weights_content_sha256']}'"):
        load_native(full, tied, args, expected_fingerprint=retrained)
    legacy = save_native(mtp_heads[0], tmp_path / "legacy")  # no fingerprint recorded
    with caplog.at_level(logging.WARNING, logger="artifacts.checkpoint"):
        head = load_native(legacy, tied, args, expected_fingerprint=other)
    assert torch.equal(probe_logits(head), probe_logits(mtp_heads[0]))
    assert f"{legacy}: records no target fingerprint" in caplog.text and "'tiny'" in caplog.text


@pytest.mark.unit
def test_export_refuses_another_target_before_writing(tiny_target, other_target, fp, tmp_path):
    eagle = _head(tiny_target, "eagle1", 0)
    other = target_fingerprint(other_target, "tiny", "float32")
    with pytest.raises(TargetMismatchError) as e:
        export_head(eagle, {"native": tmp_path / "native", "eagle1-vllm": tmp_path / "vllm"}, tiny_target, fp,
                    expected_fingerprint=other, source=tmp_path / "src-head")
    msg = str(e.value)
    assert str(tmp_path / "src-head") in msg
    assert f"weights_sha256: stored {fp['weights_sha256']!r}, configured {other['weights_sha256']!r}" in msg
    assert os.listdir(tmp_path) == []
    # the matching target: exported, and the engine export records the fingerprint in its marker ...
    dirs = export_head(eagle, {"native": tmp_path / "native", "eagle1-vllm": tmp_path / "vllm"}, tiny_target, fp,
                       expected_fingerprint=fp)
    marker = json.loads((dirs["eagle1-vllm"] / ARTIFACT_MARKER).read_text())
    assert marker["kind"] == "export:eagle1-vllm" and marker["target_fingerprint"] == fp
    # ... which loading checks: an engine export is refused against another target too
    tied, args, _ = tied_target(tiny_target)
    with pytest.raises(TargetMismatchError, match=rf"{dirs['eagle1-vllm']}: .*weights_sha256: stored"):
        load_any(dirs["eagle1-vllm"], tied, args, expected_fingerprint=other)
    back = load_any(dirs["eagle1-vllm"], tied, args, expected_fingerprint=fp)
    assert torch.equal(probe_logits(back), probe_logits(eagle))


@pytest.mark.unit
def test_scripts_export_and_evaluate_refuse_another_target(tiny_overrides, tiny_target, other_target, fp, tmp_path):
    from scripts.export import run_export
    from experiments.stages import run_evaluation
    from tests.conftest import compose_config

    eagle = _head(tiny_target, "eagle1", 0)
    src = save_native(eagle, tmp_path / "src", fp)
    base = tiny_overrides + [f"export.source={src}", f"export.root={tmp_path / 'export'}", "export.formats=[native]"]
    with pytest.raises(TargetMismatchError, match=rf"{src}: .*weights_sha256: stored"):
        run_export(compose_config(base + [f"target.path={other_target}"]))
    with pytest.raises(TargetMismatchError, match=rf"{src}: .*compute_dtype: stored 'float32', configured 'bfloat16'"):
        run_export(compose_config(base + ["target.dtype=bfloat16"]))
    assert not (tmp_path / "export").exists()
    written = run_export(compose_config(base))
    assert written == {"native": tmp_path / "export" / "native"}
    assert json.loads((written["native"] / "config.json").read_text())["target_fingerprint"] == fp
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is two plus two?"}) + "\n")
    ev = tiny_overrides + [f"+evaluate.heads.mine={written['native']}", "evaluate.heads.trained=null",
                           "evaluate.heads.untrained=null", f"evaluate.report={tmp_path / 'eval.json'}",
                           "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}", "evaluate.num_prompts=null"]
    with pytest.raises(TargetMismatchError, match=rf"{written['native']}: .*weights_sha256: stored"):
        run_evaluation(compose_config(ev + [f"target.path={other_target}"]))
