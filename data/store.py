"""The feature store (docs/design.md §6): `manifest.json` + `shards/*.safetensors`.

A shard concatenates many samples: `input_ids` [T] int32, `loss_mask` [T] uint8, `hidden` [T, H]
(H_i, the last decoder layer's output before the final norm) in the storage dtype, `offsets` [n+1]
int64; sample ids are in the safetensors metadata. The manifest holds the schema version, the
target fingerprint, the captured layers, the data source and, per shard, sample and token counts, the
sha256, the sample ids and each sample's content hash (`sample_hashes`, `sample_hash`: the sha256 of
its stored input ids and loss mask, 16 hex digits), what a resumed precompute compares with the
tokenized data to find the records that changed since they were stored.

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
fsynced (a shard hashed as its bytes are written, `write_safetensors`); the manifest is rewritten the same way after each shard. A kill at any point leaves the
manifest listing only finished shards: a shard renamed into place but not yet in the manifest is
removed when a writer resumes and written again (identically) by the resumed run, and leftover temp
files are removed when a writer opens the directory.

Integrity: the manifest records each shard's size (`bytes`; manifests from before it lack it and
skip only the size check) and sha256. Every open of a store for reading (`FeatureStore`) checks
every shard's size and safetensors header — the 8-byte length, the JSON header, tensor names,
dtypes, shapes and data offsets against the file size, the manifest's counts, hidden size, storage
dtype and aux layers, and the sample ids in the metadata — reading no tensor bytes. With
`verify="full"` (training's default, `train.data.verify_store`) it also checks every shard's
sha256, once per store state: a stamp `<store>/.verified.json` (written atomically) keys the
verification by a hash of the manifest and each shard's (size, mtime_ns), so later opens skip the
hashing until the manifest or a shard changes (a rewrite changes the mtime). A store on a read-only
mount still opens: the stamp cannot be written, so every open hashes again (logged). A damaged
shard is a StoreError naming the file. A resumed writer (`StoreWriter` over an existing manifest)
checks the size, header and sha256 of every finished shard (the hashing skipped while the stamp
vouches for the store as it is); from the first damaged or missing one on, the shards are dropped
from the manifest and recomputed by the resumed run (a warning names the file). `spechead verify`
removes the stamp when it finds a corrupt shard, so the next resume hashes again and repairs it.

Changed records: `StoreWriter.stored_hashes` gives each stored sample's content hash (a shard
written before `sample_hashes` existed gets them from its own input ids and loss masks, read from
the file, and keeps them in the manifest from its next write on: older stores resume by content
too). `StoreWriter.drop_samples` removes samples from the finished shards: each shard holding one
is rewritten without it under a new name (the other samples' bytes copied unchanged), the manifest
switches to the new files in one atomic write, then the old files are removed; shard files the
manifest does not list are removed when a writer resumes.

Target fingerprint (`core/fingerprint.py`, `inference_eval.model.target_fingerprint`): sha256 of the config (volatile keys dropped), of the
tokenizer + chat template files, and `weights_sha256`: the sha256 of every weight file's name,
size and safetensors header — no tensor bytes are read, so it costs milliseconds for a 140 GB
target (`weights_hash: "header"`). `full_hash=True` (hydra `target.fingerprint: full`) also hashes
the tensor bytes into `weights_content_sha256` (`weights_hash: "full"`). `check_fingerprint`
compares every identity key both sides hold (config, tokenizer, weight headers and sizes, the content
hash when both have one, the compute dtype); fingerprints of stores written before `weights_hash` existed hold the
content hash in `weights_sha256` and are comparable only to a `full` fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from core.files import DiskFull, atomic_write, atomic_write_bytes, sha256_file
from core.fingerprint import LEGACY_UNCOMPARABLE, compare_fingerprints, same_target_but_method
from core.lock import live_holder
from core.safetensors_io import SAFETENSORS_DTYPE, read_safetensors_header, write_safetensors

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8 = "float8_e4m3fn"
STORAGE_DTYPES = {**DTYPES, FP8: torch.float8_e4m3fn}
STORAGE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": FP8, "fp8_e4m3": FP8}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SHARD_FILE = re.compile(r"shards/shard-(\d+)\.safetensors")
SAMPLE_HASH_HEX = 16  # 64 bits: a changed record goes unnoticed with probability 2^-64


class StoreError(RuntimeError):
    pass


def sample_hash(input_ids: Any, loss_mask: Any) -> str:
    """A sample's content hash: the sha256 of its input ids as int32 and its loss mask as uint8 (the bytes
    a shard stores; lists or CPU tensors), its first `SAMPLE_HASH_HEX` hex digits. The hidden states are
    a function of these and of the target, which the fingerprint covers."""
    h = hashlib.sha256(np.asarray(input_ids, dtype="<i4").tobytes())
    h.update(np.asarray(loss_mask, dtype=np.uint8).tobytes())
    return h.hexdigest()[:SAMPLE_HASH_HEX]


def _shard_sample_hashes(path: Path) -> list[str]:
    """The content hashes of a shard's samples, from its stored input ids and loss masks (no hidden bytes read)."""
    try:
        with safe_open(path, framework="pt") as f:
            offs = f.get_tensor("offsets").tolist()
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
    except Exception as e:
        raise StoreError(f"{path}: cannot read the shard's input ids ({e})") from e
    return [sample_hash(ids[a:b], mask[a:b]) for a, b in zip(offs, offs[1:])]


