"""Precompute benchmark on the real target (SmolLM2-135M, bf16 compute): our precompute path vs a
typical HF-transformers precompute script, on the same ShareGPT samples, in one process.

- ours: `data.precompute.precompute` — the engine model (`inference_eval.model.LlamaForCausalLM`)
  with `logits="none"`, right-padded batches of at most `--batch-tokens` padded tokens without an
  attention mask (causal attention hides the padding), writing a bf16 feature store.
- HF: `AutoModelForCausalLM` in bf16, length-sorted right-padded batches of at most `--batch-tokens`
  padded tokens, `output_hidden_states=True` (as EAGLE's and SpecForge's HF paths call it, so the
  full logits are computed too) and a forward hook on the last decoder layer for the pre-norm state
  (HF's `hidden_states[-1]` is after the final norm); the unpadded rows go into the same kind of
  store. Also timed, for information: the same HF batches with `logits_to_keep=1`, i.e. a
  baseline that knows to skip the logits.

Both paths are warmed up first; with `--rounds` > 1 they alternate and the best round of each
counts (the machine may be shared). Tokenization and model loading are not timed. Bytes per token
are the shard bytes of real stores written in bf16 and fp8 by our path, divided by their tokens.
Last line:
`precompute speedup_vs_hf=<x> bytes_per_token_bf16=<b> bytes_per_token_fp8=<f> hidden_size=<H>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.precompute import precompute, tokenize_all  # noqa: E402
from data.store import FeatureStore, Sample, StoreWriter, target_fingerprint  # noqa: E402

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
def hf_precompute(hf, samples: Samples, batches: list[list[int]], writer: StoreWriter, pad_id: int,
                  logits_to_keep: int = 0) -> float:
    """The HF baseline: padded batches, hidden states via a hook; returns seconds."""
    captured = {}

    def hook(module, args, output):
        captured["hidden"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(hook)
    t0 = time.perf_counter()
    for batch in batches:
        lengths = [len(samples[i][1]) for i in batch]
        ids = torch.full((len(batch), max(lengths)), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (i, n) in enumerate(zip(batch, lengths)):
            ids[r, :n] = torch.tensor(samples[i][1])
            mask[r, :n] = 1
        hf(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=logits_to_keep)
        hidden = captured["hidden"]  # [B, T, H] pre-norm output of the last decoder layer
        for r, (i, n) in enumerate(zip(batch, lengths)):
            sid, input_ids, loss_mask = samples[i]
            writer.add(Sample(sid, torch.tensor(input_ids), torch.tensor(loss_mask), hidden[r, :n].clone()))
    writer.close()
    seconds = time.perf_counter() - t0
    handle.remove()
    return seconds


def store_bytes_per_token(root: Path) -> float:
    store = FeatureStore(root)
    tokens = sum(s["num_tokens"] for s in store.manifest["shards"])
    size = sum((root / s["file"]).stat().st_size for s in store.manifest["shards"])
    return size / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 samples of ≤ 256 tokens, one round (< 1 min)")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch, both paths")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.max_length, args.rounds = 16, 256, 1
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from data.assets import ensure_smollm2_checkpoint
    from inference_eval.model import LlamaForCausalLM

    hf_logging.disable_progress_bar()
    target_dir = ensure_smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    samples = load_samples(tokenizer, args.samples, args.max_length)
    tokens = sum(len(s[1]) for s in samples)
    ours = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    hidden_size = ours.args.hidden_size
    fingerprint = target_fingerprint(target_dir, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", "bfloat16")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = padded_batches(samples, args.batch_tokens)
    padded = sum(len(b) * len(samples[b[0]][1]) for b in batches)
    print(f"hf batches: {len(batches)} of ≤ {args.batch_tokens} padded tokens; padding {padded / tokens - 1:.1%}")

    with torch.inference_mode():  # warm-up: oneDNN picks and JITs its kernels on first use
        warm = torch.tensor([samples[0][1][:128]])
        ours(warm, logits="none")
        hf(input_ids=warm, attention_mask=torch.ones_like(warm), output_hidden_states=True)

    paths = {
        "ours": lambda w: precompute(ours, samples, w, args.batch_tokens, progress=False),
        "hf": lambda w: hf_precompute(hf, samples, batches, w, pad_id),
        "hf_logits_to_keep_1": lambda w: hf_precompute(hf, samples, batches, w, pad_id, logits_to_keep=1),
    }
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory(prefix="bench-precompute-") as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            names = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]  # rotate the order
            for name in names:
                writer = StoreWriter(tmp / f"{name}-{r}", fingerprint, hidden_size, dtype="bfloat16")
                w0, c0 = time.perf_counter(), time.process_time()
                paths[name](writer)
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
            print(f"round {r}: " + ", ".join(f"{n} {tokens / wall[n][-1]:.0f} tok/s (cpu {tokens / cpu[n][-1]:.0f})"
                                             for n in paths))
        writer = StoreWriter(tmp / "ours-fp8", fingerprint, hidden_size, dtype="fp8")
        fp8_s = precompute(ours, samples, writer, args.batch_tokens, progress=False).seconds

        # Same states from both paths (bf16 noise only): ours vs HF for the longest sample.
        a, b = FeatureStore(tmp / "ours-0"), FeatureStore(tmp / "hf-0")
        i = max(range(len(samples)), key=lambda k: len(samples[k][1]))
        j = [b[k]["input_ids"].tolist() for k in range(len(b))].index(samples[i][1])
        x, y = a[i]["hidden"].float(), b[j]["hidden"].float()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        print(f"parity ours vs hf on {len(x)} tokens: min cosine {cos.min():.5f}, "
              f"max |diff| / max |hf| {(x - y).abs().max() / y.abs().max():.4f}")
        fp8 = FeatureStore(tmp / "ours-fp8")
        rel = (fp8[i]["hidden"].float() - x).norm() / x.norm()
        print(f"fp8 store: relative L2 error vs bf16 store {rel:.4f}; reads back as {fp8[i]['hidden'].dtype}")
        bpt_bf16 = store_bytes_per_token(tmp / "ours-0")
        bpt_fp8 = store_bytes_per_token(tmp / "ours-fp8")

    best = {n: tokens / min(wall[n]) for n in paths}
    best_cpu = {n: tokens / min(cpu[n]) for n in paths}
    print(f"best round, tok/s: ours {best['ours']:.0f} (fp8 store {tokens / fp8_s:.0f}), hf {best['hf']:.0f}, "
          f"hf logits_to_keep=1 {best['hf_logits_to_keep_1']:.0f}; by process CPU time: ours {best_cpu['ours']:.0f}, "
          f"hf {best_cpu['hf']:.0f}, hf logits_to_keep=1 {best_cpu['hf_logits_to_keep_1']:.0f}; "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"speedup vs hf logits_to_keep=1 (a baseline that skips the logits): "
          f"{best['ours'] / best['hf_logits_to_keep_1']:.2f}")
    for name, value, bound in (("bf16", bpt_bf16, 2 * hidden_size + 16), ("fp8", bpt_fp8, hidden_size + 24)):
        if value > bound:
            print(f"WARNING: {name} store uses {value:.2f} bytes/token > bound {bound}")
    print(f"precompute speedup_vs_hf={best['ours'] / best['hf']:.2f} bytes_per_token_bf16={bpt_bf16:.2f} "
          f"bytes_per_token_fp8={bpt_fp8:.2f} hidden_size={hidden_size}")


if __name__ == "__main__":
    main()
