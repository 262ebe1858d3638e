"""The one reader of JSON and JSONL record files: every record comes with `<file>:<line>`, and a bad
record is a `Rejected` with its reason rather than the end of the file — a line that is not UTF-8 or not
JSON (JSONL), a record with bytes that are not UTF-8 or a file cut inside a record (a JSON array). What
cannot be recovered (no records at all, a syntax error that hides where the next record starts) raises
`error`, the caller's exception class. `read_jsonl` is the strict form: the first bad line raises.
Used by conversation sources, the packaged ShareGPT dump, prompt files and the checks. Imports nothing of
spechead.

Every record is bounded (`RecordBounds`): a record longer than `max_record_bytes` is `too_large`, one whose
containers nest deeper than `max_nesting` is `too_deep` (as is one too deep for the parser itself: its
RecursionError never escapes), one holding an integer of more digits than Python converts is `not_json`. A JSONL
line's length is known before it is parsed: a line over the bound is read in pieces and counted, never held whole.
The JSON-array reader holds the whole file as one string and learns a record's extent from its parse, so it drops
an oversized record right after parsing it, before any caller sees it. Only regular files are read: a FIFO, a
device or a directory is refused from os.stat, before anything opens it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UTF8_BOM = b"\xef\xbb\xbf"
JSON_WS = " \t\r\n"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what `surrogateescape` leaves for a byte that is not UTF-8


# Bounds on one record. The largest record of the packaged ShareGPT dump is 438 KB, the deepest 3 levels (an
# object, its turn array, a turn). 8 MiB is 19x that record, above a 128k-token conversation written as JSON or a
# book as one plain text, and bounds what one record costs downstream: tokenizing a record of 8 MB takes 1.2 GB
# (SmolLM2's tokenizer), one of 20 MB 2.8 GB.
MAX_RECORD_BYTES = 8 << 20
MAX_NESTING = 64


@dataclass(frozen=True)
class RecordBounds:
    """What one record may be: at most `max_record_bytes` bytes of JSON text (a JSONL line without its line
    ending, a JSON-array element from its first character to its last) and containers nested at most
    `max_nesting` deep (`[]` is 1 deep, a ShareGPT record 3). `settings`: the config section that sets them
    (`data`), named in rejections."""
    max_record_bytes: int = MAX_RECORD_BYTES
    max_nesting: int = MAX_NESTING
    settings: str | None = None

    def too_large(self, size: int) -> str:
        name = f" ({self.settings}.max_record_bytes)" if self.settings else ""
        return f"{size:,} bytes, over the limit of {self.max_record_bytes:,} bytes per record{name}"

    def too_deep(self, parser_error: RecursionError | None = None) -> str:
        name = f" ({self.settings}.max_nesting)" if self.settings else ""
        if parser_error is not None:
            return (f"containers nested deeper than the JSON parser follows ({parser_error}); the limit is "
                    f"{self.max_nesting} deep{name}")
        return f"containers nested more than {self.max_nesting} deep{name}"


@dataclass(frozen=True)
class Rejected:
    reason: str  # not_utf8 | not_json | truncated | too_large | too_deep
    where: str  # <file>:<line>
    detail: str


@dataclass(frozen=True)
class Record:
    value: Any  # parsed JSON: an object if well-formed
    where: str  # <file>:<line>


def _ends_inside(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is the text running out mid-value (a truncation), not a syntax error."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip())


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path: Path) -> str | None:
    """What `path` is when it is not a regular file ("a FIFO (named pipe)", "a character device", ...), else None.
    Asked of os.stat alone: opening a FIFO for reading waits for a writer, reading a device may never end. Raises
    what os.stat raises (FileNotFoundError, PermissionError)."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a regular file")


def _require_file(path: Path, error: type[Exception]) -> None:
    kind = not_a_file(path)
    if kind:
        raise error(f"{path}: {kind}, not a regular file: records are read from a file")


def _ending(raw: bytes) -> int:
    """Bytes of a line's line ending."""
    return 2 if raw.endswith(b"\r\n") else 1 if raw.endswith((b"\n", b"\r")) else 0


def _line_or_size(raw: bytes, limit: int) -> bytes | int:
    size = len(raw) - _ending(raw)
    return size if size > limit else raw


