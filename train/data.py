"""The data module over the feature store: a held-out split by sample, token-budget batches of
length-sorted samples (little padding), right padding with a `valid` mask — or, with `packing`,
one unpadded row per batch holding several samples with per-sample positions (`collate_packed`).

Batching is ours, not Lightning's: the train batches are sharded over data-parallel ranks here
(Lightning cannot inject a DistributedSampler under a custom batch_sampler, so the trainer runs with
`use_distributed_sampler=False`), and the data module's state_dict holds the train loader's place in
its epoch, so a mid-epoch resume continues with the next unseen batch instead of replaying the epoch."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from core.launch import local_ranks
from data.store import FeatureStore

log = logging.getLogger(__name__)


class _Subset(Dataset):
    def __init__(self, store: FeatureStore, indices: list[int]) -> None:
        self.store, self.indices = store, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.store[self.indices[i]]


class TokenBudgetBatches:
    """Batches whose padded size (rows × longest row) stays within `batch_tokens`. Samples are
    shuffled per epoch, sorted by length inside windows of 64 batches' worth, and batches shuffled.

    Data-parallel: every rank builds the same epoch's batch list (same seed and epoch) and takes
    every `num_replicas`-th batch from `rank` on. The list is first cut to a multiple of
    `num_replicas`, so all ranks step equally often (DDP hangs otherwise) and no sample is seen twice
    in an epoch; the < num_replicas cut batches are a different random set each epoch.

    `start` batches of the current epoch are skipped by the next pass only (set on resume).

    `pad_to_equal` (validation): nothing is cut — rank r takes batches r, r + N, … of the whole list —
    and a rank with fewer than the others repeats its first batch to the common count, so that every
    rank runs as many forwards (FSDP and ZeRO-3 gather weights collectively in each). `real_batches`
    is how many of this rank's batches are its own; the rest are to be run and not counted."""

    window_batches = 64  # the sort window: this many batches' worth of samples

    def __init__(self, lengths: list[int], batch_tokens: int, shuffle: bool, seed: int,
                 num_replicas: int = 1, rank: int = 0, packing: bool = False, pad_to_equal: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.lengths, self.batch_tokens, self.shuffle, self.seed = lengths, batch_tokens, shuffle, seed
        self.packing = packing  # a batch is one row of samples whose total length fits batch_tokens
        self.num_replicas, self.rank, self.pad_to_equal = num_replicas, rank, pad_to_equal
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    @property
    def sampler(self) -> "TokenBudgetBatches":
        # Lightning calls set_epoch on `loader.batch_sampler.sampler` (PyTorch's BatchSampler layout),
        # never on the batch sampler itself: without this every epoch would repeat epoch 0's order
        return self

    def _all_batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        window = max(self.window_batches * max(1, self.batch_tokens // max(1, max(self.lengths))), 1)
        batches: list[list[int]] = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w:w + window], key=lambda i: self.lengths[i])
            cur: list[int] = []
            longest = 0
            for i in chunk:
                longest_if = max(longest, self.lengths[i])
                size_if = (sum(self.lengths[j] for j in cur) + self.lengths[i] if self.packing
                           else longest_if * (len(cur) + 1))
                if cur and size_if > self.batch_tokens:
                    batches.append(cur)
                    cur, longest_if = [], self.lengths[i]
                cur.append(i)
                longest = longest_if
            if cur:
                batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def _batches(self) -> list[list[int]]:
        key = (self.epoch, self.batch_tokens, self.shuffle, self.seed, self.packing, self.num_replicas, self.rank,
               self.pad_to_equal, id(self.lengths), len(self.lengths))
        cached = getattr(self, "_cache", None)
        if cached is not None and cached[0] == key:  # len() and iter() of one epoch: built once
            return cached[1]
        batches = self._all_batches()
        if self.pad_to_equal:
            mine = batches[self.rank::self.num_replicas]
            self.real_batches = len(mine)
            per = -(-len(batches) // self.num_replicas)
            if batches:
                mine = mine + [(mine or batches)[0]] * (per - len(mine))
        else:
            usable = len(batches) - len(batches) % self.num_replicas
            mine = batches[:usable][self.rank::self.num_replicas]
            self.real_batches = len(mine)
        self._cache = (key, mine)
        return mine

    def __iter__(self):
        # a generator, so the epoch's batches are drawn at the first next(), after Lightning's
        # set_epoch (it creates the iterator before set_epoch on a fresh or resumed fit)
        start, self.start = self.start, 0
        yield from self._batches()[start:]

    def __len__(self) -> int:
        return len(self._batches())  # the whole epoch, also while resuming (Lightning counts the skipped part)


class PositionedLoader(DataLoader):
    """A DataLoader over TokenBudgetBatches that knows its place: (epoch, batches of it delivered),
    counted as batches leave the loader, not as workers prefetch them."""

    def __iter__(self):
        sampler: TokenBudgetBatches = self.batch_sampler
        self.position = (sampler.epoch, sampler.start)  # read at the first next(), after set_epoch / resume
        for batch in super().__iter__():
            self.position = (self.position[0], self.position[1] + 1)
            yield batch


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding to the longest row (zeros) with a `valid` mask; the states (`hidden`, `aux_hidden`)
    where the samples carry them (a store's do; online samples get theirs after transfer, train/online.py)."""
    t = max(s["input_ids"].shape[0] for s in samples)
    b = len(samples)
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "valid": torch.zeros(b, t, dtype=torch.bool),
    }
    for key in ("hidden", "aux_hidden"):
        if key in samples[0]:
            out[key] = torch.zeros(b, t, samples[0][key].shape[-1], dtype=samples[0][key].dtype)
    for r, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        out["valid"][r, :n] = True
        for key in out:
            if key != "valid":
                out[key][r, :n] = s[key]
    return out


def collate_packed(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several samples in one row, no padding: `positions` restart at 0 in each sample and `segments`
    numbers them, so attention stays inside a sample and no loss row crosses into the next one."""
    out = {key: torch.cat([s[key] for s in samples])[None] for key in samples[0]}
    out["valid"] = torch.ones_like(out["loss_mask"])
    out["positions"] = torch.cat([torch.arange(s["input_ids"].shape[0]) for s in samples])[None]
    out["segments"] = torch.cat([torch.full((s["input_ids"].shape[0],), j) for j, s in enumerate(samples)])[None]
    return out


def split_order(sample_ids: list[str], split_seed: int) -> list[int]:
    """Store indices ordered by sha256(split_seed, sample id): the held-out split is a prefix of it, so
    it depends on the samples' ids and split_seed alone."""
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("the store holds a sample id twice; the held-out split is keyed by sample id")
    keys = [hashlib.sha256(f"{int(split_seed)}:{sid}".encode()).digest() for sid in sample_ids]
    return sorted(range(len(sample_ids)), key=keys.__getitem__)


def heldout_ids_digest(val_ids: list[str]) -> str:
    """sha256 of the held-out ids in split order: two runs scored the same rows iff their digests match."""
    return hashlib.sha256(json.dumps(list(val_ids)).encode()).hexdigest()


def loader_workers(setting: int | str, on_cuda: bool) -> int:
    """`train.data.num_workers`: a number, or `auto` — none on CPU (the step itself uses the cores), on a
    GPU up to 4 per rank from its share of the node's cores (leaving one for the step's own thread), so
    that reading and collating the next batches overlaps the step."""
    if setting != "auto":
        n = int(setting)
        if n < 0:
            raise ValueError(f"train.data.num_workers={setting!r}: expected auto or a number ≥ 0")
        return n
    if not on_cuda:
        return 0
    return max(0, min(4, (os.cpu_count() or 1) // local_ranks() - 1))


def _in_process_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def open_store_once(root: str, fingerprint: dict | None, verify: str) -> FeatureStore:
    """The store, its full verification (sha256 of every shard) done once per launch: with several ranks,
    global rank 0 hashes it while the others wait; then each node's local rank 0 opens it (the stamp rank 0
    wrote, on shared storage: no hashing; a node-local copy: hashed once on that node), then the rest —
    instead of every rank hashing terabytes on its own. The waits are barriers of a gloo group of their
    own with a day's timeout (hashing 3 TB takes minutes, longer than NCCL's default)."""
    import torch.distributed as dist

    if verify != "full" or not _in_process_group():
        return FeatureStore(root, fingerprint, verify=verify)
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    turn = 0 if dist.get_rank() == 0 else (1 if local_rank == 0 else 2)
    store, error = None, None
    for step in range(3):
        if turn == step:
            try:
                store = FeatureStore(root, fingerprint, verify=verify)
            except Exception as err:  # raised after the barriers, so that no rank waits forever
                error = err
        dist.barrier(group=group)
    if error is not None:
        raise error
    return store


class FeatureDataModule(L.LightningDataModule):
    def __init__(self, store_dir: str, expected_fingerprint: dict[str, Any] | None = None,
                 batch_tokens: int = 4096, val_fraction: float = 0.05, seed: int = 0, num_workers: int | str = "auto",
                 packing: bool = False, verify_store: str = "full", train_samples: int | None = None,
                 split_seed: int = 0, source: str = "store", online: dict[str, Any] | None = None) -> None:
        """`source`, `online`: train.data.source and .online, taken with the rest of train.data; this module
        reads a store (`online` is train/run.py `data_module`'s, which builds train/online.py's module instead)."""
        if source != "store":
            raise ValueError(f"train.data.source={source!r}: this step reads a feature store (store_dir={store_dir}); "
                             "online training is `spechead train train.data.source=online` (train/run.py)")
        if (online or {}).get("write_store"):
            raise ValueError(f"train.data.online.write_store={online['write_store']!r} writes the states online training "
                             "computes; with train.data.source=store there are none (set train.data.source=online, or "
                             "write a store with scripts.precompute)")
        super().__init__()
        # the held-out split follows split_seed and the samples' ids only, not `seed` (batch order) nor the
        # shard order (rank count): every run on one store holds out the same conversations
        self.split_seed = split_seed
        self.train_samples = train_samples  # the first n conversations of the training split only (null: all)
        self.store_dir, self.expected_fingerprint = store_dir, expected_fingerprint
        self.batch_tokens, self.val_fraction, self.seed, self.num_workers = batch_tokens, val_fraction, seed, num_workers
        self.packing = packing
        self.verify_store = verify_store  # full: sha256 of every shard, once per store state (a stamp); header
        self.aux_read: list[int] | None = None  # the captured aux layers the head reads (None: all the store holds)

    def open_samples(self) -> FeatureStore:
        """The samples to train on: the store (train/online.py overrides it with tokenized conversations).
        Every open checks the shards' sizes and headers; `full` adds the checksums (data/store.py). The
        ranks of a launch (torchrun, srun: WORLD_SIZE > 1) open with headers only until the process group
        exists — run_training sets up before fit — and hash once, in the setup that fit calls."""
        verify = self.verify_store
        if verify == "full" and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _in_process_group():
            verify = "header"
        return open_store_once(self.store_dir, self.expected_fingerprint, verify)

    def setup(self, stage: str | None = None) -> None:
        self.store = self.open_samples()
        if self.aux_read is not None:
            self.store.select_aux_layers(self.aux_read)
        n = len(self.store)
        ids = self.store.sample_ids()
        order = split_order(ids, self.split_seed)
        n_val = min(max(1, round(n * self.val_fraction)), n - 1) if self.val_fraction > 0 and n > 1 else 0
        # held-out in split order (engine validation takes its prompts from the front), training by store index
        self.val_idx, self.train_idx = order[:n_val], sorted(order[n_val:])
        self.val_ids = [ids[i] for i in self.val_idx]
        if self.train_samples is not None:  # fewer conversations, more epochs (the recipe study's epochs arm)
            if int(self.train_samples) < 1:
                raise ValueError(f"train.data.train_samples={self.train_samples}: at least 1 (null: the whole split)")
            self.train_idx = self.train_idx[: int(self.train_samples)]
        self.lengths = self.store.lengths()

    def read_layers_of(self, head) -> None:
        """Serve `head` the aux layers it reads (its `capture_layers`): all the store holds, or a subset of them
        (the store selects their columns); a layer the store did not capture is refused, saying what to set."""
        wanted, stored = [int(i) for i in head.capture_layers], list(self.store.aux_layers)
        if not wanted or wanted == stored:
            return
        if not set(wanted) <= set(stored):
            raise ValueError(f"{self.store_dir}: the store holds aux layers {stored or 'none'}, the {head.kind} head "
                             f"reads {wanted}: precompute a store with precompute.aux_layers={wanted} (`auto` does "
                             "it for the configured head), or one capturing a superset of them")
        self.aux_read = wanted
        self.store.select_aux_layers(wanted)

    def sample_with_states(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i (an index into the store) with its target states, as the store holds it."""
        return self.store[i]

    def _loader(self, idx: list[int], shuffle: bool, num_replicas: int = 1, rank: int = 0,
                pad_to_equal: bool = False) -> PositionedLoader:
        lengths = [self.lengths[i] for i in idx]
        batches = TokenBudgetBatches(lengths, self.batch_tokens, shuffle, self.seed, num_replicas, rank, self.packing,
                                     pad_to_equal)
        on_cuda = self._on_cuda()
        workers = loader_workers(self.num_workers, on_cuda)
        return self.loader_class(self._dataset(idx), collate_fn=self._collate_fn(), num_workers=workers,
                                 batch_sampler=batches, pin_memory=on_cuda, persistent_workers=workers > 0)

    loader_class = PositionedLoader

    def _dataset(self, idx: list[int]) -> Dataset:
        return _Subset(self.store, idx)

    def _collate_fn(self):
        return collate_packed if self.packing else collate

    def _on_cuda(self) -> bool:
        trainer = getattr(self, "trainer", None)
        try:
            return trainer is not None and trainer.strategy.root_device.type == "cuda"
        except Exception:  # a strategy without devices yet
            return False

    def train_dataloader(self) -> PositionedLoader:
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        self._train_loader = self._loader(self.train_idx, shuffle=True, num_replicas=replicas, rank=rank)
        self._resume_train_loader()
        return self._train_loader

    def val_dataloader(self) -> PositionedLoader:
        # sharded over the ranks, none cut (padding batches are run, not counted); the module sums each
        # metric × tokens and the tokens over the ranks, so val/* is the exact per-token mean of the split
        trainer = self.trainer
        replicas, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        return self._loader(self.val_idx, shuffle=False, num_replicas=replicas, rank=rank, pad_to_equal=True)

    # ---- resume: Lightning saves this in its checkpoints and restores it on `fit(ckpt_path=...)` ----
    # (not the loader's own state_dict: Lightning builds the train loader for
    # `estimated_stepping_batches` before it restores loop states, and then skips restoring the
    # loader; the data module is restored before that with DDP, after it with DeepSpeed — both work)
    def state_dict(self) -> dict[str, int]:
        loader = getattr(self, "_train_loader", None)
        if loader is None:
            return {}
        sampler = loader.batch_sampler
        epoch, delivered = getattr(loader, "position", (sampler.epoch, sampler.start))
        return {"epoch": epoch, "delivered": delivered}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state)
        self._resume_train_loader()

    def _resume_train_loader(self) -> None:
        state, loader = getattr(self, "_resume", None), getattr(self, "_train_loader", None)
        if state and loader is not None:
            sampler = loader.batch_sampler
            sampler.epoch, sampler.start = int(state["epoch"]), int(state["delivered"])
            if not getattr(self, "_resume_logged", False):
                self._resume_logged = True
                log.info("train: the training data resumes in epoch %d after its first %d batches", sampler.epoch,
                         sampler.start)
