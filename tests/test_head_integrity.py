"""A saved head carries a checksum manifest (`checksums.json`, artifacts/integrity.py): every save writes it,
every reader checks it — `load_native`, `load_any` (every format of the registry), evaluation's head loading,
the export stage and the export validator — and refuses a file changed after the save, naming the file, the
expected and found sha256 and what to do. A directory saved before manifests existed loads with one warning;
the peer trainer's checkpoints (never written by spechead) load without one. Artifacts get the modes a plain
write under the umask gives (core/files.py), so a serving user can read them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from artifacts.checkpoint import load_native, save_native
from artifacts.export import export_head, load_any, load_export, probe_logits
from artifacts.formats import FORMATS, detect_format
from artifacts.integrity import MANIFEST, IntegrityError, main as integrity_main, manifest_problems
from artifacts.validate import ExportValidationError, check_export, main as validate_main, validate_export
from core.files import atomic_write
from core.safetensors_io import read_safetensors_header
from heads.registry import build_head
from inference_eval.model import tied_target
from tests.conftest import compose_config

pytestmark = pytest.mark.unit

# one head per kind, every format of the registry spechead writes (deep_target: room for EAGLE-3's aux layers)
KINDS = {"mtp": {"type": "mtp"}, "eagle1": {"type": "eagle1", "bias": False},
         "eagle3": {"type": "eagle3", "draft_vocab_size": 300}, "medusa": {"type": "medusa", "num_heads": 2},
         "draft_lm": {"type": "draft_lm", "num_layers": 1, "init": "random"},
         "dflash": {"type": "dflash", "num_layers": 1, "block_size": 4, "target_layers": [1]},
         "dspark": {"type": "dspark", "num_layers": 1, "block_size": 4, "target_layers": [1]}}


def _head(target: Path, cfg: dict, seed: int = 0):
    tied, args, parts = tied_target(target)
    head = build_head(cfg, args, tied)
    if cfg.get("draft_vocab_size"):
        head.set_draft_vocab(torch.arange(args.vocab_size) % 7)
    if cfg["type"] in ("dflash", "dspark"):
        head.reset_parameters(seed)
    else:
        head.reset_parameters(seed, parts.first_input_norm)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # off the initialisation, so every tensor shows in the logits
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head


def flip_exponent_bit(path: Path) -> str:
    """Flip the top exponent bit of one float32 weight in the safetensors file `path` (0.012 → ~4e36, still
    finite: no shape, dtype or NaN check sees it); returns the tensor's name."""
    header, _, raw = read_safetensors_header(path)
    data = bytearray(path.read_bytes())
    base = 8 + len(raw)
    for name, t in sorted(header.items()):
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        begin, end = t["data_offsets"]
        values = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=torch.float32)
        small = ((values.abs() > 1e-3) & (values.abs() < 1.0)).nonzero()
        if len(small):
            at = base + begin + 4 * int(small[0]) + 3  # little-endian: the sign and top exponent bits
            data[at] ^= 0x40
            path.write_bytes(bytes(data))
            return name
    raise AssertionError(f"{path}: no float32 weight to flip")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_names_the_damage(message: str, file: Path, expected: str) -> None:
    assert str(file) in message and expected in message and _sha(file) in message, message
    assert "restore" in message and "export the head again" in message and "retrain" in message


@pytest.fixture(scope="module")
def mtp(tiny_target):
    return _head(tiny_target, {"type": "mtp"})


@pytest.fixture
def flipped(mtp, tmp_path):
    """A saved native head with one bit of one weight flipped after the save: (dir, the file, its recorded sha)."""
    out = save_native(mtp, tmp_path / "head")
    recorded = json.loads((out / MANIFEST).read_text())["files"]["model.safetensors"]["sha256"]
    flip_exponent_bit(out / "model.safetensors")
    return out, out / "model.safetensors", recorded


