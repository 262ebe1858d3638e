"""Precompute by two ranks (two real processes): disjoint shards, one merged manifest that the reader
takes as it is, the same samples as a single-rank store, and a merge that refuses incomplete or
mismatched ranks."""

import json
import os
import subprocess
import sys

import pytest
import torch

from data.precompute import rank_of, resolve_rank
from data.store import FeatureStore, IncompleteRanksError, StoreError, merge_rank_manifests, rank_dir
from inference_eval.model import target_fingerprint
from experiments.stages import run_precompute
from tests.conftest import CONVERSATIONS, ROOT, compose_config
from tests.numerics import assert_same_states


def _by_id(store: FeatureStore) -> dict[str, dict[str, torch.Tensor]]:
    ids = [sid for shard in store.manifest["shards"] for sid in shard["sample_ids"]]
    return {sid: store[i] for i, sid in enumerate(ids)}


def test_two_ranks_write_one_store(tiny_overrides, tiny_target, tmp_path):
    settings = ["precompute.shard_tokens=300"]
    ref_dir, _ = run_precompute(compose_config([*tiny_overrides, *settings, f"store_dir={tmp_path / 'single'}"]))
    store_dir = tmp_path / "ranked"
    cmd = [sys.executable, "-m", "scripts.precompute", *tiny_overrides, *settings, f"store_dir={store_dir}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*cmd, "precompute.rank=0", "precompute.world_size=2"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": "1", "WORLD_SIZE": "2"},  # as torchrun sets them
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    shares = [[c["id"] for c in CONVERSATIONS if rank_of(c["id"], 2) == r] for r in (0, 1)]
    assert all(shares)  # both ranks have work
    for (out, _), share in zip(outs, shares):
        assert f" samples={len(share)} " in out.splitlines()[-1]

    ref = FeatureStore(ref_dir)
    store = FeatureStore(store_dir, target_fingerprint(tiny_target, "tiny", "float32"), verify_on_open=True)
    manifest = store.manifest
    assert manifest["complete"] and manifest["ranks"]["world_size"] == 2
    assert manifest["source"] == ref.manifest["source"]  # the ranks' own keys are not in the merged one
    for r, share in enumerate(shares):  # each rank's shards, in its own directory, hold exactly its share
        files = [s for s in manifest["shards"] if s["file"].startswith(f"ranks/rank-0000{r}/shards/")]
        assert sorted(sid for s in files for sid in s["sample_ids"]) == sorted(share)
    assert len(manifest["shards"]) > 2 and len(store) == len(ref) == len(CONVERSATIONS)
    got, expected = _by_id(store), _by_id(ref)
    assert sorted(got) == sorted(expected)  # every sample exactly once
    for sid, sample in got.items():
        assert torch.equal(sample["input_ids"], expected[sid]["input_ids"])
        assert torch.equal(sample["loss_mask"], expected[sid]["loss_mask"])
        # other batch companions than in the single-rank run: equal up to batched-matmul rounding
        assert_same_states(sample["hidden"], expected[sid]["hidden"], tiny_target)
    assert store.verify() == []
    # the held-out split follows the sample ids, not the shard order that the rank count sets
    from train.data import FeatureDataModule

    splits = []
    for d in (ref_dir, store_dir):
        dm = FeatureDataModule(str(d), None, val_fraction=0.3, verify_store="header")
        dm.setup("fit")
        splits.append(dm.val_ids)
    assert [s["sample_ids"] for s in ref.manifest["shards"]] != [s["sample_ids"] for s in manifest["shards"]]
    assert splits[0] == splits[1] and len(splits[0]) == round(0.3 * len(ref))

    # Merging refuses while a rank is incomplete (a kill after its first shard), naming it.
    rank1 = rank_dir(store_dir, 1) / "manifest.json"
    complete = json.loads(rank1.read_text())
    rank1.write_text(json.dumps({**complete, "shards": complete["shards"][:1], "complete": False}))
    with pytest.raises(IncompleteRanksError, match=r"ranks/rank-00001 \(incomplete\)"):
        merge_rank_manifests(store_dir)
    # ... and a rerun of that rank resumes it and, finding every rank complete, merges again.
    cfg = compose_config([*tiny_overrides, *settings, f"store_dir={store_dir}", "precompute.rank=1",
                          "precompute.world_size=2"])
    _, stats = run_precompute(cfg)
    assert stats.skipped_done == complete["shards"][0]["num_samples"] and stats.samples == len(shares[1]) - stats.skipped_done
    assert json.loads((store_dir / "manifest.json").read_text()) == manifest

    rank1.write_text(json.dumps({**complete, "target_fingerprint": {**complete["target_fingerprint"], "weights_sha256": "x"}}))
    with pytest.raises(StoreError, match=r"ranks/rank-00001: differs from .*ranks/rank-00000 in target_fingerprint"):
        merge_rank_manifests(store_dir)
    rank1.unlink()
    with pytest.raises(IncompleteRanksError, match=r"ranks/rank-00001 \(no manifest yet\)"):
        merge_rank_manifests(store_dir)
    cli = [sys.executable, "-m", "scripts.cli", "precompute-merge", str(store_dir)]
    refused = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 1 and f"{rank_dir(store_dir, 1)} (no manifest yet)" in refused.stderr
    rank1.write_text(json.dumps(complete))
    (store_dir / "manifest.json").unlink()
    merged = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert merged.stdout.startswith(f"merged ranks=2 shards={len(manifest['shards'])} samples={len(CONVERSATIONS)} ")
    assert json.loads((store_dir / "manifest.json").read_text()) == manifest

    shard = store_dir / manifest["shards"][-1]["file"]  # verify() checks the ranks' shards too
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert FeatureStore(store_dir).verify() == [str(shard)]


@pytest.mark.unit
def test_rank_settings_and_layout(tiny_overrides, tmp_path, monkeypatch):
    cfg = compose_config(tiny_overrides)
    assert resolve_rank(cfg.precompute.rank, cfg.precompute.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(cfg.precompute.rank, cfg.precompute.world_size) == (3, 4)
    assert resolve_rank(1, 2) == (1, 2)  # the config wins over the environment
    with pytest.raises(ValueError, match="rank 4 of world_size 4"):
        resolve_rank(4, None)
    ids = [f"id{i}" for i in range(200)]
    for world_size in (2, 3):  # a partition: every id in exactly one rank, each rank with a fair share
        counts = [sum(rank_of(s, world_size) == r for s in ids) for r in range(world_size)]
        assert sum(counts) == len(ids) and min(counts) > len(ids) / world_size / 2

    # A single-rank store and a ranked one do not share a directory.
    single, _ = run_precompute(compose_config([*tiny_overrides, f"store_dir={tmp_path / 'single'}",
                                               "precompute.rank=0", "precompute.world_size=1"]))
    with pytest.raises(StoreError, match="a single-rank store is already there"):
        run_precompute(compose_config([*tiny_overrides, f"store_dir={single}", "precompute.rank=0",
                                       "precompute.world_size=2"]))
    (tmp_path / "ranked" / "ranks").mkdir(parents=True)
    with pytest.raises(StoreError, match="written by several ranks"):
        run_precompute(compose_config([*tiny_overrides, f"store_dir={tmp_path / 'ranked'}", "precompute.rank=0",
                                       "precompute.world_size=1"]))
