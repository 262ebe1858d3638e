"""The Medusa-1 head, a baseline — docs/design.md §3, docs/reference/export_formats.md §3.4 / §9.6.

Medusa (Cai et al., 2024) drafts k tokens at once from the target's last post-norm feature
F_i = N_f(H_i), with no chain and no attention: head j (1..D) is a stack of residual SiLU blocks

    Ĥ^j_i = ResBlock_j(F_i),  ResBlock(x) = x + SiLU(W x + b)   (repeated num_layers times)
    L̂^j_i = W_lm Ĥ^j_i                                           (frozen, shared lm_head)

and predicts t_{i+1+j}. Head j is trained against the target's distribution at position i+j
(softmax(W_lm F_{i+j}), which predicts t_{i+j+1}); there is no hidden-state regression. With the
default zero initialisation every head starts as "the target's own next-token prediction".
Tensor names are vLLM's (`blocks.{j}.layers.{l}.weight|bias`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead, TiedTarget
from heads.layers import Linear, LlamaArgs


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4  # D: drafts at most D tokens per step
    num_layers: int = 1  # residual blocks per head
    bias: bool = True  # exported as vLLM's `medusa_fc_bias` (without it vLLM drops the biases)
    init: Literal["zero", "random"] = "zero"  # zero: every block starts as the identity
    init_std: float = 0.02

    def to_dict(self) -> dict:
        return {"type": "medusa", **asdict(self)}


class ResidualBlocks(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(DraftHead):
    kind = "medusa"
    chain = False

    def __init__(self, args: LlamaArgs, cfg: MedusaConfig, tied: TiedTarget) -> None:
        super().__init__(args, tied)
        if cfg.num_heads < 1 or cfg.num_layers < 1:
            raise ValueError(f"medusa needs num_heads ≥ 1 and num_layers ≥ 1, got {cfg.num_heads}, {cfg.num_layers}")
        self.cfg = cfg
        self.blocks = nn.ModuleList(ResidualBlocks(args.hidden_size, cfg.num_layers, cfg.bias)
                                    for _ in range(cfg.num_heads))

    @property
    def max_depth(self) -> int:
        return self.cfg.num_heads

    @property
    def num_cache_layers(self) -> int:
        return 0

    def depth_modules(self) -> list[nn.Module]:
        return list(self.blocks)

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        return hidden  # no final norm: vLLM applies the lm_head to the block output

    def regression_target(self, hidden_next: torch.Tensor) -> None:
        return None

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache=None, start: int = 0, depth: int = 1) -> torch.Tensor:
        """Head `depth`'s state from the target's pre-norm H_i (tokens, positions and cache unused)."""
        if not 1 <= depth <= self.cfg.num_heads:
            raise ValueError(f"medusa head {depth} does not exist (num_heads={self.cfg.num_heads})")
        return self.blocks[depth - 1](self.tied.final_norm(hidden.to(self.dtype)))

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, depth: int,
               aux: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Row i of output d is head d on F_i: it estimates position i+d (predicts t_{i+d+1})."""
        if depth > self.cfg.num_heads:
            raise ValueError(f"depth {depth} exceeds medusa's {self.cfg.num_heads} heads")
        return [self(hidden[:, :-1], depth=d) for d in range(1, depth + 1)]

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if self.cfg.init == "zero" or name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * self.cfg.init_std)