def test_a_save_records_every_file_it_wrote(mtp, tmp_path):
    out = save_native(mtp, tmp_path / "head")
    manifest = json.loads((out / MANIFEST).read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == files == [".spechead-artifact.json", "config.json", "model.safetensors"]
    for name, entry in manifest["files"].items():
        assert entry == {"sha256": _sha(out / name), "size": (out / name).stat().st_size}
    assert manifest["algorithm"] == "sha256" and manifest_problems(out) == []
    assert integrity_main([str(out)]) == 0


def test_a_flipped_bit_is_refused_by_load_native_and_load_any(flipped, tiny_target):
    out, file, recorded = flipped
    tied, args, _ = tied_target(tiny_target)
    for load in (load_native, load_any):
        with pytest.raises(IntegrityError) as e:
            load(out, tied, args)
        _assert_names_the_damage(str(e.value), file, recorded)
    assert integrity_main([str(out)]) == 1


def test_a_flipped_bit_is_refused_by_evaluations_head_loading(flipped, tiny_target, tmp_path):
    from data.prompts import PromptSet
    from evaluation.evaluate import load_proposers
    from evaluation.settings import EvalConfig
    from evaluation.vllm_eval import served_export

    out, file, recorded = flipped
    tied, args, _ = tied_target(tiny_target)
    ec = EvalConfig(prompts=PromptSet(), report=tmp_path / "eval.json", heads={"mine": str(out)})
    et = SimpleNamespace(tied=tied, model=SimpleNamespace(args=args), config=SimpleNamespace(fingerprint=None),
                         device="cpu")
    with pytest.raises(IntegrityError) as e:
        load_proposers(ec, et)
    _assert_names_the_damage(str(e.value), file, recorded)
    with pytest.raises(IntegrityError, match="model.safetensors"):  # evaluate.engine=vllm loads it the same way
        served_export("mine", out, tied, args, tiny_target, None, tmp_path / "served")
    assert not (tmp_path / "served").exists()


def test_a_flipped_bit_is_refused_by_the_export_stage(flipped, tiny_overrides, tmp_path):
    """Before: the export stage read the damaged head, wrote it out and printed "validated and read back"."""
    from scripts.export import run_export

    out, file, recorded = flipped
    cfg = compose_config([*tiny_overrides, f"export.source={out}", f"export.root={tmp_path / 'export'}"])
    with pytest.raises(IntegrityError) as e:
        run_export(cfg)
    _assert_names_the_damage(str(e.value), file, recorded)
    assert not (tmp_path / "export").exists()


def test_a_flipped_bit_in_an_export_is_a_validation_violation(mtp, tiny_target, tmp_path, capsys):
    out = export_head(mtp, {"mtp-vllm": tmp_path / "mtp-vllm"}, tiny_target)["mtp-vllm"]
    recorded = json.loads((out / MANIFEST).read_text())["files"]["model.safetensors"]["sha256"]
    assert validate_export(out, "mtp-vllm", tiny_target) == []
    flip_exponent_bit(out / "model.safetensors")
    problems = validate_export(out, "mtp-vllm", tiny_target)
    assert len(problems) == 1, problems  # the weight is finite and well shaped: only the checksum tells
    _assert_names_the_damage(problems[0], out / "model.safetensors", recorded)
    with pytest.raises(ExportValidationError):
        check_export(out, "mtp-vllm", tiny_target)
    assert validate_main([str(out), "--format", "mtp-vllm"]) == 1
    assert str(out / "model.safetensors") in capsys.readouterr().err


def test_a_renamed_or_missing_file_is_named(mtp, tiny_target, tmp_path):
    tied, args, _ = tied_target(tiny_target)
    out = save_native(mtp, tmp_path / "head")
    (out / "model.safetensors").rename(out / "model.safetensors.bak")
    with pytest.raises(IntegrityError) as e:
        load_native(out, tied, args)
    msg = str(e.value)
    assert f"{out / 'model.safetensors'}: missing" in msg and "renamed or deleted" in msg
    assert f"{out / 'model.safetensors.bak'}: not in the manifest" in msg
    gone = save_native(mtp, tmp_path / "gone")
    (gone / "config.json").unlink()  # detection cannot even tell the format: the manifest names the file
    missing = rf"{re.escape(str(gone / 'config.json'))}: missing"
    with pytest.raises(IntegrityError, match=missing):
        load_any(gone, tied, args)
    with pytest.raises(IntegrityError, match=missing):
        detect_format(gone)
    bad = save_native(mtp, tmp_path / "bad")
    (bad / "config.json").write_text("{")  # a damaged config.json: named, not a JSON error
    with pytest.raises(IntegrityError, match=rf"{re.escape(str(bad / 'config.json'))}: sha256"):
        load_any(bad, tied, args)
    (out / MANIFEST).write_text("{")  # the manifest itself damaged: refused, naming it
    with pytest.raises(IntegrityError, match=rf"{re.escape(str(out / MANIFEST))}: the checksum manifest cannot be"):
        load_native(out, tied, args)


def _integrity_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and MANIFEST in r.getMessage()]


