"""Training-step benchmark on SmolLM2's shapes (vocab 49,152, hidden 576): the chunked-KL step vs a
naive step that materialises full student and teacher logits. Random weights (shapes are what
matter for speed and memory). Last line:
`train_step mem_ratio=<peak/naive> speed_ratio=<tok_s/naive> tok_s=<x> naive_tok_s=<y> tokens=<T>`.
Peak memory: each variant runs in a fresh process; peak RSS during its steps minus the RSS after
setup (weights and inputs allocated), so the figure is what the step itself adds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heads.layers import LlamaArgs  # noqa: E402
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(name: str, tokens: int, chunk: int, repeats: int) -> tuple[float, int]:
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
    base = _rss_bytes()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(head, hidden, ids, name == "chunked", chunk)
    tok_s = repeats * tokens / (time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return tok_s, peak - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.chunk, args.repeats)))
        return
    repeats = 2 if args.quick else 5
    result = {}
    for name in ("chunked", "naive"):
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--tokens", str(args.tokens),
                              "--chunk", str(args.chunk), "--repeats", str(repeats)],
                             capture_output=True, text=True, check=True)
        result[name] = tuple(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{name}: {result[name][0]:.0f} tok/s, peak +{result[name][1] / 2**20:.0f} MiB", flush=True)
    (c_tok, c_mem), (n_tok, n_mem) = result["chunked"], result["naive"]
    print(f"train_step mem_ratio={c_mem / n_mem:.3f} speed_ratio={c_tok / n_tok:.3f} tok_s={c_tok:.0f} "
          f"naive_tok_s={n_tok:.0f} tokens={args.tokens}")


if __name__ == "__main__":
    main()
