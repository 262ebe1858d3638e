"""DeepSeek-V2 models (HF `DeepseekV2ForCausalLM`, model_type `deepseek_v2`; V2-Lite's shapes) for the engine.

What differs from the Llama family (DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", 2024; HF transformers' `modeling_deepseek_v2.py`, whose tensor names
and numerics this follows, and DeepSeek's own `modeling_deepseek.py` where HF leaves a config field out):

- multi-head latent attention (MLA, §2.1): the query comes from `q_proj` (`q_lora_rank` null: V2-Lite)
  or the low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj`; each token's keys and values come from one
  latent c = RMSNorm(x·W_DKV) (`kv_lora_rank`) and one decoupled RoPE key k_pe shared by the heads
  (`qk_rope_head_dim`), both from `kv_a_proj_with_mqa`; `kv_b_proj` expands c into each head's no-RoPE
  key and value;
- the KV cache holds only [c ; k_pe] per token and layer — one "KV head" of kv_lora_rank + rope dims, no
  separate value (`kv_layout`): a cached forward absorbs W_UK into the query and W_UV into the output
  (§2.1.3): score_h = (W_UK,hᵀ q_nope,h)·c + q_pe,h·k_pe, out_h = W_UV,h Σ p·c — multi-query attention
  over the latent, the values being the keys' first kv_lora_rank channels. A forward without a cache
  (and precompute's packed rows) expands the keys and values instead, as HF does;
- RoPE on the rope part rotates adjacent pairs (HF's complex form, equal to DeepSeek's permuted
  rotate-half), computed in fp32; YaRN (V2's `rope_scaling`) changes the frequencies, multiplies cos/sin
  by mscale / mscale_all_dim and the softmax scale by mscale_all_dim's factor squared;
- MoE layers (from `first_k_dense_replace`, every `moe_layer_freq`-th): a softmax router over
  `n_routed_experts` (`mlp.gate.weight`), the top `num_experts_per_tok` (`greedy`, or
  `group_limited_greedy` over `n_group` groups), weights scaled by `routed_scaling_factor` (or
  renormalised when `norm_topk_prob`: DeepSeek's code; HF ignores the field, V2 and V2-Lite have it
  false), plus `n_shared_experts` always-on experts as one MLP. Experts are the Hub's per-expert
  `mlp.experts.{e}.{gate,up,down}_proj` tensors (what HF's save_pretrained writes too). The routed
  experts run as a loop over the experts some row chose, which reads that set on the host.

Not covered: FP8 / quantised checkpoints, DeepSeek-V3's sigmoid router and its `noaux_tc` top-k, the
MTP layers of V3 checkpoints. The embedding, final norm and lm_head follow Llama's conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.layers import KVCache, Linear, LlamaArgs, RMSNorm
from inference_eval.model import LlamaForCausalLM
from inference_eval.paged import PackedRows


@dataclass(frozen=True)
class DeepseekV2Args(LlamaArgs):
    """LlamaArgs plus MLA's and the MoE's sizes. The Llama fields are what a draft head's Llama layer
    takes (`layer_args`): head_dim = H / n_heads, as many KV heads as heads, the dense layers'
    intermediate size, plain RoPE at rope_theta (`rope_scaling` None: Llama's rotary has no YaRN, and
    the head's layer is trained with its own encoding). V2's YaRN dict is `rope_yarn`, which only the
    target's MLA applies."""

    rope_yarn: dict[str, Any] | None = field(default=None, hash=False)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int = 1407
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    mlp_bias: bool = False
    model_type: str = "deepseek_v2"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> "DeepseekV2Args":
        """Both config layouts: transformers ≥ 5 (`rope_parameters`) and the Hub's (`rope_theta`,
        `rope_scaling` with `type`). Missing keys take `DeepseekV2Config`'s defaults."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        if d.get("model_type", "deepseek_v2") != "deepseek_v2":
            raise ValueError(f"model_type {d.get('model_type')!r} is not a DeepSeek-V2 model")
        for key, supported in (("hidden_act", "silu"), ("scoring_func", "softmax")):
            if d.get(key, supported) != supported:
                raise NotImplementedError(f"{key}={d[key]!r} is not implemented (DeepSeek-V2: {supported!r})")
        topk_method = d.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise NotImplementedError(f"topk_method {topk_method!r} is not implemented (greedy, group_limited_greedy)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise NotImplementedError(f"rope scaling {kind!r} on DeepSeek-V2 is not implemented (default, yarn)")
        hidden, n_heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
        return cls(
            vocab_size=d.get("vocab_size", 102400),
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", 11008),
            num_hidden_layers=d.get("num_hidden_layers", 32),
            num_attention_heads=n_heads,
            num_key_value_heads=n_heads,
            head_dim=hidden // n_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_yarn={**rope, "rope_type": "yarn"} if kind == "yarn" else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d.get("kv_lora_rank", 512),
            qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
            v_head_dim=d.get("v_head_dim", 128),
            n_routed_experts=d.get("n_routed_experts", d.get("num_experts", 64)),
            n_shared_experts=d.get("n_shared_experts", 2),
            num_experts_per_tok=d.get("num_experts_per_tok"),
            moe_intermediate_size=d.get("moe_intermediate_size", 1407),
            first_k_dense_replace=d.get("first_k_dense_replace", 0),
            moe_layer_freq=d.get("moe_layer_freq", 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            topk_method=topk_method,
            n_group=d.get("n_group"),
            topk_group=d.get("topk_group"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
        )

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def kv_layout(self) -> tuple[int, int, int]:
        """One latent "head" [c ; k_pe] per token and layer, no separate values (they are c)."""
        return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0

    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)² under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        y = self.rope_yarn or {}
        if y.get("mscale_all_dim"):
            scale *= yarn_mscale(y["factor"], y["mscale_all_dim"]) ** 2
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope_tables(args: DeepseekV2Args) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rope part (qk_rope_head_dim) and the factor on cos/sin, in fp32 as
    HF computes them (`_compute_yarn_parameters` under YaRN)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    y = args.rope_yarn
    if y is None:
        return 1.0 / pos_freqs, 1.0
    factor = y.get("factor") or args.max_position_embeddings / y["original_max_position_embeddings"]
    attention_factor = y.get("attention_factor")
    if attention_factor is None:
        if y.get("mscale") and y.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, y["mscale"]) / yarn_mscale(factor, y["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1
    old_ctx = y["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low))
    extrapolate = 1 - ramp.clamp(0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class MLARotary(nn.Module):
    """cos/sin [B, T, rope/2] (fp32, times YaRN's cos/sin factor) by absolute position."""

    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__()
        inv_freq, self.attention_factor = mla_rope_tables(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, d] rotated pair by pair ((x0, x1), (x2, x3), ...) in fp32: HF's complex product."""
    xf = x.float().unflatten(-1, (-1, 2))  # [B, n, T, d/2, 2]
    x1, x2 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over the contiguous KVCache, a paged layer (both holding the
    latent, attention absorbed) or packed rows / no cache (keys and values expanded)."""

    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__()
        h, n = args.hidden_size, args.num_attention_heads
        self.n_heads, self.rank = n, args.kv_lora_rank
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        qk = self.nope + self.rope
        if args.q_lora_rank is None:
            self.q_proj = Linear(h, n * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)  # HF's default eps, not the config's
            self.q_b_proj = Linear(args.q_lora_rank, n * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(n * self.v_dim, h, bias=args.attention_bias)
        self.scale = args.softmax_scale()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, start: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(b, t, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, T, r]
        q_pe, k_pe = apply_rope_pairs(q_pe, cos, sin), apply_rope_pairs(k_pe[:, None], cos, sin)  # k_pe [B, 1, T, ρ]
        if kv is None or isinstance(kv, PackedRows):
            out = self._expanded(q_nope, q_pe, latent, k_pe, kv)
        else:
            out = self._absorbed(q_nope, q_pe, latent, k_pe, kv, start)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _expanded(self, q_nope, q_pe, latent, k_pe, rows: PackedRows | None) -> torch.Tensor:
        """Keys [k_nope,h ; k_pe] and values v_h of every head from the latent: HF's computation."""
        b, _, t, _ = latent.shape
        k_nope, v = self.kv_b_proj(latent[:, 0]).view(b, t, self.n_heads, -1).transpose(1, 2).split(
            [self.nope, self.v_dim], dim=-1)  # [B, nH, T, nope], [B, nH, T, dv]
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.n_heads, -1, -1)], dim=-1)
        if rows is not None:
            return rows.attend(q, k, v, False, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale)

    def _absorbed(self, q_nope, q_pe, latent, k_pe, kv, start: int) -> torch.Tensor:
        """Attention over the cached latent: W_UK folded into the query, W_UV applied to the output."""
        b, _, t, _ = latent.shape
        w_uk, w_uv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)  # [nH, nope, r], [nH, dv, r]
        q = torch.cat([q_nope @ w_uk, q_pe], dim=-1)  # [B, nH, T, r + ρ]
        key = torch.cat([latent, k_pe], dim=-1)  # [B, 1, T, r + ρ]: what the cache stores
        if hasattr(kv, "attend"):  # a paged layer
            out = kv.attend(q, key, None, True, scale=self.scale, value_dim=self.rank)
        else:
            k_cache, _ = kv
            k_cache[:, :, start:start + t] = key
            keys = k_cache[:, :, :start + t]
            mask = None
            if t > 1 and start > 0:
                mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(start)
            out = F.scaled_dot_product_attention(q, keys, keys[..., : self.rank], attn_mask=mask,
                                                 is_causal=mask is None and t > 1, scale=self.scale, enable_gqa=True)
        return out @ w_uv.transpose(1, 2)  # [B, nH, T, r] → [B, nH, T, dv]


