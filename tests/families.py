"""The engine's model families as the tests build them: tiny random HF checkpoints of Gemma 3 and DeepSeek-V2
(Llama and its relatives: `make_hf_model` in tests/conftest.py), and what the family-conformance suite
(tests/test_family_conformance.py) needs to know of each family (`FAMILIES`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from inference_eval.families.deepseek_v2 import DeepseekV2ForCausalLM
from inference_eval.families.gemma3 import Gemma3ForCausalLM
from inference_eval.model import LlamaForCausalLM
from tests.conftest import make_hf_model
from tests.helpers import random_hf_model

WINDOW = 7
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


def make_hf_gemma3(seed: int = 0, **overrides):
    """A tiny random HF Gemma 3 text model (eager attention: the reference for the caps and windows).
    Hidden size 48, so √H is not exact in bf16; the global RoPE has linear scaling, the local one
    another base; query_pre_attn_scalar differs from head_dim; the sliding window (7) is shorter than the
    tests' sequences. Norm weights (zero at init: the (1 + w) form) are perturbed so that norm bugs show."""
    import transformers

    kwargs = dict(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                  layer_types=TYPES, max_position_embeddings=4096, attn_implementation="eager",
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    kwargs.update(overrides)
    return random_hf_model(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**kwargs), seed)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
RANK, ROPE = 16, 8


def make_hf_deepseek(seed: int = 0, **overrides):
    """A tiny random HF DeepSeek-V2 (eager attention): 3 layers, the first dense; 4 heads with
    qk = 12 + 8 (nope + rope) and v = 12 dims, a latent of 16; 8 routed experts (top 2) of width 32 and 2
    shared ones. Norm weights are perturbed so that norm bugs show."""
    import transformers

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, kv_lora_rank=RANK, q_lora_rank=None, qk_nope_head_dim=12,
                  qk_rope_head_dim=ROPE, v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1,
                  attn_implementation="eager")
    kwargs.update(overrides)
    return random_hf_model(transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(**kwargs), seed)


def _make_hf_llama(seed: int = 0, model_type: str = "llama", **overrides):
    return make_hf_model(model_type, seed, **overrides)


def _gemma3_hub_layout(path: Path, hf):
    """Rewrite the checkpoint's config.json in the older layout of the Hub's Gemma 3 checkpoints (rope_theta,
    rope_local_base_freq, rope_scaling, sliding_window_pattern; layer 2 global); the HF model that reads it."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        del cfg[key]
    cfg.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=3, num_hidden_layers=4)
    (path / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _deepseek_hub_layout(path: Path, hf):
    """Rewrite the checkpoint's config.json in the Hub's layout (`rope_theta`, `rope_scaling` with `type`,
    moe_layer_freq, scoring_func): the same model, so HF's stays the reference."""
    cfg = json.loads((path / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
               moe_layer_freq=1, scoring_func="softmax")
    (path / "config.json").write_text(json.dumps(cfg))
    return hf


@dataclass(frozen=True)
class Family:
    """One of the engine's model families as the conformance suite builds and checks it."""

    name: str  # the test ids' prefix: `pytest -k <name>` selects the family's cases
    model_cls: type  # what LlamaForCausalLM.from_pretrained returns for its checkpoints
    model_type: str  # config.json's, as a head's LlamaArgs records it
    vocab_size: int
    build: Callable[..., Any]  # (seed=0, **config overrides) -> a random HF model, norms perturbed
    parity_variants: dict[str, dict]  # variant -> build overrides (`hub_config`: then rewritten by hub_layout)
    varied: dict  # build overrides of a target whose greedy continuations vary (weights at std 0.3)
    kv_slot: tuple[int, int]  # one token's key slot in the engine's pool of one layer: (heads, dims)
    eagle3_layers: tuple[int, ...]  # the target layers an eagle3 head reads by default
    mtp_formats: tuple[str, ...]  # an mtp head's default exports: engine formats only where checked on the family
    hub_layout: Callable[[Path, Any], Any] | None = None

    def parity_checkpoint(self, variant: str, path: Path):
        """The variant's HF model saved at `path`; the HF model to compare with."""
        hf = self.build(**self.parity_variants[variant])
        hf.save_pretrained(path)
        return self.hub_layout(path, hf) if variant == "hub_config" else hf


FAMILIES = {f.name: f for f in (
    # Llama's relatives load as LlamaForCausalLM: Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Llama 3's RoPE
    Family("llama", LlamaForCausalLM, "llama", 512, _make_hf_llama,
           {"untied": {}, "tied": {"tie_word_embeddings": True}, "mistral": {"model_type": "mistral"},
            "qwen2": {"model_type": "qwen2", "attention_bias": True}, "qwen3": {"model_type": "qwen3"},
            "llama3_rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}},
           varied={"tie_word_embeddings": True, "initializer_range": 0.3}, kv_slot=(2, 16), eagle3_layers=(1,),
           mtp_formats=("native", "mtp-vllm")),
    # `softcaps`: attention and final-logit caps (Gemma 3 applies only the final one, as HF does), the final one
    # biting (large weights)
    Family("gemma3", Gemma3ForCausalLM, "gemma3_text", 512, make_hf_gemma3,
           {"default": {}, "untied": {"tie_word_embeddings": False},
            "softcaps": {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "initializer_range": 0.3},
            "hub_config": {}},
           varied={"initializer_range": 0.3, "tie_word_embeddings": False}, kv_slot=(2, 16), eagle3_layers=(1, 2),
           mtp_formats=("native",), hub_layout=_gemma3_hub_layout),
    # `lite`: V2-Lite's form (plain q_proj, greedy top-k); `q_lora`: V2's low-rank query, routed weights scaled by
    # 1.5; `yarn`: V2's YaRN (factor 4 over 64 original positions, mscale) with bias on the projections;
    # `group_limited`: 4 groups, top 2 groups
    Family("deepseek_v2", DeepseekV2ForCausalLM, "deepseek_v2", 256, make_hf_deepseek,
           {"lite": {}, "q_lora": {"q_lora_rank": 24, "routed_scaling_factor": 1.5},
            "yarn": {"rope_parameters": YARN, "attention_bias": True},
            "group_limited": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
            "hub_config": {"rope_parameters": YARN}},
           varied={"initializer_range": 0.3}, kv_slot=(1, RANK + ROPE), eagle3_layers=(1, 2),
           mtp_formats=("native",), hub_layout=_deepseek_hub_layout),
)}
