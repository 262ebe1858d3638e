"""Precompute on a tiny target: stored states are the target's, masks are the template's, bad
records are counted, and a rerun resumes."""

import pytest
import torch

from data.conversations import tokenize_conversation
from data.store import FeatureStore
from inference_eval.model import target_fingerprint
from tests.conftest import CONVERSATIONS, compose_config
from scripts.runtime import run_checked
from experiments.stages import run_precompute
from tests.numerics import assert_same_states


@pytest.mark.unit
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
    for i in range(len(CONVERSATIONS)):  # packed several to a row: each one as in its own forward
        messages, _ = normalize_record(CONVERSATIONS[i])
        expected = tokenize_conversation(tok, messages)
        got = store[i]
        assert got["input_ids"].tolist() == list(expected.input_ids)
        assert got["loss_mask"].int().tolist() == list(expected.loss_mask)
        with torch.no_grad():
            ref = hf(got["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        # stored H_i is pre-norm: N_f(H_i) is HF's final hidden state
        normed = hf.model.norm(got["hidden"].float())
        assert_same_states(normed, ref, tiny_target)  # ours (packed rows) vs transformers, both float32


@pytest.mark.unit
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


def _check_windows(plan, lengths, budget):
    from data.precompute import WINDOW_BATCHES

    flat = [i for window in plan for batch in window for i in batch]
    assert sorted(flat) == list(range(len(lengths)))
    starts = [min(i for b in w for i in b) for w in plan]
    ends = [max(i for b in w for i in b) for w in plan]
    assert starts[0] == 0 and all(e + 1 == s for e, s in zip(ends, starts[1:]))  # consecutive windows
    for window in plan:
        assert sum(lengths[i] for b in window for i in b) <= WINDOW_BATCHES * budget + max(lengths)


@pytest.mark.unit
def test_plan_batches_covers_each_sample_once_within_budget():
    from data.precompute import plan_batches

    lengths = [1024] * 30 + [700, 12, 300, 1024, 5000, 64, 64, 64] * 5
    for budget, workers in ((4096, 1), (4096, 2), (2048, 4)):
        plan = plan_batches(lengths, budget, min_batches=workers)
        _check_windows(plan, lengths, budget)
        for window in plan:
            for batch in window:
                rows = [lengths[i] for i in batch]
                assert rows == sorted(rows, reverse=True)  # longest first: the row that sets T_max
                assert len(batch) == 1 or len(batch) * rows[0] <= budget
    # a window too small to fill the workers is split between them
    assert plan_batches([100] * 8, 8192, min_batches=1) == [[[0, 1, 2, 3, 4, 5, 6, 7]]]
    assert plan_batches([100] * 8, 8192, min_batches=2) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert len(plan_batches([300, 100, 200, 100, 50, 100, 100, 100], 8192, min_batches=4)[0]) == 4


@pytest.mark.unit
def test_packed_plan_is_balanced_within_budget():
    from data.precompute import plan_batches, sample_cost

    lengths = [1024] * 30 + [700, 12, 300, 1024, 5000, 64, 64, 64] * 5
    for budget, workers in ((4096, 1), (4096, 2), (2048, 4), (8192, 2)):
        plan = plan_batches(lengths, budget, min_batches=workers, packed=True)
        _check_windows(plan, lengths, budget)
        for window in plan:
            for batch in window:
                assert batch == sorted(batch)  # input order inside a row
                assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget  # tokens, not padded rows
    # a small window is spread evenly over the workers: a multiple of them, costs close
    window = [1024, 1024, 1024, 1024, 1024, 836, 700, 500, 122, 30]
    plan = plan_batches(window, 8192, min_batches=2, packed=True)
    assert len(plan) == 1 and len(plan[0]) == 2
    costs = [sum(sample_cost(window[i]) for i in b) for b in plan[0]]
    assert max(costs) / min(costs) < 1.2, costs
    # the padded plan of the same window keeps 5 rows of 1024 on one worker
    padded = plan_batches(window, 8192, min_batches=2)
    assert [len(b) for b in padded[0]] == [5, 5]
    assert plan_batches([100] * 8, 8192, min_batches=2, packed=True) == [[[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert plan_batches([100] * 3, 8192, min_batches=4, packed=True) == [[[0], [1], [2]]]


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
    """Real SIGKILLs of `python -m scripts.precompute`: once as its first shard appears, once more
    after a few shards of the rerun; a last rerun completes, and the shards are byte-identical to an
    uninterrupted run's, with no temp file left behind."""
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
    ref_dir, ref_stats = run_precompute(compose_config(tiny_overrides + settings + [f"run_dir={tmp_path / 'ref'}"]))
    ref = _shard_hashes(ref_dir)  # uninterrupted, in another directory
    assert len(ref) >= 20

    run_dir = tmp_path / "killed"
    store_dir, manifest = run_dir / "features", run_dir / "features" / "manifest.json"
    cmd = [sys.executable, "-m", "scripts.precompute", *tiny_overrides, *settings, f"run_dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}

    def kept_shards() -> list[dict]:
        m = json.loads(manifest.read_text()) if manifest.exists() else {"shards": [], "complete": False}
        assert not m["complete"]  # the kill landed mid-run
        return m["shards"]

    def kill_when_written(shard: str) -> None:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not (store_dir / "shards" / shard).exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"{shard} did not appear"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL

    kill_when_written("shard-00000.safetensors")
    first = kept_shards()  # usually [] : killed between the shard's rename and the manifest update
    kill_when_written("shard-00008.safetensors")  # the rerun resumes, then is killed again
    kept = kept_shards()
    assert len(first) <= len(kept) < len(ref) and len(kept) >= 7

    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    # it resumed: only the samples not in the kept shards were computed
    assert f" samples={ref_stats.samples - sum(s['num_samples'] for s in kept)} " in rerun.stdout, rerun.stdout
    assert _shard_hashes(store_dir) == ref  # same files, same bytes: no leftover temp file
    assert not list(store_dir.rglob(".*.tmp"))
    store = FeatureStore(store_dir, verify_on_open=True)
    assert store.verify() == [] and len(store) == ref_stats.samples
    assert [s["sha256"] for s in store.manifest["shards"]] == \
        [s["sha256"] for s in json.loads((ref_dir / "manifest.json").read_text())["shards"]]


@pytest.mark.unit
def test_hf_backend_equals_the_engine_backend(tiny_overrides, tmp_path):
    """precompute.backend=hf (an HF model, a hook on the last layer, hidden_states for aux layers)
    stores what the engine's model stores, aux layers included."""
    stores = {}
    for backend in ("engine", "hf"):
        cfg = compose_config(tiny_overrides + [f"precompute.backend={backend}", "precompute.aux_layers=[1]",
                                               f"store_dir={tmp_path / backend}"])
        stores[backend] = FeatureStore(run_precompute(cfg)[0])
    assert len(stores["hf"]) == len(stores["engine"]) == len(CONVERSATIONS)
    for i in range(len(CONVERSATIONS)):
        a, b = stores["engine"][i], stores["hf"][i]
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        assert_same_states(a["hidden"], b["hidden"], cfg.target.path)  # the engine vs transformers, float32
        assert_same_states(a["aux_hidden"], b["aux_hidden"], cfg.target.path)


def test_a_family_the_engine_lacks_goes_through_hf(tiny_overrides, tmp_path):
    """A Gemma checkpoint (embedding scaling, (1 + w) norms: not an engine family): `auto` picks the HF
    backend, and the stored pre-norm state, through Gemma's own final norm, is HF's last hidden state."""
    import transformers

    from inference_eval.targets import resolve_backend
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path / "gemma"
    tok = make_tiny_tokenizer("chatml")
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   eos_token_id=tok.eos_token_id)
    model = transformers.GemmaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    assert resolve_backend("auto", path, "precompute") == "hf"
    overrides = [o for o in tiny_overrides if not o.startswith("target.path=")]
    cfg = compose_config(overrides + [f"target.path={path}", f"store_dir={tmp_path / 'store'}"])
    with pytest.raises(ValueError, match="training, evaluation and export would fail on this target: refused"):
        run_checked("precompute", run_precompute, cfg)  # auto: the stages after it could not use the store
    assert not (tmp_path / "store").exists()
    cfg = compose_config(overrides + [f"target.path={path}", f"store_dir={tmp_path / 'store'}",
                                      "precompute.backend=hf"])  # asked for by name: goes on, with a warning
    store = FeatureStore(run_precompute(cfg)[0])
    assert len(store) == len(CONVERSATIONS)
    for i in (0, 7):
        got = store[i]
        with torch.no_grad():
            ref = model(got["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        assert_same_states(model.model.norm(got["hidden"].float()), ref, path)  # other batches: float32 bound


@pytest.mark.unit
def test_two_batches_in_flight_on_cuda_each_worker_on_its_own_stream():
    """On CUDA two batches are in flight by default, each worker thread on its own stream (one batch's blocking copy
    to the host waits for its stream only); a set `precompute.workers` wins; on a CPU the default stays one worker
    per intra-op thread (at most 4), and no stream is entered there."""
    from contextlib import nullcontext

    import torch

    from data.precompute import _worker_stream, resolve_workers

    assert resolve_workers(None, torch.device("cuda")) == 2 and resolve_workers(3, torch.device("cuda")) == 3
    assert resolve_workers(None, torch.device("mps")) == 1 and resolve_workers(0, torch.device("cpu")) == 1
    assert resolve_workers(None, torch.device("cpu")) == max(1, min(4, torch.get_num_threads()))
    assert isinstance(_worker_stream(torch.device("cpu")), nullcontext)
