"""The EAGLE-3 head — docs/design.md §3, docs/reference/export_formats.md §3.2 / §4.2 / §9.3.

EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts from three target layers instead of the last one, has no hidden-state
regression, and predicts over its own (smaller) draft vocabulary:

    g_i = fc [ A^{a}_i ; A^{b}_i ; A^{c}_i ]                 (A^{l}: the *input* of target layer l;
                                                               default l ∈ {2, L/2, L-3}, ascending)
    x   = [ input_layernorm(E t_{i+1}) ; hidden_norm(g_i) ]  (2H: the attention's input)
    Ĥ   = g_i + Attn(x);  Ĥ = Ĥ + MLP(post_attention_layernorm(Ĥ))      (`midlayer`)
    L̂   = lm_head · norm(Ĥ)                                   ([V_d] logits, own trainable lm_head)
    target id = draft id + d2t[draft id]

At depth > 1 the head's own Ĥ replaces g (no fc), as in vLLM/SGLang. The EAGLE-3.1 normalisations
(speculators' defaults; vLLM reads each from the config, docs/reference/export_formats.md §3.2) are
options, all off in the original EAGLE-3:

    norm_before_fc:       g_i = fc input_norm([A^a; A^b; A^c])     (one RMSNorm over the K·H concatenation)
    norm_before_residual: the residual is hidden_norm(g), not g
    norm_output:          the state handed to the next step is norm(Ĥ) (what the lm_head reads), not Ĥ

The draft vocabulary holds the V_d most frequent target tokens of the training data (`set_draft_vocab`); with V_d = V it is the
whole vocabulary. Tensor names are the engines' own (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so the native state dict is the export's key set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from heads.base import DraftHead, TiedTarget, check_aux_ids, init_random
from heads.layers import MLP, Attention, Linear, LlamaArgs, RMSNorm, dropped


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """(2, L//2, L-3) in the "input of layer i" convention (docs/reference/export_formats.md §1.2): vLLM's default.
    For very shallow targets the ids are clamped into 1..L-1 and deduplicated."""
    ids = sorted({min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})
    return tuple(ids)


@dataclass(frozen=True)
class Eagle3Config:
    aux_layers: tuple[int, ...] | None = None  # None: default_aux_layers(L); ascending, each in 1..L-1
    draft_vocab_size: int | None = None  # None (or ≥ V): the target's whole vocabulary
    init: Literal["copy", "random"] = "copy"  # copy: fc passes the last aux layer through at step 0
    init_std: float = 0.02
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    train_lm_head: bool = True  # False: lm_head stays at the target's rows of the draft vocabulary (speculators' default)
    # the norms' start (reset_parameters): `ones` sets 1 (the default; speculators' init, HF's default for every norm
    # of its draft), `target` copies the target's (input_layernorm ← its layer 0's input norm, norm ← N_f;
    # ≈ 0.045 top-1 and τ below `ones` on SmolLM2: docs/RESULTS.md §8)
    input_norm_init: Literal["target", "ones"] = "ones"
    norm_init: Literal["target", "ones"] = "ones"

    def __post_init__(self) -> None:
        if self.aux_layers is not None:
            object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        for key in ("input_norm_init", "norm_init"):
            if getattr(self, key) not in ("target", "ones"):
                raise ValueError(f"eagle3 {key}={getattr(self, key)!r}: expected target or ones")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers) if self.aux_layers is not None else None
        return {"type": "eagle3", **d}


class Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: a Llama layer whose attention reads [input_layernorm(e); hidden_norm(g)] (2H)
    and whose residual is the pre-norm g (`norm_before_residual: false`, the original EAGLE-3) or
    hidden_norm(g) (true)."""

    fsdp_unit = True  # sharded on its own under FSDP2 (train/module.py configure_model)

    def __init__(self, args: LlamaArgs, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = Attention(args, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = MLP(args)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, g = x.chunk(2, dim=-1)
        g_normed = self.hidden_norm(g)
        return torch.cat([self.input_layernorm(e), g_normed], dim=-1), g_normed if self.norm_before_residual else g

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
                attn_mask: torch.Tensor | None = None, unrolled: tuple | None = None) -> torch.Tensor:
        if unrolled is not None:  # the training-time test through the module call (DecoderLayer.forward)
            return self.forward_unrolled(x, cos, sin, *unrolled)
        a_in, g = self._split(x)
        h = g + self.self_attn(a_in, cos, sin, kv, start, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_unrolled(self, x, cos, sin, base, extras, mask=None):
        a_in, g = self._split(x)
        a, kv = self.self_attn.forward_unrolled(a_in, cos, sin, base, extras, mask)
        h = g + dropped(self, a)
        return h + dropped(self, self.mlp(self.post_attention_layernorm(h))), kv


class Eagle3Head(DraftHead):
    kind = "eagle3"

    def __init__(self, args: LlamaArgs, cfg: Eagle3Config, tied: TiedTarget) -> None:
        super().__init__(args, tied)
        aux = cfg.aux_layers or default_aux_layers(args.num_hidden_layers)
        check_aux_ids(aux, args.num_hidden_layers, "eagle3 aux_layers")
        vd = min(cfg.draft_vocab_size or args.vocab_size, args.vocab_size)  # never wider than the target's
        if vd < 1:
            raise ValueError(f"eagle3 draft_vocab_size {cfg.draft_vocab_size} must be positive")
        self.cfg = dataclasses.replace(cfg, aux_layers=tuple(aux), draft_vocab_size=vd)
        h = args.hidden_size
        # the engines' EAGLE-3 layer has neither q/k/v bias nor q/k norms (Qwen targets included)
        self.layer_args = dataclasses.replace(args, attention_bias=False, qk_norm=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(len(aux) * h, args.rms_norm_eps)
        self.fc = Linear(len(aux) * h, h, bias=False)
        self.midlayer = Eagle3Layer(self.layer_args, cfg.norm_before_residual)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = Linear(h, vd, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)  # frozen: no gradient, not in the optimizer
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # target id = draft id + d2t
        self.register_buffer("t2d", torch.zeros(args.vocab_size, dtype=torch.bool))
        self.t2d[:vd] = True

    # ---- the interface ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layers

    @property
    def state_size(self) -> int:
        return len(self.cfg.aux_layers) * self.args.hidden_size

    @property
    def num_cache_layers(self) -> int:
        return 1

    def target_input(self, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        if aux is None:
            raise ValueError(f"the eagle3 head reads the inputs of target layers {list(self.cfg.aux_layers)}, and none "
                             "were given: precompute the store with those aux layers (precompute.aux_layers)")
        if aux.shape[-1] != self.state_size:
            raise ValueError(f"aux hidden states are {aux.shape[-1]} wide; the head expects "
                             f"{len(self.cfg.aux_layers)} layers × {self.args.hidden_size} = {self.state_size}")
        return aux

    def decoder(self, depth: int) -> Eagle3Layer:
        return self.midlayer

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int = 1) -> torch.Tensor:
        if depth == 1:
            g = self.fc(self.input_norm(hidden) if self.cfg.norm_before_fc else hidden)
        else:
            g = hidden
        return torch.cat([embeds.to(g.dtype), g], dim=-1)

    def step(self, x, positions, cache=None, start=0, depth=1):
        h = super().step(x, positions, cache, start, depth)
        return self.norm(h) if self.cfg.norm_output else h

    def step_unrolled(self, x, positions, base, extras, depth=1, mask=None):
        h, kv = super().step_unrolled(x, positions, base, extras, depth, mask)
        return (self.norm(h) if self.cfg.norm_output else h), kv

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        return hidden if self.cfg.norm_output else self.norm(hidden)  # norm_output: the state is normed already

    def regression_target(self, hidden_next: torch.Tensor) -> None:
        return None  # EAGLE-3 trains on the distribution only

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    @property
    def draft_ids(self) -> torch.Tensor | None:
        if self.cfg.draft_vocab_size == self.args.vocab_size:
            return None
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    # ---- draft vocabulary and initialisation -----------------------------------------------------------
    @torch.no_grad()
    def set_draft_vocab(self, counts: torch.Tensor) -> None:
        """Keep the V_d most frequent tokens (`counts` [V], ties by lower id), in ascending id order."""
        vd, v = self.cfg.draft_vocab_size, self.args.vocab_size
        if counts.shape != (v,):
            raise ValueError(f"token counts have shape {list(counts.shape)}, expected [{v}]")
        order = sorted(range(v), key=lambda i: (-int(counts[i]), i))[:vd]
        ids = torch.tensor(sorted(order), dtype=torch.long)
        self.d2t.copy_(ids - torch.arange(vd))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random layer weights (init_random); input_layernorm ← the target's layer-0 input norm (it
        normalises the same embeddings; `input_norm_init: ones`: 1), norm ← N_f (`norm_init: ones`: 1),
        lm_head ← the target's lm_head rows of the draft vocabulary (call `set_draft_vocab` first); with
        init=copy, fc passes the last aux layer."""
        gen = torch.Generator().manual_seed(seed)
        init_random(self.fc, gen, self.cfg.init_std)
        init_random(self.midlayer, gen, self.cfg.init_std)
        if first_input_norm is not None and self.cfg.input_norm_init == "target":
            self.midlayer.input_layernorm.weight.copy_(first_input_norm)
        self.norm.weight.copy_(self.tied.norm_scale if self.cfg.norm_init == "target" else 1.0)
        ids = self.draft_ids
        w = self.tied.lm_head if ids is None else self.tied.lm_head[ids.to(self.tied.lm_head.device)]
        self.lm_head.weight.copy_(w)
        if self.cfg.init == "copy":
            h = self.args.hidden_size
            self.fc.weight[:, -h:].copy_(torch.eye(h))
