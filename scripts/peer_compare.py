"""Entry point of experiments/peer_compare.py: `python -m scripts.peer_compare` (its docstring has the commands)."""

from omegaconf import DictConfig

from experiments.peer_compare import run_peer_compare
from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    run_peer_compare(cfg)


if __name__ == "__main__":
    main()
