"""Checkpoints and resume: a run stopped after k steps and resumed from its Lightning checkpoint
logs the same losses and ends with the same head as an uninterrupted run, mid-epoch included; and
the first training losses on the tiny target are pinned (golden numbers)."""

from __future__ import annotations

import csv
import json
import logging
import time
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from experiments.stages import run_precompute, run_training
from tests.conftest import compose_config
from train.data import TokenBudgetBatches

# 10 training samples of ~200-240 tokens, 2 per 512-token batch: 5 steps per epoch
STEPS = ["train.data.batch_tokens=512", "trainer.log_every_n_steps=1"]


def logged_losses(run_dir: Path) -> dict[int, list[float]]:
    """train/loss per logged step, from every CSV version (a resumed run writes a new one)."""
    out: dict[int, list[float]] = {}
    for f in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    out.setdefault(int(row["step"]), []).append(float(row["train/loss"]))
    return out


def test_sampler_skips_consumed_batches_once():
    lengths = [5, 90, 33, 12, 64, 64, 7, 100, 3]
    sampler = TokenBudgetBatches(lengths, batch_tokens=128, shuffle=True, seed=0)
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.start = 2
    assert list(sampler) == whole[2:] and len(sampler) == len(whole)
    assert list(sampler) == whole  # the skip applies to one pass only
    sampler.start = 2
    sampler.set_epoch(2)  # a new epoch drops a pending skip
    assert len(list(sampler)) == len(whole)


# the last cases: `train.module.input_noise` and `dropout` (the resumed steps draw the noise and the masks the
# uninterrupted ones drew);
# a 2-module head with the deeper module's own optimizer groups (`deep_lr_scale`) and rows (`loss_on: deep_all`)
DEEP = ("head.num_modules=2", "train.module.depth=2", "train.module.detach_depths=true", "train.module.clip_scope=module",
        "train.module.loss_on=deep_all", "train.module.deep_lr_scale=2.0")
# and depth 2 joining at step 4, module 2 starting there as a copy of module 1 (`deep_from_step`): stopped before
# the copy (it happens after the resume) and after it (it does not happen again)
LATE = (*DEEP, "train.module.deep_from_step=4")
NOISE = ("train.module.input_noise=0.5", "train.module.dropout=0.3")


@pytest.mark.parametrize("k, resume_from, extra", [(2, "path", ()), (5, "path", ()), (7, "last", ()),
                                                    (7, "last", NOISE), (7, "last", DEEP),
                                                    (2, "path", LATE), (7, "last", LATE)])
def test_resume_matches_uninterrupted_run(k, resume_from, extra, tiny_overrides, tmp_path, caplog):
    """N = 9 steps at 5 steps per epoch; stopping after k = 2 (mid-epoch 0), 5 (the epoch boundary)
    or 7 (mid-epoch 1). The LR is held constant: the cosine schedule spans trainer.max_steps, so a run
    configured for k steps has a different schedule from one configured for N (see run_training).
    With `train.module.input_noise` and `dropout` the resumed steps draw the noise and masks the uninterrupted
    ones drew; with a
    per-depth module at its own lr (`deep_lr_scale`) its optimizer groups resume as they were."""
    n = 9
    common = [*tiny_overrides, *STEPS, "train.module.warmup_steps=0", "train.module.min_lr_ratio=1.0",
              f"store_dir={tmp_path / 'features'}", *extra]
    run_precompute(compose_config(common))
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    run_training(compose_config([*common, f"run_dir={full_dir}", f"trainer.max_steps={n}"]))
    run_training(compose_config([*common, f"run_dir={part_dir}", f"trainer.max_steps={k}"]))
    ckpt = part_dir / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    resume = str(ckpt) if resume_from == "path" else "last"
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO, logger="train.data"):
        warnings.simplefilter("always")
        run_training(compose_config([*common, f"run_dir={part_dir}", f"trainer.max_steps={n}",
                                     f"train.resume={resume}"]))
    # the data module resumes the loader where it stopped (5 batches an epoch), so Lightning's warning that a
    # mid-epoch resume of a loader without state is unreliable must not reach the user, nor that the checkpoint
    # directory it resumes from is not empty; the log says where the data resumed
    assert not [w for w in seen if "dataloader is not resumable" in str(w.message)]
    assert not [w for w in seen if "exists and is not empty" in str(w.message)]  # its own checkpoints, expected
    epoch = (k - 1) // 5  # stopped at the epoch boundary (k = 5): epoch 0 with all 5 of its batches delivered
    assert f"resumes in epoch {epoch} after its first {k - 5 * epoch} batches" in caplog.text

    full, part = logged_losses(full_dir), logged_losses(part_dir)
    assert sorted(full) == sorted(part) == list(range(n))
    assert all(len(v) == 1 for v in part.values())  # every step trained once: no replay, no skip
    for step in range(n):
        assert part[step][0] == pytest.approx(full[step][0], rel=1e-6, abs=0), f"step {step + 1}"
    a, b = load_file(full_dir / "head" / "model.safetensors"), load_file(part_dir / "head" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-8)


