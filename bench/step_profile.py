"""Where a decode step of the eager engine goes (SmolLM2-135M, float32, `--batch` MT-Bench prompts, 1 by default):
the step's time as the difference of two generations ((long − short new tokens) / their difference), the model's
linears alone (`heads.layers.linear` over every linear weight in sequence, one row per sequence: what a step
streams), and every other aten
operator by torch.profiler's self time per step, measured the same way (the two generations' difference). The rest
is the step's Python. `--quick`: 8 and 24 new tokens.

Last line:
`step_profile batch=<b> threads=<n> step_ms=<a> linears_ms=<b> other_ops_ms=<c> rest_ms=<a-b-c> ops_per_step=<n>`
for each thread count."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.timing import thread_budget, thread_settings  # noqa: E402


def load(batch: int):
    import transformers

    from data.assets import ensure_smollm2_checkpoint
    from data.prompts import mtbench_prompts
    from inference_eval.model import LlamaForCausalLM

    path = ensure_smollm2_checkpoint()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, device=torch.device("cpu"))
    return target, [p["ids"] for p in mtbench_prompts(tok, batch)]


def generate(target, prompts, n: int) -> float:
    from inference_eval.engine import engine_generate

    t0 = time.perf_counter()
    engine_generate(target, prompts, n, max_batch=len(prompts), max_seq_len=max(map(len, prompts)) + n + 8)
    return time.perf_counter() - t0


def linears_ms(target, rows: int, repeats: int = 7) -> float:
    from heads.layers import linear

    ws = list({id(m.weight): m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)}.values())
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in ws}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for w in ws:
                linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[repeats // 2] * 1e3


def ops_per_step(target, prompts, short: int, long: int) -> tuple[float, float, list[tuple[float, str]]]:
    """aten self time (ms) and operator calls per step, and the largest operators, from two profiled generations."""
    from torch.profiler import ProfilerActivity, profile

    got = {}
    for n in (short, long):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            generate(target, prompts, n)
        got[n] = {e.key: (e.self_cpu_time_total, e.count) for e in p.key_averages()}
    steps = long - short
    rows = [((t - got[short].get(k, (0, 0))[0]) / steps / 1e3, (c - got[short].get(k, (0, 0))[1]) / steps, k)
            for k, (t, c) in got[long].items()]
    return sum(r[0] for r in rows), sum(r[1] for r in rows), sorted(((r[0], r[2]) for r in rows), reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", default="all,1")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (MT-Bench prompts)")
    args = ap.parse_args()
    short, long = (8, 24) if args.quick else (8, 40)
    target, prompts = load(args.batch)
    last = ""
    for threads in thread_settings(args.threads):
        with thread_budget(threads):
            generate(target, prompts, 4)  # warm
            step = (generate(target, prompts, long) - generate(target, prompts, short)) / (long - short) * 1e3
            lin = linears_ms(target, len(prompts))
            other, calls, top = ops_per_step(target, prompts, short, long)
            print(f"{threads} thread(s): step {step:.1f} ms = linears {lin:.1f} + other aten operators {other:.1f} "
                  f"({calls:.0f} calls; largest: " + ", ".join(f"{k} {t:.2f}" for t, k in top[:4]) +
                  f") + the rest {step - lin - other:.1f}", flush=True)
            last = (f"step_profile batch={len(prompts)} threads={threads} step_ms={step:.1f} linears_ms={lin:.1f} "
                    f"other_ops_ms={other:.1f} "
                    f"rest_ms={step - lin - other:.1f} ops_per_step={calls:.0f}")
            print(last, flush=True)
    print(last)


if __name__ == "__main__":
    main()
