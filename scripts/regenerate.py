"""Regenerate: replace the assistant turns of the configured conversations by the target's own
replies (self-distillation) and write them as JSONL to `regenerate.out` (`auto`: a file of the
machine's cache keyed by the prompt set, target and sampling settings, reused when they match); train
on them with `data.source=jsonl data.path=<out>`, the path the summary line ends with."""

from omegaconf import DictConfig

from scripts.runtime import stage_main


@stage_main
def main(cfg: DictConfig) -> None:
    from experiments.stages import regenerate

    out, stats = regenerate(cfg)
    print(f"regenerate conversations={stats.conversations} tokens={stats.tokens} "
          f"tokens_per_s={stats.tokens_per_s:.1f} cached={int(stats.cached)} out={out}")


if __name__ == "__main__":
    main()
