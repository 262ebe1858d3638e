"""Entry point of experiments/fp8_study.py: `python -m scripts.fp8_study` (its docstring has the commands)."""

from omegaconf import DictConfig

from experiments.fp8_study import run_fp8_study
from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    run_fp8_study(cfg)


if __name__ == "__main__":
    main()
