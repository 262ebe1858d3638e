"""The engine's target model: a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) loaded from
an HF checkpoint by its own tensor names; other families (Gemma 3) subclass it in
inference_eval/families/, whose table `from_pretrained` and `target_args` dispatch on.

The forward returns the last decoder layer's output before the final norm (H_i, DESIGN.md §2) and,
on demand, logits and the inputs of chosen layers (EAGLE-3's "input of layer i" convention). The
same code computes the features of the precompute stage and runs validation and evaluation, so
train/serve numerics are one path. Built from the blocks in heads/layers.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn

from heads.layers import DecoderLayer, KVCache, Linear, LlamaArgs, RMSNorm, Rotary


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
        from inference_eval.families import model_class

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
        return self.model.embed_tokens.weight.dtype

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


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file (is this an HF checkpoint directory?)")
    return files


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor name of an HF checkpoint directory, read from the safetensors headers alone."""
    names: list[str] = []
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as fh:
            names.extend(fh.keys())
    return names


def stream_safetensors_dir(path: Path, names: set[str] | None = None, device: str | torch.device = "cpu"):
    """Yield (name, tensor) for the checkpoint's tensors (all, or `names`), each read straight onto
    `device`: one tensor is materialised at a time, so a caller that places each one before asking
    for the next never holds the whole state dict in host memory."""
    device = torch.device(device)
    where = "cpu" if device.type == "cpu" else str(device)
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt", device=where) as fh:
            for key in fh.keys():
                if names is None or key in names:
                    yield key, fh.get_tensor(key)


def load_safetensors_dir(path: Path, names: set[str] | None = None,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read the tensors of an HF checkpoint directory (one file or an index of shards): for small
    selections (the frozen parts a head shares); models stream through `stream_safetensors_dir`."""
    return dict(stream_safetensors_dir(path, names, device))


def _assign_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer `name` of `model` by `tensor`, frozen."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


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
    first = s["model.layers.0.input_layernorm.weight"]
    offset = args.tied_conventions().norm_offset  # a family's (1 + w) norms: the multiplier a Llama norm copies
    return FrozenTargetParts(embed=s["model.embed_tokens.weight"], norm=s["model.norm.weight"],
                             lm_head=lm, first_input_norm=first + offset if offset else first)


def target_args(path: str | Path) -> LlamaArgs:
    """The engine args of a checkpoint, read by its family (LlamaArgs or a family's subclass)."""
    from inference_eval.families import args_from_hf_config

    return args_from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def tied_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The frozen target tensors a head shares, as the head's TiedTarget module, plus the target args
    and the raw parts (for initialising a new head)."""
    from heads.base import TiedTarget

    args = target_args(path)
    parts = load_frozen_parts(path, dtype, device)
    return TiedTarget(parts.embed, parts.lm_head, parts.norm, args.rms_norm_eps, args.tied_conventions()), args, parts


def tied_from_model(target: "LlamaForCausalLM"):
    """A TiedTarget over a loaded target's own E, W_lm and N_f tensors (views, not copies): the heads
    evaluated against this target add no memory for the vocabulary-sized matrices."""
    from heads.base import TiedTarget

    return TiedTarget(target.model.embed_tokens.weight, target.lm_head.weight, target.model.norm.weight,
                      target.args.rms_norm_eps, target.args.tied_conventions())


def resolve_backend(backend: str | None, target_dir: str | Path, stage: str) -> str:
    """`auto` → `engine` for a checkpoint of a family the engine implements (inference_eval/families),
    else `hf`; precompute also takes `vllm` (inference_eval/vllm_backend.py: vLLM in its own environment)."""
    backend = backend or "auto"
    choices = ("auto", "engine", "hf", "vllm") if stage == "precompute" else ("auto", "engine", "hf")
    if backend not in choices:
        raise ValueError(f"{stage}.backend={backend!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    if backend != "auto":
        return backend
    try:
        target_args(target_dir)
    except ValueError:
        return "hf"
    return "engine"


class HFTarget:
    """An HF transformers causal LM behind the engine model's forward signature, for the families
    the engine does not implement (precompute's `hf` backend): the last decoder layer's output before
    the final norm (a forward hook) and the inputs of requested layers (`hidden_states[i]`); the base
    model runs without its lm_head, so no logits are computed."""

    def __init__(self, model) -> None:
        self.hf = model.eval().requires_grad_(False)
        base = model.base_model
        self.layers = getattr(base, "layers", None) or getattr(base, "h", None)
        if self.layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layer list (base_model.layers or .h) to hook")
        # one hook for the model's lifetime, writing to thread-local storage: precompute runs batches
        # on several threads at once, and a hook sees every thread's forward
        self._local = threading.local()
        self.layers[-1].register_forward_hook(self._capture)
        cfg = model.config
        self.args = SimpleNamespace(num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                                    max_position_embeddings=getattr(cfg, "max_position_embeddings", 1 << 30))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", trust_remote_code: bool = False,
                        device_map: str | dict | None = None) -> "HFTarget":
        """`device_map` (e.g. `auto`) shards the layers over the visible GPUs through accelerate, for a
        target too large for one; the weights then load straight onto their devices."""
        from transformers import AutoModelForCausalLM

        if device_map is not None:
            return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                            device_map=device_map))
        device = torch.device(device)
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                        device_map=None if device.type == "cpu" else str(device)))

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device (the first shard's under a device_map)."""
        return self.hf.get_input_embeddings().weight.device

    def __call__(self, input_ids: torch.Tensor, logits: str = "none", capture_layers: tuple[int, ...] = ()
                 ) -> TargetOutput:
        if logits != "none":
            raise ValueError("HFTarget computes hidden states only (logits='none')")
        out = self.hf.base_model(input_ids=input_ids, output_hidden_states=bool(capture_layers), use_cache=False)
        hidden, self._local.hidden = self._local.hidden, None
        aux = [out.hidden_states[i] for i in capture_layers]
        return TargetOutput(hidden=hidden, logits=None, aux=aux)

    def _capture(self, module, args, output) -> None:
        self._local.hidden = output[0] if isinstance(output, tuple) else output



def load_target(cfg, target_dir: str | Path, backend: str, dtype: torch.dtype):
    """The target a stage runs, placed by `target.device` (`resolve_device`): the engine's model, or for
    the `hf` backend HF transformers, sharded over the visible GPUs when `target.device_map` is set, or
    for `vllm` (precompute only) a vLLM worker process placed by vLLM (`precompute.vllm.*`)."""
    if backend == "vllm":
        from inference_eval.vllm_backend import VLLMBackend

        return VLLMBackend.from_config(cfg, target_dir, dtype)
    device = resolve_device(cfg.target.get("device", "auto"))
    if backend == "engine":
        return LlamaForCausalLM.from_pretrained(target_dir, dtype=dtype, device=device)
    return HFTarget.from_pretrained(target_dir, dtype=dtype, device=device,
                                    trust_remote_code=bool(cfg.target.get("trust_remote_code", False)),
                                    device_map=cfg.target.get("device_map"))
