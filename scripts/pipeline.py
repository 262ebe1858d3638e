"""The one-shot demo: [regenerate →] precompute → train → evaluate (trained vs untrained head) → export.

`pipeline.head_modules` is the demo's training plan for a head of a module per draft depth (the default `mtp3`):
on a CPU it trains module 1 alone (`plan_modules`). `pipeline.regenerate: true` first replaces the data's
assistant turns by the target's own replies (data/regenerate.py, cached per machine by prompt set, target and settings) and trains on those.

Every setting the stages need is checked before the first one starts (scripts/checks.py). Last line:
`demo tau_trained=<x> tau_untrained=<y> speedup=<s> speedup_min=<a> speedup_max=<b> verdict=<faster|not_faster|within_noise>
predicted_speedup=<p> k=<k> draft_vocab=<n|all> runtime_s=<z> disk_mb=<d>` —
the trained head's τ and its speedup over plain decoding at the k (and draft vocabulary) `evaluate.k=auto`
chose, and the disk the run directory takes.
"""

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from core.timing import Paired
from scripts.runtime import stage_main


def disk_use(root: str | Path) -> dict[str, int]:
    """Bytes under each entry of `root` (files counted once, links not followed)."""
    root, out = Path(root), {}
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        total = 0
        if entry.is_file() and not entry.is_symlink():
            total = entry.stat().st_size
        elif entry.is_dir() and not entry.is_symlink():
            for base, _, files in os.walk(entry):
                total += sum(os.lstat(os.path.join(base, f)).st_size for f in files)
        out[entry.name] = total
    return out


def plan_modules(cfg: DictConfig) -> str | None:
    """`pipeline.head_modules`: whether the demo trains every per-depth module of its head (`head.num_modules`, 3 for
    the default `mtp3`) or module 1 alone — set into `cfg` for every stage (`head.num_modules: 1`,
    `train.module.depth: 1`, `deep_from_step: 0`); the line that says so, or None where the head trains as configured.

    auto: every module where training runs on a GPU, module 1 alone on a CPU. A round's cost there grows with k (the
    verify of k + 1 tokens is compute-bound on a few cores), so k=auto picks k ≤ 2 (docs/RESULTS.md: k = 1 on the
    Xeon of record, k = 2 on an EPYC), where the deeper modules are worth ≈ 0.01 τ (τ(k = 2) 1.395 with 3 modules,
    1.385 with one, whose module drafts every depth) for ≈ 2.4× the training time. Module 1 trains as it does among
    the three (with `detach_depths` and clipping per module nothing of depths 2–3 reaches it), so τ at k = 1 is the
    same; k=auto tries the k it would for the whole head (`evaluate.auto_max_k` capped at its modules). `all`: every
    module; 1: module 1 alone anywhere. (Two of three modules would refuse the k = 3 of in-loop validation: not
    offered.)"""
    setting = (cfg.get("pipeline") or {}).get("head_modules", "auto")
    have = cfg.head.get("num_modules")
    if setting == "all" or have is None or int(have) <= 1:
        return None
    if setting == "auto":
        from train.run import trains_on_cpu

        if not trains_on_cpu(cfg.trainer.get("accelerator")):
            return None
        why = "auto: training runs on the CPU, where k=auto picks k ≤ 2 and module 1 drafts depth 2 nearly as well"
    elif setting == 1:
        why = "as set"
    else:
        raise ValueError(f"pipeline.head_modules={setting!r}: auto, all or 1 (module 1 alone)")
    OmegaConf.update(cfg, "head.num_modules", 1, merge=False)
    OmegaConf.update(cfg, "train.module.depth", 1, merge=False)
    OmegaConf.update(cfg, "train.module.deep_from_step", 0, merge=False)  # no deeper depth to start later
    if isinstance(cfg.evaluate.get("auto_max_k"), int):  # k=auto tries the k the whole head would (≤ its modules)
        OmegaConf.update(cfg, "evaluate.auto_max_k", min(int(cfg.evaluate.auto_max_k), int(have)), merge=False)
    return (f"[plan] pipeline.head_modules={setting}: training module 1 of the head's {have} per-depth modules, which "
            f"drafts every depth ({why}; pipeline.head_modules=all trains all {have})")


def speed_verdict(trained: dict) -> str | None:
    """The line under the evaluation: the trained head's speedup over plain decoding as the paired groups
    measured it (median [min–max], evaluation/evaluate.py `evaluate_paired`), the verdict their spread
    supports (core/timing.py `Paired.verdict`: "faster" only when every group was faster, "not faster"
    when none was, else "within noise"), and the load-free prediction beside it (τ ÷ a round's cost).
    None when no plain baseline was measured."""
    if trained.get("speedup") is None:
        return None
    pairs = trained.get("speedup_pairs") or [trained["speedup"]]
    p = Paired(tuple(pairs))
    measured = f"{p.text()} paired groups" if len(pairs) > 1 else f"{p.median:.2f}x (one pass)"
    predicted = (f"; predicted {trained['predicted_speedup']:.2f}x from τ ÷ a round's cost in plain steps"
                 if trained.get("predicted_speedup") is not None else "")
    verdict = p.verdict()
    if verdict == "faster":
        return f"speed: faster than plain decoding in every paired group: {measured}{predicted}"
    if verdict == "not faster":
        probe = trained.get("k_auto") or {}
        return (f"speed: NOT faster than plain decoding in any paired group: {measured}{predicted}; "
                + ("no k=auto setting was faster either: " if probe and not probe.get("faster_than_plain") else "")
                + "serve without it, or train longer (docs/RESULTS.md)")
    return (f"speed: within this machine's timing noise: {measured}{predicted} — the groups straddle 1x (the "
            "machine's timing and τ from prompt to prompt), so the head is not reliably faster than plain decoding "
            "here (more evaluate.speed_pairs, a quieter machine, or a longer-trained head: docs/RESULTS.md)")


