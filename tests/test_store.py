"""The feature store: round trip, checksums, fingerprint refusal, atomic resume."""

import json

import pytest
import torch

from data.store import FeatureStore, Sample, StoreError, StoreWriter

FP = {"name": "tiny", "config_sha256": "c", "weights_sha256": "w", "tokenizer_sha256": "t"}


def _samples(n=7, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + i * 2
        out.append(Sample(f"s{i}", torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                          torch.randn(t, h, generator=g)))
    return out


def test_round_trip_and_shards(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    samples = _samples()
    for s in samples:
        w.add(s)
    w.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1
    assert sum(s["num_tokens"] for s in manifest["shards"]) == sum(len(s.input_ids) for s in samples)
    store = FeatureStore(tmp_path, FP)
    assert len(store) == len(samples)
    assert store.lengths() == [len(s.input_ids) for s in samples]
    for i, s in enumerate(samples):
        got = store[i]
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask.bool())
        assert torch.equal(got["hidden"], s.hidden)
    assert store.verify() == []


def test_bf16_storage_rounds_once(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="bfloat16")
    s = _samples(1)[0]
    w.add(s)
    w.close()
    got = FeatureStore(tmp_path)[0]["hidden"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, s.hidden.to(torch.bfloat16))


def test_flipped_byte_is_named(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples():
        w.add(s)
    w.close()
    shard = sorted((tmp_path / "shards").glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert FeatureStore(tmp_path).verify() == [str(shard)]


def test_refuses_other_target(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8)
    w.add(_samples(1)[0])
    w.close()
    with pytest.raises(StoreError, match="another target or tokenizer.*weights_sha256"):
        FeatureStore(tmp_path, {**FP, "weights_sha256": "other"})
    with pytest.raises(StoreError, match="tokenizer_sha256"):
        FeatureStore(tmp_path, {**FP, "tokenizer_sha256": "other"})


def test_incomplete_store_refused_then_resumed(tmp_path):
    samples = _samples()
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in samples[:4]:
        w.add(s)  # shards flushed for what crossed the budget; no close(): a killed run
    done = w.done_ids
    assert done and done < {s.sample_id for s in samples}
    with pytest.raises(StoreError, match="incomplete"):
        FeatureStore(tmp_path)
    w2 = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    assert w2.done_ids == done
    for s in samples:
        if s.sample_id not in w2.done_ids:
            w2.add(s)
    w2.close()
    store = FeatureStore(tmp_path)
    assert [store[i]["input_ids"].tolist() for i in range(len(store))] == [s.input_ids.tolist() for s in samples]
    with pytest.raises(StoreError, match="other settings"):
        StoreWriter(tmp_path, {**FP, "weights_sha256": "x"}, hidden_size=8, dtype="float32")
