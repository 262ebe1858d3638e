"""The adaptive draft length's worth: a DSpark head (`--head`, a native checkpoint or an export) drafting k tokens a
round, with its confidence head ending each sequence's block early at every threshold of `--stop-below` (the
engine's `PagedBlockProposer(head, stop_below)`, `evaluate.stop_below`) and without, beside plain decoding — every
side paired and alternated on the same prompts (evaluation/evaluate.py `evaluate_paired`: the MT-Bench first turns in
`--pairs` groups, all sides back to back on each group, the order rotating), so a busy machine moves every side alike.
Per side: τ (tokens per target pass), α_d, and the speedup over plain decoding (median of the groups' ratios,
min–max). Greedy: every side emits what plain greedy decoding emits (token counts checked). The target is the
packaged SmolLM2 in `--dtype` (the head's dtype must match its training: float32 for the peer-comparison heads).

Last line: `adaptive_draft k=<k> prompts=<n> tau_full=<t> speedup_full=<s> tau_<p>=<t> speedup_<p>=<s> ...
best=<full|p>` — `full` is k drafts every round, `<p>` a threshold.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifacts.export import load_any  # noqa: E402
from data.assets import ensure_smollm2_checkpoint  # noqa: E402
from data.conversations import load_tokenizer  # noqa: E402
from data.prompts import mtbench_prompts, stop_token_ids  # noqa: E402
from evaluation.evaluate import evaluate_paired  # noqa: E402
from inference_eval.engine import PagedBlockProposer  # noqa: E402
from inference_eval.model import LlamaForCausalLM, tied_from_model  # noqa: E402
from inference_eval.speculative import GREEDY  # noqa: E402


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="a dspark head: native checkpoint or export directory")
    p.add_argument("--k", type=int, default=7, help="drafts per round (at most the head's block size - 1)")
    p.add_argument("--stop-below", type=float, nargs="+", default=[0.5, 0.2], help="thresholds in (0, 1)")
    p.add_argument("--prompts", type=int, default=24, help="MT-Bench first turns")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--pairs", type=int, default=4, help="groups of prompts, every side timed on each")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="4 prompts, 16 new tokens, 2 groups (under a minute)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new, args.pairs = 4, 16, 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    target_dir = ensure_smollm2_checkpoint()
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, args.dtype))
    head = load_any(args.head, tied_from_model(target), target.args).eval()
    if not hasattr(head, "confidence_head"):
        raise SystemExit(f"--head {args.head}: a {head.kind} head has no confidence head (a dspark head has)")
    tokenizer = load_tokenizer(target_dir)
    stops = stop_token_ids(tokenizer)
    prompts = mtbench_prompts(tokenizer, args.prompts, 1, target, args.max_new, stops)
    runs = {"full": (PagedBlockProposer(head), args.k)}
    runs |= {f"{s:g}": (PagedBlockProposer(head, s), args.k) for s in args.stop_below}
    results, plain = evaluate_paired(target, runs, prompts, args.max_new, stops, 1, GREEDY, args.pairs, warmup=1)
    fields = [f"k={args.k}", f"prompts={len(prompts)}"]
    for label, (res, outputs, speed) in results.items():
        assert res.new_tokens == plain.new_tokens, f"{label}: {res.new_tokens} tokens, plain {plain.new_tokens}"
        logging.info("%s: tau %.3f alpha [%s] %.2fx plain [%.2f–%.2f] %s", label, res.tau,
                     " ".join(f"{a:.2f}" for a in res.alpha), speed.median, speed.lo, speed.hi, speed.verdict())
        fields += [f"tau_{label}={res.tau:.3f}", f"speedup_{label}={speed.median:.2f}",
                   f"speedup_{label}_min={speed.lo:.2f}", f"speedup_{label}_max={speed.hi:.2f}"]
    best = max(results, key=lambda label: results[label][2].median)
    line = "adaptive_draft " + " ".join(fields) + f" best={best}"
    print(line)
    return line


if __name__ == "__main__":
    main()
