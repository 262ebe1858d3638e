"""Entry point of experiments/ablation.py: `python -m scripts.ablation` (its docstring has the commands)."""

from omegaconf import DictConfig

from experiments.ablation import run_ablation
from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    run_ablation(cfg)


if __name__ == "__main__":
    main()
