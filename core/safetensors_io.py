"""Reading safetensors files and HF checkpoint directories: headers without tensor bytes, one tensor at a
time, an index file checked against the files. One reader for every stage (the target's weights, a
store's shards, an export read back). Every file is opened through `open_safetensors`: its header length is
checked before anything is allocated, and a file safetensors cannot read is a `SafetensorsError` naming it.
Imports nothing of spechead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes → torch names, for messages and a config's torch_dtype
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class SafetensorsError(RuntimeError):
    """A safetensors file that is truncated, malformed or unreadable."""


SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                        "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def read_safetensors_header(path: Path, validate: bool = True,
                            error: type[Exception] = SafetensorsError) -> tuple[dict[str, Any], int, bytes]:
    """(header, file size, raw header bytes) of a safetensors file, reading only its first 8 + N bytes.

    The header must be a JSON object that fits the file. With `validate` (a store's shards) it must
    also be well formed: a JSON object of tensors, each with a known dtype, a shape and
    data offsets whose span is the tensor's byte size, the tensors tiling the data section with no
    gap or overlap, ending exactly at the end of the file (so a truncated or extended file fails).
    Raises `error` (a store passes its StoreError) naming the file otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise error(f"{path}: {size} bytes, shorter than a safetensors header (truncated)")
            n = int.from_bytes(prefix, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise error(f"{path}: header length {n} does not fit the file's {size} bytes "
                                 "(truncated or corrupt header)")
            raw = f.read(n)
    except OSError as e:
        raise error(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: the safetensors header is not valid JSON ({e}); corrupt header") from e
    if not isinstance(header, dict):
        raise error(f"{path}: the safetensors header is not a JSON object; corrupt header")
    if not validate:  # e.g. a target's weights, whose dtypes may be ones we do not size (sub-byte fp4, ...)
        return header, size, raw
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(t, dict) and t.get("dtype") in SAFETENSORS_ITEMSIZE and isinstance(t.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
              and len(t["data_offsets"]) == 2 and all(isinstance(o, int) for o in t["data_offsets"]))
        if not ok:
            raise error(f"{path}: tensor {name!r} has a malformed header entry {t!r}; corrupt header")
        numel = 1
        for d in t["shape"]:
            numel *= d
        begin, end = t["data_offsets"]
        if end - begin != numel * SAFETENSORS_ITEMSIZE[t["dtype"]]:
            raise error(f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but is {t['dtype']} "
                             f"{t['shape']}; corrupt header")
        spans.append((begin, end, name))
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise error(f"{path}: tensor {name!r} starts at byte {begin} of the data, expected {pos} "
                             "(gap or overlap); corrupt header")
        pos = end
    if 8 + n + pos != size:
        raise error(f"{path}: the header describes {8 + n + pos} bytes, the file has {size} "
                         f"({'truncated' if size < 8 + n + pos else 'trailing bytes'})")
    return header, size, raw


# safetensors' own order of dtypes (its Rust `Dtype` enum): a file lists its tensors by this rank, highest first,
# then by name — the order `write_safetensors` must follow to write the bytes `safetensors.torch.save_file` writes
_DTYPE_RANK = {name: i for i, name in enumerate(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16",
                                                  "BF16", "I32", "U32", "F32", "F64", "I64", "U64"])}
_TORCH_CODES = {getattr(torch, name): code for code, name in DTYPE_NAMES.items()}
WRITE_CHUNK = 64 << 20  # bytes written and hashed at a time: a chunk is hashed while it is still in cache


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` (CPU, any layout) to `path` as a safetensors file and return its sha256, computed from the
    bytes as they are written (the file is not read back). The bytes are `safetensors.torch.save_file`'s for the
    same tensors and metadata of one key (several keys it orders by its hash map, differently per process): its header (the metadata first, the tensors by dtype rank then name, compact JSON,
    padded with spaces to 8 bytes) and the tensors' little-endian bytes back to back."""
    if not all(t.device.type == "cpu" for t in tensors.values()):
        raise ValueError(f"{path}: write_safetensors takes CPU tensors")
    order = sorted(tensors, key=lambda name: (-_DTYPE_RANK[_TORCH_CODES[tensors[name].dtype]], name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _TORCH_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (len(raw).to_bytes(8, "little"), raw):
            f.write(part)
            digest.update(part)
        for name in order:
            data = memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), WRITE_CHUNK):
                chunk = data[start:start + WRITE_CHUNK]
                f.write(chunk)
                digest.update(chunk)
    return digest.hexdigest()


def open_safetensors(path: Path, device: str = "cpu"):
    """safetensors' `safe_open` of one file (a context manager), after the header length is checked
    (`read_safetensors_header`: a length past the file or past the format's limit is refused before anything
    is read or allocated). A file safetensors cannot open — truncated, a garbled header — is a SafetensorsError
    naming it (safetensors' own error names no file), with what the header check finds where it finds more."""
    path = Path(path)
    read_safetensors_header(path, validate=False)
    try:
        return safe_open(str(path), framework="pt", device=device)
    except Exception as e:  # noqa: BLE001 — safetensors' SafetensorError, and what its Rust side raises
        try:  # a precise diagnosis (truncated: the sizes) where the strict header check has one
            read_safetensors_header(path, validate=True)
        except SafetensorsError as why:
            raise SafetensorsError(f"{why} — safetensors cannot open it ({e})") from e
        raise SafetensorsError(f"{path}: not a readable safetensors file ({e}); truncated or damaged") from e


def load_safetensors_file(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (`open_safetensors`: a damaged file is refused naming it)."""
    with open_safetensors(path, device) as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open is not a dict)


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file (is this an HF checkpoint directory?)")
    return files


def checkpoint_tensor_names(path: Path) -> list[str]:
    """Every tensor name of an HF checkpoint directory, read from the safetensors headers alone."""
    names: list[str] = []
    for f in checkpoint_files(path):
        with open_safetensors(f) as fh:
            names.extend(fh.keys())
    return names


def stream_safetensors_dir(path: Path, names: set[str] | None = None, device: str | torch.device = "cpu"):
    """Yield (name, tensor) for the checkpoint's tensors (all, or `names`), each read straight onto
    `device`: one tensor is materialised at a time, so a caller that places each one before asking
    for the next never holds the whole state dict in host memory."""
    device = torch.device(device)
    where = "cpu" if device.type == "cpu" else str(device)
    for f in checkpoint_files(path):
        with open_safetensors(f, where) as fh:
            for key in fh.keys():
                if names is None or key in names:
                    yield key, fh.get_tensor(key)


def load_safetensors_dir(path: Path, names: set[str] | None = None,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read the tensors of an HF checkpoint directory (one file or an index of shards): for small
    selections (the frozen parts a head shares); models stream through `stream_safetensors_dir`."""
    return dict(stream_safetensors_dir(path, names, device))


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # torch name, e.g. "float32"


def scan_tensors(path: Path, problems: list[str] | None = None) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of every tensor in a checkpoint directory (headers only, no data).
    With an index file, the index must name exactly the tensors its files hold."""
    problems = problems if problems is not None else []
    files = sorted(path.glob("*.safetensors"))
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"] if (path / INDEX_FILE).exists() else None
    infos: dict[str, TensorInfo] = {}
    for f in files:
        with open_safetensors(f) as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                if key in infos:
                    problems.append(f"tensor {key!r} is stored twice ({infos[key].file.name} and {f.name})")
                infos[key] = TensorInfo(f, tuple(sl.get_shape()), DTYPE_NAMES.get(sl.get_dtype(), sl.get_dtype()))
    if not files:
        problems.append(f"no *.safetensors file in {path}")
    if index is not None:
        for key, fname in index.items():
            if key not in infos:
                problems.append(f"{INDEX_FILE} names {key!r} in {fname}, which holds no such tensor")
            elif infos[key].file.name != fname:
                problems.append(f"{INDEX_FILE} puts {key!r} in {fname}, but it is in {infos[key].file.name}")
        for key in sorted(set(infos) - set(index)):
            problems.append(f"tensor {key!r} ({infos[key].file.name}) is missing from {INDEX_FILE}")
    return infos


def load_tensor(info: TensorInfo, name: str) -> torch.Tensor:
    with open_safetensors(info.file) as fh:
        return fh.get_tensor(name)