def _lines(path: Path, data: bytes | None, limit: int) -> Iterator[bytes | int]:
    """Each line's bytes or, for a line over `limit` bytes (its line ending aside), its length alone: such a line
    is read in pieces and counted, never held whole."""
    if data is not None:
        for raw in data.splitlines(keepends=True):
            yield _line_or_size(raw, limit)
        return
    with open(path, "rb") as f:
        while raw := f.readline(limit + 2):  # room for a line of `limit` bytes and its "\r\n"
            if raw.endswith(b"\n") or len(raw) < limit + 2:  # the whole line (the last one may lack its "\n")
                yield _line_or_size(raw, limit)
                continue
            size, piece = len(raw), raw
            while not piece.endswith(b"\n") and (piece := f.readline(1 << 16)):
                size += len(piece)
            yield size - _ending(piece)


def jsonl_records(path: Path, error: type[Exception] = ValueError, data: bytes | None = None,
                  bounds: RecordBounds = RecordBounds()) -> Iterator[Record | Rejected]:
    """Records of a JSONL file, one `Record` / `Rejected` per non-blank line: a line that is not
    UTF-8 or not JSON, or over `bounds`, is rejected and the file goes on (lines are read as bytes and
    decoded one at a time). A UTF-8 byte-order mark at the start of a line is dropped (files concatenated
    by `cat`). `data`: the file's bytes already read (a caller that checked or cut them first); `path`
    names them. A path that is not a regular file raises `error`."""
    if data is None:
        _require_file(path, error)
    lines = parsed = 0  # parsed: lines that are JSON values (accepted, or rejected for their size or depth)
    for n, raw in enumerate(_lines(path, data, bounds.max_record_bytes), 1):
        where = f"{path}:{n}"
        if isinstance(raw, int):
            lines, parsed = lines + 1, parsed + 1
            yield Rejected("too_large", where, bounds.too_large(raw))
            continue
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
        item = _parse_line(line, raw.endswith(b"\n"), where, bounds)
        parsed += not (isinstance(item, Rejected) and item.reason in ("not_json", "truncated"))
        yield item
    if not lines:
        raise error(f"{path}: no records (only blank lines)")
    if not parsed:
        raise error(f"{path}: none of its {lines} non-blank lines is a UTF-8 JSON value; not a JSONL file "
                          "(one JSON object per line)")


def _parse_line(line: str, ended: bool, where: str, bounds: RecordBounds) -> Record | Rejected:
    """One JSONL line (`ended`: it has its newline) as a Record, or why not: not JSON, cut by the end of the file,
    nested over the bound or too deep for the parser, or refused by the parser (an integer of more digits than
    Python converts)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        cut = not ended and _ends_inside(e, line)
        return Rejected("truncated" if cut else "not_json", where,
                        f"column {e.colno}: {e.msg}" + (" (the file ends inside this record)" if cut else ""))
    except RecursionError as e:
        return Rejected("too_deep", where, bounds.too_deep(e))
    except ValueError as e:
        return Rejected("not_json", where, f"the parser refused it: {e}")
    if _nested_over(value, bounds.max_nesting):
        return Rejected("too_deep", where, bounds.too_deep())
    return Record(value, where)


def _nested_over(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` deep in a parsed value, walked one level at a time (a
    recursive walk is what a deep value must not meet)."""
    level = [value] if isinstance(value, (list, dict)) else []
    for _ in range(limit):
        if not level:
            return False
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (list, dict))]
    return bool(level)


def _refuse_array_as_jsonl(path: Path, first_line: str, error: type[Exception]) -> None:
    """A JSONL file's first record that opens a JSON array: a pretty-printed array (`[` alone, not
    JSON) or one array of records on one line. (An array of non-objects stays a malformed record.)"""
    try:
        value = json.loads(first_line)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse: not a line of records either
        value = None
    if value is None or any(isinstance(v, dict) for v in value):
        raise error(f"{path}: a JSON array of records, not JSONL (one object per line): "
                          "set data.source=json, or write one record per line")


