"""Greedy generation through real vLLM, plain or speculative, for the serving contract tests
(tests/test_vllm_serving.py). Runs in vLLM's environment (`make vllm-env`), one LLM per process:

    .venv-vllm/bin/python -m inference_eval.vllm_serve_worker <job.json> <result.json>

job: {"target": dir, "prompts": [[token ids]], "max_tokens": n, "dtype": "float32",
      "speculative_config": null | {...}, "max_model_len": int,
      optional: "groups": [[prompt indices]] (generated one group after another, each with its own counters),
      "stop_token_ids": [ids] (stop there; absent: EOS ignored, every prompt gets exactly `max_tokens`),
      "max_num_seqs": n, "tensor_parallel_size": n, "gpu_memory_utilization": f, "llm_kwargs": {...},
      "in_process": null | bool (null: decided by `in_process` below)}
result: {"tokens": [[ids]], "spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
         "accepted_per_pos": [k]} | null, "groups": [{"spec": ... | null, "generate_s", "new_tokens"}],
         "load_s", "generate_s", "vllm", "in_process"}

In process: on vLLM's CPU build with one tensor-parallel rank the engine core and its worker run inside
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's uniprocess executor) instead of two more
processes that each import vLLM again: a served config on 2 cores loads in ≈ 24 s instead of ≈ 66 s and
decoded the same tokens with the same counters as the separate-process path (measured once on the
serving test's mtp1 job); tests/test_vllm_serving.py holds this path to spechead's engine exactly. On CUDA and with tensor parallelism vLLM's own default (separate processes) stays; an
explicit VLLM_ENABLE_V1_MULTIPROCESSING in the environment or "in_process" in the job wins.

Greedy (temperature 0), no prefix caching (evaluation/vllm_eval.py and the serving tests use it). The
acceptance figures are vLLM's own counters from `LLM.get_metrics()`: `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and the per-position vector
`vllm:spec_decode_num_accepted_tokens_per_pos`.
"""

from __future__ import annotations

import json
import os
import sys
import time


COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters of this LLM (`LLM.get_metrics()`)."""
    spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            spec[COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals, acc = list(m.values), spec["accepted_per_pos"]
            spec["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return spec


def counter_delta(after: dict, before: dict) -> dict:
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in COUNTERS.values()}, "accepted_per_pos": per_pos}


def in_process(job: dict, environ: dict | None = None) -> bool:
    """Whether vLLM's engine core runs inside this process (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    if job.get("in_process") is not None:
        return bool(job["in_process"])
    if environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "") != "":
        return environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    if (job.get("tensor_parallel_size") or 1) > 1:
        return False
    import torch

    return not torch.cuda.is_available()


def run(job: dict) -> dict:
    single = in_process(job)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single else "1"  # read when the LLM is built
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    extra = {k: job[k] for k in ("max_num_seqs", "tensor_parallel_size") if job.get(k)}
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
              gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3), max_model_len=job.get("max_model_len", 1024),
              enable_prefix_caching=False, speculative_config=job.get("speculative_config"),
              disable_log_stats=False, **extra, **(job.get("llm_kwargs") or {}))
    load_s = time.perf_counter() - t0
    stops = job.get("stop_token_ids")
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            **({"stop_token_ids": list(stops)} if stops else {}))
    prompts = job["prompts"]
    tokens: list = [None] * len(prompts)
    groups, spec_on = [], bool(job.get("speculative_config"))
    for group in job.get("groups") or [list(range(len(prompts)))]:
        before = spec_counters(llm) if spec_on else None
        if not group:  # a category with no prompt for this replica (evaluate.vllm.data_parallel_size)
            groups.append({"spec": counter_delta(before, before) if spec_on else None, "generate_s": 0.0,
                           "new_tokens": 0})
            continue
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in group], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        for i, o in zip(group, outs):
            tokens[i] = list(o.outputs[0].token_ids)
        groups.append({"spec": counter_delta(spec_counters(llm), before) if spec_on else None, "generate_s": seconds,
                       "new_tokens": sum(len(tokens[i]) for i in group)})
    import vllm

    return {"tokens": tokens, "spec": spec_counters(llm) if spec_on else None, "groups": groups, "load_s": load_s,
            "generate_s": sum(g["generate_s"] for g in groups), "vllm": vllm.__version__, "in_process": single}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    result = run(job)
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
