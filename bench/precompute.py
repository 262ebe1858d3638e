"""Precompute benchmark on the real target (SmolLM2-135M): our precompute path vs HF-transformers
precompute scripts, on the same ShareGPT samples, in one process, each side at its best dtype.

- ours: `data.precompute.precompute` — the engine model (`inference_eval.model.LlamaForCausalLM`)
  with `logits="none"`, packed batches of at most `--batch-tokens` tokens (samples back to back in
  one row, causal attention within each, no padding), balanced over the workers, on CPU one batch
  per worker thread, writing a bf16 feature store; computing in each dtype of `--dtypes`, the faster
  one per pair counting (a CPU without bf16 units runs bf16 several times slower than fp32).
- HF at its best: `AutoModelForCausalLM`, length-sorted right-padded batches of at most
  `--batch-tokens` padded tokens with an attention mask, `logits_to_keep=1` (no [T, V] logits), a
  forward hook on the last decoder layer for the pre-norm state (HF's `hidden_states[-1]` is after the
  final norm), in each dtype of `--dtypes` — the faster per pair is the baseline of the summary;
  the unpadded rows go into the same kind of store. Also timed, for information: the typical script
  (bf16, `output_hidden_states=True` with the full logits, as EAGLE's and SpecForge's HF paths run).
- vllm (`--vllm`, needs `make vllm-env`): the same `precompute` with `precompute.backend=vllm`
  (inference_eval/vllm_backend.py: vLLM's CPU build in a subprocess, bf16), for information; its
  speedup is printed beside the others and is not on the last line.

Timing follows core/timing.py: the samples are cut into chunks of about `--chunk-tokens` tokens, and
each chunk is run by every path back to back (the order rotating), `--rounds` pairs per chunk, under
each thread budget of `--threads` (default `all,1`: the whole machine, then one thread per side — the
per-core figure, the one that stays put on a shared machine). speedup_vs_hf is the median over chunks and
pairs of min over dtypes of HF's seconds (logits_to_keep=1) / min over dtypes of ours, with its min–max; the load seen
(other runnable threads) is printed, and a figure whose pairs spread more than the stated bound says so.
The tok/s printed are totals. Models are warmed up first; tokenization and loading are not timed. Bytes
per token are the shard bytes of whole stores written by our path in bf16 and in fp8, divided by their
tokens.
Last line: `precompute speedup_vs_hf=<x> speedup_vs_hf_min=… speedup_vs_hf_max=… speedup_vs_hf_1t=<x>
speedup_vs_hf_1t_min=… speedup_vs_hf_1t_max=… other_runnable=<n> bytes_per_token_bf16=<b>
bytes_per_token_fp8=<f> hidden_size=<H> store_wait_frac=<w> store_wait_frac_sync=<s>` (the `_1t` figures: both sides
on one thread; the `store_wait` figures: the share of the main loop's time spent waiting on the store's writes with
precompute's writer thread and with a synchronous writer, shards of a quarter of the samples' tokens).
"""

from __future__ import annotations

import argparse
import logging
import itertools
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.timing import Load, Paired, measure_pairs, thread_budget, thread_settings, warn_if_unstable  # noqa: E402
from data.precompute import precompute, tokenize_all  # noqa: E402
from data.store import FeatureStore, Sample, StoreWriter
from inference_eval.model import target_fingerprint  # noqa: E402

Samples = list[tuple[str, list[int], list[int]]]


def load_samples(tokenizer, num: int, max_length: int) -> Samples:
    from data.sources import DataConfig, load_conversations

    convs = load_conversations(DataConfig(max_samples=num))
    rejected = Counter(convs.rejected)
    samples = tokenize_all(tokenizer, convs.items, max_length, rejected)
    print(f"data: {len(samples)} ShareGPT samples, {sum(len(s[1]) for s in samples)} tokens "
          f"(max_length {max_length}), rejected {dict(rejected)}")
    return samples


def chunks_of(samples: Samples, chunk_tokens: int) -> list[Samples]:
    out: list[Samples] = [[]]
    for s in samples:
        if out[-1] and sum(len(x[1]) for x in out[-1]) + len(s[1]) > chunk_tokens:
            out.append([])
        out[-1].append(s)
    return out


def padded_batches(samples: Samples, batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length (longest first), cut so rows × longest row ≤ batch_tokens."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i][1]))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(samples[batches[-1][0]][1]) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def hf_precompute(hf, samples: Samples, batch_tokens: int, writer: StoreWriter, pad_id: int,
                  logits_to_keep: int = 0) -> None:
    """The HF baseline: padded batches with an attention mask, the pre-norm state via a hook."""
    captured = {}

    def hook(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(hook)
    try:
        for batch in padded_batches(samples, batch_tokens):
            lengths = [len(samples[i][1]) for i in batch]
            ids = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, (i, n) in enumerate(zip(batch, lengths)):
                ids[r, :n] = torch.tensor(samples[i][1])
                mask[r, :n] = 1
            hf(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), output_hidden_states=True,
               logits_to_keep=logits_to_keep)
            hidden = captured["hidden"]  # [B, T, H] pre-norm output of the last decoder layer
            for r, (i, n) in enumerate(zip(batch, lengths)):
                sid, input_ids, loss_mask = samples[i]
                writer.add(Sample(sid, torch.tensor(input_ids), torch.tensor(loss_mask), hidden[r, :n].to("cpu", copy=True)))
        writer.close()
    finally:
        handle.remove()


