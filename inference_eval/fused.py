"""Decoder layers as one native call per forward (core/native.py `decode_layers`): a Llama-layout target's whole
stack (`run`), or one draft head's layer over its paged pool (`run_layer`, through `PagedLayer.run_layer`).

A decode step of the eager engine ran ~160 torch operators per layer (views, casts, the norm's composite, the module
calls around them): on one CPU core at SmolLM2-135M's sizes a quarter of the step beside what its linears stream
(bench/step_profile.py: 4,933 operator calls per batch-1 step). When every row of a forward is one the native
kernels compute anyway — float32 on the CPU, no autograd, not traced, at most `NATIVE_ROWS` rows, every sequence
attended by the paged kernel (decode, a chain's verification, a prefill of ≤ 16 rows per sequence) — the layers run
in C instead: the same kernels (the few-row linear, `rms_norm`, `silu_mul`, the paged attention) in the same order as
the torch path takes with them, so the outputs are bit-identical to it (tests/test_fused_layers.py), and a row still
does not depend on its batch.

Which layers: heads/layers.py's `DecoderLayer` (input norm, `Attention` with or without q/k/v biases and per-head
q/k norms, the SiLU `MLP`), linear weights all float32 or all bfloat16 (`store_weights`), over a pool of per-head
keys and values; EAGLE-1's layer without the input norm too. Other families (Gemma 3, DeepSeek-V2), EAGLE-3's own
layer, prefills past 16 rows, tree or block rows and anything on a GPU take the torch path. `SPECHEAD_FUSED=0` turns
the fused path off.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import torch

from core import native
from heads.layers import NATIVE_ROWS, MLP, Attention, DecoderLayer, RMSNorm

_FIELDS = [f for f, kind in native.Layer._fields_ if kind is ctypes.c_void_p]  # the layer's tensor pointers


def enabled() -> bool:
    return os.environ.get("SPECHEAD_FUSED", "1") != "0"


class Snapshot:
    """What a verdict on some layers (supported, and their mirror; or not) was made of: the layer modules and every
    parameter slot in them (the empty ones, a bias of None, too) with its tensor and address. `same` is one pass over
    them (≈ 75 µs for SmolLM2's 30 layers), cheaper than judging the layers again."""

    def __init__(self, layers: list) -> None:
        self.layers = layers
        self.slots = [(mod._parameters, name, t, None if t is None else t.data_ptr())
                      for layer in layers for mod in layer.modules() for name, t in mod._parameters.items()]

    def same(self, layers: list) -> bool:
        return (len(layers) == len(self.layers) and all(a is b for a, b in zip(layers, self.layers))
                and all(params.get(name) is t and (t is None or t.data_ptr() == ptr)
                        for params, name, t, ptr in self.slots))


class FusedLayers:
    """The C mirror of decoder layers (`native.Layer` each); the tensors it points to are the layers' own (its
    `snapshot` says whether they still are)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.snapshot = Snapshot(layers)
        mirrors = []
        self.per_row = 0
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods = {"post_norm": (layer.post_attention_layernorm, "weight"),
                    "wq": (attn.q_proj, "weight"), "wk": (attn.k_proj, "weight"), "wv": (attn.v_proj, "weight"),
                    "wo": (attn.o_proj, "weight"), "wg": (mlp.gate_proj, "weight"), "wu": (mlp.up_proj, "weight"),
                    "wd": (mlp.down_proj, "weight")}
            if hasattr(layer, "input_layernorm"):
                mods["in_norm"] = (layer.input_layernorm, "weight")
            if attn.q_proj.bias is not None:
                mods.update(bq=(attn.q_proj, "bias"), bk=(attn.k_proj, "bias"), bv=(attn.v_proj, "bias"))
            if hasattr(attn, "q_norm"):
                mods.update(q_norm=(attn.q_norm, "weight"), k_norm=(attn.k_norm, "weight"))
            ptrs = {field: mod._parameters[name].data_ptr() for field, (mod, name) in mods.items()}
            h, inter = attn.o_proj.weight.shape[0], mlp.gate_proj.weight.shape[0]
            qd, kd = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim
            mirrors.append(native.Layer(
                **{f: ptrs.get(f) for f in _FIELDS}, bf=int(attn.q_proj.weight.dtype == torch.bfloat16),
                h=h, nh=attn.n_heads, nkv=attn.n_kv, d=attn.head_dim, inter=inter,
                eps=layer.post_attention_layernorm.eps))
            self.per_row = max(self.per_row, h + 2 * qd + 2 * kd + 2 * inter)
        self.array = (native.Layer * len(mirrors))(*mirrors)
        self.head_dim = layers[0].self_attn.head_dim


def _supported_layer(layer) -> torch.dtype | None:
    """The linear weights' dtype of a layer `decode_layers` computes (module docstring), else None."""
    if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.post_attention_layernorm] + ([layer.input_layernorm] if hasattr(layer, "input_layernorm") else [])
    if hasattr(attn, "q_norm"):
        norms += [attn.q_norm, attn.k_norm]
    if any(type(m) is not RMSNorm or m.eps != norms[0].eps or not native.accepts(m.weight) for m in norms):
        return None
    h = norms[0].weight.shape[0]
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    shapes = [(attn.n_heads * attn.head_dim, h), (attn.n_kv * attn.head_dim, h), (attn.n_kv * attn.head_dim, h),
              (h, attn.n_heads * attn.head_dim), (mlp.gate_proj.weight.shape[0], h),
              (mlp.gate_proj.weight.shape[0], h), (h, mlp.gate_proj.weight.shape[0])]
    if (attn.head_dim % 2 or attn.n_heads % attn.n_kv
            or (hasattr(attn, "q_norm")
                and {attn.q_norm.weight.shape[0], attn.k_norm.weight.shape[0]} != {attn.head_dim})
            or any(tuple(m.weight.shape) != sh for m, sh in zip(linears, shapes))
            or (hasattr(layer, "input_layernorm") and layer.input_layernorm.weight.shape[0] != h)):
        return None
    dtypes = {m.weight.dtype for m in linears}
    if len(dtypes) != 1 or not all(native.accepts_weight(m.weight) for m in linears):
        return None
    biases = [m.bias for m in linears]
    if any(b is not None for b in biases[3:]):
        return None
    if any(b is not None for b in biases[:3]) and not all(b is not None and native.accepts(b) for b in biases[:3]):
        return None
    return dtypes.pop()