def json_array_records(path: Path, error: type[Exception] = ValueError,
                       bounds: RecordBounds = RecordBounds()) -> Iterator[Record | Rejected]:
    """Records of a file holding one top-level JSON array, each a `Record` with the line it starts on.

    Decodes one element at a time with `raw_decode` from one in-memory string (the whole file). The bytes
    are decoded with `surrogateescape`, so a record holding bytes that are not UTF-8 is rejected alone
    (`not_utf8`): its raw text then holds escape surrogates, which a JSON parse of valid UTF-8 never
    leaves there (a "\\ud800" escape is six ASCII characters in the raw text). A record over `bounds` is
    rejected alone (`too_large`, `too_deep`). A file that ends inside a record (the packaged ShareGPT dump
    does) yields a `truncated` rejection and stops; a syntax error before the end is a SourceError, since
    the records after it cannot be located. A path that is not a regular file raises `error`."""
    _require_file(path, error)
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
            item, end = _element(decoder, text, pos, line, where, bounds)
        except json.JSONDecodeError as e:
            if _ends_inside(e, text):
                yield Rejected("truncated", where, f"the file ends inside this record ({e.msg}) after "
                                                    f"{count} complete records")
                return
            raise error(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}) in the record starting at "
                              f"line {line}; the records after it cannot be located: fix the file, or convert it "
                              "to JSONL, where a bad line costs only itself") from None
        if end is None:  # a record the parser gave up on, whose end its brackets do not reach either
            yield Rejected(item.reason, where, f"{item.detail}; the file ends inside this record after {count} "
                                               "complete records")
            return
        count += 1
        yield item
        pos = end
    rest = _skip(text, pos + 1, JSON_WS)
    if rest < len(text):
        raise error(f"{path}:{text.count(chr(10), 0, rest) + 1}: data after the array's closing ']'; "
                          "the file holds more than one JSON value")
    if not count:
        raise error(f"{path}: an empty JSON array: no records")


def _element(decoder: json.JSONDecoder, text: str, pos: int, line: int, where: str, bounds: RecordBounds
             ) -> tuple[Record | Rejected, int | None]:
    """The array element at `pos` as a Record or Rejected, and where it ends (None: not found before the end of
    the text). A syntax error (JSONDecodeError) is the caller's: the element's end is unknown then."""
    try:
        value, end = decoder.raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError as e:
        return Rejected("too_deep", where, bounds.too_deep(e)), _value_end(text, pos)
    except ValueError as e:  # an integer of more digits than Python converts
        return Rejected("not_json", where, f"the parser refused it: {e}"), _value_end(text, pos)
    size = end - pos  # in characters: the size in bytes of an ASCII text; at most 4 bytes a character in another
    if not text.isascii() and size * 4 > bounds.max_record_bytes:
        size = len(text[pos:end].encode("utf-8", "surrogateescape"))
    if size > bounds.max_record_bytes:
        return Rejected("too_large", where, bounds.too_large(size)), end
    bad = LONE_SURROGATE.search(text, pos, end)
    if bad:
        at = line + text.count("\n", pos, bad.start())
        byte = ord(bad.group()) - 0xDC00  # surrogateescape put byte b at U+DC00 + b
        return Rejected("not_utf8", where, f"line {at}: byte 0x{byte:02x} is not UTF-8"), end
    if _nested_over(value, bounds.max_nesting):
        return Rejected("too_deep", where, bounds.too_deep()), end
    return Record(value, where), end


# From a position, everything up to the next bracket outside a string (whole strings skipped at the regex
# engine's speed), then that bracket: one match per bracket of a value.
_NEXT_BRACKET = re.compile(r'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+")*+([\[\]{}])', re.S)
_SCALAR = re.compile(r'"(?:[^"\\]++|\\.)*+"|[^\s,\]}]+')


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value starting at `pos` ends, found from its brackets and strings alone, without a parse
    (for a value the parser gave up on); None if the text ends first."""
    if text[pos] not in "[{":
        m = _SCALAR.match(text, pos)
        return m.end() if m else None
    depth, at = 0, pos
    while (m := _NEXT_BRACKET.match(text, at)) is not None:
        depth += 1 if m.group(1) in "[{" else -1
        at = m.end()
        if depth == 0:
            return at
    return None


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


_STRICT_WORDS = {"not_utf8": "not UTF-8", "too_large": "too large", "too_deep": "nested too deep"}


def read_jsonl(path: Path, error: type[Exception] = ValueError, data: bytes | None = None,
               bounds: RecordBounds = RecordBounds()) -> Iterator[tuple[Any, str]]:
    """(value, `<file>:<line>`) for each non-blank line of a JSONL file (or of its bytes `data`); the first
    line that is not a UTF-8 JSON value within `bounds` raises `error` naming it. An empty file (or one of
    blank lines only) yields nothing."""
    path = Path(path)
    if data is None:
        _require_file(path, error)
    if not (path.read_bytes() if data is None else data).strip():
        return
    for r in jsonl_records(path, error, data, bounds):
        if isinstance(r, Rejected):
            raise error(f"{r.where}: {_STRICT_WORDS.get(r.reason, 'not JSON')} ({r.detail})")
        yield r.value, r.where
