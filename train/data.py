"""The data module over the feature store: a held-out split by sample, token-budget batches of
length-sorted samples (little padding), right padding with a `valid` mask."""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from data.store import FeatureStore


class _Subset(Dataset):
    def __init__(self, store: FeatureStore, indices: list[int]) -> None:
        self.store, self.indices = store, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.store[self.indices[i]]


class TokenBudgetBatches:
    """Batches whose padded size (rows × longest row) stays within `batch_tokens`. Samples are
    shuffled per epoch, sorted by length inside windows of 64 batches' worth, and batches shuffled."""

    def __init__(self, lengths: list[int], batch_tokens: int, shuffle: bool, seed: int) -> None:
        self.lengths, self.batch_tokens, self.shuffle, self.seed = lengths, batch_tokens, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        window = max(64 * max(1, self.batch_tokens // max(1, max(self.lengths))), 1)
        batches: list[list[int]] = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w:w + window], key=lambda i: self.lengths[i])
            cur: list[int] = []
            longest = 0
            for i in chunk:
                longest_if = max(longest, self.lengths[i])
                if cur and longest_if * (len(cur) + 1) > self.batch_tokens:
                    batches.append(cur)
                    cur, longest_if = [], self.lengths[i]
                cur.append(i)
                longest = longest_if
            if cur:
                batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    t = max(s["input_ids"].shape[0] for s in samples)
    b, h = len(samples), samples[0]["hidden"].shape[-1]
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "valid": torch.zeros(b, t, dtype=torch.bool),
        "hidden": torch.zeros(b, t, h, dtype=samples[0]["hidden"].dtype),
    }
    for r, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        out["input_ids"][r, :n] = s["input_ids"]
        out["loss_mask"][r, :n] = s["loss_mask"]
        out["valid"][r, :n] = True
        out["hidden"][r, :n] = s["hidden"]
    return out


class FeatureDataModule(L.LightningDataModule):
    def __init__(self, store_dir: str, expected_fingerprint: dict[str, Any] | None = None,
                 batch_tokens: int = 4096, val_fraction: float = 0.05, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.store_dir, self.expected_fingerprint = store_dir, expected_fingerprint
        self.batch_tokens, self.val_fraction, self.seed, self.num_workers = batch_tokens, val_fraction, seed, num_workers

    def setup(self, stage: str | None = None) -> None:
        self.store = FeatureStore(self.store_dir, self.expected_fingerprint)
        n = len(self.store)
        order = list(range(n))
        random.Random(self.seed).shuffle(order)
        n_val = min(max(1, round(n * self.val_fraction)), n - 1) if self.val_fraction > 0 and n > 1 else 0
        self.val_idx, self.train_idx = sorted(order[:n_val]), sorted(order[n_val:])
        self.lengths = self.store.lengths()

    def _loader(self, idx: list[int], shuffle: bool) -> DataLoader:
        lengths = [self.lengths[i] for i in idx]
        return DataLoader(_Subset(self.store, idx), collate_fn=collate, num_workers=self.num_workers,
                          batch_sampler=TokenBudgetBatches(lengths, self.batch_tokens, shuffle, self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_idx, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_idx, shuffle=False)
