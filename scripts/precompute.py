"""Precompute: run the target over conversations and write the feature store (`store_dir`)."""

from omegaconf import DictConfig

from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from experiments.stages import run_precompute

    store, stats = run_precompute(cfg)
    print(f"precompute store={store} samples={stats.samples} tokens={stats.tokens} "
          f"tok_per_s={stats.tokens_per_s:.0f} rejected={dict(stats.rejected)}")


if __name__ == "__main__":
    main()
