"""Greedy generation through real vLLM, plain or speculative, for the serving contract tests
(tests/test_vllm_serving.py). Runs in vLLM's environment (`make vllm-env`), one LLM per process:

    .venv-vllm/bin/python -m inference_eval.vllm_serve_worker <job.json> <result.json>

job: {"target": dir, "prompts": [[token ids]], "max_tokens": n, "dtype": "float32",
      "speculative_config": null | {...}, "max_model_len": int}
result: {"tokens": [[ids]], "spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
         "accepted_per_pos": [k]} | null, "load_s", "generate_s", "vllm"}

Greedy (temperature 0), EOS ignored (every prompt gets exactly `max_tokens`), no prefix caching. The
acceptance figures are vLLM's own counters from `LLM.get_metrics()`: `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and the per-position vector
`vllm:spec_decode_num_accepted_tokens_per_pos`.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
              gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3), max_model_len=job.get("max_model_len", 1024),
              enable_prefix_caching=False, speculative_config=job.get("speculative_config"),
              disable_log_stats=False)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    spec = None
    if job.get("speculative_config"):
        spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
        names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
        for m in llm.get_metrics():
            if m.name in names:
                spec[names[m.name]] += int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                vals = list(m.values)
                acc = spec["accepted_per_pos"]
                spec["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    import vllm

    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "spec": spec, "load_s": load_s,
            "generate_s": gen_s, "vllm": vllm.__version__}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    result = run(job)
    with open(sys.argv[2], "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
