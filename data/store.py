"""The feature store (DESIGN.md §6): `manifest.json` + `shards/*.safetensors`.

A shard concatenates many samples: `input_ids` [T] int32, `loss_mask` [T] uint8, `hidden` [T, H]
(H_i, the last decoder layer's output before the final norm) in the storage dtype, `offsets` [n+1]
int64; sample ids are in the safetensors metadata. The manifest holds the schema version, the
target fingerprint, the captured layers, the data source and, per shard, sample and token counts and
the sha256. Every file is written to a temp name, fsynced and renamed; the manifest is rewritten
after each shard, so a killed run keeps every finished shard and resumes after the last one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SCHEMA_VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StoreError(RuntimeError):
    pass


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    hidden: torch.Tensor  # [T, H]


class StoreWriter:
    """Appends samples, cuts shards by token budget, keeps the manifest current.

    Re-opening a directory whose manifest matches (same fingerprint and settings) resumes: the
    samples already in finished shards are reported by `done_ids` and skipped by the caller.
    """

    def __init__(self, root: str | Path, fingerprint: dict[str, Any], hidden_size: int,
                 dtype: str = "bfloat16", shard_tokens: int = 1 << 18, source: dict[str, Any] | None = None,
                 captured: dict[str, Any] | None = None) -> None:
        if dtype not in DTYPES:
            raise StoreError(f"storage dtype {dtype!r} not supported; choose from {sorted(DTYPES)}")
        self.root = Path(root)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.manifest = {
            "schema_version": SCHEMA_VERSION,
            "target_fingerprint": fingerprint,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "captured": captured or {"hidden": "last_layer_pre_norm"},
            "source": source or {},
            "shards": [],
            "complete": False,
        }
        existing = self.root / "manifest.json"
        if existing.exists():
            old = json.loads(existing.read_text())
            same = all(old.get(k) == self.manifest[k] for k in
                       ("schema_version", "target_fingerprint", "hidden_size", "dtype", "captured", "source"))
            if not same:
                raise StoreError(f"{existing}: an existing store with other settings (target, dtype or source); "
                                 "choose a new directory or delete it")
            self.manifest["shards"] = old["shards"]
            self.manifest["complete"] = old.get("complete", False)
        self._pending: list[Sample] = []
        self._pending_tokens = 0

    @property
    def done_ids(self) -> set[str]:
        return {sid for s in self.manifest["shards"] for sid in s["sample_ids"]}

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def add(self, sample: Sample) -> None:
        self._pending.append(sample)
        self._pending_tokens += int(sample.input_ids.numel())
        if self._pending_tokens >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self.manifest["shards"])
        name = f"shards/shard-{index:05d}.safetensors"
        lengths = [int(s.input_ids.numel()) for s in self._pending]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {
            "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in self._pending]),
            "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in self._pending]),
            "hidden": torch.cat([s.hidden.to(DTYPES[self.dtype]) for s in self._pending]).contiguous(),
            "offsets": offsets,
        }
        ids = [s.sample_id for s in self._pending]
        path = self.root / name
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, tmp, metadata={"sample_ids": json.dumps(ids)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.manifest["shards"].append({
            "file": name, "num_samples": len(ids), "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()), "sha256": sha256_file(path), "sample_ids": ids,
        })
        self._write_manifest()
        self._pending, self._pending_tokens = [], 0

    def _write_manifest(self) -> None:
        atomic_write_bytes(self.root / "manifest.json", json.dumps(self.manifest, indent=1).encode())

    def close(self) -> None:
        """Flush the last shard and mark the store complete."""
        self._flush()
        self.manifest["complete"] = True
        self._write_manifest()


class FeatureStore:
    """Read side: memory-mapped shards, per-sample access, fingerprint check and sha256 verify."""

    def __init__(self, root: str | Path, expected_fingerprint: dict[str, Any] | None = None,
                 require_complete: bool = True) -> None:
        self.root = Path(root)
        mpath = self.root / "manifest.json"
        if not mpath.exists():
            raise StoreError(f"{self.root}: no manifest.json — not a feature store (run precompute first)")
        try:
            self.manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{mpath}: unreadable manifest ({e})") from e
        if self.manifest.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(f"{mpath}: schema_version {self.manifest.get('schema_version')} != {SCHEMA_VERSION}")
        if require_complete and not self.manifest.get("complete"):
            raise StoreError(f"{mpath}: the store is incomplete (precompute was interrupted); rerun precompute to resume")
        if expected_fingerprint is not None:
            check_fingerprint(self.manifest["target_fingerprint"], expected_fingerprint, mpath)
        self._index: list[tuple[int, int]] = []  # (shard, position within shard)
        for si, shard in enumerate(self.manifest["shards"]):
            self._index.extend((si, j) for j in range(shard["num_samples"]))
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def __len__(self) -> int:
        return len(self._index)

    def lengths(self) -> list[int]:
        out = []
        for si, j in self._index:
            offs = self._shard_offsets(si)
            out.append(offs[j + 1] - offs[j])
        return out

    def _open(self, si: int):
        if si not in self._handles:
            path = self.root / self.manifest["shards"][si]["file"]
            try:
                self._handles[si] = safe_open(path, framework="pt")
            except Exception as e:
                raise StoreError(f"{path}: cannot open shard ({e}); run `spechead-verify` on the store") from e
        return self._handles[si]

    def _shard_offsets(self, si: int) -> list[int]:
        if si not in self._offsets:
            self._offsets[si] = self._open(si).get_tensor("offsets").tolist()
        return self._offsets[si]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, j = self._index[i]
        fh = self._open(si)
        offs = self._shard_offsets(si)
        a, b = offs[j], offs[j + 1]
        return {
            "input_ids": fh.get_slice("input_ids")[a:b].long(),
            "loss_mask": fh.get_slice("loss_mask")[a:b].bool(),
            "hidden": fh.get_slice("hidden")[a:b],
        }

    def verify(self) -> list[str]:
        """Recompute every shard's sha256; return the files that do not match (empty: all good)."""
        bad = []
        for shard in self.manifest["shards"]:
            path = self.root / shard["file"]
            if not path.exists() or sha256_file(path) != shard["sha256"]:
                bad.append(str(path))
        return bad

    def __getstate__(self):  # DataLoader workers reopen shards lazily
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


def check_fingerprint(stored: dict[str, Any], expected: dict[str, Any], where: Path | str) -> None:
    diffs = [k for k in sorted(set(stored) | set(expected))
             if k in ("config_sha256", "weights_sha256", "tokenizer_sha256") and stored.get(k) != expected.get(k)]
    if diffs:
        raise StoreError(f"{where}: the store was built for another target or tokenizer "
                         f"(differs in {', '.join(diffs)}: stored {stored.get('name')!r}, configured "
                         f"{expected.get('name')!r}); precompute a new store for this target")


def target_fingerprint(model_dir: str | Path, name: str, compute_dtype: str) -> dict[str, Any]:
    """What identifies the hidden states: config, weights, tokenizer + chat template, dtype, versions."""
    import safetensors
    import transformers

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    weights = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(sha256_file(f).encode())
    tok = hashlib.sha256()
    for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        f = model_dir / fname
        if f.exists():
            tok.update(fname.encode() + f.read_bytes())
    return {
        "name": name,
        "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
        "weights_sha256": weights.hexdigest(),
        "tokenizer_sha256": tok.hexdigest(),
        "compute_dtype": compute_dtype,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__},
    }
