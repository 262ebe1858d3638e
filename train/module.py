"""The LightningModule: loss, metrics and optimizer for a draft head (docs/design.md §4).

It owns no data loading and no target model: the head arrives built, with the target's frozen
embedding / final norm / lm_head attached as non-persistent buffers, and batches arrive from the
feature store. Depth 1: position i consumes (H_i, t_{i+1}) and is trained against H_{i+1} and the
teacher distribution softmax(W_lm N_f(H_{i+1})), which predicts t_{i+2}; the loss mask is that of
t_{i+2}. `depth: D > 1` unrolls the training-time test (heads/unroll.py): depth d consumes the
head's own depth d-1 state, exactly as the engine's draft loop does. Its settings (`train.module`) arrive as
one ModuleSettings (train/settings.py), checked there but for what needs the head.
"""

from __future__ import annotations

import logging
import resource
import time
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch

from heads.eagle3 import Eagle3Layer
from heads.layers import DecoderLayer
from heads.registry import head_type
from heads.unroll import unroll
from inference_eval.speculative import chain_tau
from train.block_loss import block_terms
from train.data import TokenBudgetBatches
from train.losses import depth_terms, greedy_inputs
from train.optim import NS_DTYPES, build_optimizer, lr_multiplier, resolve_optimizer
from train.settings import DEEP_FROM_AUTO, ModuleSettings, deepspeed_conflicts


log = logging.getLogger(__name__)


