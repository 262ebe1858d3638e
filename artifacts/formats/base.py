"""What every export format is (`ExportFormat`: recognise, write, read and validate one on-disk layout, as
torchtune's checkpointer classes do for theirs) and the pieces several formats share: reading a target's
config and frozen tensors, the head's state as written, and why no engine format can hold a head.

A format's write goes into a fresh directory; `save` wraps it in `artifacts.checkpoint.atomic_artifact_dir`
(marker kind `export:<name>`, with the head's target fingerprint, then the checksum manifest), and `load`
checks the manifest and that fingerprint before `read`. The checks a validator runs are in
artifacts/formats/checks.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from artifacts.checkpoint import (artifact_info, atomic_artifact_dir, check_target_fingerprint, export_kind,
                                  reading_artifact, verify_artifact)
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.layers import LLAMA_FAMILY, LlamaArgs, TiedConventions


class ExportFormat:
    """One on-disk format of a head. Subclasses set `name`, `head_kind` (the head kind spechead writes in it;
    None for a format that is only read) and `vllm_method` (vLLM's speculative `method` that serves it; None
    when vLLM does not), and implement `detect`, `write`, `read` and `validate`."""

    name: str
    head_kind: str | None = None
    vllm_method: str | None = None

    @property
    def artifact_kind(self) -> str:
        """The kind its artifact marker records (`check_replaceable` refuses to replace another kind)."""
        return export_kind(self.name)

    def holds(self, head: DraftHead) -> bool:
        """Whether the format is one of the head kind's: what `export_head` may write it in."""
        return self.head_kind is not None and head.kind == self.head_kind

    def serves(self, head: DraftHead) -> bool:
        """Whether an engine serves this head in this format without loss (`servable_formats`)."""
        return True

    def refusal(self, head: DraftHead) -> str | None:
        """Why this format cannot hold the head, checked before anything is written; None if it can."""
        blocker = engine_format_blocker(head)
        if blocker is not None:
            return f"format {self.name!r} cannot hold this {head.kind} head: {blocker}; export it as native"
        return None

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        """Whether the directory `path` (its config.json: `cfg`) is in this format."""
        raise NotImplementedError

    def write(self, head: DraftHead, out: Path, target_dir: Path) -> None:
        """Write the head into the fresh directory `out` (`target_dir`: the target's HF checkpoint)."""
        raise NotImplementedError(f"spechead does not write the {self.name!r} format")

    def save(self, head: DraftHead, out_dir: Path, target_dir: Path, fingerprint: dict[str, Any] | None,
             source: str | Path | None = None) -> Path:
        """`write` into `out_dir` atomically, marked with the head's target fingerprint and `source` (the native
        head it is exported from, named when a file of it is found damaged later)."""
        marker = {"target_fingerprint": fingerprint or {}, **({"exported_from": str(source)} if source else {})}
        with atomic_artifact_dir(out_dir, self.artifact_kind, marker) as tmp:
            self.write(head, tmp, target_dir)
        return Path(out_dir)

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        """The head the directory holds, over the target's frozen tensors (`args`: the target's)."""
        raise NotImplementedError

    def load(self, path: Path, tied: TiedTarget, args: LlamaArgs,
             expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
        """`read`, after checking the files against the checksum manifest (`artifacts.checkpoint.verify_artifact`:
        a changed, missing or added file is an IntegrityError) and the fingerprint the artifact marker records
        against `expected_fingerprint` (`artifacts.checkpoint.check_target_fingerprint`; none recorded: a
        warning; None: no check). A file that cannot be read is a DamagedFileError naming it
        (`artifacts.checkpoint.reading_artifact`)."""
        verify_artifact(path)
        if expected_fingerprint is not None:
            stored = (artifact_info(path) or {}).get("target_fingerprint") or {}
            check_target_fingerprint(stored, expected_fingerprint, path)
        with reading_artifact(path):
            return self.read(path, tied, args)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        """Append every violation of the format found in `path` (`cfg`, `infos`: its config and tensors;
        `target`, `tcfg`: the target's directory and config, when given) to `problems`."""
        raise NotImplementedError


def engine_format_blocker(head: DraftHead) -> str | None:
    """Why no engine format can hold this head, or None: the engines' draft classes (and `draft-hf`'s
    target class with Llama layers) apply Llama's conventions to a Llama-family target."""
    conventions = getattr(head.tied, "conventions", TiedConventions())
    if conventions != TiedConventions():
        return (f"the head follows its target's conventions {conventions} (embedding scale, (1 + w) final norm, "
                "logit cap), which the engines' Llama draft classes do not apply")
    if head.args.model_type not in LLAMA_FAMILY:  # DeepSeek-V2 (MLA, YaRN): no engine format checked against it
        return f"its target is a {head.args.model_type!r} model, not one of the Llama family {LLAMA_FAMILY}"
    return None


# ---- reading HF-style directories ----------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def target_embed_and_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's E and W_lm exactly as stored (dtype included); W_lm = E for tied embeddings."""
    cfg = read_json(target_dir / "config.json")
    infos = scan_tensors(target_dir)
    embed = load_tensor(infos["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in infos:
        return embed, embed
    return embed, load_tensor(infos["lm_head.weight"], "lm_head.weight")


# ---- writing and reading a head's tensors ------------------------------------------------------------
def head_state(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's own tensors as written: detached, contiguous, on the CPU."""
    return {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}


def dtype_name(head: DraftHead) -> str:
    """The head's dtype as a config writes it (`float32`, `bfloat16`)."""
    return str(head.dtype).removeprefix("torch.")


def write_config(out: Path, cfg: dict[str, Any]) -> None:
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def t2d_of(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The target ids a draft vocabulary holds ([V] bool), from its d2t offsets (target id = draft id + d2t)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t + torch.arange(d2t.shape[0])] = True
    return t2d


def loaded(head: DraftHead, state: dict[str, torch.Tensor], tied: TiedTarget) -> DraftHead:
    """The head with exactly `state` loaded, in the target's dtype."""
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)
