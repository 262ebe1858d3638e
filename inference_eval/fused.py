"""A Llama-layout target's decoder layers as one native call per forward (core/native.py `decode_layers`).

A decode step of the eager engine runs ~160 torch operators per layer (views, casts, the norm's composite, the
module calls around them): at SmolLM2-135M's sizes on one CPU core they cost a fifth of the step, as much again as
what the step's linears stream in a few milliseconds (bench/step_profile.py). When every row of a forward is one
the native kernels compute anyway — float32 on the CPU, no autograd, not traced, at most `NATIVE_ROWS` rows, every
sequence attended by the paged kernel (decode, a chain's verification) — the layers run in C instead: the same
kernels (the few-row linear, `rms_norm`, `silu_mul`, the paged attention) in the same order as the torch path
takes with them, so the hidden states are bit-identical to it (tests/test_fused_layers.py), and a row still does
not depend on its batch.

Which models: `LlamaForCausalLM` whose layers are heads/layers.py's `DecoderLayer` (input norm, `Attention` with or
without q/k/v biases and per-head q/k norms, the SiLU `MLP`), linear weights all float32 or all bfloat16
(`store_weights`), and a pool of per-head keys and values. Other families (Gemma 3, DeepSeek-V2), prefills, tree or
block rows and anything on a GPU take the torch path. `SPECHEAD_FUSED=0` turns the fused path off.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import torch

from core import native
from heads.layers import NATIVE_ROWS, MLP, Attention, DecoderLayer, RMSNorm

_FIELDS = ("in_norm", "post_norm", "q_norm", "k_norm", "wq", "wk", "wv", "wo", "wg", "wu", "wd", "bq", "bk", "bv")


def enabled() -> bool:
    return os.environ.get("SPECHEAD_FUSED", "1") != "0"


class FusedLayers:
    """The C mirror of a model's layers (`native.Layer` each), with the tensors it points to, and what it is valid
    for: every tensor still the module's own, at the same address."""

    def __init__(self, model) -> None:
        self.checks: list[tuple[dict, str, torch.Tensor, int]] = []
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods = {"in_norm": (layer.input_layernorm, "weight"),
                    "post_norm": (layer.post_attention_layernorm, "weight"),
                    "wq": (attn.q_proj, "weight"), "wk": (attn.k_proj, "weight"), "wv": (attn.v_proj, "weight"),
                    "wo": (attn.o_proj, "weight"), "wg": (mlp.gate_proj, "weight"), "wu": (mlp.up_proj, "weight"),
                    "wd": (mlp.down_proj, "weight")}
            if attn.q_proj.bias is not None:
                mods.update(bq=(attn.q_proj, "bias"), bk=(attn.k_proj, "bias"), bv=(attn.v_proj, "bias"))
            if hasattr(attn, "q_norm"):
                mods.update(q_norm=(attn.q_norm, "weight"), k_norm=(attn.k_norm, "weight"))
            ptrs = {field: mod._parameters[name].data_ptr() for field, (mod, name) in mods.items()}
            for mod in layer.modules():  # every parameter slot, the empty ones (a bias of None) too
                for name, t in mod._parameters.items():
                    self.checks.append((mod._parameters, name, t, None if t is None else t.data_ptr()))
            layers.append(native.Layer(
                **{f: ptrs.get(f) for f in _FIELDS}, bf=int(attn.q_proj.weight.dtype == torch.bfloat16),
                h=model.args.hidden_size, nh=attn.n_heads, nkv=attn.n_kv, d=attn.head_dim,
                inter=mlp.gate_proj.weight.shape[0], eps=layer.input_layernorm.eps))
        self.array = (native.Layer * len(layers))(*layers)
        a = model.args
        self.per_row = a.hidden_size + 2 * a.num_attention_heads * a.head_dim + 2 * a.num_key_value_heads * a.head_dim \
            + 2 * a.intermediate_size

    def current(self) -> bool:
        return all(params.get(name) is t and (t is None or t.data_ptr() == ptr) for params, name, t, ptr in self.checks)


