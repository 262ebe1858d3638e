"""Wiring of the train entry point: target parts + head + data module + trainer from the config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import OmegaConf

from data.sources import resolve_target_dir
from data.store import target_fingerprint
from heads.checkpoint import build_head, save_native
from heads.mtp import MTPHead
from inference_eval.model import tied_target
from train.data import FeatureDataModule
from train.module import DraftHeadModule

log = logging.getLogger(__name__)


def init_head(cfg: Any, target_dir: Path) -> MTPHead:
    """The configured head, freshly initialised (seeded) and tied to the target's frozen tensors."""
    tied, args, parts = tied_target(target_dir)
    head = build_head(OmegaConf.to_container(cfg.head, resolve=True), args, tied)
    head.reset_parameters(int(cfg.seed), parts.first_input_norm)
    return head


def run_training(cfg: Any) -> tuple[Path, dict[str, float]]:
    """Train the head on the store at cfg.store_dir; write the native checkpoint to cfg.head_dir.
    Returns that directory and the final logged metrics."""
    L.seed_everything(int(cfg.seed), workers=True)
    target_dir = resolve_target_dir(cfg.target)
    fingerprint = target_fingerprint(target_dir, cfg.target.name, cfg.target.dtype)
    head = init_head(cfg, target_dir)
    if cfg.train.get("untrained_dir"):
        save_native(head, cfg.train.untrained_dir, fingerprint)  # the baseline the demo compares against
    dm = FeatureDataModule(cfg.store_dir, fingerprint, **OmegaConf.to_container(cfg.train.data, resolve=True))
    module = DraftHeadModule(head, **OmegaConf.to_container(cfg.train.module, resolve=True))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer: L.Trainer = instantiate(cfg.trainer, logger=logger, default_root_dir=cfg.run_dir)
    trainer.fit(module, dm, ckpt_path=cfg.train.get("resume"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    out = save_native(head, cfg.head_dir, fingerprint)
    log.info("train: head saved to %s; final metrics %s", out, metrics)
    return out, metrics
