"""Engine benchmark on the real target (SmolLM2-135M-Instruct), one process.

- plain decoding: the engine (`inference_eval.engine.Engine`, paged cache, continuous batching) in
  `--dtype` vs HF `generate` in float32 AND bfloat16 (greedy, left-padded batch with an attention mask,
  `min_new_tokens` = `max_new_tokens` so both emit the same number of tokens; the engine ignores stop
  ids too), on MT-Bench first turns through the chat template, at batch 1 and at batch 8 — tokens/s =
  generated tokens / wall time. The summary compares against HF at its faster dtype in each round
  (its best configuration on this machine); the same-dtype ratios are printed above it;
- speculative decoding in the engine at batch 1 with a trained head (`--head`, a native checkpoint
  or an export; default: the mtp head of the ablation run): the configured proposer — `--k` drafts
  (default 1: the seed's k = 1 schedule, `Engine._k1_round`) over the `--draft-vocab` most frequent
  assistant tokens of ShareGPT conversations 0–299 (FR-Spec style; 0: the whole vocabulary) — gives
  the summary's speedup over the engine's plain decoding on the same prompts (median) and its pooled
  τ (emitted tokens / target passes). Other k and vocabularies (`--ks`, each with its round's cost in plain
  steps, and compiled with `--compile`), and at k = 1 the generic chain round that reads drafts and acceptance on
  the host, are printed above the summary. A block head (dflash, dspark) drafts through the engine's block
  proposer, over its own vocabulary (`--draft-vocab` does not apply).

- vLLM's CPU build (`make vllm-env`; `--vllm auto`: when `.venv-vllm` is there and not `--quick`) as a side of
  the same pairs: plain decoding at batch 1 and 8 beside the engine's, and speculative decoding at batch 1 with the
  same head exported in the format vLLM serves it (our plugin for an `mtp` head) at the configured k, beside the
  engine's configured proposer. vLLM runs in its best CPU configuration: its engine core in the worker process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), eager (the CPU build), its OpenMP threads bound to the budget's cores
  (`VLLM_CPU_OMP_THREADS_BIND`) and the whole process on them (its affinity: the variable alone left a thread of its
  GEMMs on another core, a one-thread side then decoding on two), one kept worker per configuration and thread budget
  (inference_eval/vllm_generate_worker.py), greedy, every reply `--new-tokens` long, no prefix caching; a side's
  seconds are vLLM's `generate` call (the request's JSON round trip excluded, as the engine's side excludes its
  loading). Its start (the process, the target, the draft) is timed apart and printed, not in any ratio. τ of both
  sides is printed (vLLM's from its own counters: (accepted + drafts) / drafts).

- `--compile`: the engine's plain decoding through its compiled static step (`Engine(compile="on")`,
  inference_eval/engine/static.py) as one more side of the plain-decoding pairs, every shape bucket compiled in the
  warm-up (the compile seconds printed apart): `compiled_vs_eager_b1=… compiled_vs_eager_b8=…` (the eager step's
  seconds / the compiled one's, > 1 = compiling pays); with a head, the speculative rounds too, eager against
  compiled (`spec_compiled_vs_eager_b1=…`), and a compiled round's cost in compiled plain steps
  (`round_cost_compiled=…`, beside the eager `round_cost=…`).

- `--weights-bf16`: one more engine side, the float32 target with its linear weights stored in bf16
  (`LlamaForCausalLM.store_weights`: W16A32, every product and sum in fp32, half the bytes a decode step streams):
  in the plain-decoding pairs (`w16_vs_w32_b1=…` the fp32-weight engine's seconds / its own, `w16_vs_hf_b1=…`
  against HF's best dtype, `w16_vs_vllm_b1=…`) and its speculative rounds, the head's weights stored in bf16 too
  (`DraftHead.store_weights`), over its own plain decoding (`spec_speedup_b1_w16=…`, `round_cost_w16=…`,
  `tau_w16=…`: greedy tokens of a bf16-weight target differ a little from the fp32 one's). `--vllm-dtype bfloat16`
  runs vLLM with bf16 weights as well.

Timing follows core/timing.py: every measurement runs its sides back to back on the same prompts,
`--rounds` pairs in alternating order, under each thread budget of `--threads` (default `all,1`: the
whole machine, then one thread per side — the per-core figure, the one that stays put on a shared
machine); a ratio is the median of the pairs' ratios with its min–max, the load seen is printed, and a
figure whose pairs spread more than the stated bound says so. Beside the measured speedup, a
prediction that load does not move: the cost of a round in plain-step units (`inference_eval.engine.
round_cost`: plain steps and rounds interleaved, medians), and τ ÷ cost. Models are warmed up first;
loading and tokenization are not timed.
Last line: `engine plain_vs_hf_b1=<x> plain_vs_hf_b1_min=… _max=… plain_vs_hf_b8=<y> … spec_speedup_b1=<s> …
spec_speedup_b1_1t=<s> … plain_vs_vllm_b1=… plain_vs_vllm_b8=… spec_vs_vllm_b1=… predicted_speedup_b1=<p>
round_cost=<c> tau=<t> tau_vllm=<t> k=<k> draft_vocab=<n> other_runnable=<n>` (the `_1t` figures: every side on one
thread; `*_vs_vllm_*`: vLLM's seconds / the engine's, > 1 = the engine faster).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.timing import Load, Paired, measure_pairs, thread_budget, thread_settings, warn_if_unstable  # noqa: E402
from inference_eval.engine import engine_generate, round_cost  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HEAD = ROOT / "runs/ablation/heads/mtp"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


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


def ours(target, prompts: list[list[int]], new: int, proposer=None, k: int = 1, **engine_kw):
    """(seconds, the engine's stats, the compiled step or None) of one engine generating `new` tokens per prompt; the
    seconds spent compiling a new shape bucket of its static step are not in them."""
    t0 = time.perf_counter()
    out, eng = engine_generate(target, prompts, new, proposer=proposer, k=k, max_batch=len(prompts),
                               max_seq_len=max(len(p) for p in prompts) + new + 8, **engine_kw)
    seconds = time.perf_counter() - t0 - eng.compile_s
    assert all(len(o) == new for o in out)
    return seconds, eng.stats, eng.static


def vllm_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a budget of `threads`: the first cores this process may run on."""
    import os

    cores = sorted(os.sched_getaffinity(0))[:max(int(threads), 1)]
    return ",".join(str(c) for c in cores)


class VllmSides:
    """vLLM's two workers for one thread budget: the target alone, and the target with the exported head (k drafts);
    started side by side, the start timed apart."""

    def __init__(self, target_dir: Path, dtype: str, longest: int, threads: int, served: tuple[Path, str] | None,
                 k: int) -> None:
        from inference_eval.vllm_backend import VllmSettings, VLLMGenerator

        settings = VllmSettings("bench.vllm", python=str(VLLM_PYTHON),
                                env={"VLLM_CPU_OMP_THREADS_BIND": vllm_bind(threads),
                                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"})
        t0 = time.perf_counter()
        spec = None if served is None else {"method": served[1], "model": str(served[0]), "num_speculative_tokens": k}
        self.plain = VLLMGenerator.for_target(settings, target_dir, getattr(torch, dtype), longest)
        self.spec = (VLLMGenerator.for_target(settings, target_dir, getattr(torch, dtype), longest, spec)
                     if spec else None)
        self.start_s = time.perf_counter() - t0
        self.counts = {"num_drafts": 0, "num_accepted_tokens": 0}

    def plain_s(self, prompts: list[list[int]], new: int) -> float:
        reply = self.plain.generate_timed(prompts, new)
        assert all(len(t) == new for t in reply["tokens"])
        return float(reply["generate_s"])

    def spec_s(self, prompts: list[list[int]], new: int) -> float:
        reply = self.spec.generate_timed(prompts, new)
        assert all(len(t) == new for t in reply["tokens"])
        for key in self.counts:
            self.counts[key] += int(reply["spec"][key])
        return float(reply["generate_s"])

    def tau(self) -> float:
        """vLLM's τ over the timed speculative requests: (accepted + drafts) / drafts, from its counters."""
        return (self.counts["num_accepted_tokens"] + self.counts["num_drafts"]) / max(self.counts["num_drafts"], 1)

    def close(self) -> None:
        for gen in (self.plain, self.spec):
            if gen is not None:
                gen.close()


def assistant_counts(tokenizer, vocab_size: int, conversations: int = 300) -> torch.Tensor:
    """Token frequencies of the assistant turns of ShareGPT conversations 0..n-1 (the training data's
    range, not MT-Bench)."""
    from collections import Counter

    from data.precompute import tokenize_all
    from data.sources import DataConfig, load_conversations

    convs = load_conversations(DataConfig(max_samples=conversations))
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for _, ids, mask in tokenize_all(tokenizer, convs.items, 2048, Counter()):
        ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="24 new tokens, 2 pairs, 2 prompts, the configured k only (≈ 1–2 min on 2 cores)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="pairs per measurement and thread budget")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the engine's compute dtype (CPU: float32 is its faster one); HF runs in both")
    ap.add_argument("--head", default=str(DEFAULT_HEAD), help="trained head for the speculative figures")
    ap.add_argument("--k", type=int, default=1, help="the configured proposer's k (the summary line's figures)")
    ap.add_argument("--ks", default="1,2,3,4", help="other k printed above the summary line")
    ap.add_argument("--device", default="auto", help="target.device for every path (auto: CUDA when there, else cpu)")
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="the configured proposer drafts over the N most frequent tokens (0: the whole vocabulary)")
    ap.add_argument("--threads", default="all,1",
                    help="thread budgets, every path alike, measured in turn (default all,1: whole machine, per core)")
    ap.add_argument("--compile", action="store_true",
                    help="the engine's compiled static decode step as a side of the plain-decoding pairs")
    ap.add_argument("--weights-bf16", action="store_true",
                    help="the engine with its target's linear weights stored in bf16 (W16A32) as one more side")
    ap.add_argument("--vllm-dtype", default=None, choices=["float32", "bfloat16"],
                    help="vLLM's dtype (default: the engine's --dtype); bfloat16 beside --weights-bf16 compares bf16 "
                         "weights on both sides")
    ap.add_argument("--vllm", default="auto", choices=["auto", "on", "off"],
                    help="vLLM's build in .venv-vllm as a side (auto: when installed and not --quick)")
    args = ap.parse_args()
    budgets = thread_settings(args.threads)
    if args.weights_bf16 and args.dtype != "float32":
        ap.error("--weights-bf16 stores a float32 target's weights in bf16: it needs --dtype float32")
    if args.vllm == "on" and not VLLM_PYTHON.exists():
        ap.error(f"--vllm on: {VLLM_PYTHON} is missing (`make vllm-env`)")
    with_vllm = args.vllm == "on" or (args.vllm == "auto" and VLLM_PYTHON.exists() and not args.quick)
    if args.quick:
        args.new_tokens, args.rounds, args.ks = 24, 2, ""  # the configured k only
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import transformers

    from data.assets import ensure_smollm2_checkpoint
    from artifacts.export import load_any
    from data.prompts import mtbench_prompts
    from inference_eval.engine import PagedBlockProposer, PagedHeadProposer, frequent_ids
    from inference_eval.model import LlamaForCausalLM, resolve_device, tied_target

    dtype = getattr(torch, args.dtype)
    path = ensure_smollm2_checkpoint()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    device = resolve_device(args.device)
    target = LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device)
    target16 = (LlamaForCausalLM.from_pretrained(path, dtype=dtype, device=device).store_weights(torch.bfloat16)
                if args.weights_bf16 else None)
    hf = {name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, name)).to(device).eval()
          for name in ("float32", "bfloat16")}
    prompts = [p["ids"] for p in mtbench_prompts(tok, 8)]
    new = args.new_tokens
    print(f"SmolLM2-135M, engine {args.dtype} on {device}, HF generate in float32 and bfloat16, "
          f"{torch.get_num_threads()} threads, {new} new tokens, prompts {[len(p) for p in prompts]}")
    ours(target, prompts[:2], 4)  # warm-up
    if target16 is not None:
        ours(target16, prompts[:2], 4)
    if args.compile:  # every bucket the timed runs meet, compiled before them
        t0 = time.perf_counter()
        compile_s = sum(ours(target, batch, new, compile="on")[2].compile_s for batch in (prompts[:1], prompts))
        print(f"the engine's static decode step compiled in {compile_s:.1f} s ({time.perf_counter() - t0:.1f} s "
              "with its two warm-up runs), not timed below", flush=True)
    for model in hf.values():
        hf_generate(model, tok, prompts[:2], 4)

    load = Load()
    nprompts = 2 if args.quick else 4  # the speculative measurements' prompts
    head_dir = Path(args.head)
    head = head16 = vocab = served = None

    def proposer(draft_vocab, h=None):
        """The engine's proposer of the head (`h`, default the fp32-weight one): a block head's, or a chain head's over
        `draft_vocab`."""
        h = head if h is None else h
        return PagedBlockProposer(h) if getattr(h, "block", False) else PagedHeadProposer(h, draft_vocab)

    if (head_dir / "config.json").exists():
        tied, targs, _ = tied_target(path, dtype, device)
        head = load_any(head_dir, tied, targs).to(device, dtype).eval()
        head16 = load_any(head_dir, tied, targs).to(device, dtype).eval().store_weights(torch.bfloat16) \
            if target16 is not None else None
        if getattr(head, "block", False) and args.draft_vocab:
            print(f"a {head.kind} head drafts over its own vocabulary: --draft-vocab {args.draft_vocab} not applied")
            args.draft_vocab = 0
        vocab = (frequent_ids(assistant_counts(tok, targs.vocab_size), args.draft_vocab)
                 if args.draft_vocab else None)
        if args.compile:  # the verification's buckets too, before any timing
            compile_s = sum(ours(target, [p], new, proposer(vocab), args.k, compile="on")[2].compile_s
                            for p in prompts[:nprompts])
            print(f"the engine's static step for k={args.k} rounds compiled in {compile_s:.1f} s, not timed below",
                  flush=True)
        if with_vllm:  # the same head in the format vLLM serves (an export of one is served as it is)
            from evaluation.vllm_eval import served_export

            exported = Path(tempfile.mkdtemp(prefix="spechead-bench-engine-"))
            atexit.register(shutil.rmtree, exported, True)
            served_path, method, _ = served_export("head", head_dir, *tied_target(path)[:2], Path(path), None, exported)
            served = (served_path, method)
    else:
        print(f"no trained head at {head_dir}: speculative figures skipped (train one: "
              f"python -m scripts.ablation experiment=ablation, or pass --head)")

    def measure(k: int, draft_vocab, sides: VllmSides | None = None, tgt=None,
                **engine_kw) -> tuple[Paired, float, Paired | None]:
        """Speculative vs the engine's plain decoding (of `tgt`, default the target), prompt by prompt in pairs; the
        pooled τ; with `sides`, vLLM's speculative decoding of the same prompts in the same pairs (vLLM's seconds / the
        engine's)."""
        plain_s, spec_s, vllm_s, counts = [], [], [], {"emitted": 0, "steps": 0}
        tgt = target if tgt is None else tgt
        h = head16 if tgt is target16 else head

        def spec(p):
            t, st, _ = ours(tgt, [p], new, proposer(draft_vocab, h), k, **engine_kw)
            counts["emitted"] += st.emitted
            counts["steps"] += st.steps
            return t

        for p in prompts[:nprompts]:
            runs = {"plain": lambda p=p: ours(tgt, [p], new)[0], "spec": lambda p=p: spec(p)}
            if sides is not None:
                runs["vllm_spec"] = lambda p=p: sides.spec_s([p], new)
            got = measure_pairs(runs, args.rounds, warmup=0, load=load)
            plain_s += got.seconds["plain"]
            spec_s += got.seconds["spec"]
            vllm_s += got.seconds.get("vllm_spec", [])
        return (Paired.of(plain_s, spec_s), counts["emitted"] / counts["steps"],
                Paired.of(vllm_s, spec_s) if sides is not None else None)

    figures: dict[str, Paired] = {}

    def keep(key: str, p: Paired, n: int) -> None:
        figures[key] = p
        warning = warn_if_unstable(key, p, load, n)
        if warning:
            print(warning)

    spec_tau_vllm = None
    for n in budgets:
        tag = "" if n == budgets[0] else f"_{n}t"
        sides = None
        if with_vllm:
            sides = VllmSides(Path(path), args.vllm_dtype or args.dtype, max(len(p) for p in prompts) + new + 8, n,
                              served, args.k)
            sides.plain_s(prompts[:2], 4)  # warm-up, as the other sides
            if sides.spec is not None:
                sides.spec_s(prompts[:2], 4)
                sides.counts = dict.fromkeys(sides.counts, 0)
            print(f"{n} thread(s): vLLM {sides.plain.info.get('vllm')} ({args.vllm_dtype or args.dtype}) started in "
                  f"{sides.start_s:.1f} s "
                  f"(plain{' and ' + served[1] + f' k={args.k} with ' + str(served[0]) if served else ''}, side by side; "
                  f"its processes on cores {sides.plain.info.get('cpus')}), not timed below", flush=True)
            for gen in (sides.plain, sides.spec):  # a worker on more cores than the budget is not this budget's side
                if gen is not None and gen.info.get("cpus") != [int(c) for c in vllm_bind(n).split(",")]:
                    raise SystemExit(f"vLLM's worker runs on cores {gen.info.get('cpus')}, "
                                     f"the budget is {vllm_bind(n)}")
        with thread_budget(n):
            # plain decoding: the engine vs HF generate in each dtype (and vLLM), back to back in alternation
            for name, batch in (("b1", prompts[:1]), ("b8", prompts)):
                runs = {"engine": lambda batch=batch: ours(target, batch, new)[0],
                        **{f"hf_{d}": (lambda m=m, batch=batch: hf_generate(m, tok, batch, new)) for d, m in hf.items()}}
                if args.compile:
                    runs["engine_compiled"] = lambda batch=batch: ours(target, batch, new, compile="on")[0]
                if target16 is not None:
                    runs["engine_w16"] = lambda batch=batch: ours(target16, batch, new)[0]
                if sides is not None:
                    runs["vllm"] = lambda batch=batch: sides.plain_s(batch, new)
                t = measure_pairs(runs, args.rounds, warmup=0, load=load).seconds
                best = [min(a, b) for a, b in zip(t["hf_float32"], t["hf_bfloat16"])]
                keep(f"plain_vs_hf_{name}{tag}", Paired.of(best, t["engine"]), n)
                same = Paired.of(t[f"hf_{args.dtype}"], t["engine"])
                tok_s = {key: len(batch) * new * len(v) / sum(v) for key, v in t.items()}
                text = ""
                if args.compile:
                    keep(f"compiled_vs_eager_{name}{tag}", Paired.of(t["engine"], t["engine_compiled"]), n)
                    text += (f"; the compiled step {tok_s['engine_compiled']:.1f} tok/s, the eager step's seconds / its "
                             f"per pair {figures[f'compiled_vs_eager_{name}{tag}'].text()}")
                if sides is not None:
                    keep(f"plain_vs_vllm_{name}{tag}", Paired.of(t["vllm"], t["engine"]), n)
                    text += (f"; vLLM {tok_s['vllm']:.1f} tok/s, vLLM's seconds / the engine's per pair "
                             f"{figures[f'plain_vs_vllm_{name}{tag}'].text()}")
                if target16 is not None:
                    keep(f"w16_vs_w32_{name}{tag}", Paired.of(t["engine"], t["engine_w16"]), n)
                    keep(f"w16_vs_hf_{name}{tag}", Paired.of(best, t["engine_w16"]), n)
                    text += (f"; bf16 weights {tok_s['engine_w16']:.1f} tok/s, the fp32 weights' seconds / its per pair "
                             f"{figures[f'w16_vs_w32_{name}{tag}'].text()}, HF's best's / its "
                             f"{figures[f'w16_vs_hf_{name}{tag}'].text()}")
                    if sides is not None:
                        keep(f"w16_vs_vllm_{name}{tag}", Paired.of(t["vllm"], t["engine_w16"]), n)
                print(f"{n} thread(s) {name}: engine {tok_s['engine']:.1f} tok/s, HF float32 {tok_s['hf_float32']:.1f}, "
                      f"HF bfloat16 {tok_s['hf_bfloat16']:.1f}; vs HF's best dtype per pair "
                      f"{figures[f'plain_vs_hf_{name}{tag}'].text()}, same dtype ({args.dtype}) {same.text()}{text}",
                      flush=True)
            if head is None:
                if sides is not None:
                    sides.close()
                continue
            for k in sorted({int(x) for x in args.ks.split(",") if x.strip()} - {args.k}):
                for nv, v in ({0: None, args.draft_vocab: vocab} if vocab is not None else {0: None}).items():
                    sp, tau, _ = measure(k, v)
                    cost = round_cost(target, proposer(v), k, prompts[:nprompts], new)
                    text = ""
                    if args.compile:
                        ccost = round_cost(target, proposer(v), k, prompts[:nprompts], new, compile="on")
                        text = f", a compiled round {ccost['cost']:.3f} compiled plain steps"
                    print(f"{n} thread(s) other: speculative b1 k={k} draft_vocab={nv or 'all'}: speedup {sp.text()}, "
                          f"tau {tau:.3f}, a round costs {cost['cost']:.3f} plain steps{text}", flush=True)
            if args.k == 1 and not args.quick:
                sp, tau, _ = measure(1, vocab, k1_schedule=False)
                print(f"{n} thread(s): k=1 through the generic chain round (drafts and acceptance read on the host): "
                      f"speedup {sp.text()}, tau {tau:.3f}")
            sp, tau, vs_vllm = measure(args.k, vocab, sides if sides is not None and sides.spec is not None else None)
            keep(f"spec_speedup_b1{tag}", sp, n)
            if vs_vllm is not None:
                keep(f"spec_vs_vllm_b1{tag}", vs_vllm, n)
                print(f"{n} thread(s): speculative b1 k={args.k}, vLLM ({served[1]}, {served[0].name}, its whole "
                      f"vocabulary) τ {sides.tau():.3f} vs the engine's configured proposer (draft_vocab="
                      f"{args.draft_vocab or 'all'}) τ {tau:.3f}: vLLM's seconds / the engine's per pair {vs_vllm.text()}",
                      flush=True)
            cost = round_cost(target, proposer(vocab), args.k, prompts[:nprompts], new)
            print(f"{n} thread(s) configured: speculative b1 k={args.k} draft_vocab={args.draft_vocab or 'all'}"
                  f"{' (the k = 1 schedule)' if args.k == 1 else ''}: measured speedup {sp.text()}, tau {tau:.3f}; "
                  f"a round costs {cost['cost']:.3f} plain steps ({cost['round_s'] * 1e3:.1f} vs "
                  f"{cost['plain_step_s'] * 1e3:.1f} ms, medians of {cost['rounds']}) → predicted "
                  f"{cost['predicted_speedup']:.3f}x (τ {cost['tau']:.3f} / cost)", flush=True)
            if args.compile:  # the same rounds with their target passes compiled, beside the eager rounds
                eager_s, compiled_s = [], []
                for p in prompts[:nprompts]:
                    got = measure_pairs({
                        "eager": lambda p=p: ours(target, [p], new, proposer(vocab), args.k)[0],
                        "compiled": lambda p=p: ours(target, [p], new, proposer(vocab), args.k,
                                                     compile="on")[0]}, args.rounds, warmup=0, load=load)
                    eager_s += got.seconds["eager"]
                    compiled_s += got.seconds["compiled"]
                keep(f"spec_compiled_vs_eager_b1{tag}", Paired.of(eager_s, compiled_s), n)
                ccost = round_cost(target, proposer(vocab), args.k, prompts[:nprompts], new,
                                   compile="on")
                print(f"{n} thread(s) compiled: speculative b1 k={args.k}: the eager rounds' seconds / the compiled "
                      f"ones' per pair {figures[f'spec_compiled_vs_eager_b1{tag}'].text()}; a compiled round costs "
                      f"{ccost['cost']:.3f} compiled plain steps ({ccost['round_s'] * 1e3:.1f} vs "
                      f"{ccost['plain_step_s'] * 1e3:.1f} ms) → predicted {ccost['predicted_speedup']:.3f}x over "
                      f"compiled plain decoding", flush=True)
                if n == budgets[0]:
                    compiled_cost = ccost
            if target16 is not None:  # the same proposer over the bf16-weight target, against its own plain decoding
                sp16, tau16, _ = measure(args.k, vocab, tgt=target16)
                keep(f"spec_speedup_b1_w16{tag}", sp16, n)
                cost16 = round_cost(target16, proposer(vocab, head16), args.k, prompts[:nprompts], new)
                print(f"{n} thread(s) bf16 weights: speculative b1 k={args.k}: measured speedup {sp16.text()} over its "
                      f"plain decoding, tau {tau16:.3f}; a round costs {cost16['cost']:.3f} plain steps "
                      f"({cost16['round_s'] * 1e3:.1f} vs {cost16['plain_step_s'] * 1e3:.1f} ms)", flush=True)
                if n == budgets[0]:
                    w16 = (tau16, cost16)
            if n == budgets[0]:
                spec_tau, spec_cost = tau, cost
                spec_tau_vllm = sides.tau() if vs_vllm is not None else None
            if sides is not None:
                sides.close()
    print(f"load while timing: {load.text()}")
    line = " ".join(p.kv(key) for key, p in figures.items())
    if head is not None:
        line += (f" predicted_speedup_b1={spec_cost['predicted_speedup']:.3f} round_cost={spec_cost['cost']:.3f} "
                 f"tau={spec_tau:.3f}")
        if args.compile:
            line += f" round_cost_compiled={compiled_cost['cost']:.3f}"
        if spec_tau_vllm is not None:
            line += f" tau_vllm={spec_tau_vllm:.3f}"
        if target16 is not None:
            line += f" round_cost_w16={w16[1]['cost']:.3f} tau_w16={w16[0]:.3f}"
    if with_vllm:
        line += f" vllm_dtype={args.vllm_dtype or args.dtype}"
    print(f"engine {line} k={args.k} draft_vocab={args.draft_vocab} other_runnable={load.median:g}")

if __name__ == "__main__":
    main()
