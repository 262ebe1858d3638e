"""Shard integrity (sizes + headers at every open, sha256 once per store state behind a stamp, resume
that does not trust a damaged shard) and the header-based target fingerprint."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import data.store as store_mod
from data.store import (STAMP, FeatureStore, Sample, StoreError, StoreWriter, check_fingerprint,
                        merge_rank_manifests, rank_dir)
from inference_eval.model import target_fingerprint

pytestmark = pytest.mark.unit

FP = {"name": "tiny", "config_sha256": "c", "weights_sha256": "w", "weights_hash": "header",
      "tokenizer_sha256": "t", "compute_dtype": "float32"}


def _samples(n=7, h=8, seed=0, prefix="s"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + i * 2
        out.append(Sample(f"{prefix}{i}", torch.randint(0, 100, (t,), generator=g),
                          torch.randint(0, 2, (t,), generator=g), torch.randn(t, h, generator=g)))
    return out


def _store(root, samples=None, close=True, dtype="float32", **kw):
    w = StoreWriter(root, FP, hidden_size=8, dtype=dtype, shard_tokens=20, **kw)
    for s in samples or _samples():
        w.add(s)
    if close:
        w.close()
    return w


def _shard(root, i=1):
    return root / json.loads((root / "manifest.json").read_text())["shards"][i]["file"]


def _flip_data_byte(path):
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[(start + len(data)) // 2] ^= 0x01
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # coarse clocks: make the change visible


def _no_hashing(monkeypatch):
    def fail(path, *a, **k):
        raise AssertionError(f"sha256_file({path}) called")
    monkeypatch.setattr(store_mod, "sha256_file", fail)


# ------------------------------------------------------------------------------------ full verify


def test_manifest_records_shard_bytes(tmp_path):
    _store(tmp_path)
    for s in json.loads((tmp_path / "manifest.json").read_text())["shards"]:
        assert s["bytes"] == (tmp_path / s["file"]).stat().st_size


def test_flipped_byte_caught_on_first_full_open(tmp_path):
    _store(tmp_path)
    shard = _shard(tmp_path)
    _flip_data_byte(shard)
    FeatureStore(tmp_path, verify="header")  # size and header intact: header mode cannot see it
    with pytest.raises(StoreError, match=f"{shard}: sha256 .* does not match the manifest"):
        FeatureStore(tmp_path, verify="full")
    assert not (tmp_path / STAMP).exists()  # a failed verification stamps nothing


def test_stamp_skips_hashing_until_a_shard_changes(tmp_path, monkeypatch):
    _store(tmp_path)
    calls = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p, *a: calls.append(p) or real(p, *a))
    FeatureStore(tmp_path, verify="full")
    n = len(json.loads((tmp_path / "manifest.json").read_text())["shards"])
    assert len(calls) == n and (tmp_path / STAMP).exists()
    assert not list(tmp_path.glob(".*.tmp"))

    _no_hashing(monkeypatch)
    store = FeatureStore(tmp_path, verify="full")  # stamped: no hashing
    assert len(store) == 7 and store[3]["hidden"].shape == (9, 8)

    monkeypatch.setattr(store_mod, "sha256_file", real)
    shard = _shard(tmp_path, 0)
    _flip_data_byte(shard)  # same size, new mtime: the stamp no longer applies
    with pytest.raises(StoreError, match=f"{shard}: sha256"):
        FeatureStore(tmp_path, verify="full")


def test_stamp_invalidated_by_size_and_manifest_changes(tmp_path, monkeypatch):
    _store(tmp_path)
    FeatureStore(tmp_path, verify="full")
    _no_hashing(monkeypatch)
    shard = _shard(tmp_path, 2)
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(StoreError, match=f"{shard}: .* bytes, the manifest records"):
        FeatureStore(tmp_path, verify="header")  # size checked at every open, stamp or not
    with pytest.raises(StoreError, match=f"{shard}: .* bytes, the manifest records"):
        FeatureStore(tmp_path, verify="full")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    # a changed manifest (e.g. a resumed precompute appended shards) invalidates the stamp too
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["source"] = {"note": "rewritten"}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(AssertionError, match="sha256_file"):
        FeatureStore(tmp_path, verify="full")


def test_read_only_store_opens_verified_without_stamp(tmp_path, monkeypatch, caplog):
    _store(tmp_path)

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(store_mod.os, "replace", read_only)
    with caplog.at_level(logging.WARNING, logger="data.store"):
        store = FeatureStore(tmp_path, verify="full")
    assert len(store) == 7 and not (tmp_path / STAMP).exists()
    assert "cannot write the verification stamp" in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))


def test_bad_verify_mode_refused(tmp_path):
    _store(tmp_path)
    with pytest.raises(StoreError, match="verify='sha'"):
        FeatureStore(tmp_path, verify="sha")


# --------------------------------------------------------------------------------- header checks


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 3)


def _garble_json(path):
    data = bytearray(path.read_bytes())
    data[9] = ord("#")  # inside the JSON header
    path.write_bytes(bytes(data))


def _header_length(path):
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) + 1).to_bytes(8, "little")  # a length beyond the file
    path.write_bytes(bytes(data))


def _retype(path):  # a consistent header, but not the manifest's shard: hidden F32 → I32
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    i = header.index('"hidden"')
    header = header[:i] + header[i:].replace('"F32"', '"I32"', 1)
    path.write_bytes(data[:8] + header.encode() + data[8 + n:])


def _other_ids(path):  # the metadata's sample ids, same length
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[:8] + data[8:8 + n].replace(b'\\"s', b'\\"x', 1) + data[8 + n:])


@pytest.mark.parametrize("damage,message", [
    (_truncate, r"bytes, the manifest records .* \(truncated"),
    (_garble_json, "not valid JSON"),
    (_header_length, "header length .* does not fit"),
    (_retype, "tensor 'hidden' is I32"),
    (_other_ids, "sample ids"),
])
def test_header_mode_catches_damage(tmp_path, damage, message):
    _store(tmp_path)
    shard = _shard(tmp_path, 1)
    damage(shard)
    with pytest.raises(StoreError, match=f"{shard}: .*({message})"):
        FeatureStore(tmp_path, verify="header")


def test_manifest_without_bytes_still_checks_headers(tmp_path):
    """A manifest from before `bytes`: the size check is skipped, the header check still catches truncation."""
    _store(tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    for s in m["shards"]:
        del s["bytes"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert len(FeatureStore(tmp_path, verify="full")) == 7
    shard = _shard(tmp_path, 0)
    _truncate(shard)
    with pytest.raises(StoreError, match=f"{shard}: the header describes .* \\(truncated\\)"):
        FeatureStore(tmp_path)


def test_every_damaged_shard_is_named(tmp_path):
    _store(tmp_path)
    a, b = _shard(tmp_path, 0), _shard(tmp_path, 2)
    _truncate(a)
    b.unlink()
    with pytest.raises(StoreError, match=f"2 damaged shards: {a}: .*; {b}: shard missing"):
        FeatureStore(tmp_path)


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_fp8_and_aux_stores_pass_the_header_check(tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    samples = [Sample(s.sample_id, s.input_ids, s.loss_mask, s.hidden, torch.randn(len(s.input_ids), 16, generator=g))
               for s in _samples()]
    _store(tmp_path, samples, dtype=dtype, captured={"hidden": "last_layer_pre_norm", "aux_layers": [0, 1]})
    store = FeatureStore(tmp_path, verify="full")
    assert store[2]["aux_hidden"].shape == (7, 16)


def test_merged_rank_store_stamped_at_the_root(tmp_path, monkeypatch):
    for r in range(2):
        _store(rank_dir(tmp_path, r), _samples(5, seed=r, prefix=f"r{r}-"), source={"rank": r, "world_size": 2})
    merge_rank_manifests(tmp_path)
    assert len(FeatureStore(tmp_path, verify="full")) == 10
    assert (tmp_path / STAMP).exists() and not list((tmp_path / "ranks").rglob(STAMP))
    shard = tmp_path / json.loads((tmp_path / "manifest.json").read_text())["shards"][-1]["file"]
    assert "ranks/rank-00001/shards" in str(shard)
    _flip_data_byte(shard)
    with pytest.raises(StoreError, match=f"{shard}: sha256"):
        FeatureStore(tmp_path, verify="full")


def test_train_data_module_verifies_in_full_by_default(tmp_path, monkeypatch):
    from train.data import FeatureDataModule

    _store(tmp_path)
    shard = _shard(tmp_path, 1)
    _flip_data_byte(shard)
    FeatureDataModule(str(tmp_path), FP, verify_store="header").setup()
    with pytest.raises(StoreError, match=f"{shard}: sha256"):
        FeatureDataModule(str(tmp_path), FP).setup()


def test_config_key():
    from tests.conftest import compose_config

    cfg = compose_config([])
    assert cfg.train.data.verify_store == "full" and cfg.target.fingerprint == "header"


# ---------------------------------------------------------------------------------------- resume


def test_resume_does_not_trust_a_damaged_finished_shard(tmp_path):
    samples = _samples()
    ref = tmp_path / "ref"
    _store(ref, samples)
    ref_hashes = [s["sha256"] for s in json.loads((ref / "manifest.json").read_text())["shards"]]

    root = tmp_path / "store"
    w = _store(root, samples[:6], close=False)  # killed before close()
    assert len(w.manifest["shards"]) == 2
    first = w.manifest["shards"][0]["sample_ids"]
    damaged = _shard(root, 1)
    _garble_json(damaged)
    w2 = StoreWriter(root, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    assert w2.done_ids == set(first)  # shard 1 and the ones after it are recomputed
    assert len(json.loads((root / "manifest.json").read_text())["shards"]) == 1  # on disk too
    for s in samples:
        if s.sample_id not in w2.done_ids:
            w2.add(s)
    w2.close()
    assert [s["sha256"] for s in w2.manifest["shards"]] == ref_hashes  # the store of an uninterrupted run
    assert len(FeatureStore(root, verify="full")) == len(samples)


def test_resume_of_a_complete_store_with_a_truncated_shard(tmp_path):
    _store(tmp_path)
    shard = _shard(tmp_path, 2)
    _truncate(shard)
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    assert not w.complete and len(w.manifest["shards"]) == 2 and not shard.exists()
    with pytest.raises(StoreError, match="incomplete"):
        FeatureStore(tmp_path)


# ----------------------------------------------------------------------------------- fingerprint


def _target(root, dtype=torch.float32, shape=(4, 6), extra=False, seed=0):
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 6,
                                                  "_name_or_path": str(root)}))
    (root / "tokenizer.json").write_text('{"model": "tiny"}')
    save_file({"embed.weight": torch.randn(*shape, generator=g).to(dtype)}, root / "model-00001-of-00002.safetensors")
    tensors = {"lm_head.weight": torch.randn(4, 6, generator=g)}
    if extra:
        tensors["extra.bias"] = torch.zeros(6)
    save_file(tensors, root / "model-00002-of-00002.safetensors")
    return root


def _refused(stored, expected, *needles):
    with pytest.raises(StoreError) as e:
        check_fingerprint(stored, expected, "/stores/x/manifest.json")
    msg = str(e.value)
    assert msg.startswith("/stores/x/manifest.json: ")
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_identical_copy_accepted_header_or_full(tmp_path):
    a = _target(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    fa, fb = target_fingerprint(a, "tiny", "float32"), target_fingerprint(b, "tiny copy", "float32")
    assert fa["weights_hash"] == "header" and "weights_content_sha256" not in fa
    check_fingerprint(fa, fb, "x")
    full = target_fingerprint(b, "tiny", "float32", full_hash=True)
    assert full["weights_hash"] == "full" and full["weights_sha256"] == fa["weights_sha256"]
    check_fingerprint(fa, full, "x")  # a header-made and a full-made fingerprint: compared on the headers
    check_fingerprint(full, fa, "x")
    assert target_fingerprint(a, "tiny", "float32", full_hash="full") == {**full, "name": "tiny"}
    with pytest.raises(ValueError, match="target.fingerprint='sha'"):
        target_fingerprint(a, "tiny", "float32", full_hash="sha")


@pytest.mark.parametrize("change", [{"dtype": torch.float16}, {"shape": (6, 4)}])
def test_changed_header_refused_naming_both(tmp_path, change):
    fa = target_fingerprint(_target(tmp_path / "a"), "tiny", "float32")
    fb = target_fingerprint(_target(tmp_path / "b", **change), "tiny", "float32")
    _refused(fa, fb, f"weights_sha256: stored {fa['weights_sha256']!r}, configured {fb['weights_sha256']!r}",
             "precompute a new store")


def test_changed_size_refused_naming_both(tmp_path):
    fa = target_fingerprint(_target(tmp_path / "a"), "tiny", "float32")
    fb = target_fingerprint(_target(tmp_path / "b", extra=True), "tiny", "float32")
    assert fb["weights_bytes"] > fa["weights_bytes"]
    _refused(fa, fb, f"weights_bytes: stored {fa['weights_bytes']}, configured {fb['weights_bytes']}",
             "weights_sha256: stored")


def test_other_compute_dtype_refused_naming_both(tmp_path):
    a = _target(tmp_path / "a")
    msg = _refused(target_fingerprint(a, "tiny", "float32"), target_fingerprint(a, "tiny", "bfloat16"),
                   "compute_dtype: stored 'float32', configured 'bfloat16'", "set target.dtype=float32")
    assert "weights_sha256" not in msg
    check_fingerprint({k: v for k, v in FP.items() if k != "compute_dtype"}, FP, "x")  # older fingerprints: no dtype


def test_header_fingerprint_reads_no_tensor_bytes(tmp_path, monkeypatch):
    a = _target(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    f = b / "model-00002-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # tensor bytes changed, header and size unchanged
    f.write_bytes(bytes(data))
    full_a, full_b = (target_fingerprint(d, "tiny", "float32", full_hash=True) for d in (a, b))
    assert full_a["weights_content_sha256"] != full_b["weights_content_sha256"]
    _refused(full_a, full_b, "weights_content_sha256: stored")
    _no_hashing(monkeypatch)
    ha, hb = (target_fingerprint(d, "tiny", "float32") for d in (a, b))
    assert ha == hb and ha["weights_sha256"] == full_a["weights_sha256"]


def test_legacy_fingerprint(tmp_path):
    """A store fingerprinted before `weights_hash`: weights_sha256 hashed the bytes; only a full fingerprint compares."""
    a = _target(tmp_path / "a")
    full = target_fingerprint(a, "tiny", "float32", full_hash=True)
    legacy = {k: v for k, v in full.items() if k not in ("weights_hash", "weights_content_sha256", "weights_bytes")}
    legacy["weights_sha256"] = full["weights_content_sha256"]
    check_fingerprint(legacy, full, "x")
    _refused(legacy, target_fingerprint(a, "tiny", "float32"), "target.fingerprint=full")
    _refused(legacy, {**full, "weights_content_sha256": "other"},
             f"weights_sha256 (stored) vs weights_content_sha256 (configured): stored {legacy['weights_sha256']!r}, "
             "configured 'other'")


def test_store_and_resume_across_fingerprint_methods(tmp_path):
    a = _target(tmp_path / "a")
    header, full = target_fingerprint(a, "tiny", "float32"), target_fingerprint(a, "tiny", "float32", full_hash=True)
    root = tmp_path / "store"
    w = StoreWriter(root, header, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples()[:4]:
        w.add(s)
    w2 = StoreWriter(root, full, hidden_size=8, dtype="float32", shard_tokens=20)  # resumes: same target
    assert w2.done_ids == w.done_ids and w2.manifest["target_fingerprint"] == header
    w2.close()
    FeatureStore(root, full)
    FeatureStore(root, header)
    with pytest.raises(StoreError, match=rf"{root / 'manifest.json'}: .*compute_dtype: stored 'float32', "
                                         "configured 'bfloat16'"):
        FeatureStore(root, target_fingerprint(a, "tiny", "bfloat16"))
