"""The feature store (DESIGN.md §6): `manifest.json` + `shards/*.safetensors`.

A shard concatenates many samples: `input_ids` [T] int32, `loss_mask` [T] uint8, `hidden` [T, H]
(H_i, the last decoder layer's output before the final norm) in the storage dtype, `offsets` [n+1]
int64; sample ids are in the safetensors metadata. The manifest holds the schema version, the
target fingerprint, the captured layers, the data source and, per shard, sample and token counts and
the sha256.

Storage dtypes: bfloat16 (default), float16, float32, and fp8 (`float8_e4m3fn`, config alias `fp8`)
with a per-token fp32 scale `hidden_scale` [T] = amax(|H_t|) / 448 (1 for an all-zero row), the
per-row absmax scaling of FP8 formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning").
e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element whose magnitude is at least
amax / (448·2^6) of its row; smaller ones are subnormal, with an absolute error ≤ scale·2^-10. The
reader dequantizes transparently into the target's compute dtype from the fingerprint (bfloat16 for
the real target; float32 when it is not a float dtype we know), recorded as `dequantized_dtype` in
the manifest, so an fp8 store reads like a store written in that dtype. Bytes per token on disk:
2·H + 5 for bf16, H + 9 for fp8 (ids 4, mask 1, scale 4), plus the header and offsets amortised
over the shard.

Writes: every file is written to a dot-prefixed temp name, fsynced, renamed, and the directory is
fsynced; the manifest is rewritten the same way after each shard. A kill at any point leaves the
manifest listing only finished shards: a shard renamed into place but not yet in the manifest is
rewritten (identically) by the resumed run, and leftover temp files are removed when a writer opens
the directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8 = "float8_e4m3fn"
STORAGE_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}
STORAGE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": FP8, "fp8_e4m3": FP8}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class StoreError(RuntimeError):
    pass


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temp name in the same directory, fsync it, rename it over `path`, fsync the
    directory: a reader (or a killed writer's successor) sees the old file or the new one, never a
    prefix."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def storage_dtype(name: str) -> str:
    """Canonical storage dtype name (`fp8` -> `float8_e4m3fn`, `bf16` -> `bfloat16`)."""
    canon = STORAGE_ALIASES.get(name, name)
    if canon not in STORAGE_DTYPES:
        raise StoreError(f"storage dtype {name!r} not supported; choose from "
                         f"{sorted(STORAGE_DTYPES)} (or the aliases {sorted(STORAGE_ALIASES)})")
    return canon


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax scaling to float8_e4m3fn: `hidden` [T, H] -> (q [T, H] fp8, scale [T] fp32),
    hidden ≈ q.float() * scale[:, None]."""
    x = hidden.float()
    amax = x.abs().amax(dim=-1)  # [T]
    if not torch.isfinite(amax).all():
        raise StoreError("non-finite hidden state: cannot be stored in fp8 (nor trained on)")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # zero rows: any scale works
    q = (x / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    hidden: torch.Tensor  # [T, H]
    aux_hidden: torch.Tensor | None = None  # [T, K·H]: inputs of the captured aux layers (EAGLE-3)


class StoreWriter:
    """Appends samples, cuts shards by token budget, keeps the manifest current.

    Re-opening a directory whose manifest matches (same fingerprint and settings) resumes: the
    samples already in finished shards are reported by `done_ids` and skipped by the caller.
    """

    def __init__(self, root: str | Path, fingerprint: dict[str, Any], hidden_size: int,
                 dtype: str = "bfloat16", shard_tokens: int = 1 << 18, source: dict[str, Any] | None = None,
                 captured: dict[str, Any] | None = None) -> None:
        dtype = storage_dtype(dtype)
        self.root = Path(root)
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.aux_layers = list((captured or {}).get("aux_layers") or [])
        self.manifest = {
            "schema_version": SCHEMA_VERSION,
            "target_fingerprint": fingerprint,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "captured": captured or {"hidden": "last_layer_pre_norm"},  # + "aux_layers": [ids] (EAGLE-3)
            "source": source or {},
            "shards": [],
            "complete": False,
        }
        if dtype == FP8:
            self.manifest["hidden_scale"] = "float32 per token: amax(|H_t|) / 448"
            self.manifest["dequantized_dtype"] = dequantized_dtype_name(fingerprint)
        existing = self.root / "manifest.json"
        if existing.exists():
            try:
                old = json.loads(existing.read_text())
            except json.JSONDecodeError as e:
                raise StoreError(f"{existing}: unreadable manifest ({e}); not a store this writer made") from e
            keys = ("schema_version", "target_fingerprint", "hidden_size", "dtype", "captured", "source")
            diffs = [k for k in keys if old.get(k) != self.manifest[k]]
            if diffs:
                detail = "; ".join(f"{k}: stored {old.get(k)!r}, now {self.manifest[k]!r}" for k in diffs
                                   if k in ("dtype", "hidden_size", "schema_version"))
                raise StoreError(f"{existing}: an existing store with other settings (differs in {', '.join(diffs)}"
                                 f"{'; ' + detail if detail else ''}); resuming would mix them in one store: "
                                 "choose a new directory or delete it")
            self.manifest["shards"] = old["shards"]
            self.manifest["complete"] = old.get("complete", False)
        self._remove_stale_temps()
        self._pending: list[Sample] = []
        self._pending_tokens = 0

    def _remove_stale_temps(self) -> None:
        # A kill during a write leaves `.<name>.tmp`; it is never read, but remove it so the
        # directory holds only the manifest and the shards.
        for tmp in [*self.root.glob(".*.tmp"), *(self.root / "shards").glob(".*.tmp")]:
            log.info("removing %s left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)

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
            "offsets": offsets,
        }
        if self.dtype == FP8:
            tensors["hidden"], tensors["hidden_scale"] = quantize_fp8(torch.cat([s.hidden for s in self._pending]))
        else:
            tensors["hidden"] = torch.cat([s.hidden.to(STORAGE_DTYPES[self.dtype]) for s in self._pending])
        if self.aux_layers:
            missing = [s.sample_id for s in self._pending if s.aux_hidden is None]
            if missing:
                raise StoreError(f"{self.root}: sample {missing[0]!r} has no aux_hidden, but the store captures "
                                 f"layers {self.aux_layers}")
            aux = torch.cat([s.aux_hidden for s in self._pending])  # [T, K·H]
            if self.dtype == FP8:  # one scale per token and layer: the layers' magnitudes differ
                t, k = aux.shape[0], len(self.aux_layers)
                q, scale = quantize_fp8(aux.reshape(t * k, -1))
                tensors["aux_hidden"], tensors["aux_scale"] = q.reshape(t, -1), scale.reshape(t, k)
            else:
                tensors["aux_hidden"] = aux.to(STORAGE_DTYPES[self.dtype])
        ids = [s.sample_id for s in self._pending]
        path = self.root / name
        # save_file streams the tensors to disk (no second in-memory copy of a multi-GB shard)
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"sample_ids": json.dumps(ids)}))
        self.manifest["shards"].append({
            "file": name, "num_samples": len(ids), "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()), "sha256": sha256_file(path),
            "sample_ids": ids,
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


def dequantized_dtype_name(fingerprint: dict[str, Any]) -> str:
    """What an fp8 store reads back as: the target's compute dtype, or float32 if that is unknown."""
    name = fingerprint.get("compute_dtype")
    return name if name in DTYPES else "float32"


class FeatureStore:
    """Read side: memory-mapped shards, per-sample access, fingerprint check and sha256 verify.

    `hidden` comes back in the storage dtype, except for fp8 stores, which are dequantized into the
    manifest's `dequantized_dtype` (the target's compute dtype). With `verify_on_open=True` each
    shard's sha256 is checked the first time one of its samples (or its offsets) is read, and a
    mismatch raises StoreError naming the shard file; off by default because it reads every shard
    once in full.
    """

    def __init__(self, root: str | Path, expected_fingerprint: dict[str, Any] | None = None,
                 require_complete: bool = True, verify_on_open: bool = False) -> None:
        self.root = Path(root)
        self.verify_on_open = verify_on_open
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
            raise StoreError(f"{mpath}: the store is incomplete (precompute was interrupted); "
                             "rerun precompute to resume")
        if expected_fingerprint is not None:
            check_fingerprint(self.manifest["target_fingerprint"], expected_fingerprint, mpath)
        self._index: list[tuple[int, int]] = []  # (shard, position within shard)
        for si, shard in enumerate(self.manifest["shards"]):
            self._index.extend((si, j) for j in range(shard["num_samples"]))
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}
        self._verified: set[int] = set()
        self.storage_dtype = storage_dtype(self.manifest.get("dtype", "bfloat16"))
        self.hidden_dtype = (DTYPES[self.manifest.get("dequantized_dtype", "float32")] if self.storage_dtype == FP8
                             else STORAGE_DTYPES[self.storage_dtype])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def aux_layers(self) -> list[int]:
        """Target layers whose inputs the store holds as `aux_hidden` (empty: none)."""
        return list(self.manifest.get("captured", {}).get("aux_layers") or [])

    def token_counts(self, vocab_size: int, indices: list[int] | None = None) -> torch.Tensor:
        """How often each token id occurs as a loss (assistant) token in the given samples (all by default):
        the frequencies an EAGLE-3 draft vocabulary is chosen from."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(len(self)) if indices is None else indices:
            si, j = self._index[i]
            fh, offs = self._open(si), self._shard_offsets(si)
            ids = fh.get_slice("input_ids")[offs[j]:offs[j + 1]].long()
            mask = fh.get_slice("loss_mask")[offs[j]:offs[j + 1]].bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

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
            shard = self.manifest["shards"][si]
            path = self.root / shard["file"]
            if self.verify_on_open and si not in self._verified:
                if not path.exists():
                    raise StoreError(f"{path}: shard missing; the store is damaged, precompute it again")
                if sha256_file(path) != shard["sha256"]:
                    raise StoreError(f"{path}: sha256 does not match the manifest (corrupt shard); "
                                     "delete the store and precompute it again")
                self._verified.add(si)
            try:
                self._handles[si] = safe_open(path, framework="pt")
            except Exception as e:
                raise StoreError(f"{path}: cannot open shard ({e}); run `spechead verify {self.root}`") from e
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
        hidden = fh.get_slice("hidden")[a:b]
        if self.storage_dtype == FP8:
            hidden = dequantize_fp8(hidden, fh.get_slice("hidden_scale")[a:b], self.hidden_dtype)
        out = {
            "input_ids": fh.get_slice("input_ids")[a:b].long(),
            "loss_mask": fh.get_slice("loss_mask")[a:b].bool(),
            "hidden": hidden,
        }
        if self.aux_layers:
            aux = fh.get_slice("aux_hidden")[a:b]
            if self.storage_dtype == FP8:
                k = len(self.aux_layers)
                aux = dequantize_fp8(aux.reshape((b - a) * k, -1), fh.get_slice("aux_scale")[a:b].reshape(-1),
                                     self.hidden_dtype).reshape(b - a, -1)
            out["aux_hidden"] = aux
        return out

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


# ------------------------------------------------------------------------------------ several ranks
#
# With precompute.world_size = W > 1, rank r writes a store of its own (manifest + shards, resumable
# like any store) under `<root>/ranks/rank-<r:05d>/`, with `rank` and `world_size` in its manifest's
# `source`. `merge_rank_manifests` then writes `<root>/manifest.json` listing every rank's shards by
# their path relative to the root, so FeatureStore reads the merged store like a single-rank one.

RANKS_DIR = "ranks"
RANK_SOURCE_KEYS = ("rank", "world_size")  # in a rank store's `source`, dropped from the merged one


class IncompleteRanksError(StoreError):
    """A rank has not finished (or not started) yet: the merge has to wait for it."""


def rank_dir(root: str | Path, rank: int) -> Path:
    return Path(root) / RANKS_DIR / f"rank-{rank:05d}"


def check_rank_layout(root: str | Path, world_size: int) -> None:
    """Refuse to mix a single-rank store and a multi-rank one in one directory."""
    root = Path(root)
    manifest, ranks = root / "manifest.json", root / RANKS_DIR
    if world_size > 1 and manifest.exists() and "ranks" not in _read_manifest(manifest):
        raise StoreError(f"{manifest}: a single-rank store is already there; {world_size} ranks would write beside "
                         "it: choose another store_dir or delete it")
    if world_size == 1 and ranks.exists():
        raise StoreError(f"{ranks}: this store is written by several ranks; rerun with the same "
                         "precompute.world_size (a no-op once complete) or choose another store_dir")


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: unreadable manifest ({e})") from e


def merge_rank_manifests(root: str | Path) -> dict[str, Any]:
    """Write `<root>/manifest.json` over the rank stores in `<root>/ranks/` and return it.

    Every rank 0..world_size-1 must be complete (else IncompleteRanksError naming the rank
    directories that are not) and all must share one schema, target fingerprint, hidden size, storage
    dtype, captured layers and source (else StoreError naming the rank directory that differs from
    rank 0); a sample id in two ranks or a listed shard file missing is a StoreError too. The merged
    manifest lists the ranks' shards in rank order with paths relative to the root, their counts and
    sha256, under a `ranks` entry (world size, directories) and `complete: true`. Concurrent merges
    (two ranks finishing together) are serialised by a lock file and write the same manifest.
    """
    import fcntl

    root = Path(root)
    ranks = root / RANKS_DIR
    if not ranks.is_dir():
        raise StoreError(f"{ranks}: no rank directories; not a store written with precompute.world_size > 1")
    with open(ranks / ".merge.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        manifests: dict[int, dict[str, Any]] = {}
        for d in sorted(ranks.glob("rank-*")):
            if (d / "manifest.json").exists():
                manifests[int(d.name.split("-")[1])] = _read_manifest(d / "manifest.json")
        sizes = {r: m.get("source", {}).get("world_size") for r, m in manifests.items()}
        if not manifests:
            raise IncompleteRanksError(f"{ranks}: no rank has finished a shard yet")
        world_size = sizes[min(sizes)]
        for r, m in manifests.items():
            where = rank_dir(root, r)
            if sizes[r] != world_size or m["source"].get("rank") != r or not 0 <= r < world_size:
                raise StoreError(f"{where}: written as rank {m['source'].get('rank')} of {sizes[r]}, but "
                                 f"{rank_dir(root, min(sizes))} says {world_size} ranks; a store holds one run: "
                                 "delete the stray rank directory or choose another store_dir")
        check_rank_layout(root, world_size)
        missing = [r for r in range(world_size) if r not in manifests or not manifests[r].get("complete")]
        if missing:
            raise IncompleteRanksError("not every rank is complete: " + ", ".join(
                f"{rank_dir(root, r)} ({'no manifest yet' if r not in manifests else 'incomplete'})" for r in missing))
        first = manifests[0]
        settings = [k for k in first if k not in ("shards", "complete", "source")]
        common_source = {k: v for k, v in first["source"].items() if k not in RANK_SOURCE_KEYS}
        shards: list[dict[str, Any]] = []
        owner: dict[str, int] = {}
        for r in range(world_size):
            m, where = manifests[r], rank_dir(root, r)
            source = {k: v for k, v in m["source"].items() if k not in RANK_SOURCE_KEYS}
            diffs = [k for k in sorted(set(settings) | set(m) - {"shards", "complete", "source"})
                     if m.get(k) != first.get(k)] + (["source"] if source != common_source else [])
            if diffs:
                raise StoreError(f"{where}: differs from {rank_dir(root, 0)} in {', '.join(diffs)}; the ranks of "
                                 "one store must share the target and the settings: rerun that rank with the same "
                                 "config (after deleting its directory)")
            for shard in m["shards"]:
                path = where / shard["file"]
                if not path.exists():
                    raise StoreError(f"{path}: shard listed in {where / 'manifest.json'} is missing; "
                                     f"delete {where} and rerun rank {r}")
                for sid in shard["sample_ids"]:
                    if sid in owner:
                        raise StoreError(f"{where}: sample {sid!r} is also in {rank_dir(root, owner[sid])}; the "
                                         "ranks were not run over one partition: precompute the store again")
                    owner[sid] = r
                shards.append({**shard, "file": path.relative_to(root).as_posix()})
        merged = {**{k: first[k] for k in settings}, "source": common_source, "shards": shards,
                  "ranks": {"world_size": world_size,
                            "dirs": [rank_dir(root, r).relative_to(root).as_posix() for r in range(world_size)]},
                  "complete": True}
        atomic_write_bytes(root / "manifest.json", json.dumps(merged, indent=1).encode())
    return merged
