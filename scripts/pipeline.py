"""The one-shot demo: precompute → train → evaluate (trained vs untrained head) → export.

Last line: `demo tau_trained=<x> tau_untrained=<y> runtime_s=<z>`.
"""

import time

from omegaconf import DictConfig

from scripts import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from data.precompute import run_precompute
    from inference_eval.evaluate import run_evaluation
    from scripts.export import run_export
    from train.run import run_training

    t0 = time.perf_counter()
    store, pstats = run_precompute(cfg)
    print(f"[1/4] precompute: {pstats.samples} conversations, {pstats.tokens} tokens "
          f"({pstats.tokens_per_s:.0f} tok/s), rejected {dict(pstats.rejected)} → {store}")
    head_dir, metrics = run_training(cfg)
    print(f"[2/4] train: val acc_d1={metrics.get('val/acc_d1', float('nan')):.3f} → {head_dir}")
    report = run_evaluation(cfg)
    print(f"[3/4] evaluate on MT-Bench ({report['prompts']} first turns, greedy, k={report['k']}, "
          f"{report['max_new_tokens']} new tokens):")
    for label, r in report["results"].items():
        alpha = " ".join(f"α{d + 1}={a:.3f}" for d, a in enumerate(r["alpha"]))
        print(f"      {label:>9}: τ={r['tau']:.3f}  {alpha}  ({r['tokens_per_s']:.1f} tok/s)")
    exports = run_export(cfg)
    native = exports["native"]
    print("[4/4] export (validated, read back): " + ", ".join(f"{fmt} → {p}" for fmt, p in exports.items()))
    print(f"artifacts: store={store} head={head_dir} report={cfg.evaluate.report} export={native}")
    res = report["results"]
    print(f"demo tau_trained={res['trained']['tau']:.3f} tau_untrained={res['untrained']['tau']:.3f} "
          f"runtime_s={time.perf_counter() - t0:.0f}")


if __name__ == "__main__":
    main()
