"""Where the target and the conversations come from, as configured in `conf/target` and `conf/data`.

Every record that does not become a conversation is counted under one reason, never silently
dropped or included, with where it is (`<file>:<line>`) and its id when it has one: `not_utf8` and
`not_json` (a JSONL line / JSON-array record that is not valid UTF-8 / JSON), `truncated` (the file
ends inside a record), `too_large` / `too_deep` (a record over `data.max_record_bytes` bytes, or whose
containers nest deeper than `data.max_nesting`: core/jsonio.py `RecordBounds`), `malformed` (not an
object, missing fields, wrong types, a bad id), `lone_surrogate`, `nul_char`, `unknown_role`, `tool_turn`, `empty`,
`no_assistant_turn` (data/conversations.py's policy) and `duplicate_id` (a later record with an id
already taken: the store keys samples and resume by id; ShareGPT repeats 123 ids, never between two
usable records). The first rejections of each reason are kept as examples `{reason, where, id, detail}`
(`Conversations.examples`, bounded).

`data.source=text` (base models) reads a JSONL file of plain texts, `{"text": ..., "id"?: ...}` per line,
through the same machinery: its items are the texts themselves (loss on every token, data/conversations.py
`tokenize_text`), and a record without a string `text` is `malformed`, a blank one `empty`.

`data.source=hf` reads parquet/arrow/JSON files, dataset directories and Hub dataset ids through Hugging Face
`datasets` (data/hf_source.py); its rows are records like the others, at `<file>:<row>`. `data.columns` renames a
corpus's columns to the fields read, for every source.

Only a file that cannot be read as a whole stops the caller, with a :class:`SourceError` naming it:
missing, a directory or another file that is not a regular one (a FIFO, a device: refused from os.stat,
never opened), unreadable, empty or without a single record, UTF-16/32 or gzip, a JSON array
given as JSONL or the reverse, a JSONL file none of whose lines is JSON, a JSON array with a syntax
error before its end (the records after it cannot be located) or with data after its closing `]`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from core.jsonio import (MAX_NESTING, MAX_RECORD_BYTES, UTF8_BOM, RecordBounds, Rejected, json_array_records,
                         jsonl_records)
from data.assets import TARGET_SOURCES
from data.conversations import Drop, check_text, explain_record, json_type
from data.hub import hub_snapshot
from data.source_files import SourceError, check_file
from inference_eval.targets import TargetConfig

log = logging.getLogger(__name__)


def resolve_target_dir(path: str | Path | None, source: str | None, revision: str | None = None) -> Path:
    """An HF checkpoint directory for the configured target: `target.path` if given — a local directory, or a
    Hugging Face Hub id (`org/name`, at `target.revision`) that is not one, resolved to its snapshot in the Hub's
    cache (data/hub.py) —, else the packaged GGUF that `target.source` names (data/assets.py TARGET_SOURCES:
    smollm2_gguf, gemma3_270m_gguf) converted once into the cache."""
    hub = hub_snapshot(path, revision)  # None: a local path, or a packaged source (a revision is refused there)
    if path:
        target_dir = hub.dir if hub else Path(str(path)).expanduser()
        if not (target_dir / "config.json").exists():
            where = f"{path} (its Hub snapshot {target_dir})" if hub else target_dir
            raise FileNotFoundError(f"target.path={where}: no config.json (expected an HF checkpoint directory)")
        return target_dir

    if source in TARGET_SOURCES:
        return TARGET_SOURCES[source]()
    raise ValueError(f"target: set `path` to an HF checkpoint directory or `source` to one of "
                     f"{', '.join(TARGET_SOURCES)}")


def target_config(section: Any) -> TargetConfig:
    """The config's `target` section as the typed TargetConfig every stage takes: its directory resolved once
    (`resolve_target_dir`), a Hub target's repo id and commit recorded (the fingerprint's `source`), the rest
    checked."""
    path, revision = section.get("path"), section.get("revision")
    target_dir = resolve_target_dir(path, section.get("source"), revision)
    hub = hub_snapshot(path, revision)  # the resolution resolve_target_dir made, memoized
    return TargetConfig(dir=target_dir, name=str(section.get("name") or ""), dtype=str(section.get("dtype")),
                        fingerprint_mode=str(section.get("fingerprint", "header")),
                        device=str(section.get("device", "auto")), device_map=section.get("device_map"),
                        trust_remote_code=bool(section.get("trust_remote_code", False)),
                        hub_repo=hub.repo_id if hub else None, hub_commit=hub.commit if hub else None)


EXAMPLES_PER_REASON = 10  # rejections kept as examples per reason ...
MAX_EXAMPLES = 100  # ... and in all: a manifest stays small, every reason still shows
_DETAIL_CHARS = 300


def record_rejection(counts: Counter, examples: list[dict] | None, reason: str, where: str | None,
                     detail: str, sample_id: str | None = None) -> None:
    """Count one rejected record under `reason`; keep it as an example while under the caps.

    Logged at WARNING while kept as an example, at DEBUG after (a big source may reject thousands).
    Strings are made safe for logs and JSON: a lone surrogate becomes its backslash escape."""
    counts[reason] += 1
    detail = _printable(detail)[:_DETAIL_CHARS]
    where, sample_id = (None if v is None else _printable(v) for v in (where, sample_id))
    kept = (examples is not None and len(examples) < MAX_EXAMPLES
            and sum(e["reason"] == reason for e in examples) < EXAMPLES_PER_REASON)
    if kept:
        examples.append({"reason": reason, "where": where, "id": sample_id, "detail": detail})
    id_part = f" (id {sample_id!r})" if sample_id is not None else ""
    log.log(logging.WARNING if kept else logging.DEBUG, "%s%s: rejected, %s: %s", where or "?", id_part, reason,
            detail)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Conversations:
    items: list[tuple[str, list[dict] | str]]  # (sample id, messages; the text for data.source=text)
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    examples: list[dict] = field(default_factory=list)  # the first rejections: {reason, where, id, detail}
    where: dict[str, str] = field(default_factory=dict)  # sample id -> "<file>:<line>" of its record

    def reject(self, reason: str, where: str | None, detail: str, sample_id: str | None = None) -> None:
        record_rejection(self.rejected, self.examples, reason, where, detail, sample_id)


SOURCES = ("sharegpt", "json", "jsonl", "text", "hf")
_SOURCE_WORDS = ("sharegpt (the packaged dump, or a file in its format), json (a file holding one JSON array of "
                 "records), jsonl (one record per line), text (plain texts for a base model, one {\"text\": ...} "
                 "per line) or hf (through Hugging Face datasets: parquet/arrow/json files or a glob, a dataset "
                 "directory, or a Hub dataset id)")
COLUMN_FIELDS = ("conversations", "messages", "id", "text")  # the record fields `data.columns` may map


def _whole(value: Any, at_least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


@dataclass(frozen=True)
class DataConfig:
    """The conversations a stage reads (`conf/data`): the source and its file, the range [skip, skip + max_samples)
    of its usable records, the tokens kept per sample, the chat-template file used instead of the tokenizer's, and
    the bounds on one record. Built once from the config's `data` section (`DataConfig.of`), each value checked
    here, naming the setting; the file itself is checked by `check_source`."""

    source: str = "sharegpt"
    path: Path | None = None  # None with source=sharegpt: the packaged dump
    skip: int = 0
    max_samples: int | None = None  # None: every record after `skip`
    max_length: int = 1024
    chat_template: Path | None = None
    max_record_bytes: int = MAX_RECORD_BYTES
    max_nesting: int = MAX_NESTING
    # data.source=hf (data/hf_source.py): the split and config of a Hub dataset or saved DatasetDict, and whether
    # rows are streamed (null: local files streamed, Hub datasets converted into datasets' cache first)
    split: str | None = None
    name: str | None = None
    streaming: bool | None = None
    # a corpus's column names for the fields read, e.g. {messages: chat, id: prompt_id}; every source
    columns: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise SourceError(f"data.source={self.source!r}: expected {_SOURCE_WORDS}")
        for key in ("split", "name"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SourceError(f"data.{key}={value!r}: expected a name or null")
        if self.streaming is not None and not isinstance(self.streaming, bool):
            raise SourceError(f"data.streaming={self.streaming!r}: expected true, false or null (local files "
                              "streamed, Hub datasets cached)")
        if self.source != "hf":
            for key in ("split", "name", "streaming"):
                if getattr(self, key) is not None:
                    raise SourceError(f"data.{key}={getattr(self, key)!r} applies to data.source=hf only "
                                      f"(data.source={self.source}): remove it")
        if self.columns is not None:
            if not isinstance(self.columns, dict) or not all(
                    isinstance(v, str) and v.strip() for v in self.columns.values()):
                raise SourceError(f"data.columns={self.columns!r}: expected a mapping from fields read "
                                  f"({', '.join(COLUMN_FIELDS)}) to the corpus's column names")
            unknown = sorted(set(self.columns) - set(COLUMN_FIELDS))
            if unknown:
                raise SourceError(f"data.columns.{unknown[0]}: not a field read (expected {', '.join(COLUMN_FIELDS)})")
            if {"conversations", "messages"} <= set(self.columns):
                raise SourceError("data.columns: map either conversations (ShareGPT turns) or messages (OpenAI "
                                  "turns), not both")
        for key, at_least, unit, null in (("skip", 0, "conversations", None),
                                          ("max_samples", 1, "conversations", "the whole source"),
                                          ("max_length", 1, "tokens", None)):
            value = getattr(self, key)
            if not (value is None and null) and not _whole(value, at_least):
                words = f"null ({null}) or " if null else ""
                raise SourceError(f"data.{key}={value!r}: expected {words}a whole number of {unit} ≥ {at_least}")
        for key, default, unit in (("max_record_bytes", MAX_RECORD_BYTES, "bytes"),
                                   ("max_nesting", MAX_NESTING, "levels")):
            value = getattr(self, key)
            if not _whole(value, 1):
                raise SourceError(f"data.{key}={value!r}: expected a positive whole number of {unit} per record "
                                  f"(default {default})")

    @classmethod
    def of(cls, section: Any) -> "DataConfig":
        """The typed form of a `data` section (a DictConfig or a mapping; absent keys take the defaults above). A key
        that is not a data setting is refused, naming it: a misspelt bound would otherwise be ignored."""
        if section is None:
            return cls()
        if not isinstance(section, dict):
            from omegaconf import OmegaConf

            section = OmegaConf.to_container(section, resolve=True)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise SourceError(f"data.{unknown[0]}: not a data setting (expected {', '.join(sorted(known))})")
        values = dict(section)
        for key in ("path", "chat_template"):
            if values.get(key):
                values[key] = Path(str(values[key])).expanduser()
            else:
                values[key] = None
        if values.get("columns") is not None:
            values["columns"] = dict(values["columns"]) if isinstance(values["columns"], dict) else values["columns"]
        if values.get("source") is None:
            values.pop("source", None)
        return cls(**values)

    @property
    def bounds(self) -> RecordBounds:
        return RecordBounds(self.max_record_bytes, self.max_nesting, settings="data")

    def held_out(self, num: int | None) -> "DataConfig":
        """The `num` usable records right after the training range [skip, skip + max_samples) (all after it: None):
        held-out prompts never seen in training."""
        if self.max_samples is None:
            raise ValueError("evaluate.dataset=sharegpt takes the conversations after the training range "
                             "[data.skip, data.skip + data.max_samples); data.max_samples is null (the whole source "
                             "was used for training), so nothing is held out")
        return replace(self, skip=self.skip + self.max_samples, max_samples=num)


def check_source(data: DataConfig) -> None:
    """What can be refused from a file's first bytes, before any record is read: a missing or unreadable file or one
    that is not a regular file, and a source/path mismatch (a JSON array given as JSONL or the reverse), each with
    the setting that fixes it. The settings themselves were checked when `data` was built."""
    source = data.source
    if source == "hf":
        from data import hf_source

        hf_source.check(data)
        return
    if data.path is None:
        if source != "sharegpt":
            raise SourceError(f"data.source={source} needs data.path=<file>")
        return
    path = data.path
    check_file(path, source)
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    text = head[len(UTF8_BOM):] if head.startswith(UTF8_BOM) else head
    first = text.lstrip(b" \t\r\n")[:1]
    if not first and len(head) < (1 << 16):
        raise SourceError(f"{path}: no records (only whitespace)")
    if source == "text" and first != b"{":
        raise SourceError(f"data.path={path}: data.source=text reads JSONL, one {{\"text\": ...}} object per line; "
                          f"this file starts with {first!r}. A plain .txt file becomes one record with "
                          "`jq -Rs '{text: .}' file.txt > file.jsonl`")
    if source == "jsonl" and first == b"[":
        raise SourceError(f"data.path={path} starts with '[' (a JSON array of records), but data.source=jsonl "
                          "reads one record per line: set data.source=json (or sharegpt)")
    if source in ("json", "sharegpt") and first == b"{":
        raise SourceError(f"data.path={path} starts with '{{' (one object per line: JSONL), but "
                          f"data.source={source} reads one top-level JSON array: set data.source=jsonl")


def _records(data: DataConfig):
    source, bounds = data.source, data.bounds
    if source == "hf":
        from data import hf_source

        yield from hf_source.records(data)
        return
    if source == "sharegpt" and data.path is None:
        from data.assets import sharegpt_path
        check_file(sharegpt_path(), "json")
        yield from json_array_records(sharegpt_path(), SourceError, bounds)
        return
    if data.path is None:
        raise SourceError(f"data.source={source} needs data.path")
    check_file(data.path, "jsonl" if source in ("jsonl", "text") else "json")
    yield from (jsonl_records(data.path, SourceError, bounds=bounds) if source in ("jsonl", "text")
                else json_array_records(data.path, SourceError, bounds))


def _sample_id(record: dict, index: int) -> tuple[str | None, Drop | None]:
    """A record's id: its `id` (a string, or an integer written as one), else its position among the
    source's records. Other types would give ids that differ by how they print (1.0, [1], true)."""
    raw = record.get("id")
    if raw is None:
        return str(index), None
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        return None, Drop("malformed", f"id: expected a string or an integer, got {json_type(raw)}")
    sample_id = str(raw)
    if not sample_id.strip():
        return None, Drop("malformed", "id: blank")
    return sample_id, check_text(sample_id, "id")


