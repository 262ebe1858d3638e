"""The one reader of JSON and JSONL record files: every record comes with `<file>:<line>`, and a bad
record is a `Rejected` with its reason rather than the end of the file — a line that is not UTF-8 or not
JSON (JSONL), a record with bytes that are not UTF-8 or a file cut inside a record (a JSON array). What
cannot be recovered (no records at all, a syntax error that hides where the next record starts) raises
`error`, the caller's exception class. `read_jsonl` is the strict form: the first bad line raises.
Used by conversation sources, the packaged ShareGPT dump, prompt files and the checks. Imports nothing of
spechead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UTF8_BOM = b"\xef\xbb\xbf"
JSON_WS = " \t\r\n"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what `surrogateescape` leaves for a byte that is not UTF-8


@dataclass(frozen=True)
class Rejected:
    reason: str  # not_utf8 | not_json | truncated
    where: str  # <file>:<line>
    detail: str


@dataclass(frozen=True)
class Record:
    value: Any  # parsed JSON: an object if well-formed
    where: str  # <file>:<line>


def _ends_inside(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is the text running out mid-value (a truncation), not a syntax error."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip())


def _lines(path: Path, data: bytes | None) -> Iterator[bytes]:
    if data is not None:
        yield from data.splitlines(keepends=True)
        return
    with open(path, "rb") as f:
        yield from f


def jsonl_records(path: Path, error: type[Exception] = ValueError,
                  data: bytes | None = None) -> Iterator[Record | Rejected]:
    """Records of a JSONL file, one `Record` / `Rejected` per non-blank line: a line that is not
    UTF-8 or not JSON is rejected and the file goes on (lines are read as bytes and decoded one at a
    time). A UTF-8 byte-order mark at the start of a line is dropped (files concatenated by `cat`).
    `data`: the file's bytes already read (a caller that checked or cut them first); `path` names them."""
    lines = parsed = 0
    for n, raw in enumerate(_lines(path, data), 1):
        where = f"{path}:{n}"
        if raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM):]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lines += 1
            yield Rejected("not_utf8", where, f"byte {e.start} ({raw[e.start:e.start + 4]!r}...): {e.reason}")
            continue
        if not line.strip():
            continue
        lines += 1
        if lines == 1 and line.lstrip().startswith("["):
            _refuse_array_as_jsonl(path, line, error)
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            cut = not raw.endswith(b"\n") and _ends_inside(e, line)
            yield Rejected("truncated" if cut else "not_json", where,
                            f"column {e.colno}: {e.msg}" + (" (the file ends inside this record)" if cut else ""))
            continue
        parsed += 1
        yield Record(value, where)
    if not lines:
        raise error(f"{path}: no records (only blank lines)")
    if not parsed:
        raise error(f"{path}: none of its {lines} non-blank lines is a UTF-8 JSON value; not a JSONL file "
                          "(one JSON object per line)")


def _refuse_array_as_jsonl(path: Path, first_line: str, error: type[Exception]) -> None:
    """A JSONL file's first record that opens a JSON array: a pretty-printed array (`[` alone, not
    JSON) or one array of records on one line. (An array of non-objects stays a malformed record.)"""
    try:
        value = json.loads(first_line)
    except json.JSONDecodeError:
        value = None
    if value is None or any(isinstance(v, dict) for v in value):
        raise error(f"{path}: a JSON array of records, not JSONL (one object per line): "
                          "set data.source=json, or write one record per line")


def json_array_records(path: Path, error: type[Exception] = ValueError) -> Iterator[Record | Rejected]:
    """Records of a file holding one top-level JSON array, each a `Record` with the line it starts on.

    Decodes one element at a time with `raw_decode` from one in-memory string. The bytes are decoded
    with `surrogateescape`, so a record holding bytes that are not UTF-8 is rejected alone
    (`not_utf8`): its raw text then holds escape surrogates, which a JSON parse of valid UTF-8 never
    leaves there (a "\\ud800" escape is six ASCII characters in the raw text). A file that ends inside
    a record (the packaged ShareGPT dump does) yields a `truncated` rejection and stops; a syntax error
    before the end is a SourceError, since the records after it cannot be located."""
    data = path.read_bytes()
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM):]
    text = data.decode("utf-8", errors="surrogateescape")
    del data
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, JSON_WS)
    if pos >= len(text):
        raise error(f"{path}: no records (only whitespace)")
    if text[pos] != "[":
        hint = (": it starts with an object; for JSONL (one object per line) set data.source=jsonl"
                if text[pos] == "{" else "")
        raise error(f"{path}: expected a top-level JSON array of records at line "
                          f"{text.count(chr(10), 0, pos) + 1}{hint}")
    pos, line, counted, count = pos + 1, 1, 0, 0
    while True:
        pos = _skip(text, pos, JSON_WS + ",")
        line, counted = line + text.count("\n", counted, pos), pos
        where = f"{path}:{line}"
        if pos >= len(text):
            yield Rejected("truncated", where, f"the file ends without the closing ']' after {count} records; "
                                                "the records after the cut are missing")
            return
        if text[pos] == "]":
            break
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if _ends_inside(e, text):
                yield Rejected("truncated", where, f"the file ends inside this record ({e.msg}) after "
                                                    f"{count} complete records")
                return
            raise error(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}) in the record starting at "
                              f"line {line}; the records after it cannot be located: fix the file, or convert it "
                              "to JSONL, where a bad line costs only itself") from None
        count += 1
        bad = LONE_SURROGATE.search(text, pos, end)
        if bad:
            at = line + text.count("\n", pos, bad.start())
            byte = ord(bad.group()) - 0xDC00  # surrogateescape put byte b at U+DC00 + b
            yield Rejected("not_utf8", where, f"line {at}: byte 0x{byte:02x} is not UTF-8")
        else:
            yield Record(value, where)
        pos = end
    rest = _skip(text, pos + 1, JSON_WS)
    if rest < len(text):
        raise error(f"{path}:{text.count(chr(10), 0, rest) + 1}: data after the array's closing ']'; "
                          "the file holds more than one JSON value")
    if not count:
        raise error(f"{path}: an empty JSON array: no records")


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def read_jsonl(path: Path, error: type[Exception] = ValueError, data: bytes | None = None
               ) -> Iterator[tuple[Any, str]]:
    """(value, `<file>:<line>`) for each non-blank line of a JSONL file (or of its bytes `data`); the first
    line that is not a UTF-8 JSON value raises `error` naming it. An empty file (or one of blank lines only)
    yields nothing."""
    path = Path(path)
    if not (path.read_bytes() if data is None else data).strip():
        return
    for r in jsonl_records(path, error, data):
        if isinstance(r, Rejected):
            raise error(f"{r.where}: {'not UTF-8' if r.reason == 'not_utf8' else 'not JSON'} ({r.detail})")
        yield r.value, r.where