def _supported(model) -> bool:
    """Whether the model's layers are the ones `decode_layers` computes (module docstring)."""
    a = model.args
    if a.head_dim % 2 or not len(model.model.layers):
        return False
    dtypes = set()
    for layer in model.model.layers:
        if (type(layer) is not DecoderLayer or not hasattr(layer, "input_layernorm")
                or hasattr(layer, "residual_dropout") or type(layer.self_attn) is not Attention
                or type(layer.mlp) is not MLP):
            return False
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm, attn.k_norm]
        if any(type(m) is not RMSNorm or m.eps != norms[0].eps or not native.accepts(m.weight) for m in norms):
            return False
        if (attn.n_heads % attn.n_kv or attn.head_dim != a.head_dim or attn.n_heads != a.num_attention_heads
                or attn.n_kv != a.num_key_value_heads or mlp.gate_proj.weight.shape[0] != a.intermediate_size):
            return False
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(m.weight.dtype not in (torch.float32, torch.bfloat16) or not native.accepts_weight(m.weight)
               for m in linears):
            return False
        dtypes |= {m.weight.dtype for m in linears}
        biases = [m.bias for m in linears]
        if any(b is not None for b in biases[3:]):
            return False
        if any(b is not None for b in biases[:3]) and not all(b is not None and native.accepts(b) for b in biases[:3]):
            return False
    return len(dtypes) == 1


# the mirrors, kept beside the models and pools (not on them: a model is deep-copied and pickled, a ctypes array is not)
_MIRRORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_UNSUPPORTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layers_for(model) -> FusedLayers | None:
    """The model's fused layers, built on first use and again when a tensor changed; None for a model whose layers
    the kernel does not compute."""
    got = _MIRRORS.get(model)
    if got is not None and got.current():
        return got
    if got is None and _UNSUPPORTED.get(model) == _structure_key(model):
        return None
    _MIRRORS.pop(model, None)
    _UNSUPPORTED.pop(model, None)
    if not _supported(model):
        _UNSUPPORTED[model] = _structure_key(model)
        return None
    _MIRRORS[model] = got = FusedLayers(model)
    return got


def _structure_key(model) -> tuple:
    """What an unsupported model is remembered by (so that its forwards do not check it again): every parameter's
    identity, address and dtype; any change is checked afresh."""
    return tuple((id(p), p.data_ptr(), p.dtype) for p in model.model.layers.parameters())


def _pool_pointers(pool) -> tuple:
    """Every layer's key and value pool addresses as C arrays (a pool's tensors never move)."""
    got = _POOLS.get(pool)
    if got is None:
        n = len(pool.k)
        got = _POOLS[pool] = ((ctypes.c_void_p * n)(*[t.data_ptr() for t in pool.k]),
                              (ctypes.c_void_p * n)(*[t.data_ptr() for t in pool.v]))
    return got


def run(model, x: torch.Tensor, rope: list, cache, capture_layers: tuple[int, ...]
        ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """The decoder layers on `x` [1, N, h] (the embeddings; updated in place) through `decode_layers`, with the
    inputs of `capture_layers`; None when the forward is not one the kernel computes (module docstring)."""
    batch = getattr(cache, "batch", None)
    pool = getattr(cache, "pool", None)
    if (batch is None or pool is None or not enabled() or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] != 1
            or batch.num_rows > NATIVE_ROWS or not all(batch.native) or not native.available()):
        return None
    k0, v0 = pool.k[0], pool.v[0]
    if (k0.dtype != torch.float32 or v0.shape != k0.shape or not k0.is_contiguous() or not v0.is_contiguous()
            or rope[0][0].dtype != torch.float32):
        return None
    fused = layers_for(model)
    if fused is None or len(pool.k) != len(fused.array):
        return None
    cos, sin = rope[0]
    if any(r is not rope[0] for r in rope):  # one table shared by every layer (what layer_rope gives)
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    n = x.shape[1]
    _, seq, lo, hi, table = batch.native_plan(None)
    threads = torch.get_num_threads()
    scratch = torch.empty(n * fused.per_row, dtype=torch.float32)
    buf = torch.empty(threads, table.shape[1], dtype=torch.float32)
    x = x.contiguous()
    kp, vp = _pool_pointers(pool)
    step = native.Step(x=x.data_ptr(), n=n, cos=cos.data_ptr(), sin=sin.data_ptr(), slots=batch.write_slots.data_ptr(),
                       table=table.data_ptr(), tk=table.shape[1], seq=seq.data_ptr(), lo=lo.data_ptr(),
                       hi=hi.data_ptr(), kpool=ctypes.addressof(kp), vpool=ctypes.addressof(vp), ks=k0.stride(0),
                       khs=k0.stride(1), vs=v0.stride(0), vhs=v0.stride(1), scratch=scratch.data_ptr(),
                       buf=buf.data_ptr(), scale=model.args.head_dim ** -0.5, threads=threads)
    lib = native.load()
    aux, first = [], 0
    for i in sorted(c for c in set(capture_layers) if 0 <= c < len(fused.array)):
        if i > first:
            lib.decode_layers(ctypes.addressof(fused.array), first, i, ctypes.byref(step))
        aux.append(x.clone())
        first = i
    lib.decode_layers(ctypes.addressof(fused.array), first, len(fused.array), ctypes.byref(step))
    return x, aux
