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

from inference_eval.vllm_backend import check_vllm_version, vllm_python, vllm_version

log = logging.getLogger(__name__)


class VLLMRunner:
    """One vLLM process per job (a worker run): the target, the decoding settings, the environment.
    `vcfg`: an `evaluate.vllm`-shaped section (python, tensor_parallel_size, gpu_memory_utilization,
    cpu_kvcache_space_gb, startup_timeout_s, env, llm_kwargs); `what`: the setting that asked for vLLM, named
    in errors; `max_prompt_tokens`: the longest prompt a job will hold (vLLM's max_model_len follows)."""

    def __init__(self, vcfg: Any, target_dir: Path, dtype: str, max_new_tokens: int, max_num_seqs: int,
                 max_prompt_tokens: int, stops: set[int], work: Path, what: str = "evaluate.engine=vllm",
                 setting: str = "evaluate.vllm") -> None:
        self.what = what
        self.python = vllm_python(vcfg.get("python"), f"{setting}.python", what)
        self.work, self.target_dir = Path(work), Path(target_dir)
        self.max_new = int(max_new_tokens)
        self.base = {"target": str(target_dir), "dtype": str(dtype), "max_tokens": self.max_new,
                     "stop_token_ids": sorted(stops), "max_num_seqs": int(max_num_seqs),
                     "tensor_parallel_size": int(vcfg.get("tensor_parallel_size", 1)),
                     "gpu_memory_utilization": float(vcfg.get("gpu_memory_utilization", 0.9)),
                     "max_model_len": int(max_prompt_tokens) + self.max_new + 8,
                     "llm_kwargs": dict(vcfg.get("llm_kwargs") or {})}
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(vcfg.get("cpu_kvcache_space_gb", 1)),
                    **{k: str(v) for k, v in (vcfg.get("env") or {}).items()}}
        self.startup_timeout = float(vcfg.get("startup_timeout_s", 900))
        self.runs = 0
        self.version = vllm_version(self.python)
        check_vllm_version(self.version, what)

    def run(self, prompts: list[dict[str, Any]], spec: dict | None, label: str) -> dict:
        """`prompts`: {"ids", optional "category"}; the result: the worker's (tokens, vLLM's counters per
        category group and in all, seconds) plus `categories` and `wall_s`."""
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(p.get("category", "all"), []).append(i)
        job = {**self.base, "prompts": [p["ids"] for p in prompts], "groups": list(groups.values()),
               "speculative_config": spec}
        self.runs += 1
        job_path, out_path = self.work / f"job-{self.runs}.json", self.work / f"result-{self.runs}.json"
        job_path.write_text(json.dumps(job))
        t0 = time.perf_counter()
        log.info("%s %s: one vLLM process over %d prompts%s", self.what, label, len(prompts),
                 f", {spec['method']} k={spec['num_speculative_tokens']}" if spec else ", plain decoding")
        proc = subprocess.run([str(self.python), "-m", "inference_eval.vllm_serve_worker", str(job_path), str(out_path)],
                              env=self.env, capture_output=True, text=True,
                              timeout=self.startup_timeout + 60 * len(prompts),
                              cwd=str(Path(__file__).resolve().parents[1]))
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"{self.what}: the vLLM process for {label} failed (exit {proc.returncode}); "
                               f"its last output:\n{(proc.stdout + proc.stderr)[-4000:]}")
        result = json.loads(out_path.read_text())
        result["categories"] = list(groups)
        result["wall_s"] = time.perf_counter() - t0
        return result


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
