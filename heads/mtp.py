"""The RMSNorm-restored MTP head (the default) — DESIGN.md §3.

One module computes, for position i, from the target state H_i and the next token t_{i+1}:

    x   = eh_proj [ enorm(E t_{i+1}) ; hnorm(H_i) ]          (DeepSeek-V3 MTP module shape)
    Ĥ   = DecoderLayer(x)                                      (input_layernorm restored)
    L̂   = W_lm · shared_head.norm(Ĥ)                          (frozen, shared lm_head)

Ĥ stands in for H_{i+1} at the next depth. `num_modules: D` keeps D such modules (module d at
depth d, DeepSeek-V3 style); `num_modules: 1` reuses one module at every depth. Names follow the
DeepSeek MTP export (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`).

The small interface (`embed`, `fuse`, `step`, `logits`) is what both the training unroll and the
engine's draft loop call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from heads.layers import DecoderLayer, KVCache, LlamaArgs, RMSNorm, Rotary


@dataclass(frozen=True)
class MTPConfig:
    """Head hyper-parameters beyond the target's shapes."""

    num_modules: int = 1
    init: Literal["copy", "random"] = "copy"  # copy: start near "pass the hidden state through"
    init_std: float = 0.02

    def to_dict(self) -> dict:
        return {"type": "mtp", **asdict(self)}


class TiedTarget(nn.Module):
    """Frozen target tensors shared by a head: E, W_lm, N_f. Non-persistent buffers, so they are
    never trained, never in the optimizer and never in a head checkpoint."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.register_buffer("norm_weight", norm.detach(), persistent=False)
        self.eps = eps

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """N_f: the target's final norm (F_i = N_f(H_i))."""
        h32 = h.float()
        return self.norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)

    def teacher_logits(self, h: torch.Tensor) -> torch.Tensor:
        """L = W_lm N_f(H): the target's logits recomputed from a stored state."""
        return F.linear(self.final_norm(h), self.lm_head)


class MTPModule(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(args, input_norm=True)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)


class MTPHead(nn.Module):
    kind = "mtp"

    def __init__(self, args: LlamaArgs, cfg: MTPConfig, tied: TiedTarget) -> None:
        super().__init__()
        self.args, self.cfg = args, cfg
        self.tied = tied
        self.layers = nn.ModuleList(MTPModule(args) for _ in range(cfg.num_modules))
        self.rotary = Rotary(args)

    # ---- the interface shared by training and the engine -------------------------------------
    def module(self, depth: int) -> MTPModule:
        return self.layers[min(depth, len(self.layers)) - 1]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.tied.embed)

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int = 1) -> torch.Tensor:
        m = self.module(depth)
        return m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(hidden)], dim=-1))

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
             start: int = 0, depth: int = 1) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)
        kv = cache.layer(self.cache_layer(depth)) if cache is not None else None
        return self.module(depth).layer(x, cos, sin, kv, start)

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """N_o(Ĥ): what the frozen lm_head projects (the training loss works on these)."""
        return self.module(depth).shared_head.norm(hidden)

    def logits(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        return F.linear(self.features(hidden, depth), self.tied.lm_head)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, start: int = 0, depth: int = 1) -> torch.Tensor:
        """(H_i, t_{i+1}) at RoPE position `positions` → Ĥ (the head's estimate of H_{i+1})."""
        x = self.fuse(hidden.to(self.dtype), self.embed(tokens), depth)
        return self.step(x, positions, cache, start, depth)

    # ---- engine helpers -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].eh_proj.weight.dtype

    def cache_layer(self, depth: int) -> int:
        return min(depth, len(self.layers)) - 1

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        a = self.args
        return KVCache(len(self.layers), batch, a.num_key_value_heads, max_len, a.head_dim, self.dtype,
                       self.tied.embed.device)

    # ---- initialisation -------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random decoder weights (std init_std, GPT-2 style smaller residual outputs); norms from the
        target's norms where they play the same role (hnorm and the final norm ← N_f, enorm ← layer 0's
        input norm); with init=copy, eh_proj starts as [small noise | I] so x ≈ hnorm(H_i) at step 0."""
        gen = torch.Generator().manual_seed(seed)
        h = self.args.hidden_size
        for m in self.layers:
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.ndim == 2:
                    std = self.cfg.init_std / (2 ** 0.5) if name.endswith(("o_proj.weight", "down_proj.weight")) else self.cfg.init_std
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.zero_()
            m.hnorm.weight.copy_(self.tied.norm_weight)
            m.shared_head.norm.weight.copy_(self.tied.norm_weight)
            if first_input_norm is not None:
                m.enorm.weight.copy_(first_input_norm)
            if self.cfg.init == "copy":
                m.eh_proj.weight[:, h:].copy_(torch.eye(h))
