"""Online training's write-through (`train.data.online.write_store: <dir>`): the states the target computes
in the first epoch are also written as a normal feature store — the manifest, fingerprint, shards and
sample order `scripts.precompute` writes for the same config — so that later runs, or another head, train
on them offline.

A training epoch visits samples in shuffled batches, a store lists them in input order. So each sample's
states go first to a spill file of its own (`<store>/.pending/<index>.safetensors`, written atomically, in
the compute dtype) as its batch is computed. When the first epoch ends, the samples no training batch of
this rank carried (the held-out split if validation did not run over all of it, the < world-size batches
an epoch cuts, those `train.data.train_samples` leaves out) are computed in token-budget packed batches,
and a background thread adds every spill to the store in input order (data/store.py StoreWriter: shards
cut by `precompute.shard_tokens`, the manifest complete at the end) while training goes on; the spill
directory is removed after. Disk: the rank's share once in spills and once in shards, briefly; I/O: it
written twice and read once. `on_train_end` waits for the thread.

Interrupted runs: spill files and finished shards survive a kill (atomic writes); a resumed run skips the
samples in finished shards, reuses the spills, and rewrites what a batch recomputes identically. A store
already complete is left as it is.

Ranks: rank r writes `<store>/ranks/rank-<r>/` (a rank store as precompute's, `source.rank`/`world_size`)
with the samples its epoch-0 training batches and its validation share carry (the rest: rank 0), and
the last rank to finish merges the manifests (data/store.py `merge_rank_manifests`). Its rank partition
is training's, not precompute's `rank_of` hash: the merged store holds the same samples and states, in
other shards. At world size 1 the store is byte-identical to precompute's where the target's kernels give
a sample the same floats whatever else is in its packed row (measured on this CPU: tests/test_online.py).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.files import atomic_write, remove_tree
from data.precompute import merge_if_last
from data.store import IncompleteRanksError, Sample, StoreWriter, check_rank_layout
from train.data import TokenBudgetBatches, collate_packed

log = logging.getLogger(__name__)

PENDING = ".pending"


def per_sample_states(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(hidden [n, H], aux [n, K·H] or None) of each sample of a batch with states, on the CPU, in batch
    order: the rows of a padded batch (its valid tokens), the segments of a packed one."""
    hidden, aux = batch["hidden"].detach().cpu(), batch.get("aux_hidden")
    aux = aux.detach().cpu() if aux is not None else None
    if "segments" in batch:
        counts = torch.bincount(batch["segments"][0].cpu()).tolist()
        parts = hidden[0].split(counts)
        return list(zip(parts, aux[0].split(counts) if aux is not None else [None] * len(parts)))
    valid = batch["valid"].cpu()
    return [(hidden[r][valid[r]], aux[r][valid[r]] if aux is not None else None) for r in range(hidden.shape[0])]


def owned_indices(dm: Any, rank: int, world_size: int) -> list[int]:
    """The store indices rank `rank` writes: those its epoch-0 training batches and its validation share
    carry (train/data.py TokenBudgetBatches, as its loaders build them); rank 0 also the ones no rank's
    batches carry. Every index belongs to exactly one rank."""
    n = len(dm.store)
    if world_size == 1:
        return list(range(n))
    owner: dict[int, int] = {}
    for idx, shuffle, pad in ((dm.train_idx, True, False), (dm.val_idx, False, True)):
        lengths = [dm.lengths[i] for i in idx]
        for r in range(world_size):
            batches = TokenBudgetBatches(lengths, dm.batch_tokens, shuffle, dm.seed, world_size, r, dm.packing, pad)
            mine = batches._batches()[:batches.real_batches]
            for batch in mine:
                for j in batch:
                    owner.setdefault(idx[j], r)
    return [i for i in range(n) if owner.get(i, 0) == rank]


