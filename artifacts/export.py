"""Export of a trained head: writing it in the formats asked for, each validated, read back and compared with
the live head; and reading any head directory back (docs/design.md §8).

The formats themselves — how each is recognised, written, read and validated — are artifacts/formats/, one
module per format, and its registry (`FORMATS`, `ENGINE_FORMATS`, `VLLM_METHODS`, `detect_format`) is what
this module dispatches on; docs/reference/export_formats.md describes the layouts, docs/export.md says which
engine loads what.

Every export is validated (artifacts/validate.py), read back into a head by `load_export` and compared with
the live head on fixed inputs (`probe_logits`, bit for bit) before it is reported. Each directory is
written atomically with an artifact marker (`artifacts.checkpoint.atomic_artifact_dir`, kind
`export:<format>` with the head's target fingerprint; `native-head` for the native checkpoint); an existing
directory that is not an export of the same format is never replaced.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from artifacts.checkpoint import check_replaceable, check_target_fingerprint, load_native, reading_artifact, save_native
from artifacts.formats import ENGINE_FORMATS, FORMATS, VLLM_METHODS, detect_format, get_format
from artifacts.formats.base import engine_format_blocker
from artifacts.validate import check_export
from core.files import recover_interrupted_save
from heads.base import DraftHead, TiedTarget
from heads.draft_lm import DraftLMHead
from heads.layers import LlamaArgs

__all__ = ["ENGINE_FORMATS", "VLLM_METHODS", "check_servable", "default_formats", "detect_format",
           "engine_format_blocker", "export_head", "export_native", "load_any", "load_export", "probe_logits",
           "servable_formats", "vllm_export", "vllm_format"]  # the registry's tables and detection, re-exported
log = logging.getLogger(__name__)


@torch.no_grad()
def probe_logits(head: DraftHead, seed: int = 0, length: int = 8) -> torch.Tensor:
    """Head logits (and, for a sub-vocabulary, the target ids of its rows) on a fixed random
    (state, token) sequence at every depth the head defines up to 3 — a fingerprint of the function."""
    if isinstance(head, DraftLMHead) or getattr(head, "block", False):  # a draft LM reads tokens only; a block head
        return head.probe(seed, length)                                      # drafts blocks: each its own probe
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, head.args.hidden_size, generator=gen).to(head.dtype)
    tokens = torch.randint(0, head.args.vocab_size, (1, length), generator=gen)
    if head.capture_layers:  # the state the head reads from H and its aux layers (EAGLE-3's fc, mtp's fusion)
        aux = torch.randn(1, length, len(head.capture_layers) * head.args.hidden_size, generator=gen)
        hidden = head.target_input(hidden, aux.to(head.dtype))
    positions = torch.arange(length).expand(1, length)
    depths = min(head.max_depth or 3, 3)
    outs, state = [], hidden
    for d in range(1, depths + 1):
        if head.chain:
            state = head(state, tokens, positions + d - 1, depth=d)
        else:
            state = head(hidden, depth=d)
        outs.append(head.logits(state, depth=d).float())
    ids = head.draft_ids
    if ids is not None:
        outs.append(ids.float()[None, None].expand(1, 1, -1))
    return torch.cat([o.reshape(-1) for o in outs])


def export_native(head: DraftHead, out_dir: str | Path, fingerprint: dict[str, Any] | None = None,
                  expected_fingerprint: dict[str, Any] | None = None) -> Path:
    """Write the native checkpoint and prove the round trip: the reloaded head's logits must equal
    the live head's bit for bit (and its fingerprint must agree with `expected_fingerprint`, if given)."""
    out = save_native(head, out_dir, fingerprint)
    reloaded = load_native(out, head.tied, head.args, expected_fingerprint)
    if not torch.equal(probe_logits(head), probe_logits(reloaded)):
        raise RuntimeError(f"{out}: reloaded head gives different logits than the exported one")
    return out


def servable_formats(head: DraftHead) -> list[str]:
    """The engine formats an engine serves for this head on its target, without loss (each format's `serves`:
    eagle1-vllm only when fc has no non-zero bias, mtp-vllm on a target without q/k norms, never the DeepSeek
    MTP layouts). None for a target whose tied tensors follow other conventions than Llama's (Gemma 3: E·√H,
    (1 + w) final norm): the engines' draft classes apply Llama's, and no export of such a head is validated yet."""
    if engine_format_blocker(head) is not None:
        return []
    return [fmt for fmt in ENGINE_FORMATS.get(head.kind, ()) if FORMATS[fmt].serves(head)]


def vllm_format(head: DraftHead) -> str:
    """The format vLLM serves this head in (the first of `servable_formats` with a vLLM method); a ValueError
    that says why when there is none."""
    formats = [f for f in servable_formats(head) if f in VLLM_METHODS]
    if not formats:
        why = engine_format_blocker(head) or (f"its {', '.join(ENGINE_FORMATS.get(head.kind, ())) or 'formats'} "
                                              "are not served by vLLM for this head")
        raise ValueError(f"a {head.kind} head cannot be served by vLLM: {why}")
    return formats[0]


