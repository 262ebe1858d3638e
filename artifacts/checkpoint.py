"""Save / load the native head checkpoint (docs/design.md §8) and the artifact directories every save uses.

Native format: `config.json` (head type, head hyper-parameters, target shapes and fingerprint,
spechead version) + `model.safetensors` with the head's own weights only — the frozen target
embedding, final norm and lm_head are excluded and re-attached from the target at load.

Every directory spechead writes (native heads here, engine exports in artifacts/export.py) goes through
`atomic_artifact_dir`: written in a temp dir next to the destination, marked with
`.spechead-artifact.json` (`{"kind": "native-head" | "export:<format>", ...}`), sealed with the checksum
manifest `checksums.json` (artifacts/integrity.py), fsynced, then swapped in atomically. An existing
destination is replaced only if it is empty or a spechead artifact of the same kind; leftovers of an
interrupted save are recovered or removed by the next save. Every reader checks the manifest first
(`verify_artifact`), and reads the tensors inside `reading_artifact`: a file the manifest does not catch (none, or
one rewritten after the damage) but safetensors cannot read is refused naming it and where a good copy comes
from — the training checkpoint (`checkpoint`) or native head (`exported_from`) its marker records.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.integrity import (MANIFEST, DamagedFileError, IntegrityError, integrity_error, manifest_problems,
                                 write_manifest)
from core.files import atomic_dir, leftover_hint, recover_interrupted_save
from core.fingerprint import FINGERPRINT_IGNORED, compare_fingerprints
from core.safetensors_io import INDEX_FILE, SafetensorsError, load_safetensors_file
from heads.base import DraftHead, TiedTarget
from heads.layers import LlamaArgs
from heads.registry import build_head

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ARTIFACT_MARKER = ".spechead-artifact.json"
NATIVE_KIND = "native-head"
class ArtifactError(RuntimeError):
    """A save would replace something that is not a spechead artifact of the same kind."""


class TargetMismatchError(ValueError):
    """A head (or export) was trained for another target, tokenizer or compute dtype than the configured one."""


def save_native(head: DraftHead, out_dir: str | Path, fingerprint: dict[str, Any] | None = None,
                state: dict[str, torch.Tensor] | None = None, marker: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (`atomic_artifact_dir`): refuses to replace a
    directory that is not a native head, and a kill at any point leaves the old or the new checkpoint.
    `state`: the head's whole state dict when `head` holds shards (gathered by train/run.py
    `whole_head_state`); its names must be the head's own. `marker`: more of the artifact marker — where the head
    can be written again from (`checkpoint`: the training's last Lightning checkpoint; `exported_from`: the native
    head an export copies), which `damaged_error` names."""
    out_dir = Path(out_dir)
    own = head.state_dict()
    if state is not None:
        if state.keys() != own.keys():
            raise ValueError(f"save_native({out_dir}): the given state's tensors {sorted(set(state) ^ set(own))} "
                             "differ from the head's")
    state = {k: v.detach().contiguous().cpu() for k, v in (state if state is not None else own).items()}
    config = {
        "spechead_format": FORMAT_VERSION,
        "spechead_version": _version(),
        "head": head.cfg.to_dict(),
        "target_args": asdict(head.args),
        "target_fingerprint": fingerprint or {},
    }
    with atomic_artifact_dir(out_dir, NATIVE_KIND, marker) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "spechead-native"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def load_native(path: str | Path, tied: TiedTarget, args: LlamaArgs | None = None,
                expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
    """Rebuild a head from a native checkpoint and attach the target's frozen tensors.

    Its files must match its checksum manifest (`verify_artifact`: IntegrityError naming each file that
    differs). `expected_fingerprint` (`data.store.target_fingerprint(target_dir, name, dtype)` of the
    configured target): the checkpoint's stored fingerprint must agree with it (`check_target_fingerprint`);
    None skips the check."""
    path = Path(path)
    verify_artifact(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: not a spechead head checkpoint (no config.json){leftover_hint(path)}")
    config = json.loads(cfg_file.read_text())
    if "head" not in config or "target_args" not in config:
        raise ValueError(f"{cfg_file}: missing 'head' or 'target_args' — not a native spechead checkpoint")
    check_target_fingerprint(config.get("target_fingerprint") or {}, expected_fingerprint, path)
    saved_args = LlamaArgs(**config["target_args"])
    if args is not None and (args.hidden_size, args.vocab_size) != (saved_args.hidden_size, saved_args.vocab_size):
        raise ValueError(f"{path}: head was trained for hidden={saved_args.hidden_size}, vocab={saved_args.vocab_size}; "
                         f"the target has hidden={args.hidden_size}, vocab={args.vocab_size}")
    head = build_head(config["head"], saved_args, tied)
    with reading_artifact(path):
        state = load_safetensors_file(path / "model.safetensors")
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)


@contextmanager
def reading_artifact(path: str | Path) -> Iterator[None]:
    """Around a reader's tensor reads from the head or export at `path`: a file safetensors cannot read
    (core/safetensors_io.py `SafetensorsError`) is refused as a DamagedFileError naming it and what to do
    (`damaged_error`)."""
    try:
        yield
    except SafetensorsError as e:
        raise damaged_error(Path(path), e) from e


def damaged_error(path: Path, err: SafetensorsError) -> DamagedFileError:
    """The error for a damaged file in the head or export at `path` (`err` names the file): how to get it back —
    an export (the marker's `exported_from`, or any engine format) is exported again from its native head; a
    native head is saved again from the training checkpoint it came from (the marker's `checkpoint`: a finished
    training resumed from it saves its head without training further) or retrained."""
    info = artifact_info(path)
    exported_from = (info or {}).get("exported_from")
    if info is None:
        how = ("it was not written by spechead: write it again with the tool that made it, or restore it from a good "
               "copy")
    elif info["kind"] == NATIVE_KIND and not exported_from:
        ckpt = info.get("checkpoint") or "<its train.checkpoint_dir>/last.ckpt"
        how = (f"save it again from the training checkpoint it came from — rerun that training with "
               f"train.resume={ckpt} (a finished run saves its head again without training further) — or retrain it; "
               "or restore the directory from a good copy")
    else:
        native = exported_from or "<the native head it was exported from>"
        how = (f"export it again from the native head it came from (spechead export export.source={native}; if that "
               "head is damaged too, save it again from its training checkpoint or retrain it); or restore the "
               "directory from a good copy")
    return DamagedFileError(f"{err}. Refusing to load {path}: {how}.")


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


# ---- target fingerprints ---------------------------------------------------------------------------
def check_target_fingerprint(stored: dict[str, Any], expected: dict[str, Any] | None, where: str | Path) -> None:
    """Refuse (TargetMismatchError) a head whose stored target fingerprint differs from the configured
    target's (`expected`, `data.store.target_fingerprint`), naming `where` (the checkpoint) and each
    differing key with both values. `expected=None`: no check. An empty stored fingerprint (a legacy
    checkpoint, or an export not made by spechead) loads with a warning, as do keys only one side has."""
    if expected is None:
        return
    if not stored:
        log.warning("%s: records no target fingerprint (a checkpoint written without one, or not by spechead): "
                    "cannot check that it was trained for the configured target %r (compute dtype %s); loading "
                    "it anyway", where, expected.get("name"), expected.get("compute_dtype"))
        return
    diffs, uncompared = compare_fingerprints(stored, expected)
    if diffs:
        detail = "; ".join(f"{k}: stored {s!r}, configured {e!r}" for k, (s, e) in diffs.items())
        raise TargetMismatchError(
            f"{where}: this head was trained for another target than the configured one (stored target "
            f"{stored.get('name')!r}, configured {expected.get('name')!r}; differing: {detail}). Load it with the "
            "target, tokenizer and target.dtype it was trained with, or train a head for this target.")
    compared = (set(stored) & set(expected)) - FINGERPRINT_IGNORED
    if not compared:
        log.warning("%s: its target fingerprint shares no identity key with the configured one (stored keys %s, "
                    "configured %s): nothing could be checked; loading it anyway", where, sorted(stored),
                    sorted(expected))
    elif uncompared:
        log.warning("%s: target fingerprint %s recorded on one side only or not comparable, not compared "
                    "(the rest agrees)", where, uncompared)


# ---- artifact directories --------------------------------------------------------------------------
def export_kind(fmt: str) -> str:
    """The marker kind of an engine export."""
    return f"export:{fmt}"


def artifact_info(path: str | Path) -> dict[str, Any] | None:
    """The marker of a spechead artifact directory (`{"kind": ..., ...}`), None if it is not one. A native
    checkpoint written before markers existed (config.json with `spechead_format`) counts as a native head."""
    path = Path(path)
    try:
        marker = json.loads((path / ARTIFACT_MARKER).read_text())
    except FileNotFoundError:
        marker = None
    except (OSError, ValueError):
        return None
    if marker is not None:
        return marker if isinstance(marker, dict) and isinstance(marker.get("kind"), str) else None
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(cfg, dict) and "spechead_format" in cfg:
        return {"kind": NATIVE_KIND, "legacy": True}
    return None


def check_replaceable(out_dir: str | Path, kind: str) -> None:
    """Raise ArtifactError unless `out_dir` is absent, an empty directory, or a spechead artifact of `kind`."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise ArtifactError(f"{out_dir}: is a symbolic link (to {os.readlink(out_dir)}); refusing to replace it with "
                            f"a {kind} artifact: write to the real directory, or remove the link yourself")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ArtifactError(f"{out_dir}: exists and is not a directory ({out_dir.stat().st_size} bytes); refusing to "
                            f"replace it with a {kind} artifact")
    entries = sorted(os.listdir(out_dir))
    if not entries:
        return
    info = artifact_info(out_dir)
    if info is not None and info["kind"] == kind:
        return
    what = (f"is not a spechead artifact (no {ARTIFACT_MARKER})" if info is None
            else f"is a spechead {info['kind']!r} artifact, not {kind!r}")
    shown = ", ".join(entries[:10]) + (f", ... ({len(entries)} entries)" if len(entries) > 10 else "")
    raise ArtifactError(f"{out_dir}: refusing to replace this directory with a {kind} artifact: it {what}; it "
                        f"contains: {shown}. Choose another output directory, or move or delete it yourself (an "
                        "export written before spechead marked its artifacts has to be deleted by hand).")


@contextmanager
def atomic_artifact_dir(out_dir: str | Path, kind: str, marker: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir` to write an artifact into; on success add the marker
    (`{"kind": kind, "spechead_version": ..., **marker}`) and then the checksum manifest of every file
    (`artifacts.integrity.write_manifest`), fsync, and swap it in for `out_dir`
    (`core.files.atomic_dir`: one `renameat2(RENAME_EXCHANGE)` where the kernel has it).

    Before writing, and again before the swap, an existing `out_dir` must be empty or an artifact of the
    same kind (`check_replaceable`), else ArtifactError; leftovers of an interrupted save are recovered."""
    def finish(tmp: Path) -> None:
        info = {"kind": kind, "spechead_version": _version(), **(marker or {})}
        (tmp / ARTIFACT_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
        write_manifest(tmp)  # last: it covers every file, the marker included

    with atomic_dir(out_dir, check=lambda d: check_replaceable(d, kind), finish=finish) as tmp:
        yield tmp


# ---- checksums -------------------------------------------------------------------------------------
def artifact_problems(path: str | Path) -> list[str]:
    """Each way the directory differs from its checksum manifest (`artifacts.integrity.manifest_problems`).
    Without a manifest: [] — with one warning when the directory is a spechead artifact (a marker, or a
    native checkpoint from before markers: saved before manifests existed), silently for anything else
    (the peer trainer's checkpoints, an export not written by spechead: nothing recorded to compare with)."""
    path = Path(path)
    try:
        problems = manifest_problems(path)
    except IntegrityError as e:
        return [str(e)]
    if problems is not None:
        return problems
    if artifact_info(path) is not None:
        log.warning("%s: has no %s (saved before spechead recorded checksums): its files cannot be checked "
                    "against what was written; going on without that check. To add one, save it again (load it "
                    "and save_native, or export it again), or record its files as they are now: python -m "
                    "artifacts.integrity --write %s", path, MANIFEST, path)
    else:
        log.debug("%s: not written by spechead (no artifact marker, no %s): no checksums to check", path, MANIFEST)
    return []


def verify_artifact(path: str | Path) -> None:
    """Refuse (IntegrityError) a head or export directory whose files differ from its checksum manifest,
    naming each file with the expected and found sha256 and what to do; run by every reader before it
    reads a tensor. A directory without a manifest loads (`artifact_problems`: a warning for our own)."""
    problems = artifact_problems(path)
    if problems:
        raise integrity_error(Path(path), problems)


def copy_target_files(target_dir: Path, out: Path, skip_weights: bool) -> None:
    """The target's tokenizer, generation config, ... (and its weight files unless skipped) into an export;
    never config.json, an artifact marker nor a checksum manifest."""
    for f in target_dir.iterdir():
        weights = f.suffix == ".safetensors" or f.name == INDEX_FILE
        own = f.name in ("config.json", ARTIFACT_MARKER, MANIFEST)
        if f.is_file() and not own and not (skip_weights and weights):
            shutil.copy2(f, out / f.name)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("spechead")
    except Exception:  # running from a source tree without installing
        return "0+unknown"


__all__ = ["save_native", "load_native", "read_config", "ARTIFACT_MARKER", "NATIVE_KIND", "ArtifactError",
           "TargetMismatchError", "atomic_artifact_dir", "artifact_info", "check_replaceable",
           "check_target_fingerprint", "export_kind", "recover_interrupted_save", "artifact_problems",
           "verify_artifact", "IntegrityError", "DamagedFileError", "reading_artifact", "damaged_error"]
