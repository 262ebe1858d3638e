"""Which of torch's two GEMM forms is faster for a few dozen fp32 rows on this CPU, measured once.

`heads.layers.linear` multiplies the few rows of decode, verification and drafting by each weight. Above the
native kernel's rows (or without it) it has two forms of the same product: F.linear (MKL's x·Wᵀ) and
(W·xᵀ)ᵀ. Which is faster depends on the CPU and the row count, by 1.3-1.5x either way: on a 2-core AVX2 EPYC
(W·xᵀ)ᵀ ran 1.3-5x faster at 2-256 rows; on a 2-core AVX-512 Xeon F.linear runs 1.3-1.45x faster from 64 rows
(SmolLM2's 211 linears, weights streamed from memory: 183 against 247 ms at 64 rows on one thread, 122 against
167 ms on two) and (W·xᵀ)ᵀ is faster at 48 rows on two threads. So the form is measured per CPU, torch
version, thread count and row bucket (the next power of two: the compiled step's buckets), once, on
SmolLM2-sized weights cycled through more memory than a cache holds, alternating the two forms; the answer is
kept in `<SPECHEAD_CACHE>/native/gemm-<key>-<bucket>.json`. The first process to write a bucket's answer
wins (os.link), so every process on the machine computes a bucket the same way, and summation orders do not differ
between ranks or runs. A wrong or noisy answer costs speed only: both forms give F.linear's values up to fp32
summation order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch

from core.paths import cache_dir

log = logging.getLogger(__name__)

FORMS = ("F", "mm")  # F.linear (x·Wᵀ), torch.mm(W, xᵀ)ᵀ
SHAPES = ((1536, 576), (576, 1536), (576, 576))  # SmolLM2's MLP and attention weights: 3.5, 3.5, 1.3 MB
WEIGHT_BYTES = 48 << 20  # more than a server's last-level cache share
REPEATS = 5

_lock = threading.Lock()
_known: dict[tuple[int, int], str] = {}  # (threads, bucket) -> form
_last: dict[int, str] = {}  # bucket -> the form `form` last answered (what a traced graph reads: plain ints and strs)


def bucket(rows: int) -> int:
    """The row bucket measured for `rows`: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def _key(threads: int) -> str:
    from core.native import _cpu_id

    text = "\0".join([_cpu_id(), platform.machine(), torch.__version__, str(threads), repr(SHAPES), "1"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(rows: int, threads: int | None = None) -> Path:
    """The file that keeps the answer for `rows`' bucket at `threads` (torch's thread count by default)."""
    threads = threads or torch.get_num_threads()
    return cache_dir() / "native" / f"gemm-{_key(threads)}-{bucket(rows)}.json"


def _read(file: Path) -> str | None:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("gemm choice: %s unreadable (%s); measuring again", file, e)
        return None
    if not isinstance(data, dict) or data.get("form") not in FORMS:
        log.warning("gemm choice: %s holds %r, not {\"form\": one of %s}; measuring again", file, data, FORMS)
        return None
    return data["form"]


def apply(form: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, k] @ wᵀ in `form`, as heads.layers.linear computes it (one row padded with a zero row for "mm")."""
    if form == "F":
        return torch.nn.functional.linear(x, w)
    xp = torch.cat([x, x.new_zeros(1, x.shape[1])]) if x.shape[0] == 1 else x
    return torch.mm(w, xp.t()).t()[: x.shape[0]].contiguous()


def _time(form: str, weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        apply(form, xs[w.shape[1]], w)
    return time.perf_counter() - t0


def measure(rows: int) -> dict[str, float]:
    """Seconds per pass over the weights for each form at `rows` rows (the median of REPEATS alternated
    passes, after one warm pass each), on torch's thread count."""
    g = torch.Generator().manual_seed(0)
    weights, total, i = [], 0, 0
    while total < WEIGHT_BYTES:
        n, k = SHAPES[i % len(SHAPES)]
        weights.append(torch.randn(n, k, generator=g))
        total, i = total + 4 * n * k, i + 1
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in SHAPES}}
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    with torch.inference_mode():
        for f in FORMS:
            _time(f, weights, xs)
        for r in range(REPEATS):
            for f in FORMS if r % 2 == 0 else FORMS[::-1]:
                times[f].append(_time(f, weights, xs))
    return {f: sorted(t)[len(t) // 2] for f, t in times.items()}


def _publish(file: Path, data: dict) -> None:
    """Write `data` as `file` unless another process wrote a readable answer first (then that one stands)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, sort_keys=True)
    try:
        os.link(tmp.name, file)  # the first writer wins; a concurrent one reads the winner's back
    except FileExistsError:
        if _read(file) is None:  # an unreadable answer is replaced; a readable one stands
            os.replace(tmp.name, file)
    finally:
        Path(tmp.name).unlink(missing_ok=True)


def form(rows: int) -> str:
    """"F" or "mm": the faster GEMM form for `rows` fp32 rows on this CPU at torch's thread count, measured on
    first use (≈ 0.5 s) and kept on disk. Call it outside a compiled region: a traced graph reads `known`."""
    threads, b = torch.get_num_threads(), bucket(rows)
    got = _known.get((threads, b))
    if got is not None:
        _last[b] = got
        return got
    with _lock:
        file = path(b, threads)
        choice = _read(file)
        if choice is None:
            seconds = measure(b)
            mine = min(FORMS, key=seconds.__getitem__)
            log.info("gemm choice: %d rows, %d threads: %s (F.linear %.1f ms, (W·xᵀ)ᵀ %.1f ms a pass); kept in %s",
                     b, threads, mine, seconds["F"] * 1e3, seconds["mm"] * 1e3, file)
            try:
                _publish(file, {"form": mine, "ms": {f: round(t * 1e3, 3) for f, t in seconds.items()}})
                choice = _read(file) or mine
            except OSError as e:
                log.warning("gemm choice: cannot write %s (%s); this process keeps its own answer", file, e)
                choice = mine
        _known[(threads, b)] = _last[b] = choice
        return choice


def known(rows: int) -> str:
    """The form `form` last answered for `rows`' bucket, "mm" when it answered none: what a compiled graph reads
    while tracing (it measures nothing, and dynamo cannot trace torch's thread count; the compiled step runs each
    bucket eagerly first, at the same thread count)."""
    return _last.get(bucket(rows), "mm")


def reset() -> None:
    """Forget the answers held in memory (the file stays): as a new process starts."""
    _known.clear()
    _last.clear()
