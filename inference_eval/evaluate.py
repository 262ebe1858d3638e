"""Acceptance evaluation (DESIGN.md §7): τ and α_d of a head on a prompt set through the engine."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from inference_eval.speculative import SpecStats, generate_plain, generate_speculative

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    label: str
    k: int
    tau: float
    alpha: list[float]
    target_passes: int
    new_tokens: int
    tokens_per_s: float
    per_category_tau: dict[str, float]
    prompts: int

    def summary(self) -> str:
        a = " ".join(f"{x:.3f}" for x in self.alpha)
        return f"{self.label}: tau={self.tau:.3f} alpha=[{a}] tok/s={self.tokens_per_s:.1f} ({self.prompts} prompts)"


def evaluate_head(target, head, prompts: list[dict[str, Any]], k: int, max_new_tokens: int,
                  stop_ids: set[int], label: str = "head", progress: bool = True) -> EvalResult:
    """prompts: dicts with `ids` (token ids) and `category`."""
    total = SpecStats(k=k)
    by_cat: dict[str, SpecStats] = {}
    for p in tqdm(prompts, desc=f"evaluate {label}", disable=not progress):
        _, st = generate_speculative(target, head, p["ids"], k, max_new_tokens, stop_ids)
        total.merge(st)
        by_cat.setdefault(p.get("category", "all"), SpecStats(k=k)).merge(st)
    return EvalResult(label=label, k=k, tau=total.tau, alpha=total.alpha, target_passes=total.steps,
                      new_tokens=total.new_tokens, tokens_per_s=total.new_tokens / max(total.seconds, 1e-9),
                      per_category_tau={c: s.tau for c, s in sorted(by_cat.items())}, prompts=len(prompts))


def plain_tokens_per_s(target, prompts: list[dict[str, Any]], max_new_tokens: int, stop_ids: set[int]) -> float:
    t0, n = time.perf_counter(), 0
    for p in prompts:
        n += len(generate_plain(target, p["ids"], max_new_tokens, stop_ids))
    return n / (time.perf_counter() - t0)


def mtbench_prompts(tokenizer, num_prompts: int | None) -> list[dict[str, Any]]:
    """First turns of MT-Bench, taken round-robin over the 8 categories so a subset stays balanced."""
    from data.assets import load_mtbench
    from data.conversations import tokenize_prompt

    questions = load_mtbench()
    cats: dict[str, list[dict]] = {}
    for q in questions:
        cats.setdefault(q["category"], []).append(q)
    ordered = [q for group in zip(*cats.values()) for q in group]
    ordered = ordered[:num_prompts] if num_prompts else ordered
    return [{"ids": tokenize_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]),
             "category": q["category"], "id": q["question_id"]} for q in ordered]


def stop_token_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


def run_evaluation(cfg: Any) -> dict[str, Any]:
    """Evaluate the configured head checkpoints on the configured prompts; write a JSON report."""
    from transformers import AutoTokenizer

    from data.sources import resolve_target_dir
    from data.store import DTYPES
    from heads.checkpoint import load_native
    from inference_eval.model import LlamaForCausalLM, tied_target

    ecfg = cfg.evaluate
    torch.manual_seed(int(cfg.seed))
    target_dir = resolve_target_dir(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=DTYPES[cfg.target.dtype])
    head_dtype = DTYPES[ecfg.head_dtype]
    tied, _, _ = tied_target(target_dir, head_dtype)
    if ecfg.dataset != "mtbench":
        raise ValueError(f"evaluate.dataset={ecfg.dataset!r}: only 'mtbench' is wired in this version")
    prompts = mtbench_prompts(tokenizer, ecfg.get("num_prompts"))
    stops = stop_token_ids(tokenizer)
    report: dict[str, Any] = {"target": cfg.target.name, "target_dtype": cfg.target.dtype, "head_dtype": ecfg.head_dtype,
                              "dataset": ecfg.dataset, "turn": 1, "prompts": len(prompts), "k": int(ecfg.k),
                              "max_new_tokens": int(ecfg.max_new_tokens), "temperature": 0.0, "batch_size": 1,
                              "results": {}}
    for label, path in ecfg.heads.items():
        if not path:
            continue
        head = load_native(path, tied, target.args).eval()
        res = evaluate_head(target, head, prompts, int(ecfg.k), int(ecfg.max_new_tokens), stops, label,
                            progress=cfg.get("progress", True))
        log.info(res.summary())
        report["results"][label] = {**asdict(res), "checkpoint": str(path)}
    if ecfg.get("plain_baseline"):
        report["plain_tokens_per_s"] = plain_tokens_per_s(target, prompts, int(ecfg.max_new_tokens), stops)
    out = Path(ecfg.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report
