"""The head types by name and `build_head`, which makes one from its config (docs/design.md §3)."""

from __future__ import annotations

from typing import Any

from heads.base import DraftHead, TiedTarget, check_aux_ids
from heads.dflash import DFlashConfig, DFlashHead, DSparkConfig, DSparkHead, default_target_layers
from heads.draft_lm import DraftLMConfig, DraftLMHead
from heads.eagle1 import Eagle1Config, Eagle1Head
from heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from heads.layers import LlamaArgs
from heads.medusa import MedusaConfig, MedusaHead
from heads.mtp import MTPConfig, MTPHead

HEAD_TYPES = {"mtp": (MTPConfig, MTPHead), "eagle1": (Eagle1Config, Eagle1Head),
              "eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHead),
              "draft_lm": (DraftLMConfig, DraftLMHead), "dflash": (DFlashConfig, DFlashHead),
              "dspark": (DSparkConfig, DSparkHead)}


def head_type(head: DraftHead) -> str:
    """The registry name of a built head (`mtp`, `eagle3`, …)."""
    for kind, (_, head_cls) in HEAD_TYPES.items():
        if type(head) is head_cls:
            return kind
    raise ValueError(f"{type(head).__name__} is not a registered head type; known: {sorted(HEAD_TYPES)}")


def build_head(head_cfg: dict[str, Any], args: LlamaArgs, tied: TiedTarget) -> DraftHead:
    cfg = dict(head_cfg)
    kind = cfg.pop("type", "mtp")
    cfg.pop("_target_", None)
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown head type {kind!r}; known: {sorted(HEAD_TYPES)}")
    config_cls, head_cls = HEAD_TYPES[kind]
    return head_cls(args, config_cls(**cfg), tied)


def head_aux_layers(head_cfg: Any, num_layers: int) -> tuple[int, ...]:
    """The target layers (inputs of) a head config reads besides H: EAGLE-3's (its default when unset), an
    `mtp` head's `aux_layers` (none when unset), a block head's `target_layers` (its default when unset), nothing
    for the other heads."""
    kind = head_cfg.get("type", "mtp")
    if kind == "eagle3":
        return tuple(int(i) for i in (head_cfg.get("aux_layers") or default_aux_layers(num_layers)))
    if kind in ("dflash", "dspark"):
        return tuple(int(i) for i in (head_cfg.get("target_layers") or default_target_layers(num_layers)))
    if kind == "mtp":
        return tuple(int(i) for i in (head_cfg.get("aux_layers") or ()))
    return ()


def resolve_aux_layers(cfg: Any, num_layers: int) -> tuple[int, ...]:
    """`precompute.aux_layers`: a list of target layer ids (inputs of those layers), `none`, or `auto`
    (the default): what the configured head reads — EAGLE-3's aux layers, an `mtp` head's `aux_layers`, nothing
    for other heads."""
    spec = cfg.precompute.get("aux_layers", "auto")
    if spec in (None, "none", False):
        return ()
    if spec == "auto":
        spec = head_aux_layers(cfg.get("head") or {}, num_layers)
    ids = tuple(int(i) for i in spec)
    check_aux_ids(ids, num_layers, "precompute.aux_layers")
    return ids
