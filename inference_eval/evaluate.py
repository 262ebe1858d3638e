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


def mtbench_prompts(tokenizer, num_prompts: int | None, turn: int = 1, target=None, max_new_tokens: int = 64,
                    stop_ids: set[int] = frozenset()) -> list[dict[str, Any]]:
    """MT-Bench prompts, taken round-robin over the 8 categories so a subset stays balanced.
    Turn 2 follows MT-Bench: the model's own (greedy) turn-1 answer, then the second question."""
    from data.assets import load_mtbench
    from data.conversations import tokenize_prompt

    cats: dict[str, list[dict]] = {}
    for q in load_mtbench():
        cats.setdefault(q["category"], []).append(q)
    ordered = [q for group in zip(*cats.values()) for q in group]
    ordered = ordered[:num_prompts] if num_prompts else ordered
    out = []
    for q in ordered:
        messages = [{"role": "user", "content": q["turns"][0]}]
        if turn == 2:
            if target is None:
                raise ValueError("MT-Bench turn 2 needs the target to answer turn 1")
            answer = generate_plain(target, tokenize_prompt(tokenizer, messages), max_new_tokens, stop_ids)
            messages += [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True).strip()},
                         {"role": "user", "content": q["turns"][1]}]
        out.append({"ids": tokenize_prompt(tokenizer, messages), "category": q["category"], "id": q["question_id"],
                    "turn": turn})
    return out


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
    stops = stop_token_ids(tokenizer)
    turns = [int(t) for t in ecfg.get("turns", [1])]
    prompts = [p for t in turns for p in mtbench_prompts(tokenizer, ecfg.get("num_prompts"), t, target,
                                                         int(ecfg.max_new_tokens), stops)]
    report: dict[str, Any] = {"target": cfg.target.name, "target_dtype": cfg.target.dtype, "head_dtype": ecfg.head_dtype,
                              "dataset": ecfg.dataset, "turn": "+".join(map(str, turns)), "prompts": len(prompts), "k": int(ecfg.k),
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
    write_report(report, Path(ecfg.report))
    return report


def write_report(report: dict[str, Any], json_path: Path) -> list[Path]:
    """The JSON report plus a Markdown table (`.md`) and two PNG plots beside it: α_d per draft
    position and τ per category, one series per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from data.store import atomic_write_bytes

    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(json_path, json.dumps(report, indent=2).encode())
    results = report["results"]
    k = report["k"]
    lines = [f"# Acceptance on {report['dataset']} ({report['prompts']} prompts, turn {report['turn']})", "",
             f"target {report['target']} ({report['target_dtype']}), greedy, k={k}, batch {report['batch_size']}, "
             f"{report['max_new_tokens']} new tokens", "",
             "| head | τ | " + " | ".join(f"α{d + 1}" for d in range(k)) + " | tok/s |",
             "| --- | --- | " + " | ".join("---" for _ in range(k)) + " | --- |"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['tau']:.3f} | " + " | ".join(f"{a:.3f}" for a in r["alpha"])
                     + f" | {r['tokens_per_s']:.1f} |")
    cats = sorted({c for r in results.values() for c in r["per_category_tau"]})
    lines += ["", "τ per category:", "", "| head | " + " | ".join(cats) + " |",
              "| --- | " + " | ".join("---" for _ in cats) + " |"]
    for label, r in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{r['per_category_tau'].get(c, float('nan')):.3f}" for c in cats) + " |")
    md = json_path.with_suffix(".md")
    atomic_write_bytes(md, ("\n".join(lines) + "\n").encode())

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, r in results.items():
        ax.plot(range(1, k + 1), r["alpha"], marker="o", label=f"{label} (τ={r['tau']:.2f})")
    ax.set(xlabel="draft position d", ylabel="α_d (given d-1 accepted)", ylim=(0, 1), xticks=range(1, k + 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    alpha_png = json_path.with_name(json_path.stem + "_alpha.png")
    fig.savefig(alpha_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / max(len(results), 1)
    for j, (label, r) in enumerate(results.items()):
        ax.bar([i + j * width for i in range(len(cats))], [r["per_category_tau"].get(c, 0) for c in cats], width,
               label=label)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(cats))], cats, rotation=30, fontsize=8)
    ax.set(ylabel="τ", ylim=(1, None))
    ax.legend(fontsize=8)
    fig.tight_layout()
    cat_png = json_path.with_name(json_path.stem + "_tau_by_category.png")
    fig.savefig(cat_png, dpi=100)
    plt.close(fig)
    return [json_path, md, alpha_png, cat_png]