def _dropout_layers(head: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose residual branches `train.module.dropout` drops (heads/layers.py `dropped`)."""
    return [m for m in head.modules() if isinstance(m, (DecoderLayer, Eagle3Layer))]


def check_against_head(settings: ModuleSettings, head: torch.nn.Module) -> None:
    """The settings' checks that need the head (the others: ModuleSettings itself)."""
    if settings.dropout > 0 and (hasattr(head, "unroll") or not _dropout_layers(head)):
        raise ValueError(f"train.module.dropout={settings.dropout} drops the residual branches of the layers of the "
                         f"heads with the shared unroll (mtp, eagle1, eagle3); {type(head).__name__} trains its own "
                         "way: leave it at 0")
    if settings.deep_lr_scale != 1.0 and len(head.depth_modules()) < 2:
        raise ValueError(f"train.module.deep_lr_scale={settings.deep_lr_scale!r} scales the lr of the modules of depth "
                         f"≥ 2, and this {type(head).__name__} has no separate per-depth modules (e.g. "
                         f"head.num_modules=3 for mtp); leave it at 1.0")


class DraftHeadModule(L.LightningModule):
    def __init__(self, head: torch.nn.Module, settings: ModuleSettings | None = None, **kwargs: Any) -> None:
        """`settings` (train/run.py builds them from the config), or the same settings as keywords
        (`DraftHeadModule(head, depth=3)`: every other setting at its default), not both."""
        super().__init__()
        if settings is not None and kwargs:
            raise TypeError(f"DraftHeadModule: settings given both as a ModuleSettings and as keywords "
                            f"({sorted(kwargs)})")
        if settings is not None and not isinstance(settings, ModuleSettings):
            raise TypeError(f"DraftHeadModule: settings must be a ModuleSettings, got {type(settings).__name__}")
        self.settings = settings if settings is not None else ModuleSettings.from_config(kwargs)
        check_against_head(self.settings, head)
        # count the agreements on the rows whose inputs are the target's greedy tokens too (held-out scores)
        self.track_onpolicy = False
        self._deep_copied = False  # `deep_from_step`: the deeper modules started from module 1 (kept in checkpoints)
        self.head = head
        # recompute each unrolled decoder step in backward (heads/unroll.py): less memory on long sequences
        self.head.gradient_checkpointing = self.settings.gradient_checkpointing
        # recorded as plain values: Lightning writes them into checkpoints and hands them to the logger
        self.save_hyperparameters(self.settings.as_dict())
        self._t_last: float | None = None
        clip_scope = self.settings.clip_scope
        if clip_scope == "module" or (clip_scope == "auto" and len(head.depth_modules()) > 1):
            # set on the instance, not the class: Lightning's DeepSpeed strategy warns whenever this hook is
            # overridden (it clips inside its engine), and setup() refuses `module` there (`auto` drops it there)
            self.configure_gradient_clipping = self._clip_each_module
        # The frozen target tensors (E, W_lm, N_f: gigabytes for a 128k vocabulary) are identical on
        # every rank and never change: DDP must neither broadcast them at wrap time nor before each
        # step (its `broadcast_buffers`). DDP's own ignore list keeps them out of both.
        tied = {id(t) for t in head.tied.buffers()}
        self.frozen_buffer_names = [name for name, buf in self.named_buffers() if id(buf) in tied]
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, self.frozen_buffer_names)

    # ---- sharding (FSDP2, train/strategies.py) ------------------------------------------------------
    def configure_model(self) -> None:
        """Under FSDP2Strategy: each decoder layer an FSDP unit, this module the root unit (its forward
        computes the loss, so the head's tensors outside the layers are gathered around it). Other
        strategies set no device mesh and this does nothing."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        from train.strategies import fsdp_unit_settings

        dp = mesh["data_parallel"]
        strategy = self.trainer.strategy
        for layer, kwargs in fsdp_unit_settings(self, strategy, self.settings.depth):
            fully_shard(layer, mesh=dp, **kwargs)
        self._sharded = True

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss terms of a batch (compute_loss) through the module call: what sharded strategies
        hook (FSDP gathers the root unit's tensors around it)."""
        return self.compute_loss(batch)

    # ---- the loss ---------------------------------------------------------------------------------
    def compute_loss(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Σ_d γ^(d-1) · (w_hidden · SmoothL1 + w_kl · KL) / n_d over the unrolled depths d = 1..D.

        Row i of depth d estimates H_{i+d}; its teacher is softmax(W_lm N_f(H_{i+d})), which
        predicts t_{i+d+1}, so its loss mask is that of t_{i+d+1} (`loss_on: all`: every real token)."""
        hp = self.settings
        if getattr(self.head, "block", False):  # a block drafter: random anchors, one pass per block
            # anchors from (seed, step) and each row's tokens, not the rank (N processes draw what one does); held-out
            # scores draw the same anchors at every step
            step = self._trainer.global_step if self._trainer is not None else 0
            salt = hash((torch.initial_seed() & 0xFFFFFFFF, step)) & 0x7FFFFFFF if self.training else 0
            return block_terms(self.head, batch, hp.block, salt, hp.loss_on, hp.kl_chunk_size)
        hidden = batch["hidden"].to(self.head.dtype)  # [B, T, H]
        ids, valid, loss_mask = batch["input_ids"], batch["valid"], batch["loss_mask"]
        t = hidden.shape[1]
        aux = batch.get("aux_hidden")
        aux = aux.to(self.head.dtype) if aux is not None else None
        segments = batch.get("segments")  # packed rows (train/data.py collate_packed)
        inp, aux = self.noisy_inputs(hidden, aux)  # the teacher reads `hidden` itself
        started = self.deep_started()
        # before `deep_from_step`, depth 1 alone — except over several processes, where every depth runs at weight 0 so
        # that each rank's graph uses every tensor (as DDP, FSDP and DeepSpeed expect)
        several = not started and getattr(self._trainer, "world_size", 1) > 1
        with self.residual_dropout():
            outs = unroll(self.head, inp, ids, hp.depth if started or several else 1, aux, batch.get("positions"),
                          segments, detach=hp.detach_depths)
        out: dict[str, torch.Tensor] = {"tokens": valid.sum()}
        total = hidden.new_zeros((), dtype=torch.float32)
        accs = []
        off_w = float(hp.offpolicy_weight)
        # `offpolicy_weight` < 1: greedy[:, j] — t_{j+1} is the target's greedy choice after j; `on` — row i's inputs
        # t_{i+1..i+d} all are (the rows the engine meets when the target decodes greedily)
        track = off_w != 1.0 or self.track_onpolicy
        greedy = greedy_inputs(self.head, hidden, ids, hp.kl_chunk_size) if track else None
        on = None
        for d, pred in enumerate(outs, start=1):
            rows = max(t - d - 1, 0)
            every = hp.loss_on == "all" or (hp.loss_on == "deep_all" and d >= 2)
            mask = valid[:, d + 1:] if every else loss_mask[:, d + 1:] & valid[:, d + 1:]  # [B, rows]
            if segments is not None:  # row i and its target t_{i+d+1} must be one sample
                mask = mask & (segments[:, d + 1:] == segments[:, :rows])
            n = mask.sum()
            sel_pred, sel_tgt = pred[:, :rows][mask], hidden[:, d:d + rows][mask]  # [N, H]
            row_w, sel_on = None, None
            if greedy is not None:
                on = greedy[:, d - 1:d - 1 + rows] & (on[:, :rows] if on is not None else True)
                sel_on = on[mask]
                if off_w != 1.0:
                    row_w = torch.where(sel_on, 1.0, off_w).to(torch.float32)
                out[f"onpolicy_d{d}"] = sel_on.float().sum() / n.clamp(min=1)
            reg, kl, agree = depth_terms(self.head, sel_pred, sel_tgt, d, hp.normed_regression, hp.kl_chunk_size,
                                         hp.kl_temperature, row_w, per_row_agree=sel_on is not None)
            if sel_on is not None:  # the agreements on the rows whose inputs are the target's greedy tokens
                out[f"agree_on_count_d{d}"], out[f"n_on_count_d{d}"] = (agree & sel_on).sum(), sel_on.sum()
                agree = agree.sum()
            n_safe = n.clamp(min=1)
            w_sum = n_safe if row_w is None else row_w.sum().clamp(min=1e-6)  # a weighted mean over the rows
            weight = hp.depth_decay ** (d - 1) if d == 1 or started else 0.0
            total = total + weight * (hp.w_hidden * reg + hp.w_kl * kl) / w_sum
            acc = agree.float() / n_safe
            accs.append(acc)
            out.update({f"reg_d{d}": reg / w_sum, f"kl_d{d}": kl / w_sum, f"acc_d{d}": acc,
                        f"agree_count_d{d}": agree.detach(), f"n_count_d{d}": n})
            if d == 1:
                out["n_tokens"] = n
        out["loss"] = total
        sim_tau = chain_tau(accs)
        out["sim_tau"] = sim_tau if torch.is_tensor(sim_tau) else torch.tensor(sim_tau)
        return out

    def noisy_inputs(self, hidden: torch.Tensor, aux: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target states the head reads, with `input_noise` in training: each token's state plus Gaussian
        noise of σ × its own RMS (scale-free across targets and layers), so depth 1 also learns from states a
        little off the target's — what the head is handed at depth ≥ 2, its own estimate. Validation, the
        held-out scores and the teacher see the states unchanged. The noise of a step is a function of
        (seed, global step, rank) alone: a resumed run draws what the uninterrupted one drew, and each rank
        its own. (Micro-batches of one optimizer step, `trainer.accumulate_grad_batches` > 1, share the draw.)"""
        sigma = float(self.settings.input_noise)
        if sigma == 0.0 or not self.training:
            return hidden, aux
        gen = torch.Generator(device="cpu").manual_seed(self._step_seed())

        def noisy(x: torch.Tensor) -> torch.Tensor:
            eps = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
            rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
            return (x.float() + sigma * rms * eps).to(x.dtype)

        return noisy(hidden), (noisy(aux) if aux is not None else None)

    def _step_seed(self, *salt: int) -> int:
        """A seed that is a function of (seed, global step, rank, salt) alone: a resumed run draws what the uninterrupted
        one drew, each rank its own (input_noise's has no salt, dropout's is 1)."""
        trainer = self._trainer
        step = trainer.global_step if trainer is not None else 0
        rank = trainer.global_rank if trainer is not None else 0
        return hash((torch.initial_seed() & 0xFFFFFFFF, step, rank, *salt)) & 0x7FFFFFFF

    @contextmanager
    def residual_dropout(self):
        """`dropout: p` in training: each residual branch (attention, MLP) of the head's layers is zeroed element-wise
        with probability p and the rest scaled by 1/(1-p), at every unrolled depth — the head is a whole transformer
        layer trained on a few hundred thousand tokens, and its second epoch memorises. Installed on the layers for
        this loss only (the engine, validation and the held-out scores run them as they are); the masks of a step are a
        function of (seed, step, rank)."""
        p = float(self.settings.dropout)
        if p == 0.0 or not self.training or not torch.is_grad_enabled():
            yield
            return
        device = next(self.head.parameters()).device
        gen = torch.Generator(device=device).manual_seed(self._step_seed(1))

        def drop(x: torch.Tensor) -> torch.Tensor:
            keep = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32) >= p
            return x * keep.to(x.dtype) * (1.0 / (1.0 - p))

        layers = _dropout_layers(self.head)
        for m in layers:
            m.residual_dropout = drop
        try:
            yield
        finally:
            for m in layers:
                m.residual_dropout = None

    def _metric_keys(self, out: dict[str, torch.Tensor]) -> list[str]:
        return [k for k in out if k not in ("n_tokens", "tokens") and "_count_" not in k]

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer is not None and getattr(self, "_epoch_length_synced", None) != self.trainer.current_epoch:
            self._epoch_length_synced = self.trainer.current_epoch  # once per epoch, also a resumed one
            sync_epoch_length(self.trainer)
        if not self._deep_copied and self.deep_from() > 0 and self.deep_started():
            self.start_deeper_modules(self.optimizers(use_pl_optimizer=False))

    # ---- `deep_from_step`: depth 1 first, then every depth, the deeper modules starting from module 1 --------
    def deep_from(self) -> int | float:
        """`deep_from_step` as it applies here: `auto` is DEEP_FROM_AUTO, or 0 where DeepSpeed runs the optimizer."""
        value = self.settings.deep_from_step
        if value == "auto":
            return 0 if self._on_deepspeed() else DEEP_FROM_AUTO
        return value

    def clip_scope(self) -> str:
        """`clip_scope` as it applies here: `auto` is `module` for a head of several per-depth modules outside
        DeepSpeed, else `all`."""
        value = self.settings.clip_scope
        if value == "auto":
            return "module" if len(self.head.depth_modules()) > 1 and not self._on_deepspeed() else "all"
        return value

    def deep_start_step(self) -> int:
        """The optimizer step from which the depths ≥ 2 train: `deep_from_step` itself (an integer), or that fraction
        of the run's optimizer steps (a float in (0, 1): the same step for a resumed run of the same length)."""
        value = self.deep_from()
        if isinstance(value, float):
            return max(1, round(value * int(self._trainer.estimated_stepping_batches)))
        return int(value)

    def deep_started(self) -> bool:
        """Whether the depths ≥ 2 train now: always outside training (validation and the held-out scores run every
        depth) and without a trainer; in training from optimizer step `deep_start_step()` on."""
        if not self.deep_from() or not self.training or self._trainer is None:
            return True
        return self._trainer.global_step >= self.deep_start_step()

    @torch.no_grad()
    def start_deeper_modules(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """At `deep_from_step`: each per-depth module of depth ≥ 2 (mtp `num_modules` > 1) becomes a copy of
        module 1 as trained so far, and its optimizer state is dropped (it starts afresh from there). A 1-module
        head has nothing to copy: the depths ≥ 2 then simply join its training."""
        modules = self.head.depth_modules()
        for m in modules[1:]:
            src, dst = dict(modules[0].named_parameters()), dict(m.named_parameters())
            assert src.keys() == dst.keys(), "per-depth modules of one structure"
            for name, p in dst.items():
                p.copy_(src[name])
                if optimizer is not None:
                    optimizer.state.pop(p, None)
        self._deep_copied = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["deep_copied"] = self._deep_copied

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._deep_copied = bool(checkpoint.get("deep_copied", False))

    def training_step(self, batch, batch_idx):
        out = self(batch)
        now = time.perf_counter()
        if self._t_last is not None:
            self.log("train/tokens_per_s", out["tokens"].float() / (now - self._t_last), on_step=True)
        self._t_last = now
        self.log("train/peak_rss_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, on_step=True)
        if self.device.type == "cuda":
            self.log("train/peak_gpu_mem_gb", torch.cuda.max_memory_allocated(self.device) / 2**30, on_step=True)
        bs = int(batch["input_ids"].shape[0])
        for key in self._metric_keys(out):
            self.log(f"train/{key}", out[key], on_step=True, prog_bar=key in ("loss", "acc_d1"), batch_size=bs)
        return out["loss"]

    def on_validation_epoch_start(self) -> None:
        self._val_sums: dict[str, torch.Tensor] = {}

    def validation_step(self, batch, batch_idx):
        out = self(batch)
        sampler = getattr(getattr(self.trainer, "val_dataloaders", None), "batch_sampler", None)
        own = batch_idx < getattr(sampler, "real_batches", batch_idx + 1)  # else a padding batch (train/data.py)
        n = out["n_tokens"].detach().double() * own
        for key in self._metric_keys(out):  # per-token means: Σ value·tokens and Σ tokens (no host sync per batch)
            pair = torch.stack([out[key].detach().double() * n, n])
            self._val_sums[key] = self._val_sums[key] + pair if key in self._val_sums else pair

    def on_validation_epoch_end(self) -> None:
        """val/* over the whole held-out split: each rank's sums, added over the ranks (one collective)."""
        keys = sorted(self._val_sums)
        if not keys:
            return
        sums = torch.stack([self._val_sums[k] for k in keys]).to(self.device)
        if self.trainer is not None and self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        for key, (total, n) in zip(keys, sums.tolist()):
            self.log(f"val/{key}", total / max(n, 1.0), prog_bar=key == "acc_d1", sync_dist=False)

    # ---- optimisation -----------------------------------------------------------------------------
    def clip_groups(self) -> list[list[torch.nn.Parameter]]:
        """`clip_scope: module`'s groups: each per-depth module's trainable tensors, then the rest of the head's."""
        groups, seen = [], set()
        for m in self.head.depth_modules():
            group = [p for p in m.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in group)
            groups.append(group)
        rest = [p for p in self.head.parameters() if p.requires_grad and id(p) not in seen]
        return [g for g in groups + [rest] if g]

    def _clip_each_module(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if not gradient_clip_val:
            return
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"train.module.clip_scope=module clips by norm; trainer.gradient_clip_algorithm="
                             f"{gradient_clip_algorithm!r} (set it to norm, or clip_scope to all)")
        for group in self.clip_groups():
            torch.nn.utils.clip_grad_norm_([p for p in group if p.grad is not None], float(gradient_clip_val))

    def _on_deepspeed(self) -> bool:
        """Whether DeepSpeed runs the optimizer (Lightning's DeepSpeedStrategy, or a stand-in of that name)."""
        strategy = getattr(self._trainer, "strategy", None)
        return strategy is not None and "deepspeed" in type(strategy).__name__.lower()

    def setup(self, stage: str) -> None:
        on_deepspeed = self._on_deepspeed()
        if on_deepspeed and (problems := deepspeed_conflicts(self.settings)):
            raise ValueError("; ".join(problems))
        if self.clip_scope() == "all":  # `auto` under DeepSpeed: Lightning's own clipping (DeepSpeed's, there)
            self.__dict__.pop("configure_gradient_clipping", None)
        for key, resolved in (("deep_from_step", self.deep_from()), ("clip_scope", self.clip_scope())):
            if getattr(self.settings, key) == "auto":
                log.info("train.module.%s=auto: %s%s", key, resolved, " (DeepSpeed)" if on_deepspeed else "")

    def optimizer_name(self) -> str:
        """The optimizer `train.module.optimizer` resolves to for this head and strategy (train/optim.py)."""
        return resolve_optimizer(self.settings.optimizer, head_type(self.head), self._on_deepspeed())

    def configure_optimizers(self):
        hp = self.settings
        name = self.optimizer_name()
        if hp.optimizer == "auto" and getattr(self._trainer, "global_rank", 0) == 0:
            log.info("train.module.optimizer=auto: %s", name)
        # several ranks hold the same updates (DDP's averaged gradients, FSDP2's shards): each orthogonalises its share
        several = getattr(self._trainer, "world_size", 1) > 1
        opt = build_optimizer(self.head, name, hp.lr, hp.weight_decay, hp.betas, hp.muon_momentum,
                              hp.muon_weight_decay, ns_dtype=NS_DTYPES[hp.ns_dtype], deep_lr_scale=hp.deep_lr_scale,
                              divide_ns=several)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warm = min(hp.warmup_steps, total // 2)
        lr_multiplier(0, total, warm, hp.schedule, hp.min_lr_ratio)  # a wrong name fails here, not at step 1
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_multiplier(step, total, warm, hp.schedule, hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def sync_epoch_length(trainer) -> int | None:
    """Token-budget batches (train/data.py) group the samples anew each epoch, so an epoch's number of
    batches varies. Lightning reads the loader's length once, at the first epoch, and validates when
    the epoch's batch count reaches it: a later epoch one batch shorter skipped its end-of-epoch
    validation (the final val metrics were an epoch old), a longer one validated before its last
    batches. This sets the current epoch's own count (its sampler's epoch is set by now); returns it
    (None: not a TokenBudgetBatches loader, or limit_train_batches / an int val_check_interval in use)."""
    loader = trainer.train_dataloader
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, TokenBudgetBatches) or trainer.limit_train_batches != 1.0:
        return None
    n = len(sampler)
    loop = trainer.fit_loop
    if n != loop.max_batches:
        loop.max_batches = n
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
            trainer.val_check_batch = max(1, int(n * trainer.val_check_interval))
    return n


@torch.no_grad()
def heldout_agreement(head: torch.nn.Module, loader, depth: int) -> dict[str, Any]:
    """Teacher-forced top-1 agreement per depth 1..`depth` over a loader (the held-out split),
    pooled over tokens: the training-time-test unroll, as the engine's draft chain would run it
    had the target accepted every draft token. Also the simulated τ for k = depth."""
    module = DraftHeadModule(head, depth=depth)
    module.track_onpolicy = True
    agree, count, agree_on, count_on = ([0] * depth for _ in range(4))
    was_training = head.training
    head.eval()
    for batch in loader:
        out = module.compute_loss(batch)
        for d in range(1, depth + 1):
            agree[d - 1] += int(out[f"agree_count_d{d}"])
            count[d - 1] += int(out[f"n_count_d{d}"])
            agree_on[d - 1] += int(out.get(f"agree_on_count_d{d}", 0))  # not counted for block heads
            count_on[d - 1] += int(out.get(f"n_on_count_d{d}", 0))
    head.train(was_training)
    acc = [a / max(c, 1) for a, c in zip(agree, count)]
    # acc_onpolicy: the same agreement over the rows whose input tokens t_{i+1..i+d} are the target's greedy
    # choices (argmax W_lm N_f(H_j)) — the rows the engine meets when the target decodes greedily
    return {"acc": acc, "tokens": count, "sim_tau": chain_tau(acc),
            "acc_onpolicy": [a / max(c, 1) for a, c in zip(agree_on, count_on)], "tokens_onpolicy": count_on}
