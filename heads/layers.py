"""Llama-family building blocks: args from an HF config, RMSNorm, RoPE, GQA attention with an
optional contiguous KV cache, SwiGLU MLP and the decoder layer.

One definition serves the target model of the engine (inference_eval/model.py) and every draft head,
so training, validation and serving run the same numerics. Tensor names follow HF transformers
(`q_proj`, `input_layernorm`, ...) so checkpoints load without a renaming table.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core import gemm_choice, native


@dataclass(frozen=True)
class TiedConventions:
    """How the target's family uses the tensors a head shares with it (E, N_f, W_lm): the scale of the
    embedding (Gemma: √H, rounded to the embedding's dtype), the final norm's multiplier of the
    normalised state (`norm_offset + w`: Gemma's 1 + w, computed in fp32) and the tanh cap of the final
    logits. The defaults are Llama's: plain E, w, no cap."""

    embed_scale: float | None = None
    norm_offset: float = 0.0
    logit_softcap: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the HF model types whose decoder is Llama's (the engine model, the heads' layers, draft_lm, the Llama export
# formats): Qwen2 adds q/k/v biases, Qwen3 q/k norms, Mistral a sliding window the heads do not use
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaArgs:
    """Hyper-parameters of a Llama-family model, read from its HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2/2.5: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    model_type: str = "llama"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any) -> "LlamaArgs":
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type", "llama")
        if model_type not in LLAMA_FAMILY:
            raise ValueError(f"model_type {model_type!r} is not a Llama-family architecture this engine implements")
        # transformers 5 moved rope settings into `rope_parameters`; older configs keep them top-level.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", "default") != "default" else d.get("rope_scaling")
        n_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
        )

    def tied_conventions(self) -> TiedConventions:
        """What the family does with E, N_f and W_lm (a family's subclass overrides this)."""
        return TiedConventions()

    def kv_layout(self) -> tuple[int, int, int]:
        """(KV heads, key dim, value dim) of what one token stores per layer in a KV cache (a family
        with another cache, DeepSeek-V2's compressed latent, overrides this)."""
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def layer_args(self) -> "LlamaArgs":
        """These sizes as plain LlamaArgs: what a draft head's Llama layer takes and its checkpoint
        records (a family's subclass drops its own fields)."""
        if type(self) is LlamaArgs:
            return self
        return LlamaArgs(**{f.name: getattr(self, f.name) for f in fields(LlamaArgs)})


# fp32 inference on CPU with the few rows of decode, verification and drafting: up to NATIVE_ROWS rows
# the C kernel of core/native.py (it streams the weights at close to memory speed, each row computed
# alone) where it could be built. Above that, or without it, torch's GEMM in the faster of its two
# forms on this CPU (core/gemm_choice.py measures it once): on an AVX2 EPYC MKL's x·Wᵀ (F.linear) was
# 1.3-5x slower than (W·xᵀ)ᵀ at 2..256 rows, and its one-row GEMV 2-3x slower than that GEMM on two
# rows (SmolLM2's lm_head, 2 threads: 24 vs 5 ms at 2 rows, 10 vs 3 ms at 1); on an AVX-512 Xeon
# F.linear is the faster from 64 rows and at one row. bf16 shows no such gap; large batches (prefill)
# neither.
FAST_LINEAR_ROWS = 256
NATIVE_ROWS = 48  # at ~64 rows the kernel and MKL's GEMM are even (compute-bound from there)
PAD_ONE_ROW_MIN_WEIGHT = 1 << 18  # below this a padded row's copy costs what the GEMM saves


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed by the native kernel (≤ NATIVE_ROWS rows) or as (W·xᵀ)ᵀ (a single row padded
    with a zero row; see above) for fp32 inference on CPU with a few rows; training (grad enabled),
    other dtypes and devices, and larger batches run F.linear itself. Same values up to fp32
    summation order.

    A bf16 weight with fp32 input (a model whose weights are stored in bf16, `store_weights`) is widened
    to fp32 exactly: the values are F.linear's on `weight.float()`. The native kernel widens it as it
    streams it (half the bytes read); the other paths widen a copy."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    widen = weight.dtype == torch.bfloat16 and x.dtype == torch.float32
    if (x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or rows > FAST_LINEAR_ROWS
            or rows == 0 or (weight.dtype != torch.float32 and not widen)):
        return F.linear(x, weight.to(x.dtype) if widen else weight, bias)
    flat = x.reshape(rows, k)
    if rows <= NATIVE_ROWS and native.accepts_weight(weight) and (bias is None or native.accepts(bias)):
        if torch.compiler.is_compiling():  # a compiled engine step: the kernel as one operator of the graph
            if native.loaded():
                return native.skinny_linear_op(flat.contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
        else:
            lib = native.load()
            if lib is not None:
                return native.call(lib, flat.contiguous(), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if widen:
        weight = weight.to(x.dtype)
    if rows == 1 and weight.numel() < PAD_ONE_ROW_MIN_WEIGHT:
        return F.linear(x, weight, bias)
    # the faster of the two GEMM forms for this many rows, measured once per CPU (a compiled graph reads the
    # answer its eager pass measured)
    if (gemm_choice.known(rows) if torch.compiler.is_compiling() else gemm_choice.form(rows)) == "F":
        return F.linear(x, weight, bias)
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, k)])
    out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _native_inference(x: torch.Tensor) -> bool:
    """Whether `x` is what the native elementwise kernels take: fp32 on the CPU, no autograd, not traced."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def scale_embedding(e: torch.Tensor, scale: float) -> torch.Tensor:
    """e·scale, the scale rounded to e's dtype first (through fp32), as HF's Gemma embedding does
    (bf16: √1152 = 33.94 becomes 34.0)."""
    return e * torch.tensor(scale, dtype=torch.float32).to(e.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def store_linear_weights(module: nn.Module, dtype: torch.dtype, compute: torch.dtype) -> None:
    """Keep the weight of every `Linear` in `module` in `dtype` (frozen) while the module computes in `compute`:
    bf16 under fp32 is W16A32 (`linear` widens the weight exactly; the native kernel as it streams it); the biases,
    norms and everything else stay as they are. Inference only: the weights are rounded once and not trained."""
    if not (dtype == torch.bfloat16 and compute == torch.float32):
        raise ValueError(f"weights stored in {dtype}: only bfloat16 weights under a float32 model are supported "
                         f"(this model computes in {compute}); set its dtype instead")
    for m in module.modules():
        if isinstance(m, Linear):
            m.weight = nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _native_inference(x) and native.accepts(self.weight) and native.load() is not None:
            # fp32 inference on the CPU: the native kernel (one call where torch's composite takes ~10 operators),
            # each row alone in a fixed order; inference_eval/fused.py's layers compute the same
            return native.rms_norm(x.contiguous(), self.weight, self.eps)
        # Normalise in fp32 (float64 input stays float64: the tests' same-function checks), as HF does, then
        # cast back before the weight multiply. F.rms_norm's fused kernel gives HF's x·rsqrt(mean(x²) + eps)
        # bit for bit, at a fraction of the passes over memory.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(xf, (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies of RoPE, with the target's theta and (llama3) scaling."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(is_mid, mid, scaled).float()
    raise NotImplementedError(f"rope scaling type {kind!r} is not implemented")


class Rotary(nn.Module):
    """cos/sin tables looked up by absolute position (positions may differ per row)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, n, T, d]; cos/sin: [B, T, d], both halves equal (emb = [freqs, freqs]). HF's
    # x·cos + rotate_half(x)·sin, half by half: the same roundings without materialising -x.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def causal_mask(t: int, total: int, window: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, total] bool: queries at positions total-t..total-1 see the keys at positions ≤ their own, and
    with a sliding `window` only the last `window` of them (key j visible from query i iff
    0 ≤ i - j < window: HF's `sliding_window_overlay`)."""
    m = torch.ones(t, total, dtype=torch.bool, device=device).tril(total - t)
    if window is not None:
        m &= ~torch.ones(t, total, dtype=torch.bool, device=device).tril(total - t - window)
    return m


class KVCache:
    """A contiguous per-layer key/value cache: `[B, n_kv, max_len, d]` per layer.

    The caller tracks how many slots are valid; cropping after a rejected draft is just writing the
    next step at a smaller start (stale slots beyond it are never read).
    """

    def __init__(self, num_layers: int, batch: int, n_kv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", value_dim: int | None = None) -> None:
        shape = (batch, n_kv, max_len, head_dim)
        v_shape = shape if value_dim is None else (*shape[:3], value_dim)  # 0: values live in the keys (MLA)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


def unrolled_mask(t: int, n_extra: int, mask: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """The training-time test's key mask for depth n_extra + 1: [T, (n_extra + 1)·T] bool (or
    [B, 1, T, …] from a packed [B, T, T] `mask`): causal (or `mask`) over the depth-1 block, the diagonal
    over each later depth's block."""
    eye = torch.eye(t, dtype=torch.bool, device=device)
    if mask is None:
        first = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return torch.cat([first, *[eye] * n_extra], dim=-1)
    b = mask.shape[0]
    return torch.cat([mask, *[eye.expand(b, t, t)] * n_extra], dim=-1)[:, None]


def dense_unrolled_attention(q: torch.Tensor, base: tuple[torch.Tensor, torch.Tensor],
                             blocks: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                             scale: float) -> torch.Tensor:
    """The training-time test's attention written out (`unrolled_impl = "dense"`, the reference the SDPA
    path is compared with): explicit [B, H, T, T] scores over the depth-1 keys, one dot product per later
    depth's key at the same row, one softmax (fp32 or wider) over both. Memory O(B·H·T²) per depth, kept for
    backward."""
    t = q.shape[2]
    rep = q.shape[1] // base[0].shape[1]
    k_base, v_base = (z.repeat_interleave(rep, dim=1) for z in base)  # [B, nH, T, d]
    diag = [(ke.repeat_interleave(rep, dim=1), ve.repeat_interleave(rep, dim=1)) for ke, ve in blocks]
    scores = (q @ k_base.transpose(-1, -2)) * scale  # [B, nH, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril() if mask is None else mask[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag_scores = torch.stack([(q * ke).sum(-1) * scale for ke, _ in diag], dim=-1)  # [B, nH, T, n]
    acc = torch.promote_types(q.dtype, torch.float32)
    probs = torch.cat([scores, diag_scores], dim=-1).to(acc).softmax(-1).to(q.dtype)
    out = probs[..., :t] @ v_base
    return out + sum(probs[..., t + j, None] * ve for j, (_, ve) in enumerate(diag))


class Attention(nn.Module):
    # the training-time test's attention: "sdpa" (one fused call, unrolled_mask) or "dense" (explicit
    # [B, H, T, T] scores, dense_unrolled_attention: the reference, and what bench/train_step.py compares)
    unrolled_impl = "sdpa"

    def __init__(self, args: LlamaArgs, in_features: int | None = None) -> None:
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        in_features = in_features or h
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.q_proj = Linear(in_features, self.n_heads * d, bias=args.attention_bias)
        self.k_proj = Linear(in_features, self.n_kv * d, bias=args.attention_bias)
        self.v_proj = Linear(in_features, self.n_kv * d, bias=args.attention_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, nH, T, d], k and v [B, nKV, T, d], RoPE applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if hasattr(kv, "attend"):  # a paged cache layer (inference_eval/paged.py): packed rows, own masks
            return self.o_proj(kv.attend(q, k, v, self.n_kv != self.n_heads).transpose(1, 2).reshape(b, t, -1))
        if kv is not None:
            k_cache, v_cache = kv
            k_cache[:, :, start:start + t] = k
            v_cache[:, :, start:start + t] = v
            k, v = k_cache[:, :, :start + t], v_cache[:, :, :start + t]
        if attn_mask is None and t > 1 and start > 0:
            # New queries sit at absolute slots start..start+t-1 and see every key up to themselves.
            attn_mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None and t > 1,
            enable_gqa=self.n_kv != self.n_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_unrolled(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         base: tuple[torch.Tensor, torch.Tensor] | None,
                         extras: list[tuple[torch.Tensor, torch.Tensor]],
                         mask: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention of the training-time test (docs/design.md §4). Row i of depth d attends the depth-1
        keys of positions ≤ i (`base`, causal) and the keys that depths 2..d-1 produced *at row i*
        (`extras`, one per depth, diagonal) plus its own — the draft KV cache of the engine at draft
        step d. With `base=None` (depth 1) this is plain causal attention. `mask` [B, T, T] (packed
        rows: causal within each sample) replaces the causal mask. Returns the output and this call's
        (k, v) for the deeper depths."""
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if base is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None] if mask is not None else None,
                                                 is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), _own(k, v)
        blocks = [*extras, (k, v)]
        if self.unrolled_impl == "dense":
            out = dense_unrolled_attention(q, base, blocks, mask, self.head_dim ** -0.5)
        else:
            # One attention call over the keys [depth-1 keys ; depth-2 keys ; … ; this depth's keys], each
            # block T long: causal (or the packed mask) over the first block, the diagonal over the
            # others — row i sees only what depths 2..d produced at row i. No [B, H, T, (n+1)·T] scores
            # are kept (a fused SDPA kernel); only the boolean mask, shared over batch and heads unpacked.
            keys = torch.cat([base[0], *(kb for kb, _ in blocks)], dim=2)
            values = torch.cat([base[1], *(vb for _, vb in blocks)], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=unrolled_mask(t, len(blocks), mask, x.device),
                                                 enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), _own(k, v)


def _own(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) handed to the deeper depths as tensors of their own, not views of the projection: a layer sharded
    on its own under FSDP2 registers its pre-backward hook on what it returns, which an in-place op on a view
    would drop (torch warns on every step otherwise)."""
    return k.clone() if k._is_view() else k, v.clone() if v._is_view() else v


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if _native_inference(g) and g.numel() <= NATIVE_ROWS * g.shape[-1] and native.load() is not None:
            # the few rows the native linear computes: silu(g)·u in C too (inference_eval/fused.py's layers
            # compute the same); torch's vectorised SiLU for more rows
            return self.down_proj(native.silu_mul(g.contiguous(), u.contiguous()))
        return self.down_proj(F.silu(g) * u)


def dropped(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A residual branch of a head's layer in the training-time test, through the dropout that training installs
    on the layer (`train.module.dropout`: train/module.py); unchanged when none is (the engine, validation)."""
    drop = getattr(layer, "residual_dropout", None)
    return x if drop is None else drop(x)


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer. `input_norm=False` gives EAGLE-1's layer without input norm."""

    fsdp_unit = True  # sharded on its own under FSDP2 (train/module.py configure_model)

    def __init__(self, args: LlamaArgs, input_norm: bool = True) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0,
                attn_mask: torch.Tensor | None = None, unrolled: tuple | None = None,
                kv_only: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`unrolled=(base, extras, mask)`: one depth of the training-time test (forward_unrolled) —
        through the module call, so that FSDP and ZeRO-3 gather this layer's sharded weights around it.
        `kv_only`: only the (k, v) this layer would write for `x` (RoPE applied), for the training-time
        test's keys of a module that does not answer this depth (heads/unroll.py)."""
        if kv_only:
            h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
            return _own(*self.self_attn.project(h, cos, sin)[1:])
        if unrolled is not None:
            return self.forward_unrolled(x, cos, sin, *unrolled)
        if attn_mask is None and hasattr(kv, "run_layer"):  # a paged cache layer: one native call where it applies
            out = kv.run_layer(self, x, cos, sin)
            if out is not None:
                return out
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin, kv, start, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_unrolled(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         base: tuple[torch.Tensor, torch.Tensor] | None,
                         extras: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One depth of the training-time test; see Attention.forward_unrolled."""
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        a, kv = self.self_attn.forward_unrolled(h, cos, sin, base, extras, mask)
        x = x + dropped(self, a)
        return x + dropped(self, self.mlp(self.post_attention_layernorm(x))), kv
