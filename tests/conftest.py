"""Shared fixtures: tiny random Llama-family targets built in code, saved as HF checkpoints with a
tiny tokenizer, and small conversation files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)


def make_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    kwargs = {**TINY, **overrides}
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 16)
    cfg = cfg_cls(**kwargs)
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    model = model_cls(cfg).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so norm bugs show up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny random Llama (tied embeddings, like SmolLM2) + ChatML tokenizer as an HF checkpoint."""
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_target")
    model = make_hf_model("llama", tie_word_embeddings=True)
    tok = make_tiny_tokenizer("chatml")
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"The answer is {2 * i}. " * (1 + i % 3)},
        {"from": "human", "value": "Thanks! And times two?"},
        {"from": "gpt", "value": f"That gives {4 * i}."},
    ]}
    for i in range(12)
]


@pytest.fixture(scope="session")
def conversations_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    bad = ['{"id": "bad1", "conversations": "not a list"}', "{not json", '{"id": "empty", "conversations": []}']
    path.write_text("\n".join([json.dumps(c) for c in CONVERSATIONS] + bad) + "\n")
    return path


ROOT = Path(__file__).resolve().parents[1]


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from scripts.runtime import register_resolvers

    register_resolvers()  # as every entry point does (scripts/runtime.py stage_main)

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture
def tiny_overrides(tiny_target, conversations_file, tmp_path) -> list[str]:
    """Hydra overrides that point the real config at the tiny target and the small data file. The 1-module `mtp`
    head: the tests of a mechanism train the head they were written for; the default head (`mtp3`) is named where
    it is tested (a later `head=` wins)."""
    return ["head=mtp", f"target.path={tiny_target}", "target.name=tiny", "target.dtype=float32", "target.source=null",
            "data.source=jsonl", f"data.path={conversations_file}", "data.max_length=512",
            f"run_dir={tmp_path / 'run'}", "logger=csv", "progress=false", "precompute.store_dtype=float32",
            "trainer.precision=32-true", "trainer.max_epochs=3", "train.data.batch_tokens=1024",
            "train.data.val_fraction=0.2", "evaluate.num_prompts=2", "evaluate.max_new_tokens=8",
            "evaluate.k=3", "evaluate.plain_baseline=false"]  # the defaults (k=auto, speedup) cost time: tested alone


@pytest.fixture(scope="session")
def text_target(tmp_path_factory):
    """A tiny random Llama whose greedy replies depend on the prompt and sometimes stop. tiny_target
    cannot serve here: with tied embeddings at HF's init scale the argmax repeats the last prompt
    token (ChatML's newline: every reply blank, whatever the prompt or a padding bug), and its ids past
    the tokenizer's 259 decode to nothing. So: untied, vocabulary = the tokenizer's, init std 0.4, and
    the end-of-turn row of lm_head scaled up so that some replies end before max_new_tokens and
    others are cut there."""
    import torch

    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("text_target")
    tok = make_tiny_tokenizer("chatml")
    model = make_hf_model("llama", seed=2, tie_word_embeddings=False, vocab_size=len(tok), initializer_range=0.4)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 3
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def deep_target(tmp_path_factory) -> Path:
    """Like tiny_target with 8 layers: room for EAGLE-3's default aux layers (2, 4, 5)."""
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("deep_target")
    model = make_hf_model("llama", seed=1, tie_word_embeddings=True, num_hidden_layers=8)
    tok = make_tiny_tokenizer("chatml")
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
