"""Gemma 3 text models (HF `Gemma3ForCausalLM`, model_type `gemma3_text`) for the engine.

What differs from the Llama family (Gemma Team, "Gemma 3 Technical Report", 2025; HF transformers'
`modeling_gemma3.py`, whose tensor names and numerics this follows):
- layers interleave sliding-window (local) and global attention (`layer_types`, or the older
  `sliding_window_pattern`: every n-th layer global); local layers use their own RoPE base
  (`rope_local_base_freq`), global ones `rope_theta` and its scaling;
- RMSNorm scales by (1 + w), computed in fp32 before the cast back; four norms per layer (input,
  post-attention, pre- and post-feedforward) and q/k norms per head;
- the embedding is multiplied by √H (rounded to the embedding's dtype first, as HF does);
- scores are scaled by `query_pre_attn_scalar`^-0.5; the final logits are tanh soft-capped when
  `final_logit_softcapping` is set (`attn_logit_softcapping` is Gemma 2's: HF's Gemma 3 ignores it,
  and so does this);
- the MLP is GeGLU with the tanh approximation of GELU.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.layers import MLP, Attention, Linear, LlamaArgs, Rotary, TiedConventions, causal_mask, scale_embedding
from inference_eval.model import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Gemma3Args(LlamaArgs):
    """LlamaArgs (the sizes a draft head's Llama layer takes) plus what only Gemma 3 has."""

    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    model_type: str = "gemma3_text"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> "Gemma3Args":
        """Both config layouts: transformers ≥ 5 (`rope_parameters` per layer type, `layer_types`) and
        the Hub's older one (`rope_theta`, `rope_local_base_freq`, `rope_scaling`,
        `sliding_window_pattern`). Missing keys take `Gemma3TextConfig`'s defaults."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        if d.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"model_type {d.get('model_type')!r} is not a Gemma 3 text model")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (an encoder configuration): the engine decodes causally")
        n_layers, n_heads = d.get("num_hidden_layers", 26), d.get("num_attention_heads", 8)
        rope = d.get("rope_parameters") or {}
        full = dict(rope.get(FULL) or {})
        local = dict(rope.get(SLIDING) or {})
        theta = full.pop("rope_theta", None) or d.get("rope_theta") or 1_000_000.0
        scaling = full if full.get("rope_type", "default") != "default" else d.get("rope_scaling")
        if local.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope scaling on Gemma 3's local layers ({local}) is not implemented")
        local_theta = local.get("rope_theta") or d.get("rope_local_base_freq") or 10_000.0
        layer_types = d.get("layer_types") or [
            SLIDING if (i + 1) % d.get("sliding_window_pattern", 6) else FULL for i in range(n_layers)]
        if len(layer_types) < n_layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types {layer_types}: expected {n_layers} of {SLIDING!r} / {FULL!r}")
        activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu_new"):  # both GELU's tanh approximation
            raise NotImplementedError(f"hidden_activation {activation!r} is not implemented")
        return cls(
            vocab_size=d.get("vocab_size", 262_208),
            hidden_size=d.get("hidden_size", 2304),
            intermediate_size=d.get("intermediate_size", 9216),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or 256,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=d.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=True,
            layer_types=tuple(layer_types[:n_layers]),
            sliding_window=d.get("sliding_window", 4096),
            rope_local_theta=float(local_theta),
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            hidden_activation=activation,
        )

    def tied_conventions(self) -> TiedConventions:
        return TiedConventions(embed_scale=math.sqrt(self.hidden_size), norm_offset=1.0,
                               logit_softcap=self.final_logit_softcapping)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + w), all in fp32, then cast (HF's Gemma3RMSNorm; Llama casts before the multiply)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """E·√H, the scale rounded to the weight's dtype first, as HF does."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return scale_embedding(super().forward(input_ids), math.sqrt(self.embedding_dim))


class CappedLinear(Linear):
    """The lm_head, with the final logits tanh soft-capped when the config says so."""

    cap: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.cap is None else torch.tanh(out / self.cap) * self.cap


class Gemma3Attention(Attention):
    """GQA with (1 + w) q/k norms, the `query_pre_attn_scalar` scale and, on local layers, a sliding
    window; takes the contiguous KVCache, a paged layer or packed rows."""

    def __init__(self, args: Gemma3Args, layer_type: str) -> None:
        super().__init__(args)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.layer_type = layer_type
        self.window = args.sliding_window if layer_type == SLIDING else None
        self.scale = args.query_pre_attn_scalar ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)  # q [B, nH, T, d], k/v [B, nKV, T, d]
        gqa = self.n_kv != self.n_heads
        if hasattr(kv, "attend"):  # paged cache layer or packed rows
            out = kv.attend(q, k, v, gqa, window=self.window, scale=self.scale)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if kv is not None:
            k_cache, v_cache = kv
            k_cache[:, :, start:start + t] = k
            v_cache[:, :, start:start + t] = v
            k, v = k_cache[:, :, :start + t], v_cache[:, :, :start + t]
        total = start + t
        if self.window is not None and total > self.window:
            mask, causal = causal_mask(t, total, self.window, x.device), False
        elif t > 1 and start > 0:
            mask, causal = causal_mask(t, total, device=x.device), False
        else:
            mask, causal = None, t > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                             enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + N_post_attn(attn(N_in(x))), then + N_post_ff(mlp(N_pre_ff(·)))."""

    def __init__(self, args: Gemma3Args, layer_type: str) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Gemma3Attention(args, layer_type)
        self.mlp = GeGLU(args)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, start))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Backbone(nn.Module):
    def __init__(self, args: Gemma3Args) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(args, kind)
                                    for kind in args.layer_types[: args.num_hidden_layers])
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = Rotary(args)  # global layers: rope_theta and its scaling
        self.rotary_emb_local = Rotary(local_rope_args(args))


def local_rope_args(args: Gemma3Args) -> Gemma3Args:
    return dataclasses.replace(args, rope_theta=args.rope_local_theta, rope_scaling=None)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The engine's Gemma 3 target: LlamaForCausalLM's loader, cache and interface, Gemma's layers."""

    args_class = Gemma3Args

    def __init__(self, args: Gemma3Args) -> None:
        nn.Module.__init__(self)
        self.args = args
        self.model = Gemma3Backbone(args)
        self.lm_head = CappedLinear(args.hidden_size, args.vocab_size, bias=False)
        self.lm_head.cap = args.final_logit_softcapping
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self) -> None:
        self.model.rotary_emb = Rotary(self.args)
        self.model.rotary_emb_local = Rotary(local_rope_args(self.args))

    def layer_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Global layers: rope_theta (and its scaling); local ones: the local base."""
        kinds = [layer.self_attn.layer_type for layer in self.model.layers]
        tables = {FULL: self.model.rotary_emb, SLIDING: self.model.rotary_emb_local}
        rope = {kind: tables[kind](positions, dtype) for kind in set(kinds)}
        return [rope[kind] for kind in kinds]