def _sha256_shards(root: Path, shards: list[dict[str, Any]]) -> list[str]:
    """The sha256 of each shard file, several at once: hashlib releases the GIL on large reads, so threads
    use several cores and keep a fast disk busy (one thread: ≈ 37 min for 3.3 TB)."""
    if not shards:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(shards)))) as pool:
        return list(pool.map(lambda sh: sha256_file(root / sh["file"]), shards))


def _stamp_key(manifest_bytes: bytes, stats: dict[str, tuple[int, int]]) -> str:
    """What a verification stamp vouches for: the manifest's bytes and each shard's (size, mtime_ns)."""
    h = hashlib.sha256(manifest_bytes)
    h.update(json.dumps(sorted((f, *v) for f, v in stats.items())).encode())
    return h.hexdigest()


def _stamped(root: Path, key: str) -> bool:
    try:
        return json.loads((root / STAMP).read_text()).get("key") == key
    except (OSError, ValueError, AttributeError):
        return False  # no stamp, an unreadable one, or one from another format: verify


def _write_stamp(root: Path, key: str, stats: dict[str, tuple[int, int]]) -> OSError | None:
    """Record a passed sha256 verification of the store at `root` as it is (`_stamp_key`); the error where
    the stamp cannot be written (a read-only store), else None."""
    record = {"key": key, "method": "sha256", "shards": len(stats), "bytes": sum(size for size, _ in stats.values()),
              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:  # atomic_write's temp name carries the pid: ranks may stamp together
        atomic_write_bytes(root / STAMP, json.dumps(record, indent=1).encode())
    except OSError as e:
        return e
    return None


def _expected_shard_tensors(shard: dict[str, Any], hidden_size: int, dtype: str,
                            num_aux: int) -> dict[str, tuple[str, list[int]]]:
    """The tensors (safetensors dtype, shape) a shard of this store must hold, from the manifest."""
    t, n, st = int(shard["num_tokens"]), int(shard["num_samples"]), SAFETENSORS_DTYPE[dtype]
    spec = {"input_ids": ("I32", [t]), "loss_mask": ("U8", [t]), "offsets": ("I64", [n + 1]),
            "hidden": (st, [t, hidden_size])}
    if dtype == FP8:
        spec["hidden_scale"] = ("F32", [t])
    if num_aux:
        spec["aux_hidden"] = (st, [t, num_aux * hidden_size])
        if dtype == FP8:
            spec["aux_scale"] = ("F32", [t, num_aux])
    return spec


def check_shard(path: Path, shard: dict[str, Any], hidden_size: int, dtype: str, num_aux: int) -> os.stat_result:
    """Size and header check of one shard against its manifest entry (no tensor bytes read); returns
    its stat. Raises StoreError naming the file when it is missing, has another size than the manifest
    records (`bytes`; skipped for manifests without it), or its header is malformed or does not
    describe the manifest's shard (tensor names, dtypes, shapes, sample ids)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise StoreError(f"{path}: shard missing") from None
    if "bytes" in shard and st.st_size != shard["bytes"]:
        raise StoreError(f"{path}: {st.st_size} bytes, the manifest records {shard['bytes']} "
                         f"({'truncated' if st.st_size < shard['bytes'] else 'grown'} or replaced)")
    header, _, _ = read_safetensors_header(path, error=StoreError)
    expected = _expected_shard_tensors(shard, hidden_size, dtype, num_aux)
    got = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    if set(got) != set(expected):
        raise StoreError(f"{path}: holds tensors {sorted(got)}, the store's shards hold {sorted(expected)}; "
                         "corrupt header or not this store's shard")
    for k, want in expected.items():
        if got[k] != want:
            raise StoreError(f"{path}: tensor {k!r} is {got[k][0]} {got[k][1]}, the manifest implies "
                             f"{want[0]} {want[1]}; corrupt header or not this store's shard")
    try:
        ids = json.loads((header.get("__metadata__") or {}).get("sample_ids", "null"))
    except json.JSONDecodeError:
        ids = None
    if "sample_ids" in shard and ids != shard["sample_ids"]:
        raise StoreError(f"{path}: the sample ids in its metadata are not the manifest's; "
                         "corrupt header or not this store's shard")
    return st


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
    """One sample's stored tensors. For an fp8 store the states may come quantised already (`quantize_sample`,
    where they were computed, before the copy to the host): `hidden` then is float8_e4m3fn with `hidden_scale`,
    `aux_hidden` with `aux_scale`, as `quantize_fp8` makes them — the writer stores them as they are."""

    sample_id: str
    input_ids: torch.Tensor  # [T] int
    loss_mask: torch.Tensor  # [T] 0/1
    hidden: torch.Tensor  # [T, H]
    aux_hidden: torch.Tensor | None = None  # [T, K·H]: inputs of the captured aux layers (EAGLE-3)
    hidden_scale: torch.Tensor | None = None  # [T] fp32: `hidden` is fp8 already
    aux_scale: torch.Tensor | None = None  # [T, K] fp32: `aux_hidden` is fp8 already


def quantize_states(hidden: torch.Tensor, aux: torch.Tensor | None, num_aux: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(hidden fp8, aux fp8, hidden_scale [T], aux_scale [T, K]) of `hidden` [T, H] and `aux` [T, K·H] on whatever
    device they are: one scale per token and, for the aux states, per layer (the layers' magnitudes differ)."""
    q, scale = quantize_fp8(hidden)
    if aux is None:
        return q, None, scale, None
    t = aux.shape[0]
    aq, ascale = quantize_fp8(aux.reshape(t * num_aux, -1))
    return q, aq.reshape(t, -1), scale, ascale.reshape(t, num_aux)


