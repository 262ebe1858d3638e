"""Training progress as log lines (core/progress.py): optimizer steps done/total, the loss, loss tokens
per second and the ETA every `every_s` seconds on global rank 0 — what a run whose output goes to a file
shows while Lightning's bar (a terminal's) is off or unseen."""

from __future__ import annotations

import lightning as L
import torch

from core.progress import Progress


class ProgressLog(L.Callback):
    def __init__(self, every_s: float | None, bar: bool = False) -> None:
        self.every_s, self.bar = every_s, bar
        self.progress: Progress | None = None
        self.tokens: torch.Tensor | int = 0  # summed on the device: read only when a line is logged
        self.step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or self.every_s is None:
            return
        total = trainer.estimated_stepping_batches
        self.step = trainer.global_step  # a resumed run starts part-way: counted from here (a true rate and ETA)
        total = int(total) - self.step if total not in (None, float("inf")) else None
        self.progress = Progress(total, "train", "step", bar=self.bar, every_s=self.every_s)
        self.tokens = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        p = self.progress
        if p is None:
            return
        if isinstance(batch, dict) and "loss_mask" in batch:
            self.tokens = self.tokens + batch["loss_mask"].sum()
        if trainer.global_step == self.step:  # inside a gradient-accumulation window
            return
        n, self.step = trainer.global_step - self.step, trainer.global_step
        if p.every_s is not None and p.clock() - p.last >= p.every_s:  # a line is due: read the figures now
            self._figures(trainer)
        p.update(n)

    def _figures(self, trainer) -> None:
        p = self.progress
        elapsed = max(p.clock() - p.t0, 1e-9)
        loss = trainer.callback_metrics.get("train/loss")
        fields = {"global_step": trainer.global_step, "tok_s": round(float(self.tokens) / elapsed, 1)}
        if loss is not None:
            fields["loss"] = float(loss)
        p.set(**fields)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.progress is not None:
            self._figures(trainer)  # the closing line's figures are the last step's
            self.progress.close()
            self.progress = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.progress is not None:
            self.progress.close(failed=True)
            self.progress = None
