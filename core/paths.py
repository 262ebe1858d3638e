"""Where spechead keeps what it makes once per machine (converted targets, regenerated replies, the
compiled CPU kernel): `$SPECHEAD_CACHE`, else `~/.cache/spechead`. Imports nothing of spechead."""

from __future__ import annotations

import os
from pathlib import Path

CONF = Path(__file__).resolve().parents[1] / "conf"  # the hydra configs (absolute: a stage may be defined anywhere)


def cache_dir(cache_root: Path | None = None) -> Path:
    root = cache_root or os.environ.get("SPECHEAD_CACHE") or Path.home() / ".cache" / "spechead"
    return Path(root)
