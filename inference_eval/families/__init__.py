"""The engine's model families: HF `model_type` → the model class that implements it.

A family is one class with the engine model's interface (`inference_eval/model.py`
`LlamaForCausalLM`: `from_pretrained`, `args`, `new_cache`, `truncated`, and a forward that takes the
contiguous `KVCache`, a paged cache or packed rows); its `args_class.from_hf_config` reads the HF
config. Adding a family is one module here and one line in `FAMILIES`.
"""

from __future__ import annotations

import importlib
from typing import Any

from heads.layers import LLAMA_FAMILY

FAMILIES: dict[str, str] = {
    **{model_type: "inference_eval.model:LlamaForCausalLM" for model_type in LLAMA_FAMILY},
    "gemma3_text": "inference_eval.families.gemma3:Gemma3ForCausalLM",
    "deepseek_v2": "inference_eval.families.deepseek_v2:DeepseekV2ForCausalLM",
}


def model_class(cfg: dict[str, Any]) -> type:
    """The engine class for an HF config (dict of `config.json`); a ValueError names the families."""
    model_type = cfg.get("model_type", "llama")
    if model_type == "gemma3" and "text_config" in cfg:
        raise ValueError("model_type 'gemma3' is Gemma 3's image-text checkpoint (tensors under "
                         "model.language_model.*): save its text model (Gemma3ForCausalLM, model_type "
                         "'gemma3_text') for the engine, or use the hf backend")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not an architecture this engine implements "
                         f"(families: {', '.join(sorted(FAMILIES))})")
    module, _, name = FAMILIES[model_type].partition(":")
    return getattr(importlib.import_module(module), name)


def args_from_hf_config(cfg: dict[str, Any] | Any):
    """The engine args (LlamaArgs or a family's subclass) of an HF config (dict or PretrainedConfig)."""
    d = cfg if isinstance(cfg, dict) else cfg.to_dict()
    return model_class(d).args_class.from_hf_config(d)
