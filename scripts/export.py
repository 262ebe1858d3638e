"""Export a head checkpoint (`export.source`) to `export.dir`, with a reload check."""

from pathlib import Path

import hydra
from omegaconf import DictConfig


def run_export(cfg: DictConfig) -> Path:
    from data.sources import resolve_target_dir
    from heads.checkpoint import load_native, read_config
    from heads.export import export_native
    from inference_eval.model import tied_target

    tied, args, _ = tied_target(resolve_target_dir(cfg.target))
    head = load_native(cfg.export.source, tied, args)
    return export_native(head, cfg.export.dir, read_config(cfg.export.source).get("target_fingerprint"))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(f"export native={run_export(cfg)}")


if __name__ == "__main__":
    main()