def check_servable(fmt: str, version: str, where: str) -> None:
    """Medusa on vLLM ≥ 0.33 is refused: that release removed it."""
    if VLLM_METHODS[fmt] == "medusa" and not version.startswith("0.32."):
        raise ValueError(f"{where}: a medusa head cannot be served by vLLM {version}: vLLM 0.33 removed "
                         "Medusa (its MedusaModel and model files); evaluate it with spechead's engine or on "
                         "vLLM 0.32")


def vllm_export(head: DraftHead, out_root: Path, target_dir: Path, version: str, where: str,
                fingerprint: dict | None = None, expected_fingerprint: dict | None = None) -> tuple[Path, str]:
    """(directory, vLLM `method`): the head written under `out_root/<format>` in the format vLLM serves it in."""
    fmt = vllm_format(head)
    check_servable(fmt, version, where)
    out = Path(out_root) / fmt
    export_head(head, {fmt: out}, target_dir, fingerprint, expected_fingerprint=expected_fingerprint)
    return out, VLLM_METHODS[fmt]


def default_formats(head: DraftHead) -> list[str]:
    """`export.formats: null`: `native` plus every format an engine serves for this head
    (`servable_formats`); the others only when asked for by name."""
    return ["native", *servable_formats(head)]


def export_head(head: DraftHead, out_dirs: dict[str, str | Path], target_dir: str | Path,
                fingerprint: dict[str, Any] | None = None, *, expected_fingerprint: dict[str, Any] | None = None,
                source: str | Path | None = None) -> dict[str, Path]:
    """Write each format to its directory (`{format: dir}`), validate it against the target, read it back
    and compare logits with the live head. Returns `{format: dir}`.

    `fingerprint`: the head's stored target fingerprint (its checkpoint's), written into every export.
    `expected_fingerprint`: the configured target's (`data.store.target_fingerprint`); a head trained for
    another target or compute dtype is refused before anything is written (`source`, the checkpoint it came
    from, is named in the error). Every directory must be absent, empty or an export of the same format
    (`artifacts.checkpoint.check_replaceable`), checked for all of them before the first is written."""
    target_dir = Path(target_dir)
    for fmt in out_dirs:
        if fmt not in FORMATS or not FORMATS[fmt].holds(head):
            known = ", ".join(name for name, f in FORMATS.items() if f.holds(head))
            raise ValueError(f"format {fmt!r} does not apply to a {head.kind!r} head; it exports to: {known}")
        refusal = FORMATS[fmt].refusal(head)
        if refusal is not None:
            raise ValueError(refusal)
    check_target_fingerprint(fingerprint or {}, expected_fingerprint,
                             source if source is not None else f"the {head.kind} head to export")
    seen: dict[Path, str] = {}
    for fmt, out_dir in out_dirs.items():
        key = Path(out_dir).resolve()
        if key in seen:
            raise ValueError(f"{out_dir}: formats {seen[key]!r} and {fmt!r} would both be written there")
        seen[key] = fmt
        recover_interrupted_save(out_dir)
        check_replaceable(out_dir, FORMATS[fmt].artifact_kind)
    written: dict[str, Path] = {}
    for n, (fmt, out_dir) in enumerate(out_dirs.items(), start=1):
        t0 = time.perf_counter()
        log.info("export %d/%d: %s → %s", n, len(out_dirs), fmt, out_dir)
        written[fmt] = FORMATS[fmt].save(head, Path(out_dir), target_dir, fingerprint, source)
        check_export(written[fmt], fmt, target_dir)
        reloaded = load_export(written[fmt], fmt, head.tied, head.args, expected_fingerprint)
        if not torch.equal(probe_logits(head), probe_logits(reloaded)):
            raise RuntimeError(f"{written[fmt]}: the {fmt} export read back gives different logits than the live head")
        log.info("export %d/%d: %s written, validated and read back in %.1fs", n, len(out_dirs), fmt,
                 time.perf_counter() - t0)
    return written


# ---- reading head directories back ------------------------------------------------------------------
def load_any(path: str | Path, tied: TiedTarget, args: LlamaArgs,
             expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
    """Load a native checkpoint or any engine export (format detected) as a spechead head."""
    with reading_artifact(path):  # detection reads headers too (eagle1's looks for fc.weight)
        fmt = detect_format(path)
    return load_export(path, fmt, tied, args, expected_fingerprint)


def load_export(path: str | Path, fmt: str, tied: TiedTarget, args: LlamaArgs,
                expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
    """Rebuild a spechead head from an export directory (`args`: the target's), frozen tensors attached.

    `expected_fingerprint` (the configured target's, `data.store.target_fingerprint`): the fingerprint the
    export records (native: config.json; engine formats: the artifact marker) must agree with it
    (`artifacts.checkpoint.check_target_fingerprint`); an export without one loads with a warning. None: no check."""
    return get_format(fmt).load(Path(path), tied, args, expected_fingerprint)
