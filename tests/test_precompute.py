"""Precompute on a tiny target: stored states are the target's, masks are the template's, bad
records are counted, and a rerun resumes."""

import torch

from data.conversations import tokenize_conversation
from data.precompute import run_precompute
from data.store import FeatureStore, target_fingerprint
from tests.conftest import CONVERSATIONS, compose_config


def test_store_holds_hf_hidden_states(tiny_overrides, tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.conversations import normalize_record

    cfg = compose_config(tiny_overrides)
    store_dir, stats = run_precompute(cfg)
    assert stats.samples == len(CONVERSATIONS)
    assert stats.rejected == {"malformed": 2, "empty": 1}
    store = FeatureStore(store_dir, target_fingerprint(tiny_target, "tiny", "float32"))
    assert len(store) == len(CONVERSATIONS)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target)
    for i in (0, 5, 11):
        messages, _ = normalize_record(CONVERSATIONS[i])
        expected = tokenize_conversation(tok, messages)
        got = store[i]
        assert got["input_ids"].tolist() == list(expected.input_ids)
        assert got["loss_mask"].int().tolist() == list(expected.loss_mask)
        with torch.no_grad():
            ref = hf(got["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        # stored H_i is pre-norm: N_f(H_i) is HF's final hidden state
        normed = hf.model.norm(got["hidden"].float())
        torch.testing.assert_close(normed, ref, atol=1e-5, rtol=1e-5)


def test_rerun_resumes_and_matches(tiny_overrides, tmp_path):
    cfg = compose_config(tiny_overrides + ["precompute.shard_tokens=300"])
    store_dir, _ = run_precompute(cfg)
    first = {p.name: p.read_bytes() for p in (store_dir / "shards").iterdir()}
    # Simulate a kill after two shards: drop later shards and the complete flag from the manifest.
    import json
    m = json.loads((store_dir / "manifest.json").read_text())
    for s in m["shards"][2:]:
        (store_dir / s["file"]).unlink()
    m["shards"], m["complete"] = m["shards"][:2], False
    (store_dir / "manifest.json").write_text(json.dumps(m))
    _, stats = run_precompute(cfg)
    assert stats.skipped_done > 0 and stats.samples == len(CONVERSATIONS) - stats.skipped_done
    again = {p.name: p.read_bytes() for p in (store_dir / "shards").iterdir()}
    assert again == first
    assert FeatureStore(store_dir).verify() == []
