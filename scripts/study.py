"""Entry point of experiments/study.py: `python -m scripts.study` (its docstring has the commands)."""

from omegaconf import DictConfig

from experiments.study import run_study
from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    run_study(cfg)


if __name__ == "__main__":
    main()
