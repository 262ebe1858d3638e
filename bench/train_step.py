"""Training-step benchmark on SmolLM2's shapes (vocab 49,152, hidden 576). Random weights (shapes are
what matter for speed and memory).

Default: the chunked-KL step vs a naive step that materialises full student and teacher logits. Last line:
`train_step mem_ratio=<peak/naive> speed_ratio=<tok_s/naive> speed_ratio_min=… speed_ratio_max=… speed_ratio_1t=…
… tok_s=<x> naive_tok_s=<y> tokens=<T> other_runnable=<n>`.

`--depth D` (≥ 2): a training-time-test step to depth D (heads/unroll.py, the chunked KL and the hidden
regression at every depth, as train/module.py computes them) with the unroll's attention as one SDPA call
under a block mask (`sdpa`, the default) vs the dense formulation it replaced, which keeps
[B, H, T, T] scores per depth (`dense`, heads/layers.py `dense_unrolled_attention`). Last line:
`train_step depth=<D> seq=<T> mem_ratio=<peak/dense> speed_ratio=<tok_s/dense> tok_s=<x> dense_tok_s=<y>`.

Peak memory: each variant runs in a fresh process; peak RSS during its steps minus the RSS after setup
(weights and inputs allocated), so the figure is what the step itself adds. Speed is the steady state (one
untimed step first, then `--repeats` timed ones) and follows core/timing.py:
the variants' processes alternate (A B, B A, …) for `--rounds` pairs under each thread budget of
`--threads` (default `all,1`: the whole machine, then one thread each — the per-core figure), and
speed_ratio is the median of the pairs' ratios with its min–max (`speed_ratio_min`, `speed_ratio_max`;
the 1-thread figures as `speed_ratio_1t…`); the load seen is printed, and a ratio whose pairs spread more
than the stated bound says so. tok_s figures are the first budget's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.timing import Load, Paired, measure_pairs, thread_settings, warn_if_unstable  # noqa: E402
from heads.layers import Attention, LlamaArgs  # noqa: E402
from heads.unroll import unroll  # noqa: E402
from heads.base import TiedTarget  # noqa: E402
from heads.mtp import MTPConfig, MTPHead  # noqa: E402
from train.losses import fused_linear_kl, hidden_regression, naive_kl  # noqa: E402

SMOLLM2 = LlamaArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def step(head, hidden, ids, chunked: bool, chunk: int) -> None:
    t = hidden.shape[1]
    pred = head(hidden[:, :-1], ids[:, 1:], torch.arange(t - 1).expand(1, t - 1))[0]
    tgt = hidden[0, 1:]
    reg = hidden_regression(pred, tgt)
    if chunked:
        kl, _ = fused_linear_kl(head.features(pred), head.tied.final_norm(tgt), head.tied.lm_head, chunk)
    else:
        kl = naive_kl(pred, tgt, head.logits, head.tied.teacher_logits)
    ((reg + kl) / (t - 1)).backward()


def unrolled_step(head, hidden, ids, depth: int, chunk: int) -> None:
    """Loss of depths 1..D as train/module.py builds it (γ = 1), backward."""
    t = hidden.shape[1]
    total = 0.0
    for d, pred in enumerate(unroll(head, hidden, ids, depth), start=1):
        rows = t - d - 1
        p, tgt = pred[0, :rows], hidden[0, d:d + rows]
        kl, _ = fused_linear_kl(head.features(p, d), head.tied.final_norm(tgt), head.tied.lm_head, chunk)
        total = total + (hidden_regression(p, tgt) + kl) / rows
    total.backward()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(name: str, tokens: int, chunk: int, repeats: int, depth: int = 1) -> tuple[float, int]:
    """In this process: set up, measure RSS, run the steps; return (tok/s, peak RSS growth)."""
    torch.manual_seed(0)
    a = SMOLLM2
    tied = TiedTarget(torch.randn(a.vocab_size, a.hidden_size) * 0.02, torch.randn(a.vocab_size, a.hidden_size) * 0.02,
                      torch.ones(a.hidden_size), a.rms_norm_eps)
    head = MTPHead(a, MTPConfig(), tied)
    head.reset_parameters(0)
    hidden = torch.randn(1, tokens, a.hidden_size)
    ids = torch.randint(0, a.vocab_size, (1, tokens))
    for p in head.parameters():  # allocate grads up front so both variants start equal
        p.grad = torch.zeros_like(p)
    if name in ("sdpa", "dense"):
        Attention.unrolled_impl = name
    base = _rss_bytes()

    def one() -> None:
        if depth > 1:
            unrolled_step(head, hidden, ids, depth, chunk)
        else:
            step(head, hidden, ids, name == "chunked", chunk)

    one()  # warm-up, not timed: the allocator's first touch of the step's buffers and the kernels' selection
    t0 = time.perf_counter()
    for _ in range(repeats):
        one()
    tok_s = repeats * tokens / (time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return tok_s, peak - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    ap.add_argument("--tokens", "--seq", type=int, default=2048, help="tokens per step (one row)")
    ap.add_argument("--depth", type=int, default=1, help="≥ 2: the training-time test's attention, sdpa vs dense")
    ap.add_argument("--rounds", type=int, help="pairs per thread budget (default 2 with --quick, else 3)")
    ap.add_argument("--threads", default="all,1", help="thread budgets measured in turn (default all,1)")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--variant", choices=["chunked", "naive", "sdpa", "dense"], help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        if args.threads.isdigit():
            torch.set_num_threads(int(args.threads))
        print(json.dumps(run_variant(args.variant, args.tokens, args.chunk, args.repeats, args.depth)))
        return
    if args.depth < 1:
        ap.error(f"--depth {args.depth}: expected ≥ 1")
    if args.depth > args.tokens - 2:
        ap.error(f"--depth {args.depth} needs --seq > depth + 1 tokens (got {args.tokens})")
    names = ("sdpa", "dense") if args.depth > 1 else ("chunked", "naive")
    repeats = 1 if args.quick else (2 if args.depth > 1 else 5)
    rounds = args.rounds or (2 if args.quick else 3)
    budgets = thread_settings(args.threads)
    load = Load()
    speeds: dict[int, dict[str, list[float]]] = {n: {name: [] for name in names} for n in budgets}
    peaks: dict[str, int] = {n: 0 for n in names}

    def variant(name: str, n: int):
        def run() -> float:  # seconds per token, timed inside the process (setup left out)
            out = subprocess.run([sys.executable, __file__, "--variant", name, "--tokens", str(args.tokens),
                                  "--chunk", str(args.chunk), "--repeats", str(repeats), "--depth", str(args.depth),
                                  "--threads", str(n)], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"train_step: the {name} variant failed (depth {args.depth}, seq {args.tokens}):\n"
                         f"{out.stderr[-2000:]}")
            tok_s, peak = json.loads(out.stdout.strip().splitlines()[-1])
            speeds[n][name].append(tok_s)
            peaks[name] = max(peaks[name], peak)
            print(f"{n} thread(s) pair {len(speeds[n][name])}/{rounds} {name}: {tok_s:.0f} tok/s, "
                  f"peak +{peak / 2**20:.0f} MiB", flush=True)
            return 1.0 / tok_s
        return run

    (a, b) = names
    ratios: dict[int, Paired] = {}
    for n in budgets:
        t = measure_pairs({name: variant(name, n) for name in names}, rounds, warmup=0, load=load)
        ratios[n] = t.ratio(b, a)  # seconds per token of b / of a: a's speed over b's, pair by pair
        print(f"{n} thread(s): speed ratio {a}/{b} {ratios[n].text(3)}")
        warning = warn_if_unstable("speed_ratio", ratios[n], load, n)
        if warning:
            print(warning)
    print(f"load while timing: {load.text()}")
    speed = " ".join(ratios[n].kv("speed_ratio" + ("" if i == 0 else f"_{n}t")) for i, n in enumerate(budgets))
    a_tok, b_tok = (statistics.median(speeds[budgets[0]][x]) for x in names)
    if args.depth > 1:
        print(f"train_step depth={args.depth} seq={args.tokens} mem_ratio={peaks[a] / peaks[b]:.3f} "
              f"{speed} tok_s={a_tok:.0f} dense_tok_s={b_tok:.0f} "
              f"peak_mib={peaks[a] / 2**20:.0f} dense_peak_mib={peaks[b] / 2**20:.0f} other_runnable={load.median:g}")
    else:
        print(f"train_step mem_ratio={peaks[a] / peaks[b]:.3f} {speed} tok_s={a_tok:.0f} "
              f"naive_tok_s={b_tok:.0f} tokens={args.tokens} other_runnable={load.median:g}")

if __name__ == "__main__":
    main()
