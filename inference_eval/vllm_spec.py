"""Speculative decoding in a real vLLM process, for the stages that measure through vLLM: the evaluation
(`evaluate.engine=vllm`, evaluation/vllm_eval.py) and in-loop validation (`train.engine_validation.engine=vllm`,
train/validation.py). `VLLMRunner` writes one job (prompts as token ids, the decoding settings, the draft) and
runs `inference_eval/vllm_serve_worker.py` in the vLLM environment; `spec_figures` turns vLLM's own counters
(drafts, accepted tokens per position) into τ and the conditional α_d. The head a job serves is written by
artifacts/export.py `vllm_export`."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from inference_eval.vllm_backend import (
    VllmSettings,
    bound_cores,
    check_vllm_version,
    replica_env,
    spawn_on,
    usable_cores,
    vllm_python,
    vllm_version,
)

log = logging.getLogger(__name__)


class VLLMRunner:
    """One vLLM process per job (a worker run): the target, the decoding settings, the environment.
    `vllm`: an `evaluate.vllm`-shaped section, typed (python, tensor_parallel_size, gpu_memory_utilization — `auto`
    is 0.9 of each GPU here —, cpu_kvcache_space_gb, startup_timeout_s, env, llm_kwargs); `what`: the setting that
    asked for vLLM, named in errors; `max_prompt_tokens`: the longest prompt a job will hold (vLLM's max_model_len
    follows). `data_parallel_size` > 1: that many vLLM processes at once, each on its own GPUs or cores
    (inference_eval/vllm_backend.py `replica_env`), each decoding every r-th prompt of each category; their
    tokens are put back in prompt order and their counters summed (`merge_replicas`)."""

    def __init__(self, vllm: VllmSettings, target_dir: Path, dtype: str, max_new_tokens: int, max_num_seqs: int,
                 max_prompt_tokens: int, stops: set[int], work: Path, what: str = "evaluate.engine=vllm") -> None:
        self.what = what
        setting = vllm.setting
        self.python = vllm_python(vllm.python, f"{setting}.python", what)
        self.work, self.target_dir = Path(work), Path(target_dir)
        self.max_new = int(max_new_tokens)
        memory = 0.9 if vllm.gpu_memory_utilization == "auto" else float(vllm.gpu_memory_utilization)
        self.base = {"target": str(target_dir), "dtype": str(dtype), "max_tokens": self.max_new,
                     "stop_token_ids": sorted(stops), "max_num_seqs": int(max_num_seqs),
                     "tensor_parallel_size": vllm.tensor_parallel_size, "gpu_memory_utilization": memory,
                     "max_model_len": int(max_prompt_tokens) + self.max_new + 8, "llm_kwargs": vllm.llm_kwargs}
        self.replicas = vllm.data_parallel_size
        gpus, cores, tp = torch.cuda.device_count(), usable_cores(), self.base["tensor_parallel_size"]
        self.envs = [{**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(vllm.cpu_kvcache_space_gb),
                      **replica_env(r, self.replicas, tp, gpus, cores, f"{setting}.data_parallel_size"), **vllm.env}
                     for r in range(self.replicas)]
        self.startup_timeout = float(vllm.startup_timeout_s)
        self.runs = 0
        self.version = vllm_version(self.python)
        check_vllm_version(self.version, what)

    def run(self, prompts: list[dict[str, Any]], spec: dict | None, label: str) -> dict:
        """`prompts`: {"ids", optional "category"}; the result: the worker's (tokens, vLLM's counters per
        category group and in all, seconds) plus `categories`, `wall_s` and `replicas`."""
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(p.get("category", "all"), []).append(i)
        self.runs += 1
        t0 = time.perf_counter()
        log.info("%s %s: %d vLLM process(es) over %d prompts%s", self.what, label, self.replicas, len(prompts),
                 f", {spec['method']} k={spec['num_speculative_tokens']}" if spec else ", plain decoding")
        shares = [[g[r::self.replicas] for g in groups.values()] for r in range(self.replicas)]
        procs = []
        try:
            for r, share in enumerate(shares):  # every replica started before any is waited for
                order = [i for g in share for i in g]
                local = {i: j for j, i in enumerate(order)}
                job = {**self.base, "prompts": [prompts[i]["ids"] for i in order],
                       "groups": [[local[i] for i in g] for g in share], "speculative_config": spec}
                job_path, out_path = self.work / f"job-{self.runs}-{r}.json", self.work / f"result-{self.runs}-{r}.json"
                job_path.write_text(json.dumps(job))
                log_file = open(self.work / f"log-{self.runs}-{r}.txt", "w+")
                with spawn_on(bound_cores(self.envs[r])):
                    proc = subprocess.Popen([str(self.python), "-m", "inference_eval.vllm_serve_worker",
                                             str(job_path), str(out_path)], env=self.envs[r], stdout=log_file,
                                            stderr=subprocess.STDOUT, text=True,
                                            cwd=str(Path(__file__).resolve().parents[1]))
                procs.append((proc, log_file, out_path, order))
            results = [self._wait(proc, log_file, out_path, label, len(prompts)) for proc, log_file, out_path, _ in procs]
        finally:
            for proc, log_file, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log_file.close()
        result = merge_replicas(results, [order for *_, order in procs], len(prompts))
        result["categories"] = list(groups)
        result["wall_s"] = time.perf_counter() - t0
        result["replicas"] = self.replicas
        return result

    def _wait(self, proc: subprocess.Popen, log_file, out_path: Path, label: str, n_prompts: int) -> dict:
        try:
            proc.wait(timeout=self.startup_timeout + 60 * n_prompts)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0 or not out_path.exists():
            log_file.seek(0)
            raise RuntimeError(f"{self.what}: the vLLM process for {label} failed (exit {proc.returncode}); "
                               f"its last output:\n{log_file.read()[-4000:]}")
        return json.loads(out_path.read_text())


def _add_spec(a: dict | None, b: dict | None) -> dict | None:
    """Two replicas' speculative-decoding counters summed (per position too)."""
    if a is None or b is None:
        return a if b is None else b
    n = max(len(a["accepted_per_pos"]), len(b["accepted_per_pos"]))
    pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
    return {**{k: a[k] + b[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_pos": [x + y for x, y in zip(pad(a["accepted_per_pos"]), pad(b["accepted_per_pos"]))]}


def merge_replicas(results: list[dict], orders: list[list[int]], n_prompts: int) -> dict:
    """The replicas' results as one worker's: tokens back in prompt order (`orders[r]`: the prompt indices of
    replica r's job), counters summed per category group and in all; seconds are the slowest replica's (they
    ran at the same time)."""
    tokens: list = [None] * n_prompts
    for res, order in zip(results, orders):
        for i, t in zip(order, res["tokens"]):
            tokens[i] = t
    groups = []
    for parts in zip(*(res["groups"] for res in results)):
        spec = None
        for part in parts:
            spec = _add_spec(spec, part["spec"])
        groups.append({"spec": spec, "generate_s": max(p["generate_s"] for p in parts),
                       "new_tokens": sum(p["new_tokens"] for p in parts)})
    spec = None
    for res in results:
        spec = _add_spec(spec, res["spec"])
    return {"tokens": tokens, "spec": spec, "groups": groups, "load_s": max(r["load_s"] for r in results),
            "generate_s": max(r["generate_s"] for r in results), "vllm": results[0]["vllm"]}


def rate(res: dict) -> float:
    """A worker run's new tokens per second of vLLM generation (load excluded)."""
    return sum(g["new_tokens"] for g in res["groups"]) / max(res["generate_s"], 1e-9)


def spec_figures(spec: dict, k: int) -> dict[str, Any]:
    """From vLLM's counters: τ = (accepted + drafts) / drafts (tokens per target verification pass), the
    conditional α_d = accepted at d / accepted at d − 1 (as spechead's engine reports it), and the counts."""
    drafts, per_pos = int(spec["num_drafts"]), list(spec["accepted_per_pos"])[:k]
    per_pos += [0] * (k - len(per_pos))
    reached = [drafts, *per_pos[:-1]]
    return {"tau": (spec["num_accepted_tokens"] + drafts) / max(drafts, 1),
            "alpha": [a / r if r else 0.0 for a, r in zip(per_pos, reached)],
            "target_passes": drafts, "accepted_per_pos": per_pos, "num_drafts": drafts}
