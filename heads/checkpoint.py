"""Build a head from its config and save / load the native checkpoint (DESIGN.md §8).

Native format: `config.json` (head type, head hyper-parameters, target shapes and fingerprint,
spechead version) + `model.safetensors` with the head's own weights only — the frozen target
embedding, final norm and lm_head are excluded and re-attached from the target at load.

Every directory spechead writes (native heads here, engine exports in heads/export.py) goes through
`atomic_artifact_dir`: written in a temp dir next to the destination, marked with
`.spechead-artifact.json` (`{"kind": "native-head" | "export:<format>", ...}`), fsynced, then swapped
in atomically. An existing destination is replaced only if it is empty or a spechead artifact of the
same kind; leftovers of an interrupted save are recovered or removed by the next save.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from heads.draft_lm import DraftLMConfig, DraftLMHead
from heads.eagle1 import Eagle1Config, Eagle1Head
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.layers import LlamaArgs
from heads.base import DraftHead, TiedTarget
from heads.medusa import MedusaConfig, MedusaHead
from heads.mtp import MTPConfig, MTPHead

log = logging.getLogger(__name__)

HEAD_TYPES = {"mtp": (MTPConfig, MTPHead), "eagle1": (Eagle1Config, Eagle1Head),
              "eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHead),
              "draft_lm": (DraftLMConfig, DraftLMHead)}
FORMAT_VERSION = 1
ARTIFACT_MARKER = ".spechead-artifact.json"
NATIVE_KIND = "native-head"
# fingerprint keys that do not identify the target: a label, library versions (a head trained under torch
# 2.x still fits the same weights under 2.y) and how the weights were hashed (`weights_hash`: header or
# full, data/store.py). Every other key present on both sides must be equal.
FINGERPRINT_IGNORED = frozenset({"name", "versions", "weights_hash"})


class ArtifactError(RuntimeError):
    """A save would replace something that is not a spechead artifact of the same kind."""


class TargetMismatchError(ValueError):
    """A head (or export) was trained for another target, tokenizer or compute dtype than the configured one."""


def build_head(head_cfg: dict[str, Any], args: LlamaArgs, tied: TiedTarget) -> DraftHead:
    cfg = dict(head_cfg)
    kind = cfg.pop("type", "mtp")
    cfg.pop("_target_", None)
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown head type {kind!r}; known: {sorted(HEAD_TYPES)}")
    config_cls, head_cls = HEAD_TYPES[kind]
    return head_cls(args, config_cls(**cfg), tied)


def save_native(head: DraftHead, out_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (`atomic_artifact_dir`): refuses to replace a
    directory that is not a native head, and a kill at any point leaves the old or the new checkpoint."""
    out_dir = Path(out_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    config = {
        "spechead_format": FORMAT_VERSION,
        "spechead_version": _version(),
        "head": head.cfg.to_dict(),
        "target_args": asdict(head.args),
        "target_fingerprint": fingerprint or {},
    }
    with atomic_artifact_dir(out_dir, NATIVE_KIND) as tmp:
        save_file(state, tmp / "model.safetensors", metadata={"format": "spechead-native"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def load_native(path: str | Path, tied: TiedTarget, args: LlamaArgs | None = None,
                expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
    """Rebuild a head from a native checkpoint and attach the target's frozen tensors.

    `expected_fingerprint` (`data.store.target_fingerprint(target_dir, name, dtype)` of the configured
    target): the checkpoint's stored fingerprint must agree with it (`check_target_fingerprint`);
    None skips the check."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: not a spechead head checkpoint (no config.json){_leftover_hint(path)}")
    config = json.loads(cfg_file.read_text())
    if "head" not in config or "target_args" not in config:
        raise ValueError(f"{cfg_file}: missing 'head' or 'target_args' — not a native spechead checkpoint")
    check_target_fingerprint(config.get("target_fingerprint") or {}, expected_fingerprint, path)
    saved_args = LlamaArgs(**config["target_args"])
    if args is not None and (args.hidden_size, args.vocab_size) != (saved_args.hidden_size, saved_args.vocab_size):
        raise ValueError(f"{path}: head was trained for hidden={saved_args.hidden_size}, vocab={saved_args.vocab_size}; "
                         f"the target has hidden={args.hidden_size}, vocab={args.vocab_size}")
    head = build_head(config["head"], saved_args, tied)
    state = load_file(path / "model.safetensors")
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


# ---- target fingerprints ---------------------------------------------------------------------------
def fingerprint_differences(stored: dict[str, Any], expected: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """`{key: (stored, configured)}` for every identity key present in both fingerprints whose values differ
    (all keys but `FINGERPRINT_IGNORED`; `compute_dtype` is the dtype check). Generic on purpose: keys
    data/store.py adds are compared as soon as both sides have them."""
    return _compare(stored, expected)[0]


def _compare(stored: dict[str, Any], expected: dict[str, Any]) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """(differences, what could not be compared). A fingerprint without `weights_hash` predates header
    hashing: its `weights_sha256` hashes the tensor bytes, so against a newer one it is compared with
    that one's `weights_content_sha256` (present with target.fingerprint=full), or not at all."""
    skip = set(FINGERPRINT_IGNORED)
    diffs: dict[str, tuple[Any, Any]] = {}
    uncompared = sorted((set(stored) ^ set(expected)) - skip)
    s_legacy, e_legacy = ("weights_hash" not in fp and "weights_sha256" in fp for fp in (stored, expected))
    if s_legacy != e_legacy and "weights_sha256" in stored and "weights_sha256" in expected:
        skip.add("weights_sha256")
        legacy, newer = (stored, expected) if s_legacy else (expected, stored)
        if "weights_content_sha256" in newer:
            skey, ekey = ("weights_sha256", "weights_content_sha256") if s_legacy else ("weights_content_sha256",
                                                                                      "weights_sha256")
            if stored[skey] != expected[ekey]:
                diffs[f"{skey} (stored) vs {ekey} (configured)"] = (stored[skey], expected[ekey])
            uncompared = [k for k in uncompared if k != "weights_content_sha256"]
        else:
            uncompared.append("weights_sha256 (one side hashes the weight bytes, an older spechead's fingerprint, "
                              "the other their headers: set target.fingerprint=full to compare them)")
    for k in sorted((set(stored) & set(expected)) - skip):
        if stored[k] != expected[k]:
            diffs[k] = (stored[k], expected[k])
    return diffs, uncompared


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
    diffs, uncompared = _compare(stored, expected)
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


def _leftovers(out_dir: Path) -> tuple[Path, list[Path]]:
    """`.<name>.old` (where a swap without RENAME_EXCHANGE parks the old artifact) and the temp dirs
    `.<name>.XXXXXXXX[.tmp]` that `tempfile.mkdtemp` made for a save into `out_dir`."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.[a-z0-9_]{{8}}(\.tmp)?")
    temps = []
    if out_dir.parent.is_dir():
        temps = sorted(p for p in out_dir.parent.iterdir()
                       if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    return old, temps


def _leftover_hint(path: Path) -> str:
    old, _ = _leftovers(path)
    if not path.exists() and old.is_dir():
        return f" — an interrupted save left the previous version in {old}; the next save to {path} restores it"
    return ""


def recover_interrupted_save(out_dir: str | Path) -> None:
    """Undo or clean what a killed save left next to `out_dir`: `.<name>.old` is moved back when
    `out_dir` is missing (the previous artifact) and removed otherwise (the new one is in place); temp
    dirs of unfinished saves are removed."""
    out_dir = Path(out_dir)
    old, temps = _leftovers(out_dir)
    if old.is_dir() and not old.is_symlink():
        if not out_dir.exists() and not out_dir.is_symlink():
            log.warning("%s: missing after an interrupted save; restoring the previous version from %s", out_dir, old)
            os.replace(old, out_dir)
            _fsync_dir(out_dir.parent)
        else:
            log.warning("%s: removing %s, left by an interrupted save", out_dir, old)
            _remove_tree(old)
    for tmp in temps:
        log.warning("%s: removing %s, the temp dir of an interrupted save", out_dir, tmp)
        _remove_tree(tmp)


@contextmanager
def atomic_artifact_dir(out_dir: str | Path, kind: str, marker: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir` to write an artifact into; on success add the marker
    (`{"kind": kind, "spechead_version": ..., **marker}`), fsync, and swap it in for `out_dir`.

    Before writing: leftovers of an interrupted save are recovered (`recover_interrupted_save`) and an
    existing `out_dir` must be empty or an artifact of the same kind (`check_replaceable`), else
    ArtifactError. The swap is one `renameat2(RENAME_EXCHANGE)` where the kernel has it, so `out_dir`
    holds the old or the new artifact at every instant; elsewhere the old one is parked at `.<name>.old`
    for an instant, which the next save moves back if a kill struck in between."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(out_dir)
    check_replaceable(out_dir, kind)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        info = {"kind": kind, "spechead_version": _version(), **(marker or {})}
        (tmp / ARTIFACT_MARKER).write_text(json.dumps(info, indent=2, sort_keys=True))
        _fsync_tree(tmp)
        check_replaceable(out_dir, kind)  # in case something appeared there while we wrote
    except BaseException:
        _remove_tree(tmp)
        raise
    _swap_in(tmp, out_dir)


def _swap_in(tmp: Path, out_dir: Path) -> None:
    if not (out_dir.exists() or out_dir.is_symlink()):
        os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
        return
    try:
        _rename_exchange(tmp, out_dir)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        old = out_dir.with_name(f".{out_dir.name}.old")  # absent: recover_interrupted_save ran
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
        _remove_tree(old)
        return
    _fsync_dir(out_dir.parent)
    _remove_tree(tmp)  # now the old artifact


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _rename_exchange(a: Path, b: Path) -> None:
    """Atomically exchange two paths (Linux renameat2 RENAME_EXCHANGE); OSError(ENOSYS) elsewhere."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _remove_tree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    if p.exists():
        log.warning("%s: could not be removed entirely (the next save retries)", p)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("spechead")
    except Exception:  # running from a source tree without installing
        return "0+unknown"


__all__ = ["build_head", "save_native", "load_native", "read_config", "HEAD_TYPES", "ARTIFACT_MARKER",
           "NATIVE_KIND", "ArtifactError", "TargetMismatchError", "atomic_artifact_dir", "artifact_info",
           "check_replaceable", "check_target_fingerprint", "export_kind", "fingerprint_differences",
           "recover_interrupted_save"]
