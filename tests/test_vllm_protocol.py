"""The vLLM backends' side of the worker protocol (inference_eval/vllm_backend.py), against a stand-in
worker process (tests/fake_vllm_worker.py), without vLLM: requests are pipelined — several queued in the
worker at once, each reply resolving its own request in order —, a failed request fails alone, and a worker
that dies fails every pending request with its exit code instead of hanging."""

import re
import sys
import time
from pathlib import Path

import pytest

from inference_eval import vllm_backend
from inference_eval.vllm_backend import VLLMBackend, VllmSettings, VLLMWorkerError


pytestmark = pytest.mark.unit


class FakeBackend(VLLMBackend):
    worker_module = "tests.fake_vllm_worker"


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda python: "0.32.0")
    b = FakeBackend(Path(sys.executable), {}, {}, startup_timeout_s=60)
    yield b
    b.close(force=True)


def test_requests_queue_in_the_worker_and_resolve_in_order(backend):
    t0 = time.perf_counter()
    futures = [backend.submit({"n": i, "sleep": 0.3}, f"request {i}") for i in range(3)]
    sent_s = time.perf_counter() - t0
    assert sent_s < 0.3  # all three sent before the first was answered: queued in the worker
    assert backend.max_pending == 3
    assert [f.result(timeout=30)["n"] for f in futures] == [0, 1, 2]
    assert backend.request({"n": 7}, "one more")["n"] == 7  # request = submit + wait


def test_a_failed_request_fails_alone(backend):
    bad = backend.submit({"fail": "no such layer"}, "the bad one")
    good = backend.submit({"n": 1}, "the next one")
    with pytest.raises(VLLMWorkerError, match="failed on the bad one:\nno such layer"):
        bad.result(timeout=30)
    assert good.result(timeout=30)["n"] == 1


def test_a_dead_worker_fails_every_pending_request(backend):
    slow = backend.submit({"n": 0, "sleep": 0.2}, "the first")
    dying = backend.submit({"exit": 3}, "the fatal one")
    after = backend.submit({"n": 2}, "the one after")
    assert slow.result(timeout=30)["n"] == 0
    for future, what in ((dying, "the fatal one"), (after, "the one after")):
        with pytest.raises(VLLMWorkerError, match=rf"exited \(code 3\) during {what}"):
            future.result(timeout=30)
    with pytest.raises(VLLMWorkerError, match="gone"):
        backend.submit({"n": 3}, "a late one")


def test_vllm_settings_are_checked_and_typed():
    """A `*.vllm` section's counts are whole numbers ≥ 1 (refused naming the setting), an unknown key is refused, the
    absent ones take the defaults, `env` values become strings."""
    from omegaconf import OmegaConf

    got = VllmSettings.of(OmegaConf.create({"in_flight": 1, "env": {"X": 1}, "python": None}), "precompute.vllm")
    assert (got.in_flight, got.env, got.tensor_parallel_size, got.python) == (1, {"X": "1"}, 1, None)
    assert VllmSettings.of(None, "evaluate.vllm") == VllmSettings("evaluate.vllm")
    for key, value in (("in_flight", 0), ("data_parallel_size", -1), ("tensor_parallel_size", "2"),
                       ("in_flight", True)):
        with pytest.raises(ValueError, match=rf"precompute.vllm.{key}={value!r}: expected a whole number ≥ 1"):
            VllmSettings.of({key: value}, "precompute.vllm")
    with pytest.raises(ValueError, match="regenerate.vllm.in_fligt: not a vLLM setting"):
        VllmSettings.of({"in_fligt": 2}, "regenerate.vllm")