def _supported(layers) -> bool:
    """Whether every layer is one `decode_layers` computes, all with one weight dtype."""
    dtypes = {_supported_layer(layer) for layer in layers}
    return len(layers) > 0 and len(dtypes) == 1 and None not in dtypes


# the mirrors, kept beside the models and pools (not on them: a model is deep-copied and pickled, a ctypes array is not)
_MIRRORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_UNSUPPORTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layers_for(owner) -> FusedLayers | None:
    """The fused mirror of `owner`'s layers (a target: `owner.model.layers`; a single DecoderLayer: itself), built
    on first use and again when a layer or parameter changed; None when the kernel does not compute them."""
    layers = list(owner.model.layers) if hasattr(owner, "model") else [owner]
    got = _MIRRORS.get(owner)
    if got is not None and got.snapshot.same(layers):
        return got
    refused = _UNSUPPORTED.get(owner)
    if got is None and refused is not None and refused.same(layers):
        return None
    _MIRRORS.pop(owner, None)
    _UNSUPPORTED.pop(owner, None)
    if not _supported(layers):
        _UNSUPPORTED[owner] = Snapshot(layers)
        return None
    _MIRRORS[owner] = got = FusedLayers(layers)
    return got


def _pool_pointers(pool) -> tuple:
    """Every layer's key and value pool addresses as C arrays (a pool's tensors never move)."""
    got = _POOLS.get(pool)
    if got is None:
        n = len(pool.k)
        got = _POOLS[pool] = ((ctypes.c_void_p * n)(*[t.data_ptr() for t in pool.k]),
                              (ctypes.c_void_p * n)(*[t.data_ptr() for t in pool.v]))
    return got


def _applies(x: torch.Tensor, batch) -> bool:
    """Whether a forward's rows are ones the fused layers compute (module docstring)."""
    return (enabled() and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.shape[0] == 1
            and batch.num_rows == x.shape[1] and batch.num_rows <= NATIVE_ROWS and all(batch.native)
            and native.available())


