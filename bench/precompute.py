"""Precompute benchmark on the real target (SmolLM2-135M, bf16 compute): our precompute path vs a
typical HF-transformers precompute script, on the same ShareGPT samples, in one process.

- ours: `data.precompute.precompute` — the engine model (`inference_eval.model.LlamaForCausalLM`)
  with `logits="none"`, packed batches of at most `--batch-tokens` tokens (samples back to back in
  one row, causal attention within each, no padding), balanced over the workers, on CPU one batch
  per worker thread, writing a bf16 feature store.
- HF at its best: `AutoModelForCausalLM`, length-sorted right-padded batches of at most
  `--batch-tokens` padded tokens with an attention mask, `logits_to_keep=1` (no [T, V] logits), a
  forward hook on the last decoder layer for the pre-norm state (HF's `hidden_states[-1]` is after the
  final norm), in bf16 and in fp32 — the faster of the two per chunk is the baseline of the summary;
  the unpadded rows go into the same kind of store. Also timed, for information: the typical script
  (bf16, `output_hidden_states=True` with the full logits, as EAGLE's and SpecForge's HF paths run).
- vllm (`--vllm`, needs `make vllm-env`): the same `precompute` with `precompute.backend=vllm`
  (inference_eval/vllm_backend.py: vLLM's CPU build in a subprocess, bf16), for information; its
  speedup is printed beside the others and is not on the last line.

Timing is paired because these machines are shared and their speed swings by several times within
seconds: the samples are cut into chunks of about `--chunk-tokens` tokens, and each chunk is run by
every path back to back (the order rotating), `--rounds` times. speedup_vs_hf is the median over
chunks and rounds of min(t_hf_bf16, t_hf_fp32) / t_ours (HF with logits_to_keep=1); the tok/s printed
are totals. Models are warmed up first;
tokenization and loading are not timed. Bytes per token are the shard bytes of whole stores written
by our path in bf16 and in fp8, divided by their tokens.
Last line:
`precompute speedup_vs_hf=<x> bytes_per_token_bf16=<b> bytes_per_token_fp8=<f> hidden_size=<H>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.precompute import precompute, tokenize_all  # noqa: E402
from data.store import FeatureStore, Sample, StoreWriter
from inference_eval.model import target_fingerprint  # noqa: E402

Samples = list[tuple[str, list[int], list[int]]]


def load_samples(tokenizer, num: int, max_length: int) -> Samples:
    from omegaconf import OmegaConf

    from data.sources import load_conversations

    convs = load_conversations(OmegaConf.create({"source": "sharegpt", "max_samples": num, "skip": 0}))
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
                        help="12 samples of ≤ 256 tokens, chunks of 1024 tokens, one round (< 1 min)")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch, both paths")
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="tokens per paired timing unit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto", help="target.device for both paths (auto: CUDA when there)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both paths (default: torch's); with 1, ours runs one "
                             "worker, and the comparison is per core, free of thread scheduling effects")
    parser.add_argument("--vllm", action="store_true", help="also time precompute.backend=vllm (make vllm-env)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.max_length, args.chunk_tokens, args.rounds = 12, 256, 1024, 1
    if args.threads:
        torch.set_num_threads(args.threads)
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
    ours = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, device=device)
    hf = {name: AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, name)).to(device).eval()
          for name in ("bfloat16", "float32")}
    hidden_size = ours.args.hidden_size
    fingerprint = target_fingerprint(target_dir, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "bfloat16")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chunks = chunks_of(samples, args.chunk_tokens)

    with torch.inference_mode():  # warm-up: oneDNN picks and JITs its kernels on first use
        warm = torch.tensor([samples[0][1][:128]], device=device)
        ours(warm, logits="none")
        for model in hf.values():
            model(input_ids=warm, attention_mask=torch.ones_like(warm), output_hidden_states=True)

    # HF's best configuration: length-sorted batches, logits_to_keep=1, in whichever dtype is faster
    # (both timed, the faster one per chunk counts); the typical script (full logits) for information
    paths = {
        "ours": lambda part, w: precompute(ours, part, w, args.batch_tokens, progress=False),
        "hf_bf16_keep1": lambda part, w: hf_precompute(hf["bfloat16"], part, args.batch_tokens, w, pad_id, 1),
        "hf_fp32_keep1": lambda part, w: hf_precompute(hf["float32"], part, args.batch_tokens, w, pad_id, 1),
        "hf_bf16_full_logits": lambda part, w: hf_precompute(hf["bfloat16"], part, args.batch_tokens, w, pad_id),
    }
    best_hf = ("hf_bf16_keep1", "hf_fp32_keep1")
    if args.vllm:
        from omegaconf import OmegaConf

        from inference_eval.vllm_backend import VLLMBackend

        vcfg = OmegaConf.create({"precompute": {"aux_layers": "none", "vllm": {}},
                                 "data": {"max_length": args.max_length}})
        vllm = VLLMBackend.from_config(vcfg, target_dir, torch.bfloat16)  # closed at exit
        vllm.hidden_states([samples[0][1][:128]], ())  # warm-up
        paths["vllm"] = lambda part, w: precompute(vllm, part, w, args.batch_tokens, progress=False)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory(prefix="bench-precompute-") as tmp:
        tmp = Path(tmp)
        unit = 0
        for r in range(args.rounds):
            for c, part in enumerate(chunks):
                names = list(paths)[unit % len(paths):] + list(paths)[:unit % len(paths)]  # rotate the order
                for name in names:
                    writer = StoreWriter(tmp / f"{name}-{r}-{c}", fingerprint, hidden_size, dtype="bfloat16")
                    t0 = time.perf_counter()
                    paths[name](part, writer)
                    seconds[name].append(time.perf_counter() - t0)
                unit += 1
            print(f"round {r}, tok/s: " + ", ".join(f"{n} {tokens / sum(s[-len(chunks):]):.0f}"
                                                   for n, s in seconds.items()))
        whole = {}
        for dtype in ("bfloat16", "fp8"):
            writer = StoreWriter(tmp / f"ours-{dtype}", fingerprint, hidden_size, dtype=dtype)
            whole[dtype] = precompute(ours, samples, writer, args.batch_tokens, progress=False).seconds

        # Same states from both paths (bf16 rounding only): ours vs HF on the first chunk's longest sample.
        a, b = FeatureStore(tmp / "ours-0-0"), FeatureStore(tmp / "hf_bf16_keep1-0-0")
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

    ratio = {n: statistics.median(t / o for t, o in zip(seconds[n], seconds["ours"])) for n in paths}
    best = statistics.median(min(seconds[n][i] for n in best_hf) / o for i, o in enumerate(seconds["ours"]))
    total = {n: tokens * args.rounds / sum(seconds[n]) for n in paths}
    print(f"{len(chunks)} chunks x {args.rounds} rounds, {tokens} tokens per round; tok/s over all: "
          + ", ".join(f"{n} {v:.0f}" for n, v in total.items())
          + f"; whole-store runs of ours: bf16 {tokens / whole['bfloat16']:.0f}, fp8 {tokens / whole['fp8']:.0f}; "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("median paired speedup: " + ", ".join(f"vs {n} {ratio[n]:.2f}" for n in paths if n != "ours")
          + f"; vs HF's best configuration (the faster of {', '.join(best_hf)} per chunk) {best:.2f}")
    for name, value, bound in (("bf16", bpt_bf16, 2 * hidden_size + 16), ("fp8", bpt_fp8, hidden_size + 24)):
        if value > bound:
            print(f"WARNING: {name} store uses {value:.2f} bytes/token > bound {bound}")
    print(f"precompute speedup_vs_hf={best:.2f} bytes_per_token_bf16={bpt_bf16:.2f} "
          f"bytes_per_token_fp8={bpt_fp8:.2f} hidden_size={hidden_size}")


if __name__ == "__main__":
    main()