class StoreWriter:
    """Appends samples, cuts shards by token budget, keeps the manifest current.

    Re-opening a directory whose manifest matches (same fingerprint and settings) resumes: damaged
    shards are dropped (`_drop_damaged_shards`), the samples already in finished shards are reported
    by `done_ids` and skipped by the caller, which compares their content hashes (`stored_hashes`)
    with its own and removes the changed ones first (`drop_samples`). `previous_manifest` is the
    manifest found on opening (None for a new store).

    `background=True` (precompute): a full shard is written on a thread of its own — concatenated, converted,
    saved, fsynced, hashed, added to the manifest — while the caller goes on adding samples; at most one shard
    waits behind the one being written (`add` waits for it otherwise: memory stays bounded). Shards are written in
    order by that one thread, so the store is byte for byte the one a synchronous writer makes. A failed write
    is raised by the next `add` or by `close` (a full disk as `DiskFull` naming the shard; anything else as a
    StoreError naming it), and no later shard is written after it. `wait_s`: the seconds `add` and `close` spent
    writing (synchronous) or waiting for the thread.
    """

    QUEUED = 1  # full shards waiting behind the one being written (background)

    def __init__(self, root: str | Path, fingerprint: dict[str, Any], hidden_size: int,
                 dtype: str = "bfloat16", shard_tokens: int = 1 << 18, source: dict[str, Any] | None = None,
                 captured: dict[str, Any] | None = None, background: bool = False) -> None:
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
        self.previous_manifest: dict[str, Any] | None = None
        if existing.exists():
            manifest_bytes = existing.read_bytes()
            try:
                old = json.loads(manifest_bytes)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise StoreError(f"{existing}: unreadable manifest ({e}); not a store this writer made") from e
            if same_target_but_method(old.get("target_fingerprint"), fingerprint):
                self.manifest["target_fingerprint"] = old["target_fingerprint"]  # header vs full: same target
            keys = ("schema_version", "target_fingerprint", "hidden_size", "dtype", "captured", "source")
            diffs = [k for k in keys if old.get(k) != self.manifest[k]]
            if diffs:
                detail = "; ".join(f"{k}: stored {old.get(k)!r}, now {self.manifest[k]!r}" for k in diffs
                                   if k in ("dtype", "hidden_size", "schema_version"))
                raise StoreError(f"{existing}: an existing store with other settings (differs in {', '.join(diffs)}"
                                 f"{'; ' + detail if detail else ''}); resuming would mix them in one store: "
                                 "choose a new directory or delete it")
            self.previous_manifest = old
            self.manifest["shards"] = old["shards"]
            self.manifest["complete"] = old.get("complete", False)
            self._drop_damaged_shards(manifest_bytes)
            self._remove_unlisted_shards()
        self._remove_stale_temps()
        self._pending: list[Sample] = []
        self._pending_tokens = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="store-writer") if background else None
        self._writing: deque[Future] = deque()
        self._failed: BaseException | None = None
        self.wait_s = 0.0

    def _drop_damaged_shards(self, manifest_bytes: bytes) -> None:
        """Resume trusts no finished shard blindly: each one's size and header are checked (no tensor
        bytes read), then its sha256 against the manifest's — unless the store's verification stamp
        (`FeatureStore`'s, which this check also writes when every shard passes) vouches for the manifest
        and every shard's size and mtime as they are. The hashing reads the whole store once (threads,
        like a full open); a complete store rerun unchanged costs it once, later reruns only the stamp.
        From the first missing or damaged shard on, the shards leave the manifest and their samples are
        recomputed by the resumed run, in the batches of an uninterrupted run (a store no `drop_samples`
        has changed comes back byte for byte as an uninterrupted run writes it). The damaged file is
        removed (a warning names it), the later ones too (`_remove_unlisted_shards`)."""
        shards = self.manifest["shards"]
        bad, problem, stats = len(shards), "", {}
        for i, shard in enumerate(shards):
            try:
                st = check_shard(self.root / shard["file"], shard, self.manifest["hidden_size"], self.dtype,
                                 len(self.aux_layers))
                stats[shard["file"]] = (st.st_size, st.st_mtime_ns)
            except StoreError as e:
                bad, problem = i, str(e)
                break
        key = _stamp_key(manifest_bytes, stats) if bad == len(shards) else None
        if key is None or not _stamped(self.root, key):
            t0 = time.perf_counter()
            for i, (shard, digest) in enumerate(zip(shards, _sha256_shards(self.root, shards[:bad]))):
                if digest != shard["sha256"]:
                    bad, problem = i, (f"{self.root / shard['file']}: sha256 {digest[:16]}… does not match the "
                                       f"manifest's {shard['sha256'][:16]}… (corrupt shard)")
                    break
            else:
                if bad:
                    log.info("%s: sha256 of %d finished shards checked in %.1fs", self.root, bad,
                             time.perf_counter() - t0)
                if key is not None:
                    _write_stamp(self.root, key, stats)  # a read-only store is not written to anyway
        if bad == len(shards):
            return
        later = len(shards) - bad - 1
        log.warning("%s; resuming recomputes its %d samples%s", problem, shards[bad]["num_samples"],
                    f" and those of the {later} shard(s) after it" if later else "")
        self.manifest["shards"] = shards[:bad]
        self.manifest["complete"] = False
        self._write_manifest()  # no reader may take the damaged shard for a finished one
        (self.root / shards[bad]["file"]).unlink(missing_ok=True)

    def _remove_unlisted_shards(self) -> None:
        """Shard files the manifest does not list: those after a damaged one, and those a kill left between
        writing a rewritten shard and switching the manifest (`drop_samples`). Under the writer's lock
        nothing else writes here; readers read only what the manifest lists."""
        listed = {shard["file"] for shard in self.manifest["shards"]}
        for path in sorted((self.root / "shards").glob("shard-*.safetensors")):
            if f"shards/{path.name}" not in listed:
                log.info("removing %s: not in the manifest", path)
                path.unlink(missing_ok=True)

    def _remove_stale_temps(self) -> None:
        # A kill during a write leaves `.<name>.tmp`; it is never read, but remove it so the
        # directory holds only the manifest and the shards.
        for tmp in [*self.root.glob(".*.tmp"), *(self.root / "shards").glob(".*.tmp")]:
            log.info("removing %s left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)

    @property
    def done_ids(self) -> set[str]:
        return {sid for s in self.manifest["shards"] for sid in s["sample_ids"]}

    def stored_hashes(self) -> dict[str, str]:
        """{sample id: content hash (`sample_hash`)} of the samples in finished shards. A shard written
        before the manifest held `sample_hashes` gets them from its own input ids and loss masks (read
        from the file, whose sha256 the resume has checked), kept in the manifest from its next write on."""
        out: dict[str, str] = {}
        for shard in self.manifest["shards"]:
            if "sample_hashes" not in shard:
                shard["sample_hashes"] = _shard_sample_hashes(self.root / shard["file"])
            out.update(zip(shard["sample_ids"], shard["sample_hashes"]))
        return out

    def drop_samples(self, ids: set[str]) -> None:
        """Remove the samples `ids` from the finished shards, keeping every other sample's bytes: each
        shard holding one is rewritten without it under a new name (a shard left empty is dropped), then
        the manifest switches to the new files in one atomic write and the old files are removed. A kill
        before that write leaves the store as it was (the new files, unlisted, are removed by the next
        writer); after it, the store without the samples. The store is incomplete until the caller has
        added them again and closed it."""
        shards, replaced, written = [], [], []
        for shard in self.manifest["shards"]:
            keep = [j for j, sid in enumerate(shard["sample_ids"]) if sid not in ids]
            if len(keep) == shard["num_samples"]:
                shards.append(shard)
                continue
            replaced.append(self.root / shard["file"])
            if keep:
                shards.append(self._rewrite_shard(shard, keep, written))
                written.append(shards[-1]["file"])
        if not replaced:
            return
        self.manifest["shards"] = shards
        self.manifest["complete"] = False
        self._write_manifest()
        for path in replaced:
            path.unlink(missing_ok=True)

    def _rewrite_shard(self, shard: dict[str, Any], keep: list[int], taken: list[str]) -> dict[str, Any]:
        """A new shard file (a name neither listed nor in `taken`) holding the samples at positions `keep`
        of `shard`, their tensor bytes copied unchanged; its manifest entry."""
        path = self.root / shard["file"]
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        offs = tensors.pop("offsets").tolist()
        spans = [(offs[j], offs[j + 1]) for j in keep]
        out = {k: torch.cat([v[a:b] for a, b in spans]) for k, v in tensors.items()}  # the others are per token
        out["offsets"] = torch.zeros(len(keep) + 1, dtype=torch.int64)
        out["offsets"][1:] = torch.tensor([b - a for a, b in spans]).cumsum(0)
        hashes = shard.get("sample_hashes")
        return self._save_shard(out, [shard["sample_ids"][j] for j in keep],
                                [hashes[j] for j in keep] if hashes else None, taken)

    def _save_shard(self, tensors: dict[str, torch.Tensor], ids: list[str], hashes: list[str] | None,
                    taken: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """Write a shard (atomically) under the next free name and return its manifest entry. The name is
        one past the highest index of the listed shards and `taken`: the number of shards while no shard
        has been rewritten, so a resumed run names its shards as an uninterrupted one does."""
        name = self._next_shard_name(taken)
        path = self.root / name
        offsets = tensors["offsets"]
        if hashes is None:
            hashes = [sample_hash(tensors["input_ids"][a:b], tensors["loss_mask"][a:b])
                      for a, b in zip(offsets.tolist(), offsets[1:].tolist())]
        # streamed to disk (no second in-memory copy of a multi-GB shard) and hashed as it is written, not re-read:
        # the bytes are safetensors' save_file's
        digest: list[str] = []
        atomic_write(path, lambda tmp: digest.append(write_safetensors(tensors, tmp, {"sample_ids": json.dumps(ids)})))
        return {"file": name, "num_samples": len(ids), "num_tokens": int(offsets[-1]),
                "num_loss_tokens": int(tensors["loss_mask"].sum()), "bytes": path.stat().st_size,
                "sha256": digest[-1], "sample_ids": ids, "sample_hashes": hashes}

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
        pending, self._pending, self._pending_tokens = self._pending, [], 0
        t0 = time.perf_counter()
        try:
            if self._pool is None:
                self._write_shard(pending)
            else:
                self._wait(self.QUEUED)  # bounded: the shard being written and at most QUEUED behind it
                self._writing.append(self._pool.submit(self._write_shard, pending))
        finally:
            self.wait_s += time.perf_counter() - t0

    def _wait(self, keep: int) -> None:
        """Wait until at most `keep` shards are being written or queued; a failed write is raised here."""
        while len(self._writing) > keep:
            self._writing.popleft().result()

    def _write_shard(self, pending: list[Sample]) -> None:
        """One shard of `pending`, then the manifest listing it (the writer thread's job, in order)."""
        if self._failed is not None:  # an earlier shard failed: none after it may be written
            raise StoreError(f"{self.root}: not written, an earlier shard's write failed ({self._failed})")
        try:
            self._flush_samples(pending)
        except BaseException as err:
            self._failed = err
            if self._pool is None or isinstance(err, (DiskFull, StoreError)):
                raise
            raise StoreError(f"{self.root}: writing shard {self._next_shard_name()} failed: {type(err).__name__}: "
                             f"{err}; the shards before it are complete — rerun the same command to resume") from err

    def _next_shard_name(self, taken: list[str] | tuple[str, ...] = ()) -> str:
        """The next free shard name: one past the highest index of the listed shards and `taken`."""
        used = [int(m.group(1)) for f in [*(s["file"] for s in self.manifest["shards"]), *taken]
                if (m := SHARD_FILE.fullmatch(f))]
        return f"shards/shard-{max(used, default=-1) + 1:05d}.safetensors"

    def _flush_samples(self, pending: list[Sample]) -> None:
        lengths = [int(s.input_ids.numel()) for s in pending]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths).cumsum(0)
        tensors = {
            "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in pending]),
            "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in pending]),
            "offsets": offsets,
        }
        if self.aux_layers:
            missing = [s.sample_id for s in pending if s.aux_hidden is None]
            if missing:
                raise StoreError(f"{self.root}: sample {missing[0]!r} has no aux_hidden, but the store captures "
                                 f"layers {self.aux_layers}")
        quantized = [s.sample_id for s in pending if s.hidden_scale is not None]
        if quantized and self.dtype != FP8:
            raise StoreError(f"{self.root}: sample {quantized[0]!r} comes quantised to fp8, but the store holds "
                             f"{self.dtype}")
        if self.dtype == FP8:  # per token (and per aux layer): a sample quantised alone is quantised as in a shard
            parts = [(s.hidden, s.aux_hidden, s.hidden_scale, s.aux_scale) if s.hidden_scale is not None
                     else quantize_states(s.hidden, s.aux_hidden if self.aux_layers else None, len(self.aux_layers))
                     for s in pending]
            tensors["hidden"], tensors["hidden_scale"] = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])
            if self.aux_layers:
                tensors["aux_hidden"] = torch.cat([p[1] for p in parts])
                tensors["aux_scale"] = torch.cat([p[3] for p in parts])
        else:
            tensors["hidden"] = torch.cat([s.hidden.to(STORAGE_DTYPES[self.dtype]) for s in pending])
            if self.aux_layers:
                tensors["aux_hidden"] = torch.cat([s.aux_hidden for s in pending]).to(STORAGE_DTYPES[self.dtype])
        ids = [s.sample_id for s in pending]
        hashes = [sample_hash(s.input_ids, s.loss_mask) for s in pending]
        self.manifest["shards"].append(self._save_shard(tensors, ids, hashes))
        self._write_manifest()

    def _write_manifest(self) -> None:
        atomic_write_bytes(self.root / "manifest.json", json.dumps(self.manifest, indent=1).encode())

    def close(self) -> None:
        """Flush the last shard (waiting for the writer thread's) and mark the store complete."""
        self._flush()
        t0 = time.perf_counter()
        try:
            self._wait(0)
        finally:
            self.wait_s += time.perf_counter() - t0
            if self._pool is not None:
                self._pool.shutdown()
        self.manifest["complete"] = True
        self._write_manifest()


