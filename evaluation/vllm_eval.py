"""`evaluate.engine: vllm`: the evaluation through real vLLM instead of spechead's engine — for targets
that do not fit one device (vLLM's tensor parallelism), and to measure what serving will do.

Per configured head: the head is exported to the format vLLM serves for it (artifacts/export.py
`VLLM_METHODS`: `mtp` → `mtp-vllm` through spechead's plugin, `eagle1` → `eagle1-vllm`, `eagle3` →
`eagle3`, `medusa` → `medusa-vllm`, vLLM ≤ 0.32; a directory that already is such an export is served as it
is) under `<run_dir>/eval_vllm/<label>/`, and one vLLM process (`inference_eval/vllm_serve_worker.py` in
the vLLM environment, `evaluate.vllm.python`) decodes the prompts greedily with it — category by category,
so that vLLM's own counters (`LLM.get_metrics()`: drafts, accepted tokens per position) give τ and α_d per
category. `evaluate.vllm.data_parallel_size` > 1 runs that many vLLM processes at once, each on its own GPUs
(or cores) and a share of every category's prompts; their counters are summed (inference_eval/vllm_spec.py). With `plain_baseline`, one more process decodes them plainly. `k: auto` probes k = 1..auto_max_k
on the first `auto_prompts` prompts, one vLLM process per k, and keeps the fastest.

From vLLM's counters: τ = (accepted + drafts) / drafts (tokens per target verification pass: the
accepted drafts and the target's own token), α_d = accepted at d / accepted at d − 1 (conditional, as
spechead's engine reports it). tokens/s: new tokens / generation seconds in vLLM, load excluded. The
speedup over plain decoding comes from two processes run one after the other, not interleaved: it is
reported as `speedup_unpaired`, and a busy machine moves it. Greedy chains only (no tree, temperature 0,
no draft-model baselines, MT-Bench turn 1 or the other prompt sets): each is refused with the setting to
change.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from artifacts.export import VLLM_METHODS, check_servable, detect_format, load_any, vllm_export
from data.conversations import load_tokenizer
from data.prompts import load_prompts, stop_token_ids
from evaluation.settings import EvalConfig
from inference_eval.model import tied_target
from inference_eval.targets import TargetConfig
from inference_eval.vllm_backend import vllm_python
from inference_eval.vllm_spec import VLLMRunner, rate, spec_figures

log = logging.getLogger(__name__)


def check_vllm_evaluation(ec: EvalConfig) -> None:
    """What `evaluate.engine=vllm` cannot do, refused before work with the setting to change."""
    problems = []
    if ec.temperature != 0.0:
        problems.append("it decodes greedily: set evaluate.temperature=0")
    if ec.proposer != "chain":
        problems.append("it drafts chains: set evaluate.proposer=chain")
    if ec.draft_models:
        problems.append("draft-model baselines run in spechead's engine: set evaluate.draft_models={}")
    if ec.prompts.dataset == "mtbench" and ec.prompts.turns != (1,):
        problems.append("MT-Bench turn 2 needs the target's own turn-1 answers from spechead's engine: set "
                        "evaluate.turns=[1]")
    if problems:
        raise ValueError("evaluate.engine=vllm: " + "; ".join(problems))
    vllm_python(ec.vllm.python, "evaluate.vllm.python", "evaluate.engine=vllm")


def result_entry(label: str, k: int, res: dict, plain: dict | None, head_kind: str, served: Path, method: str
                 ) -> dict[str, Any]:
    new_tokens = sum(g["new_tokens"] for g in res["groups"])
    entry = {"label": label, "k": k, **spec_figures(res["spec"], k), "new_tokens": new_tokens,
             "tokens_per_s": rate(res), "prompts": len(res["tokens"]),
             "per_category_tau": {c: spec_figures(g["spec"], k)["tau"]
                                  for c, g in sorted(zip(res["categories"], res["groups"]))},
             "proposer": head_kind, "engine": "vllm", "vllm": res["vllm"], "served": str(served),
             "vllm_method": method, "vllm_load_s": res["load_s"]}
    if plain is not None:
        entry["speedup_unpaired"] = entry["tokens_per_s"] / rate(plain)
        entry["lossless"] = res["tokens"] == plain["tokens"]
    return entry


def served_export(label: str, path: str | Path, tied, args, target_dir: Path, expected_fp: dict, out_root: Path,
                  version: str = "0.32.0") -> tuple[Path, str, Any]:
    """(the directory vLLM loads, its `method`, the head): an export vLLM serves as it is, else one written.
    Medusa on vLLM ≥ 0.33 is refused: that release removed it."""
    head = load_any(path, tied, args, expected_fingerprint=expected_fp)
    fmt = detect_format(path)
    if fmt in VLLM_METHODS:
        check_servable(fmt, version, f"evaluate.heads.{label}")
        return Path(path), VLLM_METHODS[fmt], head
    out, method = vllm_export(head, out_root / label, target_dir, version, f"evaluate.heads.{label}",
                              expected_fingerprint=expected_fp)
    log.info("evaluate (vllm) %s: exported to %s for vLLM", label, out)
    return out, method, head


def probe_k(runner: VLLMRunner, prompts: list[dict], served: Path, method: str, top: int, label: str
            ) -> tuple[int, dict[str, Any]]:
    """k=auto in vLLM: tokens/s of k = 1..top on the probe prompts, one process each; the fastest k."""
    table = []
    for k in range(1, top + 1):
        res = runner.run(prompts, {"method": method, "model": str(served), "num_speculative_tokens": k},
                         f"{label} k=auto probe")
        table.append({"k": k, "tokens_per_s": rate(res),
                      "tau": spec_figures(res["spec"], k)["tau"]})
    best = max(table, key=lambda r: r["tokens_per_s"])
    log.info("evaluate (vllm) %s: k=auto on %d prompts: %s → k=%d", label, len(prompts),
             ", ".join(f"k={r['k']} {r['tokens_per_s']:.1f} tok/s τ {r['tau']:.3f}" for r in table), best["k"])
    return best["k"], {"table": table, "chosen_k": best["k"], "prompts": len(prompts), "timing": "one vLLM process per k"}


def run_vllm_evaluation(ec: EvalConfig, tc: TargetConfig) -> dict[str, Any]:
    """evaluation/evaluate.py `evaluation_stage` with `evaluate.engine=vllm` (module docstring): the report (which
    `evaluation_stage` writes) has the same shape, each entry's figures from vLLM's counters."""
    check_vllm_evaluation(ec)
    target_dir = tc.dir
    tokenizer = load_tokenizer(target_dir, ec.prompts.data.chat_template)
    stops = stop_token_ids(tokenizer)
    prompts = load_prompts(ec.prompts, tokenizer, None, stops)
    if not prompts:
        raise ValueError(f"evaluate: no prompts from dataset {ec.prompts.dataset!r}")
    tied, args, _ = tied_target(target_dir)  # the shared tensors only, to read and export the heads
    expected_fp = tc.fingerprint
    max_new = ec.prompts.max_new_tokens
    report: dict[str, Any] = {"target": tc.name, "target_dtype": tc.dtype, "engine": "vllm",
                              "dataset": ec.prompts.dataset, "turn": "1", "prompts": len(prompts),
                              "k": "auto" if ec.auto else ec.k, "max_new_tokens": max_new,
                              "temperature": 0.0, "batch_size": ec.batch_size, "proposer": "chain",
                              "tensor_parallel_size": ec.vllm.tensor_parallel_size, "results": {}}
    out_root = ec.run_dir / "eval_vllm"
    with tempfile.TemporaryDirectory(prefix="spechead-eval-vllm-") as tmp:
        runner = VLLMRunner(ec.vllm, target_dir, tc.dtype, max_new, ec.batch_size,
                            max(len(p["ids"]) for p in prompts), stops, Path(tmp))
        report["data_parallel_size"] = runner.replicas
        plain = runner.run(prompts, None, "plain") if ec.plain_baseline else None
        if plain is not None:
            report["plain_tokens_per_s"] = rate(plain)
        for label, path in ec.heads.items():
            served, method, head = served_export(label, path, tied, args, target_dir, expected_fp, out_root,
                                                 runner.version)
            depth = getattr(head, "max_depth", None)
            auto = None
            if ec.auto:
                top = min(ec.auto_max_k, depth or ec.auto_max_k)
                k, auto = probe_k(runner, prompts[: ec.auto_prompts], served, method, top, label)
            else:
                k = ec.k
                if depth is not None and k > depth:  # as spechead's engine refuses it
                    raise ValueError(f"evaluate.k={k} draft tokens, but the {head.kind} head {label} defines {depth} "
                                     f"draft steps: set evaluate.k ≤ {depth} (or auto)")
            res = runner.run(prompts, {"method": method, "model": str(served), "num_speculative_tokens": k}, label)
            entry = result_entry(label, k, res, plain, head.kind, served, method)
            entry["checkpoint"] = str(path)
            if auto is not None:
                entry["k_auto"] = auto
            report["results"][label] = entry
            log.info("%s (vllm %s): tau=%.3f alpha=[%s] tok/s=%.1f%s", label, res["vllm"], entry["tau"],
                     " ".join(f"{a:.3f}" for a in entry["alpha"]), entry["tokens_per_s"],
                     f"; {entry['speedup_unpaired']:.2f}x plain (unpaired)" if plain is not None else "")
    return report