def store_bytes_per_token(root: Path) -> float:
    shards = FeatureStore(root).manifest["shards"]
    return sum((root / s["file"]).stat().st_size for s in shards) / sum(s["num_tokens"] for s in shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 samples of ≤ 128 tokens in one chunk, 2 pairs per thread budget, without the "
                             "typical script's path (≈ 1 min)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch, both paths")
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="tokens per paired timing unit")
    parser.add_argument("--rounds", type=int, default=2, help="pairs per chunk and thread budget")
    parser.add_argument("--device", default="auto", help="target.device for both paths (auto: CUDA when there)")
    parser.add_argument("--threads", default="all,1",
                        help="thread budgets, both paths alike, measured in turn (default all,1: the whole machine "
                             "and per core); with 1, ours runs one worker and HF one intra-op thread")
    parser.add_argument("--dtypes", default=None,
                        help="compute dtypes each side is timed in, the faster counting (default bfloat16,float32; "
                             "--quick: float32, the faster one on CPUs without bf16 units)")
    parser.add_argument("--vllm", action="store_true", help="also time precompute.backend=vllm (make vllm-env)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.max_length, args.chunk_tokens, args.rounds = 5, 128, 1024, 2
    budgets = thread_settings(args.threads)
    args.dtypes = args.dtypes or ("float32" if args.quick else "bfloat16,float32")
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from data.assets import ensure_smollm2_checkpoint
    from inference_eval.model import LlamaForCausalLM, resolve_device

    hf_logging.disable_progress_bar()
    target_dir = ensure_smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    samples = load_samples(tokenizer, args.samples, args.max_length)
    tokens = sum(len(s[1]) for s in samples)
    device = resolve_device(args.device)
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if not dtypes or any(d not in ("bfloat16", "float32") for d in dtypes):
        parser.error(f"--dtypes {args.dtypes!r}: a comma list of bfloat16, float32")
    models = {name: LlamaForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, name), device=device)
              for name in dtypes}
    ours = models[dtypes[0]]
    hf = {name: AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, name)).to(device).eval()
          for name in dtypes}
    hidden_size = ours.args.hidden_size
    fingerprint = target_fingerprint(target_dir, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "bfloat16")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chunks = chunks_of(samples, args.chunk_tokens)

    with torch.inference_mode():  # warm-up: oneDNN picks and JITs its kernels on first use
        warm = torch.tensor([samples[0][1][:128]], device=device)
        for model in models.values():
            model(warm, logits="none")
        for model in hf.values():
            model(input_ids=warm, attention_mask=torch.ones_like(warm), output_hidden_states=True)

    # each side at its best configuration: every dtype of --dtypes timed, the faster one per pair counts (on a
    # CPU without bf16 units float32 is the faster by several times); HF length-sorted with logits_to_keep=1.
    # The typical script (full logits, bf16) for information. Every path writes a bf16 store.
    short = {"bfloat16": "bf16", "float32": "fp32"}
    paths = {f"ours_{short[d]}": (lambda part, w, m=m: precompute(m, part, w, args.batch_tokens, progress=False))
             for d, m in models.items()}
    paths.update({f"hf_{short[d]}_keep1": (lambda part, w, m=m: hf_precompute(m, part, args.batch_tokens, w, pad_id, 1))
                  for d, m in hf.items()})
    best_ours = tuple(n for n in paths if n.startswith("ours_"))
    best_hf = tuple(n for n in paths if n.startswith("hf_"))
    if not args.quick and "bfloat16" in hf:
        paths["hf_bf16_full_logits"] = lambda part, w: hf_precompute(hf["bfloat16"], part, args.batch_tokens, w, pad_id)
    if args.vllm:
        from inference_eval.vllm_backend import VLLMBackend, VllmSettings

        vllm = VLLMBackend.for_target(VllmSettings("precompute.vllm"), target_dir, torch.bfloat16, "none", None,
                                      args.max_length)  # closed at exit
        vllm.hidden_states([samples[0][1][:128]], ())  # warm-up
        paths["vllm"] = lambda part, w: precompute(vllm, part, w, args.batch_tokens, progress=False)  # not in the best
    seconds: dict[int, dict[str, list[float]]] = {n: {name: [] for name in paths} for n in budgets}
    load, serial = Load(), itertools.count()
    with tempfile.TemporaryDirectory(prefix="bench-precompute-") as tmp:
        tmp = Path(tmp)
        for n in budgets:
            with thread_budget(n):
                for c, part in enumerate(chunks):
                    def side(name, part=part, c=c):
                        def run() -> float:
                            writer = StoreWriter(tmp / f"{name}-{n}-{c}-{next(serial)}", fingerprint,
                                                 hidden_size, dtype="bfloat16")
                            t0 = time.perf_counter()
                            paths[name](part, writer)
                            return time.perf_counter() - t0
                        return run
                    got = measure_pairs({name: side(name) for name in paths}, args.rounds, warmup=0, load=load)
                    for name in paths:
                        seconds[n][name] += got.seconds[name]
            print(f"{n} thread(s), tok/s: " + ", ".join(f"{name} {tokens * args.rounds / sum(s):.0f}"
                                                       for name, s in seconds[n].items()), flush=True)
        whole = {}
        for dtype in ("bfloat16", "fp8"):
            writer = StoreWriter(tmp / f"ours-{dtype}", fingerprint, hidden_size, dtype=dtype, background=True)
            whole[dtype] = precompute(ours, samples, writer, args.batch_tokens, progress=False).seconds
        # the store's writes beside the main loop: a synchronous writer and precompute's writer thread, alternated,
        # shards of a quarter of the samples' tokens (a few per run): the seconds the main loop waited on them
        shard = max(1, tokens // 4)
        waited: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for background in (False, True, True, False):
            writer = StoreWriter(tmp / f"writer-{int(background)}-{next(serial)}", fingerprint, hidden_size,
                                 dtype="bfloat16", shard_tokens=shard, background=background)
            st = precompute(ours, samples, writer, args.batch_tokens, progress=False)
            waited[background].append((st.store_wait_s, st.seconds))
        wait_frac = {bg: sum(w for w, _ in v) / sum(t for _, t in v) for bg, v in waited.items()}
        print(f"store writes ({shard}-token bf16 shards, 2 runs each): the main loop waited "
              f"{100 * wait_frac[False]:.1f} % of its time on a synchronous writer, {100 * wait_frac[True]:.1f} % "
              "with the writer thread")

        # Same states from both paths (bf16 rounding only): ours vs HF on the first chunk's longest sample.
        a, b = (FeatureStore(next(tmp.glob(f"{name}-{budgets[0]}-0-*"))) for name in (best_ours[0], best_hf[0]))
        i = max(range(len(a)), key=lambda k: a.lengths()[k])
        j = [b[k]["input_ids"].tolist() for k in range(len(b))].index(a[i]["input_ids"].tolist())
        x, y = a[i]["hidden"].float(), b[j]["hidden"].float()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        print(f"parity ours vs hf on {len(x)} tokens: min cosine {cos.min():.5f}, "
              f"max |diff| / max |hf| {(x - y).abs().max() / y.abs().max():.4f}")
        bf16, fp8 = FeatureStore(tmp / "ours-bfloat16"), FeatureStore(tmp / "ours-fp8")
        x, y = bf16[0]["hidden"].float(), fp8[0]["hidden"]
        print(f"fp8 store: reads back as {y.dtype}; relative L2 error vs the bf16 store "
              f"{(y.float() - x).norm() / x.norm():.4f}")
        bpt_bf16 = store_bytes_per_token(tmp / "ours-bfloat16")
        bpt_fp8 = store_bytes_per_token(tmp / "ours-fp8")

    figures = {}
    for n in budgets:
        sec = seconds[n]
        fastest_ours = [min(sec[o][i] for o in best_ours) for i in range(args.rounds * len(chunks))]
        ratio = {name: Paired.of(sec[name], fastest_ours) for name in paths if name not in best_ours}
        best = Paired.of([min(sec[h][i] for h in best_hf) for i in range(len(fastest_ours))], fastest_ours)
        figures[n] = best
        total = {name: tokens * args.rounds / sum(sec[name]) for name in paths}
        print(f"{n} thread(s): {len(chunks)} chunks x {args.rounds} pairs, {tokens} tokens per pass; tok/s over all: "
              + ", ".join(f"{name} {v:.0f}" for name, v in total.items()))
        print(f"{n} thread(s): paired speedup of the faster of {', '.join(best_ours)} (median [min–max]): "
              + ", ".join(f"vs {name} {r.text()}" for name, r in ratio.items())
              + f"; ours at its best ({' or '.join(best_ours)}) vs HF's best ({' or '.join(best_hf)}), per pair: "
              + best.text())
        warning = warn_if_unstable("speedup_vs_hf", best, load, n)
        if warning:
            print(warning)
    print(f"whole-store runs of ours: bf16 {tokens / whole['bfloat16']:.0f} tok/s, fp8 {tokens / whole['fp8']:.0f}; "
          f"load while timing: {load.text()}")
    for name, value, bound in (("bf16", bpt_bf16, 2 * hidden_size + 16), ("fp8", bpt_fp8, hidden_size + 24)):
        if value > bound:
            print(f"WARNING: {name} store uses {value:.2f} bytes/token > bound {bound}")
    line = " ".join(figures[n].kv("speedup_vs_hf" + ("" if i == 0 else f"_{n}t"))
                    for i, n in enumerate(budgets))
    print(f"precompute {line} other_runnable={load.median:g} bytes_per_token_bf16={bpt_bf16:.2f} "
          f"bytes_per_token_fp8={bpt_fp8:.2f} hidden_size={hidden_size} store_wait_frac={wait_frac[True]:.3f} "
          f"store_wait_frac_sync={wait_frac[False]:.3f}")

if __name__ == "__main__":
    main()
