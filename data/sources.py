"""Where the target and the conversations come from, as configured in `conf/target` and `conf/data`."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def resolve_target_dir(target_cfg: Any) -> Path:
    """An HF checkpoint directory for the configured target: `path` if given, else the packaged
    SmolLM2 GGUF converted once into the cache."""
    if target_cfg.get("path"):
        path = Path(target_cfg["path"]).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target.path={path}: no config.json (expected an HF checkpoint directory)")
        return path
    if target_cfg.get("source") == "smollm2_gguf":
        from data.assets import ensure_smollm2_checkpoint
        return ensure_smollm2_checkpoint()
    raise ValueError("target: set `path` to an HF checkpoint directory or `source: smollm2_gguf`")


@dataclass
class Conversations:
    items: list[tuple[str, list[dict]]]  # (sample id, messages)
    rejected: Counter = field(default_factory=Counter)  # reason -> count


def _records(data_cfg: Any):
    source = data_cfg.get("source", "sharegpt")
    if source == "sharegpt" and not data_cfg.get("path"):
        from data.assets import iter_json_records, sharegpt_path
        yield from iter_json_records(sharegpt_path())
    elif source in ("sharegpt", "json"):
        from data.assets import iter_json_records
        yield from iter_json_records(Path(data_cfg["path"]))
    elif source == "jsonl":
        path = Path(data_cfg["path"])
        with open(path, encoding="utf-8", errors="strict") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        log.warning("%s:%d: skipped, not JSON (%s)", path, n, e)
                        yield {"__malformed__": f"{path}:{n}"}
    else:
        raise ValueError(f"data.source={source!r}: expected sharegpt, json or jsonl")


def load_conversations(data_cfg: Any) -> Conversations:
    """Normalised conversations [skip, skip + max_samples) of the source, with rejects counted by reason."""
    from data.conversations import normalize_record

    out = Conversations(items=[])
    skip, limit = int(data_cfg.get("skip", 0)), data_cfg.get("max_samples")
    seen = 0
    for n, record in enumerate(_records(data_cfg)):
        if limit is not None and len(out.items) >= int(limit):
            break
        if not isinstance(record, dict) or "__malformed__" in record:
            out.rejected["malformed"] += 1
            continue
        messages, reason = normalize_record(record)
        if messages is None:
            out.rejected[reason or "malformed"] += 1
            continue
        seen += 1
        if seen <= skip:
            continue
        out.items.append((str(record.get("id", n)), messages))
    return out
