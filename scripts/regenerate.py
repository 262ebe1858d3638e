"""Regenerate: replace the assistant turns of the configured conversations by the target's own
replies (self-distillation) and write them as JSONL to `regenerate.out`; train on them with
`data.source=jsonl data.path=<out>`."""

from omegaconf import DictConfig

from scripts import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from data.regenerate import regenerate

    out, stats = regenerate(cfg)
    print(f"regenerate conversations={stats.conversations} tokens={stats.tokens} "
          f"tokens_per_s={stats.tokens_per_s:.1f} out={out}")


if __name__ == "__main__":
    main()
