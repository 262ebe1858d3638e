"""The head types by name and `build_head`, which makes one from its config (docs/design.md §3)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def head_config(section: Mapping[str, Any]) -> tuple[str, Any]:
    """(type, its typed config: MTPConfig, Eagle3Config, …) of a `head` section — what `build_head` builds from and
    what other stages read (the target layers a head needs); the config class checks the values."""
    values = dict(section)
    kind = values.pop("type", "mtp")
    values.pop("_target_", None)
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown head type {kind!r}; known: {sorted(HEAD_TYPES)}")
    return kind, HEAD_TYPES[kind][0](**values)


def build_head(head_cfg: dict[str, Any], args: LlamaArgs, tied: TiedTarget) -> DraftHead:
    kind, config = head_config(head_cfg)
    return HEAD_TYPES[kind][1](args, config, tied)


def head_aux_layers(config: Any, num_layers: int) -> tuple[int, ...]:
    """The target layers (inputs of) a head reads besides H, from its typed config (`head_config`): EAGLE-3's (its
    default when unset), an `mtp` head's `aux_layers` (none when unset), a block head's `target_layers` (its default
    when unset), nothing for the other heads."""
    if isinstance(config, Eagle3Config):
        return tuple(int(i) for i in (config.aux_layers or default_aux_layers(num_layers)))
    if isinstance(config, DFlashConfig):  # dspark's config is one too
        return tuple(int(i) for i in (config.target_layers or default_target_layers(num_layers)))
    if isinstance(config, MTPConfig):
        return tuple(int(i) for i in (config.aux_layers or ()))
    return ()


def resolve_aux_layers(spec: str | Sequence[int] | None, head: Any, num_layers: int) -> tuple[int, ...]:
    """`precompute.aux_layers` (`spec`): a list of target layer ids (inputs of those layers), `none`, or `auto` (the
    default): what the configured head (its typed config, `head_config`) reads — EAGLE-3's aux layers, an `mtp`
    head's `aux_layers`, a block head's target layers, nothing for other heads."""
    if spec in (None, "none", False):
        return ()
    if spec == "auto":
        spec = head_aux_layers(head, num_layers)
    ids = tuple(int(i) for i in spec)
    check_aux_ids(ids, num_layers, "precompute.aux_layers")
    return ids
