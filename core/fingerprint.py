"""The target fingerprint: what identifies the hidden states a target produces — its config, weight
files (headers and sizes; the bytes too with `full`), tokenizer and chat template, compute dtype — and
the one comparison that stores, heads and result caches use to ask "the same target?".

Creation (`fingerprint_checkpoint`) reads the safetensors headers only: milliseconds for a 140 GB
target. Comparison (`compare_fingerprints`) compares every identity key both sides hold
(`FINGERPRINT_IGNORED` never: the display name, library versions, the hashing method, and `source` — where the
files came from, a Hugging Face Hub repo and commit: provenance, not identity, so the same files at a local path and
from the Hub are one target and a store made from one resumes from the other), and reports
what could not be compared (a key one side lacks; a legacy fingerprint whose `weights_sha256` hashed
the tensor bytes against a header-hashed one). Callers decide what an uncomparable key means: a store
refuses (`data.store.check_fingerprint`), a head loads with a warning (`artifacts.checkpoint`).
Imports nothing of spechead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from core.files import sha256_file
from core.safetensors_io import read_safetensors_header

FINGERPRINT_METHODS = ("header", "full")
FINGERPRINT_IGNORED = frozenset({"name", "versions", "weights_hash", "source"})
LEGACY_UNCOMPARABLE = ("weights_sha256 (one side hashes the weight bytes, an older spechead's fingerprint, "
                       "the other their headers: set target.fingerprint=full to compare them)")


def same_target_but_method(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Two fingerprints equal but for how the weights were hashed (header vs full) and where the files came from
    (`source`: a Hub repo and commit, or none for a local directory)."""
    if not isinstance(a, dict):
        return False
    aside = ("weights_hash", "weights_content_sha256", "source")  # the hashing method; where the files came from
    both_full = all("weights_content_sha256" in fp for fp in (a, b))
    return ("weights_hash" in a and {k: v for k, v in a.items() if k not in aside}
            == {k: v for k, v in b.items() if k not in aside}
            and (not both_full or a["weights_content_sha256"] == b["weights_content_sha256"]))


def compare_fingerprints(stored: dict[str, Any], expected: dict[str, Any]) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """({key: (stored, configured)} for every identity key both hold whose values differ — every key but
    `FINGERPRINT_IGNORED`, so keys a fingerprint gains are compared as soon as both sides have them —,
    what could not be compared). A fingerprint without `weights_hash` predates header
    hashing: its `weights_sha256` hashes the tensor bytes, so against a newer one it is compared with
    that one's `weights_content_sha256` (present with target.fingerprint=full), or not at all."""
    skip = set(FINGERPRINT_IGNORED)
    diffs: dict[str, tuple[Any, Any]] = {}
    uncompared = sorted((set(stored) ^ set(expected)) - skip)
    s_legacy, e_legacy = ("weights_hash" not in fp and "weights_sha256" in fp for fp in (stored, expected))
    if s_legacy != e_legacy and "weights_sha256" in stored and "weights_sha256" in expected:
        skip.add("weights_sha256")
        legacy, newer = (stored, expected) if s_legacy else (expected, stored)
        if "weights_content_sha256" in newer:
            skey, ekey = ("weights_sha256", "weights_content_sha256") if s_legacy else ("weights_content_sha256",
                                                                                      "weights_sha256")
            if stored[skey] != expected[ekey]:
                diffs[f"{skey} (stored) vs {ekey} (configured)"] = (stored[skey], expected[ekey])
            uncompared = [k for k in uncompared if k != "weights_content_sha256"]
        else:
            uncompared.append(LEGACY_UNCOMPARABLE)
    for k in sorted((set(stored) & set(expected)) - skip):
        if stored[k] != expected[k]:
            diffs[k] = (stored[k], expected[k])
    return diffs, uncompared


def weights_header_sha256(files: list[Path]) -> tuple[str, int]:
    """(sha256 over each weight file's name, size and raw safetensors header, total bytes): reads the
    headers only, never the tensor bytes. A malformed or truncated file is a SafetensorsError naming it."""
    h, total = hashlib.sha256(), 0
    for f in files:
        _, size, raw = read_safetensors_header(f, validate=False)
        h.update(f"{f.name}\0{size}\0{len(raw)}\0".encode())
        h.update(raw)
        total += size
    return h.hexdigest(), total


def fingerprint_checkpoint(model_dir: str | Path, name: str, compute_dtype: str, full_hash: bool | str = False,
                           tied_conventions: dict[str, Any] | None = None) -> dict[str, Any]:
    """What identifies the hidden states: config, weights, tokenizer + chat template, dtype, versions.

    The weights enter as `weights_sha256`, the hash of every `*.safetensors` file's name, size and
    header (tensor names, dtypes, shapes, offsets, metadata), with `weights_bytes` their total size:
    milliseconds for a 140 GB target, no tensor bytes read. `full_hash=True` (or "full"; the hydra key
    `target.fingerprint`) adds `weights_content_sha256`, the sha256 of every file's bytes (what
    `weights_sha256` was before `weights_hash` existed); `weights_hash` records "header" or "full".
    A target whose family ties E, N_f, W_lm to a head otherwise than Llama (Gemma: E·√H, (1 + w) norm)
    records how as `tied_conventions` (heads/layers.py TiedConventions), which the caller passes
    (`inference_eval.model.target_fingerprint` reads them from the target's family); Llama-family ones
    record none."""
    import safetensors
    import transformers

    if isinstance(full_hash, str):
        if full_hash not in FINGERPRINT_METHODS:
            raise ValueError(f"target.fingerprint={full_hash!r}: choose one of {FINGERPRINT_METHODS}")
        full_hash = full_hash == "full"
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    files = sorted(model_dir.glob("*.safetensors"))
    weights, weights_bytes = weights_header_sha256(files)
    tok = hashlib.sha256()
    for fname in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        f = model_dir / fname
        if f.exists():
            tok.update(fname.encode() + f.read_bytes())
    fp = {
        "name": name,
        "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest(),
        "weights_sha256": weights,
        "weights_bytes": weights_bytes,
        "weights_hash": "full" if full_hash else "header",
        "tokenizer_sha256": tok.hexdigest(),
        "compute_dtype": compute_dtype,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__},
    }
    if tied_conventions is not None:
        fp["tied_conventions"] = tied_conventions
    if full_hash:
        content = hashlib.sha256()
        for f in files:
            content.update(sha256_file(f).encode())
        fp["weights_content_sha256"] = content.hexdigest()
    return fp
