"""The precompute stage: run the target over tokenized conversations and store H_i per token.

Uses the engine's model (inference_eval/model.py) in the configured compute dtype, with
`logits="none"`: the store needs H_i only, and the vocabulary projection would be about a fifth of
SmolLM2-135M's FLOPs plus a [T, V] tensor per sample.

Batching without padding (the engine model): a batch is several samples packed back to back in
one `[1, N]` row (`inference_eval.paged.PackedRows`), each with its own positions and causal
attention within itself only, so the linear layers and attention see real tokens only. Samples are
taken in windows of consecutive samples (`WINDOW_BATCHES` batches' worth of tokens); a window is
spread over a multiple-of-the-workers number of batches of at most `batch_tokens` tokens, balanced
by estimated cost so that the workers finish a window together; results are written in input order.
The HF backend (other families) cannot pack: its batches are right-padded `[B, T_max]` rows sorted
by length, without an attention mask (causal attention hides the padding after a sample).

Resumable and deterministic: windows and batches are a function of the full sample list,
`batch_tokens` and the number of workers only. A resumed run skips every batch whose samples are all
in finished shards and recomputes a batch straddling the last finished shard whole (writing only its
new samples), so every sample is computed in the same batch as in an uninterrupted run and, with the
same settings and thread count, the shards come out byte-identical.

Resume is keyed by content, not by id alone: each stored sample carries a hash of its tokenized input
(data/store.py `sample_hash`). A stored sample whose id the data still has but whose input ids or
loss mask differ (its record was edited), or whose id the data no longer yields (a record removed, or
now rejected), is a changed record; `precompute.on_changed` decides: `recompute` (default) removes
the changed samples from the store, keeping every other sample's bytes, and computes those still in
the data again; `refuse` stops before writing anything, listing them. A shard that fails its size,
header or sha256 check is recomputed (StoreWriter, warned naming the file). The data file's size and
sha256 go into the manifest's `data_file` (information only: the per-sample hashes decide).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.files import sha256_file
from core.lock import check_free, writer_lock
from core.progress import DEFAULT_EVERY_S, Progress
from data.conversations import chat_template_sha256, load_tokenizer, tokenize_sample
from data.sources import EXAMPLES_PER_REASON, MAX_EXAMPLES, DataConfig, load_conversations, record_rejection
from data.store import (
    FP8,
    IncompleteRanksError,
    Sample,
    StoreError,
    StoreWriter,
    check_rank_layout,
    merge_rank_manifests,
    quantize_states,
    rank_dir,
    sample_hash,
)
from heads.registry import resolve_aux_layers
from inference_eval.paged import PackedRows
from inference_eval.targets import TargetConfig, load_target, resolve_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrecomputeConfig:
    """What a store is computed from and how (`precompute.*`, the `data` section, `store_dir`, the head's target
    layers), built once at the stage's entry (experiments/stages.py `precompute_config`): precompute, and online training's
    write-through of the store precompute would write, take it instead of the hydra config."""

    data: DataConfig
    data_path: str | None  # data.path as written: the store's `source` records it so (a resumed store compares it)
    store_dir: Path
    store_dtype: str = "bfloat16"
    shard_tokens: int = 262144
    aux_layers: Any = "auto"  # precompute.aux_layers: auto, none or [ids]
    head_layers: Any = None  # the target layers the head reads (heads/registry.py head_config)
    backend: str | None = "auto"
    batch_tokens: int = 8192
    workers: int | None = None
    on_changed: str = "recompute"
    rank: int | None = None  # None: $RANK, else 0
    world_size: int | None = None  # None: $WORLD_SIZE, else 1
    vllm: Any = None  # VllmSettings of precompute.vllm (backend=vllm)
    progress: bool = True
    every_s: float | None = DEFAULT_EVERY_S


@dataclass
class PrecomputeStats:
    samples: int
    tokens: int
    loss_tokens: int
    skipped_done: int
    rejected: Counter
    seconds: float
    store_wait_s: float = 0.0  # of `seconds`: the main loop waiting on the store's writer thread

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def tokenize_all(tokenizer, conversations: list[tuple[str, list[dict]]], max_length: int,
                 rejected: Counter, examples: list[dict] | None = None,
                 where: dict[str, str] | None = None) -> list[tuple[str, list[int], list[int]]]:
    """(id, input ids, loss mask) of every conversation the template and the tokenizer take.

    A conversation they cannot take is counted in `rejected` under the error's `reason`
    (data/conversations.py: `template_error`, `template_mask`, `too_long`, `tokenizer_error`,
    `special_token`; `no_loss_tokens`) and, while under the caps, added to `examples` with its
    `<file>:<line>` from `where` (sample id -> location, `Conversations.where`); the others go on.
    A plain text (data.source=text) is tokenized with a loss on every token but the first."""
    where = where or {}
    out = []
    for sid, messages in conversations:
        try:
            tc = tokenize_sample(tokenizer, messages, max_length=max_length)
        except ValueError as e:  # template / tokenizer / length problems: counted, never silently included
            record_rejection(rejected, examples, getattr(e, "reason", type(e).__name__), where.get(sid), str(e), sid)
            continue
        if tc is None or sum(tc.loss_mask) == 0:
            record_rejection(rejected, examples, "no_loss_tokens", where.get(sid), "no assistant token to learn", sid)
            continue
        out.append((sid, list(tc.input_ids), list(tc.loss_mask)))
    return out


WINDOW_BATCHES = 8  # a window holds about this many batches' worth of tokens


def plan_batches(lengths: list[int], batch_tokens: int, min_batches: int = 1,
                 packed: bool = False) -> list[list[list[int]]]:
    """Windows of consecutive sample indices (about `WINDOW_BATCHES` batches' worth of tokens each),
    each a list of batches.

    `packed=False` (right-padded rows): batches longest first, whose padded size rows × longest row
    is at most `batch_tokens` (a longer sample gets a batch of its own). A window too small to fill
    `min_batches` batches (the last one, or a small dataset) is cut into about `min_batches` smaller
    ones (at most ceil(n / min_batches) rows each), so that every worker gets one.

    `packed=True` (samples back to back in one row, no padding): a window's samples are spread over
    a multiple of `min_batches` batches of at most `batch_tokens` tokens (a longer sample alone),
    balanced by estimated cost, longest sample first onto the cheapest batch; each batch lists its
    samples in index order. Balanced batches keep the workers finishing together at a window's end.
    """
    windows, window, window_tokens = [], [], 0
    for i, n in enumerate(lengths):
        window.append(i)
        window_tokens += n
        if window_tokens >= WINDOW_BATCHES * batch_tokens or i == len(lengths) - 1:
            windows.append(window)
            window, window_tokens = [], 0
    if packed:
        return [_balanced_batches(window, lengths, batch_tokens, min_batches) for window in windows]
    planned = []
    for window in windows:
        max_rows = -(-len(window) // min_batches)  # binds only in a window too small for the workers
        batches: list[list[int]] = []
        for i in sorted(window, key=lambda i: (-lengths[i], i)):
            last = batches[-1] if batches else None
            if last and len(last) < max_rows and (len(last) + 1) * lengths[last[0]] <= batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        planned.append(batches)
    return planned


# Attention's share of a sample's cost grows with its length; on CPU (bf16 SDPA) a token's attention
# costs about as much as its linear layers at this sequence length. Used only to balance batches.
ATTENTION_BREAK_EVEN = 1024


def sample_cost(n: int) -> float:
    return n * (1 + n / ATTENTION_BREAK_EVEN)


def _balanced_batches(window: list[int], lengths: list[int], batch_tokens: int, min_batches: int
                      ) -> list[list[int]]:
    tokens = sum(lengths[i] for i in window)
    count = max(min_batches, -(-tokens // batch_tokens))
    count = min(len(window), -(-count // min_batches) * min_batches)
    members: list[list[int]] = [[] for _ in range(count)]
    load, used = [0.0] * count, [0] * count
    for i in sorted(window, key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(count) if not members[b] or used[b] + lengths[i] <= batch_tokens]
        if not fits:  # every batch is full: open another
            members.append([])
            load.append(0.0)
            used.append(0)
            fits = [len(members) - 1]
        b = min(fits, key=lambda b: (load[b], b))
        members[b].append(i)
        load[b] += sample_cost(lengths[i])
        used[b] += lengths[i]
    return [sorted(m) for m in members if m]


def resolve_workers(workers: int | None, device: torch.device) -> int:
    """Batches in flight at once: on CUDA 2 (each worker thread on its own stream, `_worker_stream`: one batch's
    copy to the host overlaps the next one's forward); on CPU by default one per intra-op thread, at most 4 (each
    worker then gets num_threads // workers threads); 1 on another accelerator."""
    if workers is not None:
        return max(1, int(workers))
    if device.type == "cuda":
        return 2
    return 1 if device.type != "cpu" else max(1, min(4, torch.get_num_threads()))


_WORKER = threading.local()


def _worker_stream(device: torch.device):
    """On CUDA, the calling worker thread's own stream (made once per thread): its batch's kernels and its blocking
    copy to the host wait for that stream alone, so another worker's batch computes meanwhile. Elsewhere nothing."""
    if device.type != "cuda":
        return nullcontext()
    stream = getattr(_WORKER, "stream", None)
    if stream is None:
        stream = _WORKER.stream = torch.cuda.Stream(device)
    return torch.cuda.stream(stream)


def _in_order(fn, jobs: list, pool: ThreadPoolExecutor | None, in_flight: int):
    """Yield (job, fn(job)) in job order, keeping up to `in_flight` jobs running on the pool: the next
    window's batches start while the last ones of the current window finish."""
    if pool is None:
        yield from ((job, fn(job)) for job in jobs)
        return
    pending: deque = deque()
    for job in jobs:
        pending.append((job, pool.submit(fn, job)))
        if len(pending) >= in_flight:
            done_job, future = pending.popleft()
            yield done_job, future.result()
    while pending:
        done_job, future = pending.popleft()
        yield done_job, future.result()


def packed_forward(model, input_ids: torch.Tensor, lengths: list[int], aux_layers: tuple[int, ...]):
    """The model over samples back to back in one row `input_ids` [1, N] (`lengths` summing to N), each
    attending to itself only, no logits: its TargetOutput (pre-norm `hidden`, the aux layers' inputs)."""
    rows = PackedRows(lengths)
    return model(input_ids, positions=rows.positions(input_ids.device), cache=rows, logits="none",
                 capture_layers=aux_layers)


def batch_states(model, samples: list[tuple[str, list[int], list[int]]], batch: list[int],
                 aux_layers: tuple[int, ...], fp8: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """(H_i [n, H], aux [n, K·H] or None) of each sample of `batch` (indices into `samples`), in batch
    order, on the CPU: one packed row where the model packs (each sample attends to itself only), else
    right-padded rows; an out-of-process backend (`hidden_states`, vLLM) computes them itself. `fp8` (an fp8
    store): quantised where they were computed, before the copy to the host (a quarter of an fp32 copy), each
    with its scales — (H_i fp8, aux fp8, hidden_scale, aux_scale), data/store.py `Sample`."""
    if hasattr(model, "hidden_states"):
        return model.hidden_states([samples[i][1] for i in batch], aux_layers)
    device = model.device
    lengths = [len(samples[i][1]) for i in batch]
    with torch.inference_mode(), _worker_stream(device):  # thread-local: entered in the worker
        if getattr(model, "supports_packing", False):
            input_ids = torch.tensor([t for i in batch for t in samples[i][1]], device=device)[None]
            out = packed_forward(model, input_ids, lengths, aux_layers)
            bounds = PackedRows(lengths).bounds
            spans = [(0, a, b) for a, b in zip(bounds, bounds[1:])]
        else:
            input_ids = torch.zeros(len(batch), lengths[0], dtype=torch.long)  # right padding
            for row, i in enumerate(batch):
                input_ids[row, :lengths[row]] = torch.tensor(samples[i][1])
            out = model(input_ids.to(device), logits="none", capture_layers=aux_layers)
            spans = [(row, 0, n) for row, n in enumerate(lengths)]
        if fp8:  # the samples' rows only (no padding), quantised per token on the device, then copied
            rows = [b - a for _, a, b in spans]
            hidden = torch.cat([out.hidden[r, a:b] for r, a, b in spans])
            joined = torch.cat(out.aux, dim=-1) if aux_layers else None  # [B, T, K·H]
            aux = torch.cat([joined[r, a:b] for r, a, b in spans]) if aux_layers else None
            parts = [t.cpu() if t is not None else None for t in quantize_states(hidden, aux, len(aux_layers))]
            return list(zip(*[p.split(rows) if p is not None else [None] * len(rows) for p in parts]))
        hidden = out.hidden.cpu()  # pre-norm
        aux = torch.cat(out.aux, dim=-1).cpu() if aux_layers else None  # [B, T, K·H]
        return [(hidden[r, a:b], aux[r, a:b] if aux is not None else None) for r, a, b in spans]


class _WindowWriter:
    """Adds a window's computed samples to the store in input order, skipping those already stored
    (computed only because their batch straddles the last finished shard), and counts what it added."""

    def __init__(self, writer: StoreWriter, samples: list[tuple[str, list[int], list[int]]], done: set[str]) -> None:
        self.writer, self.samples, self.done = writer, samples, done
        self.count = self.tokens = self.loss_tokens = 0

    def write(self, hidden: dict[int, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        for i in sorted(hidden):
            sid, ids, mask = self.samples[i]
            if sid in self.done:
                continue
            self.writer.add(Sample(sid, torch.tensor(ids), torch.tensor(mask), *hidden[i]))
            self.count, self.tokens, self.loss_tokens = self.count + 1, self.tokens + len(ids), self.loss_tokens + sum(mask)


ON_CHANGED = ("recompute", "refuse")
SHOWN_CHANGED = 10  # changed ids named in a message; the rest are counted


def drop_changed(writer: StoreWriter, samples: list[tuple[str, list[int], list[int]]],
                 on_changed: str = "recompute") -> None:
    """Compare the stored samples with `samples` by content (`sample_hash` of the input ids and loss
    mask). A stored sample whose content differs (an edited record) or whose id `samples` lacks (a
    removed record, or one now rejected) is changed: `recompute` removes the changed ones from the
    store (`StoreWriter.drop_samples`: the other samples' bytes are kept) so that the caller computes
    those still in `samples` again; `refuse` raises a StoreError listing them and naming the setting,
    writing nothing (what the writer repaired on opening, a damaged shard, stays repaired)."""
    if on_changed not in ON_CHANGED:
        raise ValueError(f"precompute.on_changed={on_changed!r}: expected one of {', '.join(ON_CHANGED)}")
    stored = writer.stored_hashes()
    if not stored:
        return
    edited = [sid for sid, ids, mask in samples if sid in stored and sample_hash(ids, mask) != stored[sid]]
    present = {sid for sid, _, _ in samples}
    removed = [sid for sid in stored if sid not in present]
    if not edited and not removed:
        return

    def listed(ids: list[str]) -> str:
        more = f" and {len(ids) - SHOWN_CHANGED} more" if len(ids) > SHOWN_CHANGED else ""
        return ", ".join(map(repr, ids[:SHOWN_CHANGED])) + more

    parts = ([f"{len(edited)} whose tokenized input changed ({listed(edited)})"] if edited else []) + (
        [f"{len(removed)} no longer in the data, removed or now rejected ({listed(removed)})"] if removed else [])
    what = f"{writer.root}: stored samples differ from the data: {'; '.join(parts)}"
    if on_changed == "refuse":
        raise StoreError(f"{what}; the store is left as it is (precompute.on_changed=refuse): rerun with "
                         "precompute.on_changed=recompute to drop them from the store and compute the changed ones "
                         "again, or choose another store_dir")
    log.warning("%s; precompute.on_changed=recompute: they leave the store, the changed ones are computed again", what)
    writer.drop_samples(set(edited) | set(removed))


def precompute(model, samples: list[tuple[str, list[int], list[int]]], writer: StoreWriter,
               batch_tokens: int = 8192, workers: int | None = None, progress: bool = True,
               progress_log_s: float | None = None, on_changed: str = "recompute") -> PrecomputeStats:
    """Compute and store H_i (and the inputs of the writer's aux layers, for EAGLE-3) for every sample
    not yet in a finished shard of `writer`'s store, after removing the stored samples that differ
    from `samples` (`drop_changed`, as `on_changed` says).

    On CPU, `workers` batches run concurrently on threads with num_threads // workers intra-op
    threads each, instead of one batch on all of them: the layers' small-matrix and elementwise
    ops then need no cross-thread barrier, and a core taken by another process slows one batch
    instead of every op (the setting is restored on return). Each batch runs alone on its worker,
    so its numerics do not depend on what else is in flight.
    """
    drop_changed(writer, samples, on_changed)
    done = writer.done_ids
    lengths = [len(ids) for _, ids, _ in samples]
    todo_tokens = sum(n for (sid, _, _), n in zip(samples, lengths) if sid not in done)
    device = model.device
    # an out-of-process backend (vllm): its batches do not depend on how many are in flight (it runs them one
    # after another), and `in_flight` of them wait in its queue, so it starts the next while this process
    # reads the last one's states and writes the store
    remote = hasattr(model, "hidden_states")
    workers = int(getattr(model, "in_flight", 1)) if remote else resolve_workers(workers, device)
    aux_layers = tuple(writer.aux_layers)
    packed = bool(getattr(model, "supports_packing", False))
    plan = plan_batches(lengths, batch_tokens, min_batches=1 if remote else workers, packed=packed)
    jobs = [(w, batch) for w, window in enumerate(plan) for batch in window
            if not all(samples[i][0] in done for i in batch)]
    t0 = time.perf_counter()
    bar = Progress(todo_tokens, "precompute", "tok", bar=progress, every_s=progress_log_s, unit_scale=True)
    out = _WindowWriter(writer, samples, done)
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="precompute") if workers > 1 else None
    if pool is not None and device.type == "cpu" and not remote:
        torch.set_num_threads(max(1, threads // workers))
    try:
        hidden: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        current = None
        fp8 = writer.dtype == FP8 and not remote
        forward = lambda job: batch_states(model, samples, job[1], aux_layers, fp8)  # noqa: E731
        for (w, batch), states in _in_order(forward, jobs, pool, in_flight=2 * workers):
            bar.update(sum(lengths[i] for i in batch if samples[i][0] not in done))  # computed, written at the window's end
            if w != current:  # a window's samples go to the store together, in input order
                out.write(hidden)
                hidden, current = {}, w
            for i, st in zip(batch, states):
                hidden[i] = st
        out.write(hidden)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
            if not remote:
                torch.set_num_threads(threads)
        bar.close(failed=sys.exc_info()[0] is not None)
    writer.close()
    return PrecomputeStats(samples=out.count, tokens=out.tokens, loss_tokens=out.loss_tokens,
                           skipped_done=len(samples) - out.count, rejected=Counter(),
                           seconds=time.perf_counter() - t0, store_wait_s=writer.wait_s)


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size) from `precompute.rank` / `precompute.world_size`; where those are null, from
    the RANK / WORLD_SIZE environment variables (torchrun sets them), else 0 / 1."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"precompute: rank {rank} of world_size {world_size} (precompute.rank / precompute.world_size "
                         "or RANK / WORLD_SIZE): need 0 <= rank < world_size")
    return rank, world_size


def rank_of(sample_id: str, world_size: int) -> int:
    """The rank that precomputes a sample: a stable hash of its id, so the partition depends on the id
    and the world size only (not on the order, the other samples or the process)."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") % world_size


def tokenize_source(data: DataConfig, target_dir: str | Path) -> tuple[list[tuple[str, list[int], list[int]]],
                                                                       Counter, list[dict]]:
    """`data.*`'s conversations, tokenized with the target's tokenizer (and data.chat_template's template
    when set): (id, input ids, loss mask) of each usable one, the rejection counts and the first examples.
    What precompute stores and online training trains on. A file unreadable as a whole is a SourceError
    naming it."""
    tokenizer = load_tokenizer(target_dir, data.chat_template)
    convs = load_conversations(data)
    rejected, examples = Counter(convs.rejected), list(convs.examples)
    tokenized = tokenize_all(tokenizer, convs.items, data.max_length, rejected, examples, convs.where)
    return tokenized, rejected, examples


def precompute_stage(pc: PrecomputeConfig, target: TargetConfig) -> tuple[Path, PrecomputeStats]:
    """The precompute stage: the target over `pc`'s data → a complete store at pc.store_dir.

    With world_size > 1 (`resolve_rank`), this rank precomputes its share of the samples (`rank_of`)
    into `<store_dir>/ranks/rank-<rank>/`, a store of its own, resumable like any; the rank that finds
    every rank complete when it finishes writes the merged `<store_dir>/manifest.json`
    (data/store.py `merge_rank_manifests`; `spechead precompute-merge <store_dir>` does it by hand).

    One writer per directory (core/lock.py): the store directory's lock, or under several ranks this rank
    directory's, is held while it is written; a second precompute into it is refused at once, naming the
    first. The merge runs after the release, so the rank that finishes last sees every rank released."""
    rank, world_size = resolve_rank(pc.rank, pc.world_size)
    check_rank_layout(pc.store_dir, world_size)
    writes = rank_dir(pc.store_dir, rank) if world_size > 1 else pc.store_dir
    with writer_lock(writes, "precompute" if world_size == 1 else f"precompute rank {rank} of {world_size}"):
        if world_size > 1:
            check_free(pc.store_dir)  # a single-rank precompute writing the whole directory
        check_rank_layout(pc.store_dir, world_size)  # again, under the lock: a layout another writer made meanwhile
        stats = precompute_share(pc, target, rank, world_size)
    if world_size > 1:
        merge_if_last(pc.store_dir, rank, world_size)
    return pc.store_dir, stats


def precompute_share(pc: PrecomputeConfig, target: TargetConfig, rank: int, world_size: int) -> PrecomputeStats:
    """This rank's share of the samples (all of them for one rank) into its store, the lock held."""
    target_dir = target.dir
    # Every rank tokenizes every conversation and keeps its share: the rejections are then the whole
    # source's in every rank's manifest, identical across ranks as the merge requires (and what the
    # merged store reports); tokenizing is cheap next to the target's forward passes.
    tokenized, rejected, examples = tokenize_source(pc.data, target_dir)
    samples = [s for s in tokenized if rank_of(s[0], world_size) == rank] if world_size > 1 else tokenized
    if rejected:
        log.warning("precompute: rejected %d records (%s); the first %d, with <file>:<line>, are in the "
                    "manifest's `rejected`", sum(rejected.values()), ", ".join(f"{k}={v}" for k, v in
                                                                             sorted(rejected.items())), len(examples))
    if not tokenized:
        raise RuntimeError(f"precompute: no usable conversation in the data source (rejected: {dict(rejected)}; first: "
                           + "; ".join(f"{e['where']}: {e['reason']}: {e['detail']}" for e in examples[:5]) + ")")
    backend = resolve_backend(pc.backend, target_dir, "precompute")
    model = vllm_target(pc, target) if backend == "vllm" else load_target(target, backend)
    if pc.data.max_length > model.args.max_position_embeddings:
        raise ValueError(f"data.max_length={pc.data.max_length} exceeds the target's context "
                         f"(max_position_embeddings={model.args.max_position_embeddings} in {target_dir}/config.json)")
    if world_size > 1 and not samples:
        log.warning("precompute rank %d of %d: no usable sample hashes to this rank; its store stays empty",
                    rank, world_size)
    # the shards are written on a thread of their own while the target computes the next batches
    writer = open_store_writer(pc, target, backend, model, pc.store_dir, (rank, world_size), rejected, examples,
                               background=True)
    out_dir = writer.root
    try:
        stats = precompute(model, samples, writer, batch_tokens=pc.batch_tokens, workers=pc.workers,
                           progress=pc.progress, progress_log_s=pc.every_s, on_changed=pc.on_changed)
    finally:
        if hasattr(model, "release"):  # the vllm backend's worker process
            model.release()
    stats.rejected = rejected
    log.info("precompute: %d samples, %d tokens (%d loss tokens) in %.1fs (%.0f tok/s; %.1fs of it waiting on the "
             "store's writer); rejected %s; store %s", stats.samples, stats.tokens, stats.loss_tokens, stats.seconds,
             stats.tokens_per_s, stats.store_wait_s, dict(rejected), out_dir)
    return stats


def vllm_target(pc: PrecomputeConfig, target: TargetConfig):
    """The target in a vLLM worker process, placed by vLLM (`precompute.vllm.*`)."""
    from inference_eval.vllm_backend import VLLMBackend

    return VLLMBackend.for_target(pc.vllm, target.dir, target.torch_dtype, pc.aux_layers, pc.head_layers,
                                  pc.data.max_length)


def open_store_writer(pc: PrecomputeConfig, target: TargetConfig, backend: str, model, root: str | Path,
                      rank: tuple[int, int], rejected: Counter, examples: list[dict],
                      background: bool = False) -> StoreWriter:
    """The StoreWriter of the store at `root` (`rank` = (rank, world_size) > 1: its rank directory) with
    the manifest precompute writes for `pc` — fingerprint, source, captured layers, rejections — so that
    online training's write-through (train/online_store.py) writes the store this stage would. `background`: shards
    written on the writer's own thread (StoreWriter), as precompute does."""
    r, world_size = rank
    source = store_source(pc, backend, model)
    out_dir = Path(root)
    if world_size > 1:
        source |= {"rank": r, "world_size": world_size}
        out_dir = rank_dir(root, r)
    aux_layers = resolve_aux_layers(pc.aux_layers, pc.head_layers, model.args.num_hidden_layers)
    captured = {"hidden": "last_layer_pre_norm", **({"aux_layers": list(aux_layers)} if aux_layers else {})}
    writer = StoreWriter(out_dir, target.fingerprint, model.args.hidden_size, dtype=pc.store_dtype,
                         shard_tokens=pc.shard_tokens, source=source, captured=captured, background=background)
    # Outside `source`, which a resumed writer compares: a top-level key the writer keeps and writes.
    writer.manifest["rejected"] = {"total": sum(rejected.values()), "counts": dict(sorted(rejected.items())),
                                   "examples": examples,
                                   "examples_cap": {"per_reason": EXAMPLES_PER_REASON, "total": MAX_EXAMPLES}}
    data_file = data_file_fingerprint(pc.data)
    before = (writer.previous_manifest or {}).get("data_file")
    if before and data_file and before != data_file:
        log.info("%s: the data file %s changed since the store was last written (%s bytes, sha256 %.12s… before); "
                 "each stored sample's content hash decides what is recomputed", writer.root, data_file["name"],
                 before.get("bytes"), before.get("sha256"))
    writer.manifest["data_file"] = data_file
    return writer


def data_file_fingerprint(data: DataConfig) -> dict[str, Any] | None:
    """The manifest's `data_file`: the name, size and sha256 of the file the conversations come from (the
    packaged ShareGPT for data.source=sharegpt without a path), None when there is none. For information: a
    resumed run decides by each sample's content hash. Hashing costs about a second per GB (the packaged
    ShareGPT: 125 MB), small next to tokenizing the file; the path itself is in `source`, and a mtime would
    differ between the copies ranks on several nodes read. data.source=hf: data/hf_source.py `fingerprint`."""
    if data.source == "hf":
        from data import hf_source

        return hf_source.fingerprint(data)
    path = data.path
    if path is None and data.source == "sharegpt":
        from data.assets import sharegpt_path

        path = sharegpt_path()
    if path is None:
        return None
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def store_source(pc: PrecomputeConfig, backend: str, model) -> dict[str, Any]:
    """The manifest's `source`: what a resumed writer must find equal (the data, the template, the backend)."""
    data = pc.data
    # the path as the user wrote it: a store written before resumes with the same setting
    source = {"source": data.source, "path": pc.data_path, "skip": data.skip, "max_samples": data.max_samples,
              "max_length": data.max_length}
    for key in ("split", "name", "columns"):  # which rows and fields of the source (absent: the defaults)
        if getattr(data, key) is not None:
            source[key] = getattr(data, key)
    if data.chat_template:  # another template, other samples: never resumed across templates
        source["chat_template_sha256"] = chat_template_sha256(data.chat_template)
    if backend == "vllm":  # other numerics than the engine's: a store is not resumed across backends
        source["backend"] = {"name": "vllm", "vllm": model.info.get("vllm")}
    return source


def merge_if_last(store_dir: str | Path, rank: int, world_size: int) -> None:
    """Write the merged manifest if every rank's store is complete (this rank finished last), else say who does."""
    try:
        merged = merge_rank_manifests(store_dir)
        log.info("precompute rank %d: every rank is complete; merged %d shards (%d samples) into %s", rank,
                 len(merged["shards"]), sum(s["num_samples"] for s in merged["shards"]), Path(store_dir) / "manifest.json")
    except IncompleteRanksError as e:
        log.info("precompute rank %d of %d done; %s. The last rank to finish writes the merged manifest "
                 "(or run `spechead precompute-merge %s`)", rank, world_size, e, store_dir)