# Recorded once from this test on the development machine (2-core CPU, torch 2.13.0+cpu, fp32).
# re-recorded for the held-out split by sample id (issue 34): with the former seed-shuffled split the same
# code still gives the former numbers [0.58887488, 0.56003255, 0.53630477, 0.53641921, 0.52318865].
# Re-recorded for the norms' start at 1 (issue 28: mtp `head.enorm_init: ones`, the default since); with
# `head.enorm_init=target` the same code still gives the former [0.5867148, 0.55995065, 0.55227411, 0.54003972, 0.52408886]
# Re-recorded for hnorm's start at 1 (issue 28: mtp `head.hnorm_init: ones`, the default since); with
# `head.hnorm_init=target` the same code gives the numbers above: [0.58725196, 0.56049985, 0.55287987, 0.54073405, 0.52490211]
# With `train.module.optimizer: auto` (Muon for the mtp head, the default since issue 28's Muon measurement) the
# default's numbers are the first row; the AdamW row is the former default's, kept as `optimizer=adamw`.
GOLDEN_LOSSES = {"auto": [0.58739811, 0.5684846, 0.57631022, 0.57737923, 0.5765664],
                 "adamw": [0.58739811, 0.5605725, 0.55191457, 0.53977597, 0.52424997]}


@pytest.mark.parametrize("optimizer", ["auto", "adamw"])
def test_golden_losses(optimizer, tiny_overrides, tmp_path):
    """The first 5 training losses on the tiny target (seed 0, the default LR schedule), against
    numbers recorded on this machine's torch 2.13 CPU build. A change in the loss, the head's
    initialisation, batching or the optimizer shows up here; re-record only for an intended change."""
    cfg = compose_config([*tiny_overrides, *STEPS, "trainer.max_steps=5", f"train.module.optimizer={optimizer}"])
    run_precompute(cfg)
    run_training(cfg)
    losses = logged_losses(Path(cfg.run_dir))
    assert [v[0] for _, v in sorted(losses.items())] == pytest.approx(GOLDEN_LOSSES[optimizer], rel=1e-4)


class Interrupted(RuntimeError):
    pass


