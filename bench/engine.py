"""Engine benchmark on the real target (SmolLM2-135M-Instruct), one process, one dtype for all paths.

- plain decoding: the engine (`inference_eval.engine.Engine`, paged cache, continuous batching) vs HF
  `generate` (greedy, left-padded batch with an attention mask, `min_new_tokens` = `max_new_tokens` so
  both emit the same number of tokens; the engine ignores stop ids too), on MT-Bench first turns
  through the chat template, at batch 1 and at batch 8 — tokens/s = generated tokens / wall time;
- speculative decoding in the engine at batch 1 with a trained head (`--head`, a native checkpoint
  or an export; default: the mtp head of the ablation run), k = 1..4: wall-clock speedup over the
  engine's plain decoding on the same prompts, and τ — drafting over the whole vocabulary, and
  (`--draft-vocab N`, FR-Spec style) over the N most frequent assistant tokens of ShareGPT
  conversations 0–299 (the head's lm_head pass is a 49,152 × 576 matrix per draft token, a quarter of
  the target's per-token cost on CPU; N = 8,192 cuts it six-fold).

Timing is paired because these machines are shared and their speed swings: every measurement runs
all paths back to back on the same prompts, `--rounds` times in rotating order, and a ratio is the
median over rounds. Models are warmed up first; loading and tokenization are not timed.
Last line: `engine plain_vs_hf_b1=<x> plain_vs_hf_b8=<y> spec_speedup_b1=<s> tau=<t> k=<k> draft_vocab=<n>`
for the (k, draft vocabulary) with the best speedup (draft_vocab 0: the whole vocabulary); per-k
figures are printed above it.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_eval.engine import engine_generate  # noqa: E402

DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "runs/ablation/heads/mtp"


def hf_generate(model, tokenizer, prompts: list[list[int]], new: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=pad)
    out = out.cpu()  # waits for the device
    seconds = time.perf_counter() - t0
    assert out.shape[1] == width + new
    return seconds


def ours(target, prompts: list[list[int]], new: int, proposer=None, k: int = 1):
    t0 = time.perf_counter()
    out, eng = engine_generate(target, prompts, new, proposer=proposer, k=k, max_batch=len(prompts),
                               max_seq_len=max(len(p) for p in prompts) + new + 8)
    seconds = time.perf_counter() - t0
    assert all(len(o) == new for o in out)
    return seconds, eng.stats


def assistant_counts(tokenizer, vocab_size: int, conversations: int = 300) -> torch.Tensor:
    """Token frequencies of the assistant turns of ShareGPT conversations 0..n-1 (the training data's
    range, not MT-Bench)."""
    from collections import Counter

    from omegaconf import OmegaConf

    from data.precompute import tokenize_all
    from data.sources import load_conversations

    convs = load_conversations(OmegaConf.create({"source": "sharegpt", "max_samples": conversations, "skip": 0}))
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for _, ids, mask in tokenize_all(tokenizer, convs.items, 2048, Counter()):
        ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds (under a minute)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype of every path (CPU: float32 is the faster one)")
    ap.add_argument("--head", default=str(DEFAULT_HEAD), help="trained head for the speculative figures")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--device", default="auto", help="target.device for every path (auto: CUDA when there, else cpu)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="also draft over the N most frequent tokens (0: off)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for every path (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.new_tokens, args.rounds, args.ks = 24, 1, "1,3"
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import transformers

    from data.assets import ensure_smollm2_checkpoint
    from heads.export import load_any
    from inference_eval.evaluate import mtbench_prompts
    from inference_eval.engine import PagedHeadProposer, frequent_ids
    from inference_eval.model import LlamaForCausalLM, resolve_device, tied_target

    dtype = getattr(torch, args.dtype)
    path = ensure_smollm2_checkpoint()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    device = resolve_device(args.device)
    target = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    prompts = [p["ids"] for p in mtbench_prompts(tok, 8)]
    new = args.new_tokens
    print(f"SmolLM2-135M {args.dtype} on {device}, {torch.get_num_threads()} threads, {new} new tokens, "
          f"prompts {[len(p) for p in prompts]}")
    ours(target, prompts[:2], 4)  # warm-up
    hf_generate(hf, tok, prompts[:2], 4)

    ratios: dict[str, list[float]] = {"b1": [], "b8": []}
    for r in range(args.rounds):
        for name, batch in (("b1", prompts[:1]), ("b8", prompts)):
            runs = [lambda: ours(target, batch, new)[0], lambda: hf_generate(hf, tok, batch, new)]
            if r % 2:
                runs.reverse()
            a, b = (f() for f in runs)
            t_ours, t_hf = (a, b) if r % 2 == 0 else (b, a)
            ratios[name].append(t_hf / t_ours)
            n = len(batch) * new
            print(f"round {r} {name}: engine {n / t_ours:.1f} tok/s, HF generate {n / t_hf:.1f} tok/s, "
                  f"ratio {t_hf / t_ours:.2f}")

    best = {"k": 0, "speedup": float("nan"), "tau": float("nan"), "vocab": 0}
    head_dir = Path(args.head)
    if (head_dir / "config.json").exists():
        tied, targs, _ = tied_target(path, dtype, device)
        head = load_any(head_dir, tied, targs).to(device, dtype).eval()
        variants = {0: None}
        if args.draft_vocab:
            variants[args.draft_vocab] = frequent_ids(assistant_counts(tok, targs.vocab_size), args.draft_vocab)
        for k in [int(x) for x in args.ks.split(",")]:
            for nv, vocab in variants.items():
                speedups, taus = [], []
                for r in range(args.rounds):
                    for p in prompts[: 2 if args.quick else 4]:
                        t_plain = ours(target, [p], new)[0]
                        t_spec, st = ours(target, [p], new, PagedHeadProposer(head, vocab), k)
                        speedups.append(t_plain / t_spec)
                        taus.append(st.tau)
                sp, tau = statistics.median(speedups), statistics.mean(taus)
                print(f"speculative b1 k={k} draft_vocab={nv or 'all'}: speedup {sp:.2f}x over plain engine "
                      f"decoding, tau {tau:.3f}")
                if not sp <= best["speedup"]:  # also replaces nan
                    best = {"k": k, "speedup": sp, "tau": tau, "vocab": nv}
    else:
        print(f"no trained head at {head_dir}: speculative figures skipped (train one: "
              f"python -m scripts.ablation experiment=ablation, or pass --head)")
    print(f"engine plain_vs_hf_b1={statistics.median(ratios['b1']):.3f} plain_vs_hf_b8={statistics.median(ratios['b8']):.3f} "
          f"spec_speedup_b1={best['speedup']:.3f} tau={best['tau']:.3f} k={best['k']} draft_vocab={best['vocab']}")


if __name__ == "__main__":
    main()