def test_a_head_saved_before_manifests_loads_with_one_warning(mtp, tiny_target, tmp_path, caplog):
    tied, args, _ = tied_target(tiny_target)
    out = save_native(mtp, tmp_path / "old")
    (out / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        head = load_any(out, tied, args)
    assert torch.equal(probe_logits(head), probe_logits(mtp))
    warnings = _integrity_warnings(caplog)
    assert len(warnings) == 1 and str(out) in warnings[0], warnings
    assert "save it again" in warnings[0] and "python -m artifacts.integrity --write" in warnings[0]
    assert integrity_main([str(out), "--write"]) == 0  # what the warning says: now it has one
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_native(out, tied, args)
    assert _integrity_warnings(caplog) == [] and manifest_problems(out) == []


def test_a_peer_checkpoint_loads_without_a_warning(tiny_target, tmp_path, caplog):
    """The peer trainer's checkpoints were not written by spechead: nothing recorded to check, nothing to warn."""
    from tests.test_peer import our_head, write_speculators_format

    head, tied, args = our_head(tiny_target, {})
    path = write_speculators_format(head, tiny_target, tmp_path / "peer")
    with caplog.at_level(logging.WARNING):
        assert detect_format(path) == "speculators-eagle3"
        load_any(path, tied, args)
        validate_export(path, "speculators-eagle3")
    assert _integrity_warnings(caplog) == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_written_format_round_trips_and_refuses_a_flipped_bit(kind, deep_target, tmp_path):
    tied, args, _ = tied_target(deep_target)
    head = _head(deep_target, KINDS[kind])
    formats = [name for name, fmt in FORMATS.items() if fmt.holds(head)]
    written = export_head(head, {f: tmp_path / f for f in formats}, deep_target)
    for fmt, out in written.items():
        assert manifest_problems(out) == [], fmt
        assert detect_format(out) == fmt and validate_export(out, fmt, deep_target) == [], fmt
        assert torch.equal(probe_logits(load_any(out, tied, args)), probe_logits(head)), fmt
        bad = shutil.copytree(out, tmp_path / "bad" / fmt)
        weights = sorted(bad.glob("*.safetensors"))[0]  # the head's own file (mtp-stitched: model-mtp)
        flip_exponent_bit(weights)
        with pytest.raises(IntegrityError, match=rf"{re.escape(str(weights))}: sha256"):
            load_export(bad, fmt, tied, args)
        assert any(str(weights) in p for p in validate_export(bad, fmt, deep_target)), fmt


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_artifacts_are_readable_under_the_umask(umask, file_mode, dir_mode, mtp, tiny_target, tmp_path):
    old = os.umask(umask)
    try:
        native = save_native(mtp, tmp_path / "head")
        # mtp-stitched copies the target's files too (copy2 would keep their modes)
        stitched = export_head(mtp, {"mtp-stitched": tmp_path / "stitched"}, tiny_target)["mtp-stitched"]
        # a store's files: atomic_write, whatever made the temp file (safetensors' save_file makes it 0600)
        shard, manifest = tmp_path / "shard-00000.safetensors", tmp_path / "manifest.json"
        atomic_write(shard, lambda tmp: save_file({"hidden": torch.zeros(2)}, tmp))
        atomic_write(manifest, lambda tmp: os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)))
    finally:
        os.umask(old)
    for root in (native, stitched):
        modes = _modes(root)
        assert all(m == (dir_mode if (tmp_path / p).is_dir() else file_mode) for p, m in modes.items()), modes
    assert stat.S_IMODE(shard.stat().st_mode) == stat.S_IMODE(manifest.stat().st_mode) == file_mode