def stage_line(label: str, r: dict) -> str:
    alpha = " ".join(f"α{d + 1}={a:.3f}" for d, a in enumerate(r["alpha"]))
    speed = f"{r['tokens_per_s']:.1f} tok/s"
    if r.get("speedup") is not None:
        speed += f", {r['speedup']:.2f}x plain"
        if r.get("speedup_min") is not None:
            speed += f" [{r['speedup_min']:.2f}–{r['speedup_max']:.2f}]"
    chosen = f"k={r['k']}" + (f", draft vocabulary {r['draft_vocab'] or 'all'}" if "draft_vocab" in r else "")
    if r.get("k_from"):
        chosen += f": {r['k_from']}'s setting"
    return f"      {label:>9}: τ={r['tau']:.3f}  {alpha}  ({speed}; {chosen})"


@stage_main
def main(cfg: DictConfig) -> None:
    run_pipeline(cfg)


def run_pipeline(cfg: DictConfig) -> dict:
    """The demo's stages in order (main's body); returns the evaluation report."""
    from scripts.checks import check_before_work
    from scripts.export import run_export
    from experiments.stages import run_evaluation, run_precompute, run_training

    check_before_work(cfg, "pipeline")  # every stage's settings, before the first one loads anything
    t0 = time.perf_counter()
    plan = plan_modules(cfg)
    if plan:
        print(plan)
    if cfg.get("pipeline", {}).get("regenerate"):  # self-distillation: train on the target's own replies
        from experiments.stages import use_regenerated

        path, rstats = use_regenerated(cfg)
        print(f"[0/4] regenerate: {rstats.conversations + rstats.skipped_done} conversations "
              + ("(cached per machine: reused)" if rstats.cached else
                 f"({rstats.tokens} new tokens, {rstats.tokens_per_s:.0f} tok/s)") + f" → {path}")
    store, pstats = run_precompute(cfg)
    print(f"[1/4] precompute: {pstats.samples} conversations, {pstats.tokens} tokens "
          f"({pstats.tokens_per_s:.0f} tok/s), rejected {dict(pstats.rejected)} → {store}")
    head_dir, metrics = run_training(cfg)
    print(f"[2/4] train: val acc_d1={metrics.get('val/acc_d1', float('nan')):.3f} → {head_dir}")
    report = run_evaluation(cfg)
    print(f"[3/4] evaluate on {report['dataset']} ({report['prompts']} prompts, "
          f"{'greedy' if not report['temperature'] else 'T=' + str(report['temperature'])}, k={report['k']}, "
          f"{report['max_new_tokens']} new tokens):")
    for label, r in report["results"].items():
        print(stage_line(label, r))
    trained = report["results"]["trained"]
    verdict = speed_verdict(trained)
    if verdict:
        print("      " + verdict)
    exports = run_export(cfg)
    native = exports["native"]
    print("[4/4] export (validated, read back): " + ", ".join(f"{fmt} → {p}" for fmt, p in exports.items()))
    print(f"artifacts: store={store} head={head_dir} report={cfg.evaluate.report} export={native}")
    use = disk_use(cfg.run_dir)
    total = sum(use.values())
    big = [(name, b) for name, b in sorted(use.items(), key=lambda kv: -kv[1]) if b >= 2**17]
    rest = total - sum(b for _, b in big)
    print(f"disk: {cfg.run_dir} takes {total / 2**20:.1f} MB ("
          + ", ".join([f"{name} {b / 2**20:.1f} MB" for name, b in big] + ([f"other {rest / 2**20:.1f} MB"] if rest else []))
          + ")")
    res = report["results"]
    speed = trained.get("speedup")
    untrained = f"{res['untrained']['tau']:.3f}" if "untrained" in res else "nan"  # evaluate.heads.untrained=null
    print(f"demo tau_trained={res['trained']['tau']:.3f} tau_untrained={untrained} "
          f"speedup={'nan' if speed is None else f'{speed:.2f}'} "
          f"speedup_min={trained.get('speedup_min') or float('nan'):.2f} speedup_max={trained.get('speedup_max') or float('nan'):.2f} "
          f"verdict={(trained.get('speed_verdict') or 'none').replace(' ', '_')} "
          f"predicted_speedup={trained.get('predicted_speedup') or float('nan'):.2f} k={trained['k']} "
          f"draft_vocab={trained.get('draft_vocab') or 'all'} runtime_s={time.perf_counter() - t0:.0f} "
          f"disk_mb={total / 2**20:.0f}")
    return report


if __name__ == "__main__":
    main()
