"""How a training ends: a checkpoint write that fails (a full disk) leaves the previous checkpoint as it was and no
partial file, names the file, and the run resumes from the previous checkpoint to the head an uninterrupted run
saves; and the held-out scores training reports (the last line of `spechead train`) are those of the head it
saved — after a stop mid-epoch, and after a resume that crosses no epoch end."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from artifacts.checkpoint import load_native
from core.files import DiskFull
from inference_eval.model import tied_target
from experiments.stages import run_precompute, run_training
from tests.conftest import compose_config
from tests.test_resume import STEPS  # 5 steps per epoch on the tiny store
from train.data import FeatureDataModule
from train.module import DraftHeadModule, heldout_agreement
from train.settings import ModuleSettings


@pytest.fixture
def common(tiny_overrides, tmp_path):
    overrides = [*tiny_overrides, *STEPS, "train.engine_validation.enabled=false", f"store_dir={tmp_path / 'features'}"]
    run_precompute(compose_config(overrides))
    return overrides


def failing_save(succeed: int):
    """torch.save that works `succeed` times, then writes half of the checkpoint's bytes and fails as a full disk
    does (ENOSPC)."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) <= succeed:
            return real(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real(obj, buf, *args, **kwargs)
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        if hasattr(f, "write"):
            f.write(half)
        else:
            Path(f).write_bytes(half)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return save


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_resume_works(common, tmp_path, monkeypatch):
    """Every step saves `epoch=0-step=<n>.ckpt` and `last.ckpt`; step 2's first write fails half-way. Before: the
    error named no file (Lightning's writer, buffering in memory, then wrote through the system's temp directory
    and moved the file into place — a copy, non-atomic, where that directory is on another filesystem)."""
    cfg = [*common, "trainer.max_steps=4", "train.checkpoint_every_n_steps=1"]
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    monkeypatch.setattr(torch, "save", failing_save(succeed=2))
    with pytest.raises(DiskFull) as e:
        run_training(compose_config(cfg))
    monkeypatch.undo()
    msg = str(e.value)
    assert msg.startswith(f"{ckpts / 'epoch=0-step=2.ckpt'}: cannot be written: the disk is full"), msg
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # no temp file, no half checkpoint
    for name in ("epoch=0-step=1.ckpt", "last.ckpt"):
        assert torch.load(ckpts / name, weights_only=False)["global_step"] == 1, name
    assert not (run / "head").exists()

    resumed_head, _ = run_training(compose_config([*cfg, "train.resume=last"]))
    full_head, _ = run_training(compose_config([*cfg, f"run_dir={tmp_path / 'full'}"]))
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    a, b = load_file(full_head / "model.safetensors"), load_file(resumed_head / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-8)


def fresh_heldout_scores(cfg, head_dir: Path) -> dict[str, float]:
    """val/* of the head saved at `head_dir`, loaded from disk and validated by a trainer of its own on the run's
    held-out split."""
    tied, args, _ = tied_target(Path(cfg.target.path))
    head = load_native(head_dir, tied, args)
    dm = FeatureDataModule(cfg.store_dir, None, **OmegaConf.to_container(cfg.train.data, resolve=True))
    module = DraftHeadModule(head, ModuleSettings.from_config(cfg.train.module))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true")
    scores = trainer.validate(module, datamodule=dm, verbose=False)[0]
    dm.setup("validate")
    scores["agreement_d1"] = heldout_agreement(head, dm.val_dataloader(), 1)["acc"][0]  # another code path
    return scores


def _assert_scores_of(metrics: dict[str, float], fresh: dict[str, float]) -> None:
    keys = sorted(k for k in fresh if k.startswith("val/"))
    assert "val/loss" in keys and "val/acc_d1" in keys, keys
    for k in keys:
        assert metrics[k] == pytest.approx(fresh[k], rel=1e-5, abs=1e-7), k
    assert metrics["val/acc_d1"] == pytest.approx(fresh["agreement_d1"], abs=1e-6)


def test_the_reported_heldout_scores_are_the_saved_heads(common, tmp_path):
    """Stopped at step 7 (mid-epoch 1), the last epoch-end validation scored step 5's weights; resumed to step 9, no
    epoch end is crossed and no validation ran at all. Before: the first reported step 5's scores, the second none
    (no val/* in the metrics, none on the last line)."""
    cfg = compose_config([*common, "trainer.max_steps=7"])
    head_dir, metrics = run_training(cfg)
    fresh = fresh_heldout_scores(cfg, head_dir)
    _assert_scores_of(metrics, fresh)
    epoch_end = compose_config([*common, "trainer.max_steps=5", f"run_dir={tmp_path / 'five'}"])
    _, at_five = run_training(epoch_end)  # what the epoch-end validation of the first run reported
    assert at_five["val/loss"] != pytest.approx(fresh["val/loss"], rel=1e-4)  # so the check above can fail

    cfg = compose_config([*common, "trainer.max_steps=9", "train.resume=last"])
    head_dir, metrics = run_training(cfg)
    _assert_scores_of(metrics, fresh_heldout_scores(cfg, head_dir))
    assert metrics["val/loss"] != pytest.approx(fresh["val/loss"], rel=1e-4)  # two more steps: other weights
