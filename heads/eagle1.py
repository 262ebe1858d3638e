"""The EAGLE-1 head, kept exactly for the ablation and for export — docs/design.md §3.

EAGLE-1 (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty";
SafeAILab/EAGLE `eagle/model/cnets1.py`) works in the target's *post-norm* feature space:

    F_i = N_f(H_i)                                             (the store holds H_i: the head applies N_f)
    x   = fc [ E t_{i+1} ; F_i ]   (+ bias)                    (order as in vLLM/SGLang `llama_eagle.py`)
    Ĥ   = DecoderLayer(x)  without input_layernorm, no final norm
    L̂   = W_lm · Ĥ                                             (frozen, shared lm_head)

Ĥ stands in for F_{i+1}, so it is fed back as is at depth > 1 and regressed against N_f(H_{i+1}).
Depth convention of `fuse` / `forward`: depth 1 consumes the target's pre-norm H_i (the store's and
the engine's hidden states), depth > 1 the head's own previous output Ĥ (already in F-space).

Tensor names are EAGLE's own (`fc`, `layers.0.self_attn.*`, `layers.0.post_attention_layernorm`,
`layers.0.mlp.*`), so the native state dict is already the engines' key set (artifacts/export.py).
The interface is MTPHead's, so the training module and the engine's draft loop drive it unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from heads.base import DraftHead, TiedTarget, init_random
from heads.layers import DecoderLayer, Linear, LlamaArgs


@dataclass(frozen=True)
class Eagle1Config:
    """Head hyper-parameters beyond the target's shapes. `bias=False` for a head meant for vLLM,
    which has no `fc.bias` parameter and silently drops the key (docs/reference/export_formats.md §14)."""

    bias: bool = True
    init: Literal["copy", "random"] = "copy"  # copy: fc starts as [noise | I], x ≈ F_i at step 0
    init_std: float = 0.02

    def to_dict(self) -> dict:
        return {"type": "eagle1", **asdict(self)}


class Eagle1Head(DraftHead):
    kind = "eagle1"

    def __init__(self, args: LlamaArgs, cfg: Eagle1Config, tied: TiedTarget) -> None:
        super().__init__(args, tied)
        h = args.hidden_size
        self.cfg = cfg
        self.fc = Linear(2 * h, h, bias=cfg.bias)
        self.layers = nn.ModuleList([DecoderLayer(args, input_norm=False)])  # one module: EAGLE's layers.0

    def decoder(self, depth: int) -> DecoderLayer:
        return self.layers[0]

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int = 1) -> torch.Tensor:
        feature = self.tied.final_norm(hidden) if depth == 1 else hidden  # F_i, or the head's own Ĥ
        return self.fc(torch.cat([embeds, feature], dim=-1))

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """What the frozen lm_head projects: Ĥ itself (EAGLE-1 has no final norm)."""
        return hidden

    def regression_target(self, hidden_next: torch.Tensor) -> torch.Tensor:
        """F_{i+1} = N_f(H_{i+1}): Ĥ lives in the target's post-norm feature space."""
        return self.tied.final_norm(hidden_next)

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random weights (heads/base.py init_random); with init=copy, fc starts as [small noise | I]
        so x ≈ F_i at step 0. `first_input_norm` is accepted for interface parity and unused: EAGLE-1
        does not normalise the embedding."""
        init_random(self, torch.Generator().manual_seed(seed), self.cfg.init_std)
        if self.cfg.init == "copy":
            self.fc.weight[:, self.args.hidden_size:].copy_(torch.eye(self.args.hidden_size))
