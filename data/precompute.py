"""The precompute stage: run the target over tokenized conversations and store H_i per token.

Uses the engine's model (inference_eval/model.py), one sample per forward (no padding), in the
configured compute dtype. Resumable: samples already in finished shards are skipped.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from data.store import Sample, StoreWriter

log = logging.getLogger(__name__)


@dataclass
class PrecomputeStats:
    samples: int
    tokens: int
    loss_tokens: int
    skipped_done: int
    rejected: Counter
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def tokenize_all(tokenizer, conversations: list[tuple[str, list[dict]]], max_length: int,
                 rejected: Counter) -> list[tuple[str, list[int], list[int]]]:
    from data.conversations import tokenize_conversation

    out = []
    for sid, messages in conversations:
        try:
            tc = tokenize_conversation(tokenizer, messages, max_length=max_length)
        except ValueError as e:  # template / length problems: counted, never silently included
            rejected[type(e).__name__] += 1
            log.debug("sample %s rejected: %s", sid, e)
            continue
        if tc is None or sum(tc.loss_mask) == 0:
            rejected["no_loss_tokens"] += 1
            continue
        out.append((sid, list(tc.input_ids), list(tc.loss_mask)))
    return out


@torch.inference_mode()
def precompute(model, samples: list[tuple[str, list[int], list[int]]], writer: StoreWriter,
               progress: bool = True) -> PrecomputeStats:
    done = writer.done_ids
    todo = [s for s in samples if s[0] not in done]
    total_tokens = sum(len(s[1]) for s in todo)
    t0 = time.perf_counter()
    tokens = loss_tokens = 0
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="precompute", disable=not progress)
    for sid, ids, mask in todo:
        input_ids = torch.tensor([ids])
        hidden = model(input_ids, logits="none").hidden[0]  # [T, H], pre-norm last layer
        writer.add(Sample(sid, input_ids[0], torch.tensor(mask), hidden))
        tokens += len(ids)
        loss_tokens += sum(mask)
        bar.update(len(ids))
    bar.close()
    writer.close()
    return PrecomputeStats(samples=len(todo), tokens=tokens, loss_tokens=loss_tokens,
                           skipped_done=len(samples) - len(todo), rejected=Counter(),
                           seconds=time.perf_counter() - t0)


def run_precompute(cfg: Any) -> tuple[Path, PrecomputeStats]:
    """The precompute entry point's body: target + data config → a complete store at cfg.store_dir."""
    from transformers import AutoTokenizer

    from data.sources import load_conversations, resolve_target_dir
    from data.store import DTYPES, target_fingerprint
    from inference_eval.model import LlamaForCausalLM

    target_dir = resolve_target_dir(cfg.target)
    dtype = cfg.target.dtype
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    convs = load_conversations(cfg.data)
    rejected = Counter(convs.rejected)
    samples = tokenize_all(tokenizer, convs.items, int(cfg.data.max_length), rejected)
    if not samples:
        raise RuntimeError(f"precompute: no usable conversation in the data source (rejected: {dict(rejected)})")
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype])
    fingerprint = target_fingerprint(target_dir, cfg.target.name, dtype)
    source = {"source": cfg.data.source, "path": cfg.data.get("path"), "skip": cfg.data.get("skip", 0),
              "max_samples": cfg.data.get("max_samples"), "max_length": cfg.data.max_length}
    writer = StoreWriter(cfg.store_dir, fingerprint, model.args.hidden_size, dtype=cfg.precompute.store_dtype,
                         shard_tokens=int(cfg.precompute.shard_tokens), source=source)
    stats = precompute(model, samples, writer, progress=cfg.get("progress", True))
    stats.rejected = rejected
    log.info("precompute: %d samples, %d tokens (%d loss tokens) in %.1fs (%.0f tok/s); rejected %s; store %s",
             stats.samples, stats.tokens, stats.loss_tokens, stats.seconds, stats.tokens_per_s, dict(rejected),
             cfg.store_dir)
    return Path(cfg.store_dir), stats
