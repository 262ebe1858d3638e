"""Where the target and the conversations come from, as configured in `conf/target` and `conf/data`.

Every record that does not become a conversation is counted under one reason, never silently
dropped or included: `not_utf8` and `not_json` (a JSONL line that is not valid UTF-8 / JSON),
`malformed` (not an object, missing fields, wrong types), `unknown_role`, `empty`,
`no_assistant_turn` (data/conversations.py's policy) and `duplicate_id` (a later record with an id
already taken: the store keys samples and resume by id, and ShareGPT repeats 123 ids).
"""

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


@dataclass(frozen=True)
class _Rejected:
    reason: str


def _jsonl_records(path: Path):
    """Records of a JSONL file; a line that is not UTF-8 or not JSON yields a `_Rejected` and the
    file goes on (lines are read as bytes and decoded one at a time)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                log.warning("%s:%d: skipped, not UTF-8 (%s)", path, n, e)
                yield _Rejected("not_utf8")
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                log.warning("%s:%d: skipped, not JSON (%s)", path, n, e)
                yield _Rejected("not_json")


def _records(data_cfg: Any):
    source = data_cfg.get("source", "sharegpt")
    if source == "sharegpt" and not data_cfg.get("path"):
        from data.assets import iter_json_records, sharegpt_path
        yield from iter_json_records(sharegpt_path())
    elif source in ("sharegpt", "json"):
        from data.assets import iter_json_records
        yield from iter_json_records(Path(data_cfg["path"]))
    elif source == "jsonl":
        yield from _jsonl_records(Path(data_cfg["path"]))
    else:
        raise ValueError(f"data.source={source!r}: expected sharegpt, json or jsonl")


def load_conversations(data_cfg: Any) -> Conversations:
    """Normalised conversations [skip, skip + max_samples) of the source, with rejects counted by reason."""
    from data.conversations import normalize_record

    out = Conversations(items=[])
    skip, limit = int(data_cfg.get("skip", 0)), data_cfg.get("max_samples")
    seen = 0
    ids: set[str] = set()
    for n, record in enumerate(_records(data_cfg)):
        if limit is not None and len(out.items) >= int(limit):
            break
        if isinstance(record, _Rejected):
            out.rejected[record.reason] += 1
            continue
        if not isinstance(record, dict):
            out.rejected["malformed"] += 1
            continue
        messages, reason = normalize_record(record)
        if messages is None:
            out.rejected[reason or "malformed"] += 1
            continue
        sample_id = str(record.get("id", n))
        if sample_id in ids:
            out.rejected["duplicate_id"] += 1
            continue
        ids.add(sample_id)
        seen += 1
        if seen <= skip:
            continue
        out.items.append((sample_id, messages))
    return out