def dequantized_dtype_name(fingerprint: dict[str, Any]) -> str:
    """What an fp8 store reads back as: the target's compute dtype, or float32 if that is unknown."""
    name = fingerprint.get("compute_dtype")
    return name if name in DTYPES else "float32"


VERIFY_MODES = ("header", "full")
STAMP = ".verified.json"  # in the store's root: the full verification it last passed


class FeatureStore:
    """Read side: memory-mapped shards, per-sample access, fingerprint check, integrity checks.

    `hidden` comes back in the storage dtype, except for fp8 stores, which are dequantized into the
    manifest's `dequantized_dtype` (the target's compute dtype).

    Opening checks every shard's size and safetensors header against the manifest (`check_shard`,
    no tensor bytes read). `verify="full"` also checks every shard's sha256 — once per store state:
    the stamp `<root>/.verified.json` records the manifest's hash and each shard's (size, mtime_ns),
    and while they are unchanged later opens skip the hashing. A store that cannot take the stamp
    (read-only) is hashed at every full open. Any damage is a StoreError naming the shard files.
    `verify_on_open=True` is the older spelling of `verify="full"`.
    """

    def __init__(self, root: str | Path, expected_fingerprint: dict[str, Any] | None = None,
                 require_complete: bool = True, verify_on_open: bool = False, verify: str = "header") -> None:
        self.root = Path(root)
        self.verify_mode = "full" if verify_on_open else verify
        if self.verify_mode not in VERIFY_MODES:
            raise StoreError(f"verify={verify!r}: choose one of {VERIFY_MODES}")
        mpath = self.root / "manifest.json"
        if not mpath.exists():
            raise StoreError(f"{self.root}: no manifest.json — not a feature store (run precompute first)")
        manifest_bytes = mpath.read_bytes()
        try:
            self.manifest = json.loads(manifest_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
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
        self._aux_pick: list[int] | None = None  # positions among aux_layers that __getitem__ returns (None: all)
        self.storage_dtype = storage_dtype(self.manifest.get("dtype", "bfloat16"))
        self.hidden_dtype = (DTYPES[self.manifest.get("dequantized_dtype", "float32")] if self.storage_dtype == FP8
                             else STORAGE_DTYPES[self.storage_dtype])
        stats = self._check_headers()
        if self.verify_mode == "full":
            self._verify_full(manifest_bytes, stats)

    def _damaged(self, problems: list[str]) -> StoreError:
        hint = ("rerun precompute on the store (a resumed run recomputes the samples of shards whose size, header "
                f"or sha256 is damaged) or delete it and precompute it again; `spechead verify {self.root}` lists "
                "every corrupt shard")
        if len(problems) == 1:
            return StoreError(f"{problems[0]}; {hint}")
        shown = "; ".join(problems[:8]) + (f"; ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        return StoreError(f"{self.root}: {len(problems)} damaged shards: {shown}; {hint}")

    def _check_headers(self) -> dict[str, tuple[int, int]]:
        """Size + header of every shard; returns {file: (size, mtime_ns)}."""
        stats, problems = {}, []
        for shard in self.manifest["shards"]:
            try:
                st = check_shard(self.root / shard["file"], shard, self.hidden_size, self.storage_dtype,
                                 len(self.aux_layers))
                stats[shard["file"]] = (st.st_size, st.st_mtime_ns)
            except StoreError as e:
                problems.append(str(e))
        if problems:
            raise self._damaged(problems)
        return stats

    def _verify_full(self, manifest_bytes: bytes, stats: dict[str, tuple[int, int]]) -> None:
        key = _stamp_key(manifest_bytes, stats)
        if _stamped(self.root, key):
            log.debug("%s: sha256 verified before (%s, unchanged since)", self.root, self.root / STAMP)
            return
        t0 = time.perf_counter()
        problems = []
        shards = self.manifest["shards"]
        for shard, digest in zip(shards, _sha256_shards(self.root, shards)):
            path = self.root / shard["file"]
            if digest != shard["sha256"]:
                problems.append(f"{path}: sha256 {digest[:16]}… does not match the manifest's "
                                f"{shard['sha256'][:16]}… (corrupt shard)")
        if problems:
            raise self._damaged(problems)
        total = sum(size for size, _ in stats.values())
        log.info("%s: sha256 of %d shards (%.2f GB) verified in %.1fs", self.root, len(stats), total / 1e9,
                 time.perf_counter() - t0)
        if (e := _write_stamp(self.root, key, stats)) is not None:
            log.warning("%s: cannot write the verification stamp (%s); the store is verified, but the next "
                        "open with full verification hashes it again (train.data.verify_store=header skips that)",
                        self.root, e)

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def aux_layers(self) -> list[int]:
        """Target layers whose inputs the store holds as `aux_hidden` (empty: none)."""
        return list(self.manifest.get("captured", {}).get("aux_layers") or [])

    @property
    def read_aux_layers(self) -> list[int]:
        """The aux layers `__getitem__` returns as `aux_hidden`, in order: `aux_layers`, or the ones selected."""
        stored = self.aux_layers
        return stored if self._aux_pick is None else [stored[p] for p in self._aux_pick]

    def select_aux_layers(self, layers) -> None:
        """Have `__getitem__` return the states of these captured layers only, in this order — one store serves
        heads that read different subsets of the layers it captured. Raises StoreError naming the missing ones."""
        stored, layers = self.aux_layers, [int(i) for i in layers]
        missing = [i for i in layers if i not in stored]
        if missing or not layers or len(set(layers)) != len(layers):
            raise StoreError(f"{self.root}: the store holds aux layers {stored or 'none'}; cannot read {layers}"
                             + (f" ({missing} not among them)" if missing else " (a non-empty list of distinct ids)"))
        self._aux_pick = None if layers == stored else [stored.index(i) for i in layers]

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

    def sample_ids(self) -> list[str]:
        """The samples' ids in index order."""
        return [self.manifest["shards"][si]["sample_ids"][j] for si, j in self._index]

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
            if self._aux_pick is not None:
                k, t = len(self.aux_layers), b - a
                aux = aux.reshape(t, k, -1)[:, self._aux_pick].reshape(t, -1)
            out["aux_hidden"] = aux
        return out

    def verify(self) -> list[str]:
        """Recompute every shard's sha256; return the files that do not match (empty: all good), removing the
        verification stamps that vouched for them."""
        bad = []
        for shard in self.manifest["shards"]:
            path = self.root / shard["file"]
            if not path.exists() or sha256_file(path) != shard["sha256"]:
                bad.append(str(path))
        # A stamp that vouches for a corrupt shard (its bytes changed, its mtime did not) would let a full
        # open or a resumed precompute skip the hashing that finds it: remove the stamps of the store and of
        # the rank stores holding a corrupt shard, so a rerun of precompute repairs them.
        for store_dir in {self.root, *(Path(p).parent.parent for p in bad)} if bad else ():
            try:
                (store_dir / STAMP).unlink(missing_ok=True)
            except OSError:
                pass  # a read-only store: it is never stamped
        return bad

    def __getstate__(self):  # DataLoader workers reopen shards lazily
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


def check_fingerprint(stored: dict[str, Any], expected: dict[str, Any], where: Path | str) -> None:
    """Refuse (StoreError) a store whose target differs from the configured one, naming the store (`where`)
    and, for each differing key, the stored and the configured value (`core.fingerprint`'s comparison). A
    legacy fingerprint that cannot be compared with the configured one is refused too: the store's states
    would be used on faith."""
    diffs, uncompared = compare_fingerprints(stored, expected)
    items = [(k, sv, ev) for k, (sv, ev) in diffs.items()]
    if LEGACY_UNCOMPARABLE in uncompared:
        items.append((LEGACY_UNCOMPARABLE, stored.get("weights_sha256"), expected.get("weights_sha256")))
    if items:
        detail = "; ".join(f"{k}: stored {sv!r}, configured {ev!r}" for k, sv, ev in items)
        if [k for k, _, _ in items] == ["compute_dtype"]:
            remedy = (f"set target.dtype={stored.get('compute_dtype')} (the dtype the store's hidden states were "
                      "computed in) or precompute a new store")
        else:
            remedy = "precompute a new store for this target"
        raise StoreError(f"{where}: the store was built for another target or tokenizer or compute dtype "
                         f"(stored {stored.get('name')!r}, configured {expected.get('name')!r}; {detail}); {remedy}")


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


def _complete_rank_manifests(root: Path) -> tuple[dict[int, dict[str, Any]], int]:
    """({rank: its manifest}, world size) when ranks 0..world_size-1 all wrote complete stores of one run;
    IncompleteRanksError naming those that did not, StoreError for a rank of another run."""
    ranks = root / RANKS_DIR
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
    # A complete rank whose writer still holds its lock (core/lock.py; a rerun that may be rewriting it, or the
    # rank itself between its last write and its own merge) is not merged from: its writer merges after it.
    writing = {r: h for r in range(world_size) if (h := live_holder(rank_dir(root, r))) is not None}
    if writing:
        raise IncompleteRanksError("a rank is still being written: " + ", ".join(
            f"{rank_dir(root, r)} (pid {h.get('pid')} on {h.get('host')})" for r, h in writing.items()))
    return manifests, world_size


def merge_rank_manifests(root: str | Path) -> dict[str, Any]:
    """Write `<root>/manifest.json` over the rank stores in `<root>/ranks/` and return it.

    Every rank 0..world_size-1 must be complete and no longer held by its writer (core/lock.py; else
    IncompleteRanksError naming the rank directories that are not) and all must share one schema, target
    fingerprint, hidden size, storage dtype, captured layers and source (else StoreError naming the rank directory that differs from
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
        manifests, world_size = _complete_rank_manifests(root)
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
