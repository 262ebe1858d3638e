"""`data.source=hf`: conversations read through Hugging Face `datasets`, from where corpora live.

`data.path` is one of
- parquet, arrow, JSON/JSONL or CSV files: a path or a glob (`shards/*.parquet`); each file is read by `datasets`'
  builder for its extension, in sorted order, and a record is `<file>:<row>` (its row in that file, from 0);
- a directory: one written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read by `load_from_disk`, the
  split `data.split`), else the data files under it (as a glob of every file with those extensions);
- a Hub dataset id (`HuggingFaceH4/ultrachat_200k`): `load_dataset(id, data.name, split=data.split)`, from
  `datasets`' cache when offline; a record is `<id>[<split>]:<row>`. Where that fails (offline, or the Hub
  unreachable) and the hub cache holds a snapshot of the repository (`hf download --repo-type dataset <id>`), its
  data files for the split are read as local files are (`snapshot_files`).

Rows are records as the JSON sources' are (data/conversations.py `explain_record`: ShareGPT `conversations`, OpenAI
`messages`; `text` for base models), with the same rejection accounting, after two steps: a column that is null in a
row is absent from its record (parquet gives every row every column of the file), and `data.columns` renames a
corpus's columns to the fields read (`{messages: chat, id: prompt_id}`; also applied to the JSON sources).

`data.streaming` reads rows as they are needed instead of converting the whole source into `datasets`' Arrow cache
first: null (the default) streams local files and converts Hub datasets and directories; true streams a Hub dataset
too (each run reads it from the Hub again).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.jsonio import Record, Rejected
from data.hub import hub_cache_dir, looks_like_repo_id
from data.source_files import SourceError, check_file

# the datasets builder for each data file extension
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
_SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


def has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def plan(path: Path | str) -> tuple[str, Any]:
    """How `data.path` is read: ("files", [file, ...]) | ("disk", directory) | ("hub", id). Raises SourceError, naming
    data.path, for a glob matching nothing, a file of an unknown extension, or a path that is neither on disk nor a
    Hub id."""
    text = str(path)
    if has_glob(text):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(text), recursive=True) if Path(f).is_file())
        if not files:
            raise SourceError(f"data.path={text}: no file matches this pattern (data.source=hf)")
        return "files", _known(files, text)
    local = Path(os.path.expanduser(text))
    if local.is_dir():
        if any((local / name).is_file() for name in _SAVED):
            return "disk", local
        files = sorted(f for f in local.rglob("*") if f.is_file() and f.suffix in BUILDERS)
        if not files:
            raise SourceError(f"data.path={local}: a directory with neither a dataset saved by save_to_disk nor data "
                              f"files ({', '.join(BUILDERS)}) under it")
        return "files", files
    if local.exists():
        return "files", _known([local], text)
    if not text.startswith(("/", ".", "~")) and looks_like_repo_id(text) and Path(text).suffix not in BUILDERS:
        return "hub", text
    raise SourceError(f"data.path={text}: no such file or directory, and not a Hub dataset id (org/name) "
                      "(data.source=hf)")


def _known(files: list[Path], text: str) -> list[Path]:
    odd = [f for f in files if f.suffix not in BUILDERS]
    if odd:
        raise SourceError(f"data.path={text}: {odd[0]} is not a data file datasets reads here (expected "
                          f"{', '.join(BUILDERS)})")
    return files


def check(data) -> None:
    """Pre-flight for data.source=hf: the path resolves (`plan`) and each local file is a readable regular file."""
    if data.path is None:
        raise SourceError("data.source=hf needs data.path=<parquet/arrow/json files or a glob, a dataset directory, "
                          "or a Hub dataset id>")
    kind, what = plan(data.path)
    if kind == "files":
        for f in what:
            check_file(f, "hf")


def _cache_dir() -> str | None:
    """datasets' cache as the environment says now (`datasets.config` read it once, at import)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "datasets")
    return None


