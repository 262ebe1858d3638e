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
    assert stats.rejected == {"malformed": 1, "not_json": 1, "empty": 1}
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


def _many_conversations(path, n=300):
    import json
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns += [{"from": "human", "value": f"Question {i}: " + "why? " * rng.randint(1, 30)},
                          {"from": "gpt", "value": f"Answer {i}. " + "because. " * rng.randint(1, 40)}]
            f.write(json.dumps({"id": f"m{i}", "conversations": turns}) + "\n")
    return path


def _shard_hashes(store_dir):
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((store_dir / "shards").iterdir())}


def test_kill_9_then_rerun_gives_the_same_shards(tiny_overrides, tmp_path):
    """A real SIGKILL of `python -m scripts.precompute` after its first shard, then a rerun: the shards
    are byte-identical to an uninterrupted run's, and no temp file is left behind."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    data = _many_conversations(tmp_path / "many.jsonl")
    settings = [f"data.path={data}", "data.max_samples=null", "precompute.shard_tokens=2000",
                "precompute.batch_tokens=1024"]
    ref_cfg = compose_config(tiny_overrides + settings + [f"run_dir={tmp_path / 'ref'}"])
    ref_dir, ref_stats = run_precompute(ref_cfg)  # uninterrupted, in another directory
    ref = _shard_hashes(ref_dir)
    assert len(ref) >= 10

    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "scripts.precompute", *tiny_overrides, *settings, f"run_dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    shards = run_dir / "features" / "shards"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (shards.is_dir() and any(p.name.startswith("shard-") for p in shards.iterdir())):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no shard appeared"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    manifest = run_dir / "features" / "manifest.json"
    # the kill landed mid-run: the store is not complete (the manifest may not exist yet)
    assert not (manifest.exists() and json.loads(manifest.read_text())["complete"])
    kept = json.loads(manifest.read_text())["shards"] if manifest.exists() else []
    assert len(kept) < len(ref)

    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    # it resumed: only the samples not in the kept shards were computed
    assert f" samples={ref_stats.samples - sum(s['num_samples'] for s in kept)} " in rerun.stdout, rerun.stdout
    assert _shard_hashes(run_dir / "features") == ref  # same files, same bytes: no leftover temp file
    assert not list((run_dir / "features").rglob(".*.tmp"))
    store = FeatureStore(run_dir / "features", verify_on_open=True)
    assert store.verify() == [] and len(store) == ref_stats.samples
    assert [s["sha256"] for s in store.manifest["shards"]] == \
        [s["sha256"] for s in json.loads((ref_dir / "manifest.json").read_text())["shards"]]
