"""The engine's target model: a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) loaded from
an HF checkpoint by its own tensor names; other families (Gemma 3) subclass it in
inference_eval/families/, whose table `from_pretrained` and `target_args` dispatch on.

The forward returns the last decoder layer's output before the final norm (H_i, docs/design.md §2) and,
on demand, logits and the inputs of chosen layers (EAGLE-3's "input of layer i" convention). The
same code computes the features of the precompute stage and runs validation and evaluation, so
train/serve numerics are one path. Built from the blocks in heads/layers.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from core.fingerprint import fingerprint_checkpoint
from core.safetensors_io import checkpoint_tensor_names, stream_safetensors_dir
from heads.base import TiedTarget
from heads.layers import (DecoderLayer, KVCache, Linear, LlamaArgs, RMSNorm, Rotary, TiedConventions,
                          store_linear_weights)
from inference_eval import fused
from inference_eval.families import args_from_hf_config, model_class


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, T, H] last layer output, pre-norm (H_i)
    logits: torch.Tensor | None  # [B, T or 1, V] or None
    aux: list[torch.Tensor]  # inputs of the requested layers, each [B, T, H]


class LlamaBackbone(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = Rotary(args)


class LlamaForCausalLM(nn.Module):
    """Target model. Module names mirror HF's, so `model.layers.3.self_attn.q_proj.weight` loads as is."""

    supports_packing = True  # forward takes packed samples (`cache=PackedRows`, per-sample positions)
    static_step = True  # its decode step has no value-dependent shape: the engine may compile it (engine/static.py)
    args_class = LlamaArgs
    keep_fp32: tuple[str, ...] = ()  # name suffixes of tensors loaded in fp32 whatever the dtype (a router's)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaBackbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LlamaForCausalLM":
        """Build on the meta device, then stream the checkpoint tensor by tensor onto `device` in
        `dtype`: host memory holds one tensor at a time (plus the model itself when `device` is the
        CPU), never a whole state dict beside the model. Called on this class, it builds the class
        of the checkpoint's family (inference_eval/families: a Gemma 3 checkpoint gives a Gemma 3 model)."""
        path = Path(path)
        device = torch.device(device)
        config = json.loads((path / "config.json").read_text())
        if cls is LlamaForCausalLM:
            cls = model_class(config)
        args = cls.args_class.from_hf_config(config)
        with torch.device("meta"):
            model = cls(args)
        expected = set(model.state_dict())
        skip = {"lm_head.weight"} if args.tie_word_embeddings else set()
        names = checkpoint_tensor_names(path)
        missing = expected - set(names) - skip
        unexpected = set(names) - expected - skip
        if missing or unexpected:
            raise ValueError(f"{path}: checkpoint does not match a {args.model_type} model: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        for name, tensor in stream_safetensors_dir(path, expected - skip, device):
            _assign_tensor(model, name, tensor.to(torch.float32 if name.endswith(cls.keep_fp32) else dtype))
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.init_buffers()  # buffers were on meta
        return model.to(device).eval().requires_grad_(False)

    def init_buffers(self) -> None:
        """Compute the non-persistent buffers (RoPE tables), which a meta-device build leaves empty."""
        self.model.rotary_emb = Rotary(self.args)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, norms, the embedding and the KV cache (the linear weights may be
        stored in another, `store_weights`)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the linear weights are stored in (`store_weights`; else the compute dtype)."""
        return self.lm_head.weight.dtype

    def store_weights(self, dtype: torch.dtype) -> "LlamaForCausalLM":
        """Keep every linear weight (the attention and MLP projections, the lm_head) in `dtype`; activations,
        norms, biases, the embedding and the KV cache stay in the compute dtype. A float32 model with bfloat16
        weights is W16A32: each weight rounded to bf16 once, every product and sum in fp32 — the model whose
        weights are `w.bfloat16().float()`, at half the bytes a decode step streams (on the CPU the native
        kernel widens them as it reads them; heads.layers.linear). A tied lm_head gets its own copy, so the
        embedding's rows stay exact. The compute dtype itself: returns self unchanged."""
        if dtype != self.dtype:
            store_linear_weights(self, dtype, self.dtype)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def truncated(self, num_layers: int) -> "LlamaForCausalLM":
        """A draft model made of this model's first `num_layers` decoder layers, its final norm and its
        lm_head — the weights are shared, not copied (a layer-skip draft for the draft_model proposer)."""
        if not 1 <= num_layers <= self.args.num_hidden_layers:
            raise ValueError(f"truncate to {num_layers} layers: the model has {self.args.num_hidden_layers}")
        args = dataclasses.replace(self.args, num_hidden_layers=num_layers)
        with torch.device("meta"):
            draft = type(self)(args)
        for name, module in self.model.named_children():  # embedding, norm, RoPE tables: shared
            setattr(draft.model, name, nn.ModuleList(module[:num_layers]) if name == "layers" else module)
        draft.lm_head = self.lm_head
        return draft.eval()

    def layer_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per layer: here one table shared by all (a family may give layers their own)."""
        return [self.model.rotary_emb(positions, dtype)] * len(self.model.layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, batch, a.num_key_value_heads, max_len, a.head_dim,
                       self.dtype, self.model.embed_tokens.weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, start: int = 0,
                logits: Literal["all", "last", "none"] = "all",
                capture_layers: tuple[int, ...] = ()) -> TargetOutput:
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        rope = self.layer_rope(positions, x.dtype)
        got = fused.run(self, x, rope, cache, capture_layers) if cache is not None else None
        if got is not None:  # decode / verification rows: every layer in one native call (inference_eval/fused.py)
            x, aux = got
        else:
            aux = []
            for i, layer in enumerate(self.model.layers):
                if i in capture_layers:
                    aux.append(x)
                cos, sin = rope[i]
                x = layer(x, cos, sin, cache.layer(i) if cache is not None else None, start)
        out = None
        if logits != "none":
            last = x[:, -1:] if logits == "last" else x
            out = self.lm_head(self.model.norm(last))
        return TargetOutput(hidden=x, logits=out, aux=aux)


def _assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer `name` of `model` by `tensor`, frozen."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively. On x86: AVX-512-BF16 or AMX. oneDNN's own check
    (`mkldnn._is_mkldnn_bf16_supported`) also says yes on an AVX-512 CPU without them, where bf16 is emulated: on
    such a Xeon (Ice Lake) bf16 precompute ran at 257 tok/s against fp32's 541, and a k = 1 round of the demo's head
    cost 1.71 bf16 plain steps against 1.18 fp32 ones (0.85x instead of 1.10x, docs/RESULTS.md). Elsewhere (ARM):
    oneDNN's check."""
    import platform

    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def auto_compute_dtype(device: str | None = "auto") -> str:
    """`target.dtype: auto` (the `compute_dtype` resolver, scripts/runtime.py): bfloat16 where the target
    runs on a GPU or on a CPU with bf16 matrix instructions; float32 on a CPU without them, where a bf16
    matrix product is up to ~170× slower (tests/README.md) — a bf16 demo precompute there takes hours."""
    dev = resolve_device(device)
    return "bfloat16" if dev.type != "cpu" or cpu_has_fast_bf16() else "float32"


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """`target.device`: `auto` (or null) = `cuda:$LOCAL_RANK` when CUDA is available (each rank of a
    torchrun / Lightning launch on its own GPU), else the CPU; anything else is a torch device string
    (`cpu`, `cuda`, `cuda:3`, `mps`)."""
    import os

    if spec is None or str(spec) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")
    try:
        device = torch.device(str(spec))
    except RuntimeError as e:
        raise ValueError(f"target.device={spec!r}: not a torch device (expected auto, cpu, cuda, cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"target.device={spec!r}: CUDA is not available on this machine (use auto or cpu)")
    return device


@dataclass
class FrozenTargetParts:
    """The target weights a draft head shares: embedding E, final norm N_f and lm_head W_lm."""

    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    first_input_norm: torch.Tensor  # [H], layer 0's input_layernorm multiplier (w, Gemma 1 + w: enorm's init)


def load_frozen_parts(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> FrozenTargetParts:
    """Read only the shared tensors from a target checkpoint (no full model load)."""
    path = Path(path)
    args = target_args(path)
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
             "model.layers.0.input_layernorm.weight"}
    s = {k: v.to(dtype) for k, v in stream_safetensors_dir(path, names, device)}
    lm = s["model.embed_tokens.weight"] if args.tie_word_embeddings or "lm_head.weight" not in s else s["lm_head.weight"]
    return FrozenTargetParts(embed=s["model.embed_tokens.weight"], norm=s["model.norm.weight"],
                             lm_head=lm, first_input_norm=_norm_multiplier(s["model.layers.0.input_layernorm.weight"], args))


def _norm_multiplier(w: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    offset = args.tied_conventions().norm_offset  # a family's (1 + w) norms: the multiplier a Llama norm copies
    return w + offset if offset else w


def first_input_norm(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Layer 0's input_layernorm multiplier alone (FrozenTargetParts.first_input_norm) from a checkpoint."""
    name = "model.layers.0.input_layernorm.weight"
    return _norm_multiplier(dict(stream_safetensors_dir(Path(path), {name}, "cpu"))[name].to(dtype), target_args(path))


def target_args(path: str | Path) -> LlamaArgs:
    """The engine args of a checkpoint, read by its family (LlamaArgs or a family's subclass)."""
    return args_from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def tied_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The frozen target tensors a head shares, as the head's TiedTarget module, plus the target args
    and the raw parts (for initialising a new head)."""
    args = target_args(path)
    parts = load_frozen_parts(path, dtype, device)
    return TiedTarget(parts.embed, parts.lm_head, parts.norm, args.rms_norm_eps, args.tied_conventions()), args, parts


def tied_from_model(target: "LlamaForCausalLM"):
    """A TiedTarget over a loaded target's own E, W_lm and N_f tensors (views, not copies): the heads
    evaluated against this target add no memory for the vocabulary-sized matrices."""
    return TiedTarget(target.model.embed_tokens.weight, target.lm_head.weight, target.model.norm.weight,
                      target.args.rms_norm_eps, target.args.tied_conventions())


def target_fingerprint(model_dir: str | Path, name: str, compute_dtype: str,
                       full_hash: bool | str = False) -> dict[str, Any]:
    """The target's fingerprint (`core.fingerprint.fingerprint_checkpoint`) with its family's
    `tied_conventions` when they are not Llama's: what stores, heads and caches compare."""
    return fingerprint_checkpoint(model_dir, name, compute_dtype, full_hash, _tied_conventions(Path(model_dir)))


def _tied_conventions(model_dir: Path) -> dict[str, Any] | None:
    """The target family's TiedConventions when they are not Llama's (None too for a family the engine
    does not implement: its heads cannot be built)."""
    try:
        conventions = target_args(model_dir).tied_conventions()
    except (ValueError, NotImplementedError, KeyError):
        return None
    return None if conventions == TiedConventions() else conventions.to_dict()