def explain_text(record: object) -> tuple[str | None, Drop | None]:
    """A `data.source=text` record's text, or why it is not one."""
    if not isinstance(record, dict):
        return None, Drop("malformed", f"record: expected an object with 'text', got {json_type(record)}")
    if "text" not in record:
        return None, Drop("malformed", "record: no 'text' field (data.source=text reads {\"text\": ...} per line)")
    text = record["text"]
    if not isinstance(text, str):
        return None, Drop("malformed", f"text: expected a string, got {json_type(text)}")
    if not text.strip():
        return None, Drop("empty", f"text: blank ({len(text)} characters)")
    bad = check_text(text, "text")
    return (None, bad) if bad else (text, None)


def _mapped(record: object, columns: dict[str, str] | None) -> object:
    """A record with the corpus's columns renamed to the fields read (`data.columns`); a mapped turn list replaces
    the other kind (a corpus with both columns is read by the mapping)."""
    if not columns or not isinstance(record, dict):
        return record
    record = dict(record)
    for field_name, column in columns.items():
        if column in record:
            value = record.pop(column)
            if field_name in ("conversations", "messages"):
                record.pop("conversations", None)
                record.pop("messages", None)
            record[field_name] = value
    return record


def load_conversations(data: DataConfig) -> Conversations:
    """Normalised conversations [skip, skip + max_samples) of the source, with rejects counted by
    reason (see the module docstring); SourceError when the file cannot be read at all. For
    `data.source=text` the items are the texts."""
    explain = explain_text if data.source == "text" else explain_record
    out = Conversations(items=[])
    skip, limit = data.skip, data.max_samples
    seen = 0
    first_at: dict[str, str] = {}  # sample id -> where its (accepted) record is
    for n, item in enumerate(_records(data)):
        if limit is not None and len(out.items) >= int(limit):
            break
        if isinstance(item, Rejected):
            out.reject(item.reason, item.where, item.detail)
            continue
        record, where = _mapped(item.value, data.columns), item.where
        sample_id, drop = _sample_id(record, n) if isinstance(record, dict) else (None, None)
        if drop is not None:
            out.reject(drop.reason, where, drop.detail, sample_id)
            continue
        messages, drop = explain(record)
        if messages is None:
            out.reject(drop.reason, where, drop.detail, sample_id)
            continue
        if sample_id in first_at:
            out.reject("duplicate_id", where, f"id {sample_id!r} is taken by the record at {first_at[sample_id]}",
                       sample_id)
            continue
        first_at[sample_id] = where
        seen += 1
        if seen <= skip:
            continue
        out.items.append((sample_id, messages))
        out.where[sample_id] = where
    return out
