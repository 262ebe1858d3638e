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
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from data.precompute import packed_forward
from train.data import FeatureDataModule, PositionedLoader, TokenBudgetBatches, collate

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


class _Indexed(Dataset):
    """The samples at `indices`, each item carrying its index into OnlineSamples (`sample_index`)."""

    def __init__(self, samples: OnlineSamples, indices: list[int]) -> None:
        self.samples, self.indices = samples, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.samples[self.indices[i]], "sample_index": self.indices[i]}


def collate_indexed(collate_fn, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`collate_fn` over the items without their `sample_index`, which the batch carries as one tensor."""
    batch = collate_fn([{k: v for k, v in item.items() if k != "sample_index"} for item in items])
    batch["sample_index"] = torch.tensor([item["sample_index"] for item in items], dtype=torch.long)
    return batch


class StatesAheadLoader(PositionedLoader):
    """A PositionedLoader whose batches get their states one batch ahead, on a thread of their own
    (`prepare`: batch -> batch with states, on the device): the target's forward over batch i+1 runs while
    the head trains on batch i. The loader's place (`position`) counts batches as they leave it, so a
    mid-epoch resume is unchanged. `prepare` None: a plain PositionedLoader."""

    prepare: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None

    def __iter__(self):
        if self.prepare is None:
            yield from super().__iter__()
            return
        sampler: TokenBudgetBatches = self.batch_sampler
        self.position = (sampler.epoch, sampler.start)
        with ThreadPoolExecutor(1, thread_name_prefix="online-states") as pool:
            ahead = None
            for batch in DataLoader.__iter__(self):
                submitted = pool.submit(self.prepare, batch)
                if ahead is not None:
                    ready = ahead.result()
                    self.position = (self.position[0], self.position[1] + 1)
                    yield ready
                ahead = submitted
            if ahead is not None:
                ready = ahead.result()
                self.position = (self.position[0], self.position[1] + 1)
                yield ready


def resolve_prefetch(setting: Any, device: torch.device) -> bool:
    """`train.data.online.prefetch`: auto — on an accelerator (the forward runs on a CUDA stream of its own
    beside the step's), not on a CPU, where the step already uses every core; true / false."""
    if setting in (True, False):
        return bool(setting)
    if setting != "auto":
        raise ValueError(f"train.data.online.prefetch={setting!r}: expected auto, true or false")
    return device.type == "cuda"


class OnlineDataModule(FeatureDataModule):
    """FeatureDataModule over `OnlineSamples`; each batch gets its states from `states` on its device —
    one batch ahead on a thread (`prefetch`), and written through to a store (`write_through`) if set."""

    loader_class = StatesAheadLoader

    def __init__(self, samples: OnlineSamples, states: TargetStates, prefetch: Any = "auto", **data_kw: Any) -> None:
        super().__init__(store_dir=None, expected_fingerprint=None, **data_kw)
        self.samples, self.states = samples, states
        self.prefetch = prefetch
        self.write_through = None  # train/online_store.py WriteThrough, set by train/run.py data_module
        self._stream = None

    def open_samples(self) -> OnlineSamples:
        return self.samples

    def _dataset(self, idx: list[int]) -> Dataset:
        return _Indexed(self.samples, idx)

    def _collate_fn(self):
        return partial(collate_indexed, super()._collate_fn())

    def train_dataloader(self) -> StatesAheadLoader:
        loader = super().train_dataloader()
        device = self._device()
        if device is not None and resolve_prefetch(self.prefetch, device):
            loader.prepare = partial(self._prepare_ahead, device)
            log.info("online training: each batch's states are computed one batch ahead, on a thread%s",
                     " and a CUDA stream of their own" if device.type == "cuda" else "")
        return loader

    def _device(self) -> torch.device | None:
        trainer = getattr(self, "trainer", None)
        try:
            return trainer.strategy.root_device if trainer is not None else None
        except Exception:  # a strategy without devices yet
            return None

    def _tied(self):
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        return getattr(getattr(module, "head", None), "tied", None)

    def _prepare_ahead(self, device: torch.device, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The loader thread's part: the batch on the device with its states. On CUDA on a stream of its own;
        the event it records is waited for on the step's stream (`on_after_batch_transfer`)."""
        self.states.to(device, self._tied())
        if device.type != "cuda":
            return self.states({k: v.to(device) for k, v in batch.items()})
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            batch = self.states({k: v.to(device, non_blocking=True) for k, v in batch.items()})
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return {**batch, "_states_ready": ready}

    def sample_with_states(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i with the states the target computes for it alone, on the CPU (the store's layout)."""
        batch = collate([self.samples[i]])
        device = self.states.device
        batch = self.states({k: v.to(device) for k, v in batch.items()})
        return {k: v[0].cpu() for k, v in batch.items() if k != "valid"}

    def on_after_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, torch.Tensor]:
        ready = batch.pop("_states_ready", None)
        if ready is not None:  # computed ahead on another CUDA stream: the step's stream waits for it
            stream = torch.cuda.current_stream(batch["input_ids"].device)
            stream.wait_event(ready)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(stream)
        indices = batch.pop("sample_index", None)
        if "hidden" not in batch:
            self.states.to(batch["input_ids"].device, self._tied())
            batch = self.states(batch)
        if self.write_through is not None and indices is not None:
            self.write_through.add(indices.tolist(), batch)
        return batch