def _rows(data) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the source, in order."""
    import datasets

    kind, what = plan(data.path)
    split = data.split or "train"
    streaming = data.streaming
    if kind == "files":
        for f in what:
            try:
                ds = datasets.load_dataset(BUILDERS[f.suffix], data_files=[str(f)], split="train",
                                           streaming=True if streaming is None else bool(streaming),
                                           cache_dir=_cache_dir())
            except Exception as e:  # datasets' builders raise many types for a file they cannot parse
                hint = ("; data.source=jsonl reads a JSONL file record by record, counting each bad one"
                        if BUILDERS[f.suffix] == "json" else "")
                raise SourceError(f"{f}: datasets cannot read it as {BUILDERS[f.suffix]} ({type(e).__name__}: "
                                  f"{_short(e)}){hint}") from e
            yield from _numbered(ds, str(f))
        return
    if kind == "disk":
        try:
            ds = datasets.load_from_disk(str(what))
        except Exception as e:
            raise SourceError(f"data.path={what}: load_from_disk failed ({type(e).__name__}: {_short(e)})") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SourceError(f"data.split={split}: {what} holds the splits {', '.join(ds)}; set data.split")
            ds = ds[split]
        elif data.split:
            raise SourceError(f"data.split={data.split}: {what} holds one dataset, not splits; remove data.split")
        yield from _numbered(ds, f"{what}[{split}]" if data.split else str(what))
        return
    try:
        ds = datasets.load_dataset(what, data.name, split=split, streaming=bool(streaming), cache_dir=_cache_dir())
    except Exception as e:
        files = snapshot_files(what, data.name, split)
        if not files:
            cached = (f"its snapshot in the Hugging Face cache ({hub_cache_dir()}) has no data file for that split and "
                      "config" if files is not None else f"the Hugging Face cache ({hub_cache_dir()}) holds no snapshot "
                      "of it")
            raise SourceError(f"data.path={what} (a Hub dataset id, data.name={data.name}, data.split={split}): "
                              f"load_dataset failed ({type(e).__name__}: {_short(e)}), and {cached}. Check the id, "
                              "data.name and data.split; a gated or private dataset needs HF_TOKEN; offline, "
                              f"download it once (`hf download --repo-type dataset {what}`) or set data.path to "
                              "local files") from e
        for f in files:
            ds = datasets.load_dataset(BUILDERS[f.suffix], data_files=[str(f)], split="train", streaming=True,
                                       cache_dir=_cache_dir())
            yield from _numbered(ds, str(f))
        return
    yield from _numbered(ds, f"{what}[{split}]")


# how datasets names a split in a repository's files: a directory named for it, or a file name starting with it
_SPLIT_SEP = "-._ 0123456789"
_KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")


def _names_split(rel: Path, split: str) -> bool:
    return split in rel.parts[:-1] or (rel.name.startswith(split) and rel.name[len(split):len(split) + 1] in
                                       _SPLIT_SEP)


def snapshot_files(repo: str, name: str | None, split: str) -> list[Path] | None:
    """The data files of a Hub dataset's snapshot in the hub cache (what `hf download --repo-type dataset` leaves)
    for `split` (and config `name`: a directory of that name), read when load_dataset cannot reach the Hub and
    datasets' own cache lacks the dataset. None without a snapshot, [] without a file for the split. Files naming no
    split at all are the train split, as datasets reads them."""
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(repo, repo_type="dataset", local_files_only=True, cache_dir=hub_cache_dir()))
    except Exception:  # not in the cache (LocalEntryNotFoundError) or an id the hub client refuses
        return None
    files = sorted(f for f in root.rglob("*") if f.suffix in BUILDERS and f.is_file())
    if name:
        files = [f for f in files if name in f.relative_to(root).parts[:-1]]
    chosen = [f for f in files if _names_split(f.relative_to(root), split)]
    if not chosen and split == "train" and not any(_names_split(f.relative_to(root), s) for f in files
                                                   for s in _KNOWN_SPLITS):
        chosen = files
    return chosen


def _numbered(ds, where: str) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(ds):
        yield f"{where}:{i}", row


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:300]


def records(data) -> Iterator[Record | Rejected]:
    """The source's rows as records: null columns dropped (the column mapping is applied by the caller, as for every
    source)."""
    for where, row in _rows(data):
        if isinstance(row, dict):
            row = {k: v for k, v in row.items() if v is not None}
        yield Record(row, where)


def fingerprint(data) -> dict[str, Any] | None:
    """The manifest's `data_file` for an hf source: local files by name, size and sha256 (several: `files`, with the
    pattern as the name); a directory or Hub id by name, split and config (information only, as for every source)."""
    from core.files import sha256_file

    kind, what = plan(data.path)
    if kind == "files":
        entries = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in what]
        if len(entries) == 1:
            return entries[0]
        return {"name": str(data.path), "bytes": sum(e["bytes"] for e in entries), "files": entries}
    return {"name": str(what), "split": data.split or "train", "config": data.name}
