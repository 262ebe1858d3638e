"""Online training (`train.data.source: online`): the target computes, batch by batch, the states a
feature store would have held, and nothing is written to disk.

The data module is `FeatureDataModule` itself over `OnlineSamples` instead of a `FeatureStore`: the
same tokenized conversations precompute would store (data/precompute.py `tokenize_all`, the same ids,
loss masks and rejections), so the same held-out split, token-budget batches, packing, rank split and
mid-epoch resume. Its loaders deliver token ids and loss masks; `on_after_batch_transfer` (a Lightning
data-module hook, run on the rank's device after the batch got there) runs the frozen target over the
batch's real tokens as one packed row — each sample attends to itself only, as in precompute's packed
batches, and no compute goes to padding — and adds the last pre-norm state per token (`hidden`) and
EAGLE-3's aux layers (`aux_hidden`) in the batch's layout, zero at padding as `collate` pads a stored
batch. The LightningModule gets one batch type from either source.

The target's embedding, lm_head and final norm are the head's own frozen tensors (`TiedTarget`): the
target is loaded on `target.device` and the head tied to its tensors (views); should the rank's device
differ, the target's three shared weights are replaced by the head's (already moved by Lightning) before
it moves there — the vocabulary-sized matrices exist once on the device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from data.precompute import packed_forward
from train.data import FeatureDataModule, collate

log = logging.getLogger(__name__)


class OnlineSamples:
    """Tokenized conversations with the interface of a FeatureStore that training reads (len,
    sample_ids, lengths, token_counts, aux_layers, items), without the states: items are
    {input_ids, loss_mask}."""

    def __init__(self, samples: list[tuple[str, list[int], list[int]]], aux_layers: list[int] | tuple[int, ...] = ()):
        if not samples:
            raise ValueError("online training: no usable conversation in the data source")
        self.samples = samples
        self._aux_layers = list(aux_layers)

    def __len__(self) -> int:
        return len(self.samples)

    def sample_ids(self) -> list[str]:
        return [sid for sid, _, _ in self.samples]

    def lengths(self) -> list[int]:
        return [len(ids) for _, ids, _ in self.samples]

    @property
    def aux_layers(self) -> list[int]:
        return list(self._aux_layers)

    def token_counts(self, vocab_size: int, indices: list[int] | None = None) -> torch.Tensor:
        """How often each token id occurs as a loss token in the given samples (FeatureStore's definition)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(len(self)) if indices is None else indices:
            _, ids, mask = self.samples[i]
            ids_t, mask_t = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)
            counts += torch.bincount(ids_t[mask_t], minlength=vocab_size)[:vocab_size]
        return counts

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        _, ids, mask = self.samples[i]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.bool)}


class TargetStates:
    """The frozen target over a batch of token ids: what precompute stores for those tokens."""

    def __init__(self, model, aux_layers: list[int] | tuple[int, ...] = ()) -> None:
        self.model = model
        self.aux_layers = tuple(aux_layers)
        self.packed = bool(getattr(model, "supports_packing", False))
        self._device: torch.device | None = None
        for p in model.parameters():
            p.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else next(self.model.parameters()).device

    def tie_to(self, tied: nn.Module) -> None:
        """Make the target's embedding, lm_head and final norm the head's TiedTarget buffers (one copy)."""
        m = self.model
        shared_lm = m.lm_head.weight is m.model.embed_tokens.weight
        m.model.embed_tokens.weight = nn.Parameter(tied.embed, requires_grad=False)
        m.lm_head.weight = m.model.embed_tokens.weight if shared_lm else nn.Parameter(tied.lm_head, requires_grad=False)
        m.model.norm.weight = nn.Parameter(tied.norm_weight, requires_grad=False)

    def to(self, device: torch.device, tied: nn.Module | None = None) -> None:
        if self._device == device:
            return
        if tied is not None and tied.embed.device == device:
            self.tie_to(tied)
        self.model.to(device)
        self._device = device
        log.info("online training: the target runs on %s", device)

    def _packed(self, ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """States [1, N, H] (and aux [1, N, K·H]) of samples back to back in one row `ids` [1, N]: one packed
        forward where the family packs (each sample attends to itself), else each sample alone."""
        if self.packed:
            out = packed_forward(self.model, ids, lengths, self.aux_layers)
            return out.hidden, (torch.cat(out.aux, dim=-1) if self.aux_layers else None)
        parts = [self.model(chunk, logits="none", capture_layers=self.aux_layers) for chunk in ids.split(lengths, dim=1)]
        hidden = torch.cat([p.hidden for p in parts], dim=1)
        return hidden, (torch.cat([torch.cat(p.aux, dim=-1) for p in parts], dim=1) if self.aux_layers else None)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with `hidden` (and `aux_hidden`) added. A packed batch (train/data.py collate_packed) is
        one row already; right-padded rows are run as one packed row of their real tokens — no compute on
        the padding, and the arithmetic of precompute's packed batches — and scattered back, zero at the
        padding as `collate` pads a stored batch."""
        ids, valid = batch["input_ids"], batch["valid"]
        if "segments" in batch:
            hidden, aux = self._packed(ids, torch.bincount(batch["segments"][0]).tolist())
        else:
            lengths = valid.sum(1).tolist()
            h, a = self._packed(ids[valid][None], [n for n in lengths if n])
            hidden = h.new_zeros(*ids.shape, h.shape[-1])
            hidden[valid] = h[0]
            aux = None
            if a is not None:
                aux = a.new_zeros(*ids.shape, a.shape[-1])
                aux[valid] = a[0]
        batch["hidden"] = hidden
        if aux is not None:
            batch["aux_hidden"] = aux
        return batch


class OnlineDataModule(FeatureDataModule):
    """FeatureDataModule over `OnlineSamples`; each batch gets its states from `states` on its device."""

    def __init__(self, samples: OnlineSamples, states: TargetStates, **data_kw: Any) -> None:
        super().__init__(store_dir=None, expected_fingerprint=None, **data_kw)
        self.samples, self.states = samples, states

    def open_samples(self) -> OnlineSamples:
        return self.samples

    def sample_with_states(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i with the states the target computes for it alone, on the CPU (the store's layout)."""
        batch = collate([self.samples[i]])
        device = self.states.device
        batch = self.states({k: v.to(device) for k, v in batch.items()})
        return {k: v[0].cpu() for k, v in batch.items() if k != "valid"}

    def on_after_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        if "hidden" not in batch:
            trainer = getattr(self, "trainer", None)
            module = trainer.lightning_module if trainer is not None else None
            self.states.to(batch["input_ids"].device, getattr(getattr(module, "head", None), "tied", None))
            batch = self.states(batch)
        return batch
