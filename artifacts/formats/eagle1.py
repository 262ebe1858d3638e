"""The EAGLE-1 head's two engine formats (docs/reference/export_formats.md §3.1, §4.1, §9.1, §9.2): one
Llama decoder layer without `input_layernorm` after `fc` [H, 2H], under the engines' own names, no
embed_tokens / lm_head (shared from the target), RoPE and positions equal to the target's.

- `eagle1-vllm`   vLLM `method="eagle"`: arch `LlamaForCausalLM` (vLLM prefixes `Eagle`), no `fc.bias` —
                  vLLM 0.32 drops it silently, so a head with a non-zero bias is refused;
- `eagle1-sglang` SGLang `--speculative-algorithm EAGLE`: arch `LlamaForCausalLMEagle`, `fc.bias` always
                  shipped (zeros when the head has none: SGLang keeps a random bias when the key is missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.formats.base import ExportFormat, dtype_name, head_state, loaded, read_json, write_config
from artifacts.formats.checks import (check_eagle_draft_config, check_keys, check_own_tensors, check_shipped_embedding,
                                      draft_args, llama_layer_shapes)
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.eagle1 import Eagle1Config, Eagle1Head
from heads.layers import LlamaArgs

EAGLE1_ARCH = {"eagle1-vllm": "LlamaForCausalLM", "eagle1-sglang": "LlamaForCausalLMEagle"}


def nonzero_bias(head: DraftHead) -> bool:
    bias = getattr(getattr(head, "fc", None), "bias", None)
    return bias is not None and bool(bias.ne(0).any())


def eagle1_config(head: Eagle1Head, target_cfg: dict[str, Any], fmt: str) -> dict[str, Any]:
    """§9.1 / §9.2: a one-layer Llama config sized like the head, RoPE and positions equal to the target's."""
    a = head.args
    dtype = dtype_name(head)
    cfg = {
        "architectures": [EAGLE1_ARCH[fmt]],
        "model_type": "llama",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": max(a.max_position_embeddings, target_cfg.get("max_position_embeddings", 0)),
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "attention_bias": a.attention_bias, "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,  # transformers < 5 reads the first, >= 5 the second
        "bias": fmt == "eagle1-sglang",  # EAGLE's own ea_model.py reads it (default true when missing)
    }
    if "rope_parameters" in target_cfg:  # transformers >= 5 configs keep theta/scaling here
        cfg["rope_parameters"] = target_cfg["rope_parameters"]
    return cfg


def eagle1_shapes(a: LlamaArgs, bias: bool) -> dict[str, tuple[int, ...]]:
    """EAGLE-1 keys (§3.1): fc, then layer 0 without input_layernorm. No embed_tokens, no lm_head."""
    h = a.hidden_size
    shapes = {"fc.weight": (h, 2 * h)} | ({"fc.bias": (h,)} if bias else {})
    return shapes | {f"layers.0.{k}": s for k, s in llama_layer_shapes(a, input_norm=False).items()}


class Eagle1(ExportFormat):
    head_kind = "eagle1"

    def __init__(self, name: str, vllm_method: str | None) -> None:
        self.name, self.vllm_method = name, vllm_method
        self.for_vllm = name == "eagle1-vllm"

    def serves(self, head: DraftHead) -> bool:
        return not (self.for_vllm and nonzero_bias(head))

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        if cfg.get("architectures") != [EAGLE1_ARCH[self.name]]:
            return False
        # vLLM's architecture is the plain Llama one: only the one-layer shape and `fc` tell it from a model
        return not self.for_vllm or (cfg.get("num_hidden_layers") == 1 and "fc.weight" in scan_tensors(path))

    def write(self, head: Eagle1Head, out: Path, target_dir: Path) -> None:
        if head.args.qk_norm:
            raise ValueError("EAGLE-1 export: the engines' Llama EAGLE-1 layer has no q/k norm (Qwen3 target)")
        state = head_state(head)
        if self.for_vllm:
            if nonzero_bias(head):
                b = head.fc.bias.detach()
                raise ValueError(f"eagle1-vllm export refused: the head has a trained non-zero fc.bias (max |b| = "
                                 f"{float(b.abs().max()):.3g}). vLLM's EAGLE-1 has no fc.bias and silently drops it "
                                 "(docs/reference/export_formats.md §14), so it would serve a different function. "
                                 "Train with head.bias=false for vLLM, or export eagle1-sglang.")
            state.pop("fc.bias", None)
        elif "fc.bias" not in state:  # SGLang's fc always has a bias: ship zeros, or it stays random (§4.1)
            state["fc.bias"] = torch.zeros(head.args.hidden_size, dtype=head.dtype)
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        write_config(out, eagle1_config(head, read_json(target_dir / "config.json"), self.name))

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        infos = scan_tensors(path)
        names = {k for k in infos if k != "embed_tokens.weight"}  # equal to the target's: validated
        head = Eagle1Head(args, Eagle1Config(bias="fc.bias" in names), tied)
        return loaded(head, {k: load_tensor(infos[k], k) for k in names}, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        vllm, fmt = self.for_vllm, self.name
        check_eagle_draft_config(cfg, EAGLE1_ARCH[fmt], "EAGLE-1", problems)
        if "bias" in cfg and cfg["bias"] is not (not vllm):
            problems.append(f"config 'bias' is {cfg['bias']!r} but the {fmt} variant "
                            f"{'has no' if vllm else 'has a'} fc.bias")
        a = draft_args(cfg, tcfg, problems)
        if a is None:
            return
        expected = eagle1_shapes(a, bias=not vllm)
        if "layers.0.input_layernorm.weight" in infos:
            problems.append("layers.0.input_layernorm.weight is present: EAGLE-1's layer 0 has no input norm "
                            "(the engines replace it by Identity and reject the key)")
        if vllm and "fc.bias" in infos:
            b = load_tensor(infos["fc.bias"], "fc.bias")
            if bool(b.ne(0).any()):
                problems.append(f"fc.bias is present and non-zero (max |b| = {float(b.abs().max()):.3g}): vLLM's "
                                "EAGLE-1 has no fc.bias and silently drops it (§14), so the served head computes a "
                                "different function")
            else:
                problems.append("fc.bias is present (all zeros): vLLM's EAGLE-1 has no fc.bias parameter "
                                "(a KeyError in the loader of §3.1, dropped by vLLM 0.32, §14): omit the key")
        check_keys(infos, expected, problems, eagle=True,
                   optional=("embed_tokens.weight", "fc.bias", "layers.0.input_layernorm.weight"))  # checked here
        if "embed_tokens.weight" in infos:
            if vllm:
                problems.append("embed_tokens.weight must be omitted for vLLM EAGLE-1 (its loader skips the key but "
                                "flags an own embedding, §2.1)")
            else:
                check_shipped_embedding(infos, target, problems)
        check_own_tensors(infos, expected, cfg, problems)


EAGLE1_VLLM = Eagle1("eagle1-vllm", vllm_method="eagle")
EAGLE1_SGLANG = Eagle1("eagle1-sglang", vllm_method=None)