class DeepseekMLP(nn.Module):
    """SwiGLU MLP of a given width (dense layers, each routed expert, the shared experts together)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """Softmax over the routed experts (fp32), top-k (greedy or group-limited), weights scaled by
    `routed_scaling_factor` or renormalised (`norm_topk_prob`)."""

    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        self.top_k, self.method = args.num_experts_per_tok, args.topk_method
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.scaling, self.renormalise = args.routed_scaling_factor, args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → weights [N, k] (fp32; float64 for float64 input) and expert ids [N, k]."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = F.linear(x.to(dtype), self.weight.to(dtype)).softmax(dim=-1)  # [N, E]
        if self.method == "group_limited_greedy":
            n, e = scores.shape
            groups = scores.view(n, self.n_group, -1).amax(dim=-1)  # [N, G]
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1).indices, 1.0)
            scores = scores.masked_fill(~keep.bool().repeat_interleave(e // self.n_group, dim=1), 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        if self.renormalise and self.top_k > 1:
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
        return weights * self.scaling, ids


class DeepseekMoE(nn.Module):
    """Routed experts (each row through its top-k, weighted) plus the shared experts."""

    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__()
        h, i = args.hidden_size, args.moe_intermediate_size
        self.experts = nn.ModuleList(DeepseekMLP(h, i, args.mlp_bias) for _ in range(args.n_routed_experts))
        self.gate = TopkRouter(args)
        if args.n_shared_experts:
            self.shared_experts = DeepseekMLP(h, i * args.n_shared_experts, args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, ids = self.gate(flat)  # [N, k]
        out = torch.zeros_like(flat)
        for e in ids.unique().tolist():  # the experts some row chose (a host read)
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows]) * weights[rows, slot, None]  # fp32 weights, as HF
            out.index_add_(0, rows, y.to(out.dtype))
        out = out.view_as(x)
        return out + self.shared_experts(x) if hasattr(self, "shared_experts") else out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV2Args, index: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(args)
        self.mlp = (DeepseekMoE(args) if args.is_moe_layer(index)
                    else DeepseekMLP(args.hidden_size, args.intermediate_size, args.mlp_bias))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, start: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Backbone(nn.Module):
    def __init__(self, args: DeepseekV2Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = MLARotary(args)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The engine's DeepSeek-V2 target: LlamaForCausalLM's loader, interface and forward; MLA and MoE
    layers; a cache of latents (`new_cache`, and the engine's pool through `DeepseekV2Args.kv_layout`)."""

    args_class = DeepseekV2Args
    static_step = False  # the MoE layers loop over the experts the rows chose, read on the host
    keep_fp32 = ("mlp.gate.weight",)  # the router runs in fp32, as HF keeps it (`_keep_in_fp32_modules_strict`)

    def __init__(self, args: DeepseekV2Args) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = DeepseekV2Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        self.model.rotary_emb = MLARotary(self.args)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """The contiguous cache: [B, 1, max_len, kv_lora_rank + ρ] per layer, values empty."""
        n_kv, key_dim, value_dim = self.args.kv_layout()
        return KVCache(self.args.num_hidden_layers, batch, n_kv, max_len, key_dim, self.dtype,
                       self.model.embed_tokens.weight.device, value_dim=value_dim)
