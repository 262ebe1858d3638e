"""Evaluate head checkpoints (`evaluate.heads`) through the engine: τ and α_d, JSON report."""

from omegaconf import DictConfig

from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from experiments.stages import run_evaluation

    report = run_evaluation(cfg)
    for label, r in report["results"].items():
        print(f"evaluate {label} tau={r['tau']:.3f} alpha={[round(a, 3) for a in r['alpha']]} k={r['k']}")
    print(f"evaluate report={cfg.evaluate.report}")


if __name__ == "__main__":
    main()
