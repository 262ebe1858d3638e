"""`round_cost`: a speculative round's cost in plain decoding steps, measured (evaluate's predicted speedup and
bench/engine.py)."""

from __future__ import annotations

import statistics
import time

import torch

from inference_eval.engine.proposers import engine_proposer
from inference_eval.engine.scheduler import Engine
from inference_eval.speculative import SpecStats


def round_cost(target, proposer, k: int, prompts: list[list[int]], max_new_tokens: int,
               stop_ids=frozenset(), **engine_kw) -> dict[str, float]:
    """The cost of a speculative round in plain decoding steps, and the speedup it predicts.

    For each prompt, one engine decodes plainly and one speculatively (batch 1, greedy), their steps
    interleaved — a plain step, a round, a plain step, … — each timed alone, the prefill steps left out.
    cost = median round / median plain step: the target's verify of k + 1 tokens and the drafts, in
    units of one plain decoding step, measured a few milliseconds apart so that a load on the machine
    slows both alike; medians over many steps shrug off a preempted one. predicted_speedup = τ / cost,
    τ of the same rounds (prefill and the host's scheduling outside the steps are not in it)."""
    proposer = engine_proposer(proposer)
    sync = torch.cuda.synchronize if target.model.embed_tokens.weight.device.type == "cuda" else (lambda: None)
    plain_s: list[float] = []
    round_s: list[float] = []
    stats = SpecStats(k=k)
    for prompt in prompts:
        room = -(-(len(prompt) + max_new_tokens + 2 * proposer.lookahead(k) + 32) // 16)
        plain = Engine(target, None, k=1, max_batch=1, num_blocks=room, **engine_kw)
        spec = Engine(target, proposer, k=k, max_batch=1, num_blocks=room, **engine_kw)
        for eng in (plain, spec):
            eng.add_request(prompt, max_new_tokens, stop_ids)
            eng.step()  # the prefill (and, speculatively, the first round): not timed
        stats_before = SpecStats(k=spec.k)
        stats_before.merge(spec.stats)
        while spec.has_work and plain.has_work:
            for eng, out in ((plain, plain_s), (spec, round_s)):
                sync()
                t0 = time.perf_counter()
                eng.step()
                sync()
                out.append(time.perf_counter() - t0)
        spec.run()
        stats.steps += spec.stats.steps - stats_before.steps
        stats.emitted += spec.stats.emitted - stats_before.emitted
    if not plain_s:
        raise ValueError("round_cost: no decoding steps to time (max_new_tokens too small?)")
    cost = statistics.median(round_s) / statistics.median(plain_s)
    return {"plain_step_s": statistics.median(plain_s), "round_s": statistics.median(round_s), "cost": cost,
            "tau": stats.tau, "predicted_speedup": stats.tau / cost, "rounds": len(round_s)}
