"""Export a head checkpoint (`export.source`) to the native format (`export.dir`) and the engine
formats `export.formats` (default: native + every format an engine serves for
the head, artifacts/export.py default_formats) under `export.root`; each one is
validated against the target and read back before it is reported (artifacts/export.py, docs/export.md)."""

import logging
from pathlib import Path

from omegaconf import DictConfig

from scripts.runtime import stage_main

log = logging.getLogger(__name__)


def run_export(cfg: DictConfig) -> dict[str, Path]:
    """Returns {format: directory}; "native" is always among them."""
    from data.sources import target_config
    from artifacts.checkpoint import load_native, read_config
    from core.lock import writer_locks
    from artifacts.export import default_formats, export_head
    from inference_eval.model import tied_target

    if not Path(cfg.export.source).is_dir():
        raise FileNotFoundError(f"export.source={cfg.export.source}: no such directory (train a head first, or point "
                                "export.source at a native head checkpoint)")
    target = target_config(cfg.target)
    target_dir = target.dir
    log.info("export: loading %s and the target's embedding / lm_head from %s", cfg.export.source, target_dir)
    tied, args, _ = tied_target(target_dir)
    # the configured target's fingerprint: a head trained for another target (or target.dtype) is refused
    expected = target.fingerprint
    head = load_native(cfg.export.source, tied, args, expected_fingerprint=expected)
    formats = list(cfg.export.get("formats") or default_formats(head))
    dirs = {fmt: Path(cfg.export.dir) if fmt == "native" else Path(cfg.export.root) / fmt
            for fmt in dict.fromkeys(["native", *formats])}
    with writer_locks(dirs.values(), "export"):  # one writer per directory: a second export there is refused
        return export_head(head, dirs, target_dir, read_config(cfg.export.source).get("target_fingerprint"),
                           expected_fingerprint=expected, source=cfg.export.source)


@stage_main
def main(cfg: DictConfig) -> None:
    print("export " + " ".join(f"{fmt}={path}" for fmt, path in run_export(cfg).items()))


if __name__ == "__main__":
    main()
