"""Generation through vLLM for regeneration's `vllm` backend (data/regenerate.py): a process in vLLM's own
environment (`make vllm-env`) that holds the target in vLLM (tensor parallel over
`tensor_parallel_size` devices) and answers batches of prompts with continuous batching.

Run by `inference_eval/vllm_backend.py` `VLLMGenerator` as `<.venv-vllm>/bin/python -m
inference_eval.vllm_generate_worker '<init json>'`; the protocol is precompute's worker's
(inference_eval/vllm_worker.py): JSON lines, replies on the original stdout, `{"ready": true, "vllm": ...}`
first. A request `{"prompts": [[ids]], "max_tokens": n, "stop_token_ids": [ids], "temperature": t,
"top_p": p, "top_k": k, "seeds": [per prompt] | null}` is answered `{"ok": true, "tokens": [[ids]], "generate_s": s,
"spec": counters | null}`: each reply as generated, its stop token included when it stopped on one (EOS is not
special: the stop set is the caller's); `generate_s` the seconds of vLLM's `generate` call alone; `spec` vLLM's
speculative-decoding counters of this request (inference_eval/vllm_serve_worker.py `spec_counters`) when the init
carries a `speculative_config` (a draft served beside the target; bench/engine.py's vLLM side). No prefix caching,
so a reply does not depend on what ran before it.
"""

from __future__ import annotations

import time

from inference_eval.vllm_serve_worker import counter_delta, spec_counters
from inference_eval.vllm_worker import serve


def load(init: dict):
    import torch
    from vllm import LLM

    kwargs = dict(init.get("llm_kwargs") or {})
    kwargs.setdefault("enforce_eager", not torch.cuda.is_available())  # the CPU build runs eagerly
    spec = init.get("speculative_config")
    if spec:  # the counters come from the metrics that stats logging keeps
        kwargs.update(speculative_config=spec, disable_log_stats=False)
    return LLM(model=init["model"], dtype=init["dtype"], seed=0, enable_prefix_caching=False,
               max_model_len=init["max_model_len"], tensor_parallel_size=init.get("tensor_parallel_size", 1),
               gpu_memory_utilization=init.get("gpu_memory_utilization", 0.3), **kwargs)


def answer(llm, spec_on: bool, req: dict) -> dict:
    """One request's reply: the tokens, the seconds of the generate call, the request's counters (`spec_on`: a
    draft is served)."""
    before = spec_counters(llm) if spec_on else None
    t0 = time.perf_counter()
    tokens = generate(llm, req)
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "generate_s": seconds,
            "spec": counter_delta(spec_counters(llm), before) if spec_on else None}


def generate(llm, req: dict) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    seeds = req.get("seeds") or [None] * len(req["prompts"])
    temperature = float(req.get("temperature", 0.0))
    params = [SamplingParams(temperature=temperature, top_p=float(req.get("top_p", 1.0)) if temperature else 1.0,
                             top_k=int(req.get("top_k", 0)) or -1 if temperature else -1, max_tokens=int(req["max_tokens"]),
                             stop_token_ids=list(req.get("stop_token_ids") or []), ignore_eos=True, seed=seed)
              for seed in seeds]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    serve(lambda init: (load(init), bool(init.get("speculative_config"))), lambda state: {},
          lambda state, req: answer(*state, req))


if __name__ == "__main__":
    main()