def _pools_fit(k0: torch.Tensor, v0: torch.Tensor, mirror: FusedLayers) -> bool:
    return (k0.dtype == torch.float32 and v0.shape == k0.shape and k0.is_contiguous() and v0.is_contiguous()
            and k0.shape[2] == mirror.head_dim and k0.device.type == "cpu")


def _step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, k0: torch.Tensor, v0: torch.Tensor,
          kp, vp, mirror: FusedLayers) -> tuple:
    """The C `step_t` of a forward, with the tensors it points to (kept alive by the caller)."""
    n = x.shape[1]
    _, seq, lo, hi, table = batch.native_plan(None)
    threads = torch.get_num_threads()
    scratch = torch.empty(n * mirror.per_row, dtype=torch.float32)
    buf = torch.empty(threads, table.shape[1], dtype=torch.float32)
    step = native.Step(x=x.data_ptr(), n=n, cos=cos.data_ptr(), sin=sin.data_ptr(), slots=batch.write_slots.data_ptr(),
                       table=table.data_ptr(), tk=table.shape[1], seq=seq.data_ptr(), lo=lo.data_ptr(),
                       hi=hi.data_ptr(), kpool=ctypes.addressof(kp), vpool=ctypes.addressof(vp), ks=k0.stride(0),
                       khs=k0.stride(1), vs=v0.stride(0), vhs=v0.stride(1), scratch=scratch.data_ptr(),
                       buf=buf.data_ptr(), scale=mirror.head_dim ** -0.5, threads=threads)
    return step, (scratch, buf)


def _rope_fits(cos: torch.Tensor, x: torch.Tensor, head_dim: int) -> bool:
    return cos.dtype == torch.float32 and tuple(cos.shape) == (1, x.shape[1], head_dim)


def run(model, x: torch.Tensor, rope: list, cache, capture_layers: tuple[int, ...]
        ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """A target's decoder layers on `x` [1, N, h] (the embeddings; updated in place) through `decode_layers`, with
    the inputs of `capture_layers`; None when the forward is not one the kernel computes (module docstring)."""
    batch, pool = getattr(cache, "batch", None), getattr(cache, "pool", None)
    if batch is None or pool is None or not _applies(x, batch):
        return None
    fused = layers_for(model)
    if fused is None or len(pool.k) != len(fused.array) or not _pools_fit(pool.k[0], pool.v[0], fused):
        return None
    cos, sin = rope[0]
    if any(r is not rope[0] for r in rope) or not _rope_fits(cos, x, fused.head_dim):  # one table for every layer
        return None
    cos, sin, x = cos.contiguous(), sin.contiguous(), x.contiguous()
    kp, vp = _pool_pointers(pool)
    step, keep = _step(x, cos, sin, batch, pool.k[0], pool.v[0], kp, vp, fused)
    lib = native.load()
    aux, first = [], 0
    for i in sorted(c for c in set(capture_layers) if 0 <= c < len(fused.array)):
        if i > first:
            lib.decode_layers(ctypes.addressof(fused.array), first, i, ctypes.byref(step))
        aux.append(x.clone())
        first = i
    lib.decode_layers(ctypes.addressof(fused.array), first, len(fused.array), ctypes.byref(step))
    return x, aux


def run_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged) -> torch.Tensor | None:
    """One decoder layer (a draft head's) on `x` [1, N, h] over a paged layer's pool, through `decode_layers`: the
    layer's output (x is not changed), or None when the kernel does not compute it."""
    batch = paged.batch
    if not _applies(x, batch):
        return None
    fused = layers_for(layer)
    if fused is None or not _pools_fit(paged.k_pool, paged.v_pool, fused) or not _rope_fits(cos, x, fused.head_dim):
        return None
    out = x.clone(memory_format=torch.contiguous_format)
    cos, sin = cos.contiguous(), sin.contiguous()
    kp, vp = (ctypes.c_void_p * 1)(paged.k_pool.data_ptr()), (ctypes.c_void_p * 1)(paged.v_pool.data_ptr())
    step, keep = _step(out, cos, sin, batch, paged.k_pool, paged.v_pool, kp, vp, fused)
    native.load().decode_layers(ctypes.addressof(fused.array), 0, 1, ctypes.byref(step))
    return out
