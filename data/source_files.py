"""What every data file must be before a record is read from it, and the error that names a data source which cannot
be read as a whole (`SourceError`): shared by the JSON readers (data/sources.py) and `datasets`' (data/hf_source.py).
"""

from __future__ import annotations

from pathlib import Path

from core.jsonio import not_a_file


class SourceError(ValueError):
    """The data file cannot be read as a whole; the message names it and says why."""


_OTHER_ENCODINGS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                    (b"\xfe\xff", "UTF-16"))


def check_file(path: Path, source: str) -> None:
    """Refuse, naming it, a file that cannot hold records at all. What the path is comes from os.stat first: a
    FIFO is never opened (that waits for a writer), a device never read (/dev/zero never ends)."""
    try:
        kind = not_a_file(path)
    except FileNotFoundError:
        raise SourceError(f"data.path={path}: no such file (data.source={source})") from None
    except OSError as e:
        raise SourceError(f"data.path={path}: cannot be read ({e})") from e
    if kind == "a directory":
        raise SourceError(f"data.path={path}: a directory; data.source={source} reads one file")
    if kind:
        raise SourceError(f"data.path={path}: {kind}, not a regular file; data.source={source} reads one file "
                          "(write the data to a file first)")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise SourceError(f"data.path={path}: cannot be read ({e})") from e
    if not head:
        raise SourceError(f"{path}: empty file (0 bytes): no records")
    for bom, name in _OTHER_ENCODINGS:
        if head.startswith(bom):
            raise SourceError(f"{path}: starts with a {name} byte-order mark; records must be UTF-8 "
                              f"(re-encode it, e.g. `iconv -f {name} -t UTF-8`)")
    if head.startswith(b"\x1f\x8b"):
        raise SourceError(f"{path}: gzip-compressed; decompress it first")