class StopAt(Callback):
    """Kills a training (raises) when its global step reaches `step`: a run interrupted mid-way."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise Interrupted(f"stopped at step {self.step}")


def newest_steps(run_dir: Path) -> list[int]:
    """The steps the newest CSV version logged: what the last process trained."""
    versions = sorted((run_dir / "logs").glob("version_*/metrics.csv"), key=lambda f: int(f.parent.name[8:]))
    with open(versions[-1]) as fh:
        return sorted({int(r["step"]) for r in csv.DictReader(fh) if r.get("train/loss")})


def test_an_interrupted_experiment_training_resumes_from_its_checkpoint_and_a_stale_one_is_not(
        tiny_overrides, tmp_path, monkeypatch, caplog):
    """experiments/cache.py `cached_training`, as the study and peer comparison call it: a training killed at step 5
    (checkpoints every 3 steps) and run again with the same key resumes at step 3 and ends with the head of an
    uninterrupted run; a training of another key in the same checkpoint directory removes that checkpoint and starts
    at step 0; and how often a run saved is not part of the head's key (the finished head is reused)."""
    import experiments.cache as cache

    n = 9
    common = [*tiny_overrides, *STEPS, f"store_dir={tmp_path / 'features'}", f"trainer.max_steps={n}"]
    run_precompute(compose_config(common))
    store = tmp_path / "features"
    full_cfg = compose_config([*common, f"run_dir={tmp_path / 'full'}"])
    cache.cached_training(full_cfg, store, "the uninterrupted head")

    part = [*common, f"run_dir={tmp_path / 'part'}", "train.checkpoint_every_n_steps=3"]
    real = cache.run_training
    monkeypatch.setattr(cache, "run_training", lambda cfg, extra_callbacks=None: real(
        cfg, extra_callbacks=[*(extra_callbacks or []), StopAt(5)]))
    with pytest.raises(Interrupted):
        cache.cached_training(compose_config(part), store, "the interrupted head")
    monkeypatch.setattr(cache, "run_training", real)
    ckpt_dir = tmp_path / "part" / "checkpoints"
    assert (ckpt_dir / "last.ckpt").exists() and not cache.key_path(tmp_path / "part" / "head").exists()

    # the seconds behind the checkpoint's weights travel in it (train/run.py TrainingClock)
    before = torch.load(ckpt_dir / "last.ckpt", weights_only=True)["callbacks"]["TrainingClock"]["seconds"]
    assert before > 0
    caplog.set_level(logging.INFO, logger="experiments.cache")
    t0 = time.perf_counter()
    metrics, seconds, reused = cache.cached_training(compose_config(part), store, "the interrupted head")
    assert not reused and seconds > 0
    assert any("resuming the interrupted head from" in r.getMessage() for r in caplog.records)
    assert newest_steps(tmp_path / "part") == list(range(3, n))  # steps 0-2 came from the checkpoint
    a = load_file(tmp_path / "full" / "head" / "model.safetensors")
    b = load_file(tmp_path / "part" / "head" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-8)
    rec = json.loads(cache.key_path(tmp_path / "part" / "head").read_text())
    assert rec["meta"]["resumed"] is True and rec["meta"]["train_seconds"] == seconds
    assert before < seconds < before + (time.perf_counter() - t0)  # the seconds before the kill, then this run's

    # saving at another interval changes no key: the finished head is reused, nothing trains
    _, _, reused = cache.cached_training(compose_config([*common, f"run_dir={tmp_path / 'part'}"]), store, "again")
    assert reused

    # another training (another lr) into the same checkpoint directory: the checkpoint of the first is not resumed
    assert (ckpt_dir / "last.ckpt").exists()
    caplog.clear()
    other = compose_config([*part, "train.module.lr=3e-3"])
    cache.cached_training(other, store, "another head")
    assert not any("resuming" in r.getMessage() for r in caplog.records)
    assert any("written by a training of another key" in r.getMessage() for r in caplog.records)
    assert newest_steps(tmp_path / "part") == list(range(n))


def test_the_training_clock_counts_on_from_the_seconds_its_checkpoint_held():
    from train.run import TrainingClock

    t0 = time.perf_counter()
    clock = TrainingClock()
    clock.load_state_dict({"seconds": 100.0})
    now = clock.seconds
    assert 100.0 <= now < 100.0 + (time.perf_counter() - t0)
    assert clock.state_dict()["seconds"] >= now
