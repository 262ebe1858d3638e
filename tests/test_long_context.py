"""Sequences up to the target's context (SmolLM2: 8192): stored in full, truncated only beyond
data.max_length, trained on; a max_length beyond the target's context is refused."""

import json

import pytest
import torch

from data.store import FeatureStore
from experiments.stages import run_precompute
from tests.conftest import compose_config, make_hf_model


pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("long_target")
    model = make_hf_model("llama", tie_word_embeddings=True, max_position_embeddings=8192, num_hidden_layers=1)
    tok = make_tiny_tokenizer("chatml")
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_8192_token_conversations(long_target, tmp_path):
    from transformers import AutoTokenizer

    from data.conversations import tokenize_conversation
    from train.data import collate
    from train.module import DraftHeadModule
    from tests.helpers import init_head_of

    tok = AutoTokenizer.from_pretrained(long_target)
    conv = lambda n: [{"from": "human", "value": "Tell me a long story."}, {"from": "gpt", "value": "once " * n}]  # noqa: E731
    per_word = len(tokenize_conversation(tok, [{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": "once " * 200}]).input_ids) / 200
    words = {"fits": int(7900 / per_word), "too_long": int(9500 / per_word)}
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"id": k, "conversations": conv(n)}) for k, n in words.items()) + "\n")
    base = [f"target.path={long_target}", "target.name=long", "target.dtype=float32", "target.source=null",
            "data.source=jsonl", f"data.path={data}", "logger=csv", "progress=false"]
    cfg = compose_config(base + ["data.max_length=8192", f"run_dir={tmp_path / 'run'}"])
    store = FeatureStore(run_precompute(cfg)[0])
    lengths = dict(zip([sid for s in store.manifest["shards"] for sid in s["sample_ids"]], store.lengths()))
    assert 7000 < lengths["fits"] < 8192  # kept whole: nothing cut at 2048
    assert lengths["too_long"] == 8192  # truncated at data.max_length, not dropped
    sample = store[0]
    assert sample["hidden"].shape == (lengths[store.manifest["shards"][0]["sample_ids"][0]], 64)
    head = init_head_of(cfg, long_target)
    module = DraftHeadModule(head, kl_chunk_size=1024)
    out = module.compute_loss(collate([store[i] for i in range(len(store))]))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and int(out["n_tokens"]) > 14000
    with pytest.raises(ValueError, match="exceeds the target's context"):
        run_precompute(compose_config(base + ["data.max_length=9000", f"run_dir={tmp_path / 'run2'}"]))
