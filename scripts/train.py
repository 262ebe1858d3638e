"""Train the configured head on the feature store; writes the native checkpoint to `head_dir`. The last line names
it with its held-out scores (val/*: those of the head saved, train/run.py `final_heldout_scores`)."""

from omegaconf import DictConfig

from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from experiments.stages import run_training

    head_dir, metrics = run_training(cfg)
    shown = " ".join(f"{k.replace('/', '_')}={v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
    print(f"train head={head_dir} {shown}")


if __name__ == "__main__":
    main()