def test_replicas_get_their_own_devices_or_cores():
    from inference_eval.vllm_backend import replica_env

    assert replica_env(0, 1, 4, 8, 64, "x") == {}  # one replica: vLLM chooses
    assert [replica_env(r, 2, 4, 8, 0, "x") for r in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                                                                  {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]
    assert [replica_env(r, 2, 1, 0, 2, "x")["VLLM_CPU_OMP_THREADS_BIND"] for r in (0, 1)] == ["0", "1"]
    assert [replica_env(r, 2, 2, 0, 8, "x")["VLLM_CPU_OMP_THREADS_BIND"] for r in (0, 1)] == ["0-1|2-3", "4-5|6-7"]
    with pytest.raises(ValueError, match=r"evaluate.vllm.data_parallel_size=3 replicas × tensor_parallel_size=4 "
                                         r"need 12 GPUs, 8 are visible"):
        replica_env(0, 3, 4, 8, 64, "evaluate.vllm.data_parallel_size")
    with pytest.raises(ValueError, match="need 4 CPU cores, 2 are usable"):
        replica_env(0, 2, 2, 0, 2, "evaluate.vllm.data_parallel_size")


def test_a_worker_bound_to_cores_starts_on_those_cores_alone(monkeypatch):
    """VLLM_CPU_OMP_THREADS_BIND's cores become the worker process's affinity (vLLM binds only its OpenMP threads;
    a worker bound to one core ran threads on another), the spawning thread's own affinity is put back, a worker
    without the variable keeps every core, and cores this process may not use, or text that names no cores, are
    refused naming the variable."""
    import os

    from inference_eval.vllm_backend import bound_cores, spawn_on

    assert bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "0-1|4-5"}) == {0, 1, 4, 5}
    assert bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "0,2"}) == {0, 2}
    assert bound_cores({"VLLM_CPU_OMP_THREADS_BIND": "3"}) == {3}
    for none in ({}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}):
        assert bound_cores(none) is None
    for bad in ("0-", "2-1", "a", "0|x"):
        with pytest.raises(ValueError, match=rf"VLLM_CPU_OMP_THREADS_BIND='{re.escape(bad)}': expected core numbers"):
            bound_cores({"VLLM_CPU_OMP_THREADS_BIND": bad})
    monkeypatch.setattr(vllm_backend, "vllm_version", lambda python: "0.32.0")
    mine = os.sched_getaffinity(0)
    first = min(mine)
    for env, want in (({"VLLM_CPU_OMP_THREADS_BIND": str(first)}, [first]), ({}, sorted(mine))):
        b = FakeBackend(Path(sys.executable), {}, env, startup_timeout_s=60)
        try:
            assert b.info["cpus"] == want
        finally:
            b.close(force=True)
        assert os.sched_getaffinity(0) == mine  # the spawning thread's cores, put back
    with pytest.raises(ValueError, match=r"names cores \[4096\] this process may not run on"):
        with spawn_on({first, 4096}):
            pass
    assert os.sched_getaffinity(0) == mine


def test_replica_results_merge_into_one_workers():
    """Two replicas' shares of two categories: tokens back in prompt order, counters summed per category and
    in all (per position too, vectors of unequal length padded), seconds the slowest replica's."""
    from inference_eval.vllm_spec import merge_replicas

    def spec(drafts, per_pos):
        return {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": sum(per_pos),
                "accepted_per_pos": per_pos}

    # prompts 0, 1, 2 in category a; 3, 4 in b; replica 0 took 0, 2, 3 and replica 1 took 1, 4
    r0 = {"tokens": [[10], [12], [13]], "spec": spec(9, [4, 2, 1]), "load_s": 5.0, "generate_s": 2.0, "vllm": "0.32.0",
          "groups": [{"spec": spec(6, [3, 1, 1]), "generate_s": 1.5, "new_tokens": 2},
                     {"spec": spec(3, [1, 1, 0]), "generate_s": 0.5, "new_tokens": 1}]}
    r1 = {"tokens": [[11], [14]], "spec": spec(4, [2, 1]), "load_s": 6.0, "generate_s": 1.0, "vllm": "0.32.0",
          "groups": [{"spec": spec(2, [1, 0]), "generate_s": 0.6, "new_tokens": 1},
                     {"spec": spec(2, [1, 1]), "generate_s": 0.4, "new_tokens": 1}]}
    got = merge_replicas([r0, r1], [[0, 2, 3], [1, 4]], 5)
    assert got["tokens"] == [[10], [11], [12], [13], [14]]
    assert got["spec"] == spec(13, [6, 3, 1])
    assert [g["spec"] for g in got["groups"]] == [spec(8, [4, 1, 1]), spec(5, [2, 2, 0])]
    assert [g["new_tokens"] for g in got["groups"]] == [3, 2]
    assert [g["generate_s"] for g in got["groups"]] == [1.5, 0.5]
    assert (got["load_s"], got["generate_s"]) == (6.0, 2.0)


def test_the_serve_worker_runs_vllm_in_process_on_a_cpu_build_with_one_rank(monkeypatch):
    """inference_eval/vllm_serve_worker.py: one rank without CUDA → engine core in this process (saves two
    vLLM imports per served config); tensor parallelism or CUDA → vLLM's separate processes; the job's
    "in_process" and an explicit VLLM_ENABLE_V1_MULTIPROCESSING win, in that order. (The serving tests
    run the in-process path against spechead's engine: tests/test_vllm_serving.py.)"""
    import torch

    from inference_eval.vllm_serve_worker import in_process

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert in_process({}, {}) is True
    assert in_process({"tensor_parallel_size": 1}, {}) is True
    assert in_process({"tensor_parallel_size": 2}, {}) is False
    assert in_process({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) is False
    assert in_process({"tensor_parallel_size": 2}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) is True
    assert in_process({"in_process": False}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) is False
    assert in_process({"in_process": True, "tensor_parallel_size": 2}, {}) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert in_process({}, {}) is False