class WriteThrough(L.Callback):
    """The write-through store of one online run (module docstring). `open_writer((rank, world_size))`
    returns the StoreWriter precompute would open for that rank (data/precompute.py open_store_writer)."""

    def __init__(self, root: str | Path, open_writer: Callable[[tuple[int, int]], StoreWriter], dm: Any) -> None:
        self.root, self.open_writer, self.dm = Path(root), open_writer, dm
        self.writer: StoreWriter | None = None
        self.todo: set[int] = set()
        self.first_epoch: int | None = None
        self.finished = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- opening: on the rank, once the trainer knows it ----
    def open(self, rank: int, world_size: int, epoch: int = 0) -> None:
        check_rank_layout(self.root, world_size)
        self.rank, self.world_size, self.first_epoch = rank, world_size, epoch
        self.writer = self.open_writer((rank, world_size))
        self.spill = self.writer.root / PENDING
        samples = self.dm.store.samples
        done = self.writer.done_ids
        self.owned = owned_indices(self.dm, rank, world_size)
        if self.writer.complete:
            log.info("online write-through: %s is complete already; nothing is written", self.writer.root)
            self.finished = True
            return
        self.todo = {i for i in self.owned if samples[i][0] not in done}
        self.spill.mkdir(parents=True, exist_ok=True)
        for tmp in self.spill.glob(".*.tmp"):  # a kill during a spill write
            tmp.unlink(missing_ok=True)
        log.info("online write-through: rank %d writes %d samples (%d in finished shards already) to %s%s", rank,
                 len(self.owned), len(self.owned) - len(self.todo), self.writer.root,
                 "" if epoch == 0 else f" — resumed in epoch {epoch}: the samples are completed at its end")

    def _spill_path(self, i: int) -> Path:
        return self.spill / f"{i:09d}.safetensors"

    def _spilled(self, i: int) -> bool:
        """Spill i exists and holds sample i's states (its id and length): else it is to be computed."""
        path = self._spill_path(i)
        if not path.is_file():
            return False
        sid, ids, _ = self.dm.store.samples[i]
        try:
            with safe_open(str(path), "pt") as f:
                ok = (f.metadata() or {}).get("sample_id") == sid and f.get_slice("hidden").get_shape()[0] == len(ids)
        except Exception:  # noqa: BLE001 - an unreadable spill is recomputed, never trusted
            ok = False
        if not ok:
            log.warning("online write-through: %s does not hold sample %r's states; it is computed again", path, sid)
            path.unlink(missing_ok=True)
        return ok

    def add(self, indices: list[int], batch: dict[str, torch.Tensor]) -> None:
        """Spill the states of the batch's samples this rank writes (once each)."""
        if self.writer is None or self.finished or not self.todo.intersection(indices):
            return
        for i, (hidden, aux) in zip(indices, per_sample_states(batch)):
            path = self._spill_path(i)
            if i not in self.todo or path.exists():
                continue
            tensors = {"hidden": hidden.contiguous(), **({"aux_hidden": aux.contiguous()} if aux is not None else {})}
            sid = self.dm.store.samples[i][0]
            atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"sample_id": sid}))

    # ---- finishing: the rest computed, then the store assembled in input order ----
    def _compute_missing(self) -> None:
        missing = sorted(i for i in self.todo if not self._spilled(i))
        if not missing:
            return
        log.info("online write-through: computing the %d samples no training batch of rank %d carried", len(missing),
                 self.rank)
        states, samples, budget = self.dm.states, self.dm.store, int(self.dm.batch_tokens)
        batch: list[int] = []
        tokens = 0
        for k, i in enumerate(missing):
            batch.append(i)
            tokens += len(samples.samples[i][1])
            nxt = missing[k + 1] if k + 1 < len(missing) else None
            if nxt is None or tokens + len(samples.samples[nxt][1]) > budget:
                rows = collate_packed([samples[j] for j in batch])
                self.add(batch, states({key: v.to(states.device) for key, v in rows.items()}))
                batch, tokens = [], 0

    def _assemble(self) -> None:
        try:
            samples, done = self.dm.store.samples, self.writer.done_ids
            for i in self.owned:
                sid, ids, mask = samples[i]
                if sid in done:
                    continue
                with safe_open(str(self._spill_path(i)), "pt") as f:
                    hidden = f.get_tensor("hidden")
                    aux = f.get_tensor("aux_hidden") if "aux_hidden" in f.keys() else None
                self.writer.add(Sample(sid, torch.tensor(ids), torch.tensor(mask), hidden, aux))
            self.writer.close()
            remove_tree(self.spill)
            log.info("online write-through: %s complete (%d samples)", self.writer.root, len(self.owned))
            if self.world_size > 1:
                try:
                    merge_if_last(self.root, self.rank, self.world_size)
                except IncompleteRanksError:
                    pass
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = e

    def finish(self, background: bool = True) -> None:
        if self.writer is None or self.finished:
            return
        self._compute_missing()
        self.finished = True  # later batches spill nothing
        self._thread = threading.Thread(target=self._assemble, name="write-through", daemon=True)
        self._thread.start()
        if not background:
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"online write-through to {self.root} failed: {error}") from error

    # ---- Lightning hooks ----
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.writer is None:
            self.open(trainer.global_rank, trainer.world_size, trainer.current_epoch)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.first_epoch:
            self.finish()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish()  # training stopped inside its first epoch (max_steps): the rest is computed here
        self.wait()
