"""The training module's settings, `train.module` of conf/config.yaml, as one typed and checked object.

train/run.py builds it once from the run's config (`ModuleSettings.from_config`) and hands it to the
LightningModule (train/module.py), which reads it and records it as its hyperparameters (checkpoints, the
logger). scripts/checks.py builds it too, before any model or data work, so a wrong setting is refused there
with the message training would give. The checks that need the head itself (`dropout` on a head without the
shared unroll's layers, `deep_lr_scale` on a head without per-depth modules) stay in the module.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from train.block_loss import BlockLossConfig
from train.optim import NS_DTYPES, SCHEDULES, SETTINGS

# whose gradient norm `trainer.gradient_clip_val` bounds: `all` = the head's whole gradient (Lightning's clipping);
# `module` = each of the head's per-depth modules (head.depth_modules(): mtp with num_modules > 1, medusa's blocks)
# by its own norm, the rest of the head as one more group — with `detach_depths`, module 1 then trains exactly as
# a depth-1 head alone would (the other depths' gradients no longer scale its steps); `auto` = `module` for a head
# of several per-depth modules, except where DeepSpeed clips the whole gradient inside its engine (there and for
# a head of one module: `all`)
CLIP_SCOPES = ("all", "module", "auto")
# `deep_from_step: auto`: this fraction of the run's steps, or 0 under DeepSpeed (which keeps the optimizer state
# that start_deeper_modules drops in its own partitions): every depth from the first step, measured level with
# the half-run start in τ at ≈ 1.7× its training time (docs/RESULTS.md §8, "The deeper modules of `head=mtp3`")
DEEP_FROM_AUTO = 0.5
# the positions trained on: `assistant` = the store's loss mask (the assistant replies, what the engine drafts
# in serving); `all` = every real token of the conversation, the user turns and template tokens too (their
# states are stored anyway: more supervised rows per stored token); `deep_all` = depth 1 on the replies and
# depths ≥ 2 on every real token (with separate modules, `detach_depths` and `clip_scope: module`, module 1 then
# trains as the default head while the deeper modules get the extra rows)
LOSS_ON = ("assistant", "all", "deep_all")
# the range of each numeric setting (name: accepted, the range in words), checked with its type: a negative or zero
# lr, a warm-up of -5 steps or a momentum of 1 would train nonsense without an error
RANGES = {
    "lr": (lambda v: v > 0, "a learning rate > 0"),
    "weight_decay": (lambda v: v >= 0, "a number ≥ 0 (0: off)"),
    "muon_weight_decay": (lambda v: v >= 0, "a number ≥ 0 (0: off)"),
    "muon_momentum": (lambda v: 0 <= v < 1, "a momentum in [0, 1)"),
    "warmup_steps": (lambda v: v >= 0, "a whole number of optimizer steps ≥ 0 (0: no warm-up)"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "a fraction of lr in [0, 1]"),
    "w_hidden": (lambda v: v >= 0, "a loss weight ≥ 0"),
    "w_kl": (lambda v: v >= 0, "a loss weight ≥ 0"),
    "kl_chunk_size": (lambda v: v >= 1, "a whole number of rows ≥ 1"),
    "depth": (lambda v: v >= 1, "a whole number of draft steps ≥ 1"),
    "depth_decay": (lambda v: v > 0, "a weight > 0 (1: every depth alike)"),
    "kl_temperature": (lambda v: v > 0, "a positive number"),
    "input_noise": (lambda v: v >= 0, "a number ≥ 0 (0: off)"),
    "dropout": (lambda v: 0 <= v < 1, "a probability in [0, 1) (0: off)"),
    "deep_lr_scale": (lambda v: v > 0, "a positive number (1: off)"),
    "offpolicy_weight": (lambda v: 0 <= v <= 1, "a weight in [0, 1] (1: every row alike, the default; 0: only rows "
                                                "the greedy target would produce)"),
}


@dataclass(frozen=True)
class ModuleSettings:
    """Every `train.module` setting (conf/config.yaml explains each). The defaults are the module's own when it
    is built without a config (tests, tools); the config sets its own values (its `lr` is 1e-3)."""

    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    w_hidden: float = 1.0
    w_kl: float = 1.0
    normed_regression: bool = True
    kl_chunk_size: int = 512
    depth: int = 1
    depth_decay: float = 0.8
    gradient_checkpointing: bool = False
    optimizer: str = "auto"
    schedule: str = "cosine"
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    ns_dtype: str = "auto"
    loss_on: str = "assistant"
    kl_temperature: float = 1.0
    detach_depths: bool = False
    clip_scope: str = "all"
    input_noise: float = 0.0
    deep_lr_scale: float = 1.0
    deep_from_step: int | float | str = 0
    dropout: float = 0.0
    offpolicy_weight: float = 1.0
    # the block drafters' loss settings (train/block_loss.py): checked for every head, used by dflash / dspark;
    # given as a mapping (the config's `block:` section) or None (the defaults)
    block: BlockLossConfig = field(default_factory=BlockLossConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", block_config(self.block))
        object.__setattr__(self, "betas", tuple(self.betas) if isinstance(self.betas, (list, tuple)) else (self.betas,))
        self._check_types()
        self._check_values()
        self._check_depth_schedule()

    def _check_types(self) -> None:
        """Each number a number (a whole one for an int setting) in its `RANGES` range, each flag true or false, the
        betas a pair and the schedule a known one: a string from the command line would otherwise fail deep in
        training, or a flag `"no"` pass as true."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"train.module.{f.name}={value!r}: expected true or false")
            whole = f.type == "int"
            ok, accepted = RANGES.get(f.name, (lambda v: True, "a whole number" if whole else "a number"))
            if f.type in ("int", "float") and (isinstance(value, bool) or not isinstance(
                    value, numbers.Integral if whole else numbers.Real) or not ok(value)):
                raise ValueError(f"train.module.{f.name}={value!r}: expected {accepted}")
        if len(self.betas) != 2 or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1
                                           for b in self.betas):
            raise ValueError(f"train.module.betas={list(self.betas)!r}: expected two moment decays in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.module.schedule={self.schedule!r}: expected one of {SCHEDULES}")

    def _check_values(self) -> None:
        if self.optimizer not in SETTINGS:
            raise ValueError(f"train.module.optimizer={self.optimizer!r}: expected one of {SETTINGS}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"train.module.ns_dtype={self.ns_dtype!r}: expected one of {tuple(NS_DTYPES)}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"train.module.loss_on={self.loss_on!r}: expected one of {LOSS_ON}")
        if self.clip_scope not in CLIP_SCOPES:
            raise ValueError(f"train.module.clip_scope={self.clip_scope!r}: expected one of {CLIP_SCOPES}")
        if self.dropout > 0 and self.gradient_checkpointing:
            raise ValueError(f"train.module.dropout={self.dropout} and train.module.gradient_checkpointing=true: the "
                             "recomputed steps would draw other dropout masks than the forward did; turn one off")

    def _check_depth_schedule(self) -> None:
        step = self.deep_from_step
        step_ok = isinstance(step, int) and not isinstance(step, bool) and step >= 0
        if not (step_ok or step == "auto" or (isinstance(step, float) and 0 < step < 1)):
            raise ValueError(f"train.module.deep_from_step={step!r}: expected an optimizer step (an integer "
                             f"≥ 0; 0: every depth trains from the first step), a fraction of the run's steps in "
                             f"(0, 1) or auto ({DEEP_FROM_AUTO}, and 0 under DeepSpeed)")
        if (step == "auto" or step > 0) and self.depth < 2:
            raise ValueError(f"train.module.deep_from_step={step} delays the depths ≥ 2, and "
                             f"train.module.depth is {self.depth}: set depth > 1 or leave deep_from_step at 0")

    @classmethod
    def from_config(cls, section: Any) -> ModuleSettings:
        """The settings of a `train.module` section: a hydra DictConfig (resolved here), a mapping, or None (every
        default). A key that is no setting is refused, naming the known ones."""
        return built(cls, plain_mapping(section, "train.module"), "train.module", "the training module")

    def as_dict(self) -> dict[str, Any]:
        """Plain values (`block` a dict): what the module records as its hyperparameters."""
        return dataclasses.asdict(self)


def built(cls, values: dict[str, Any], prefix: str, what: str):
    """`cls(**values)`, a key that is no field of `cls` refused naming it (`<prefix>.<key>`) and the known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    if unknown := [k for k in values if k not in known]:
        raise ValueError(f"{', '.join(f'{prefix}.{k}' for k in unknown)}: no such setting of {what}; known: "
                         f"{', '.join(known)}")
    return cls(**values)


def plain_mapping(section: Any, name: str) -> dict[str, Any]:
    """A config section as a plain dict: a DictConfig resolved, a mapping copied, None empty."""
    if section is None:
        return {}
    from omegaconf import DictConfig, OmegaConf

    if isinstance(section, DictConfig):
        return OmegaConf.to_container(section, resolve=True)
    if not isinstance(section, Mapping):
        raise ValueError(f"{name}: expected a mapping of settings, got {type(section).__name__}")
    return dict(section)


def block_config(block: BlockLossConfig | Mapping | None) -> BlockLossConfig:
    """`train.module.block` as a BlockLossConfig (a mapping of its settings, None: the defaults)."""
    if isinstance(block, BlockLossConfig):
        return block
    return built(BlockLossConfig, plain_mapping(block, "train.module.block"), "train.module.block", "the block loss")


def deepspeed_conflicts(settings: ModuleSettings | Mapping) -> list[str]:
    """What the train.module `settings` (a ModuleSettings, or a mapping of them) ask that a DeepSpeed strategy
    cannot run, each naming the fix (checked before any work by scripts/checks.py, and again by the module's
    setup)."""
    s = settings if isinstance(settings, ModuleSettings) else ModuleSettings.from_config(settings)
    out = []
    if s.deep_from_step not in (0, "auto"):
        out.append("train.module.deep_from_step drops the deeper modules' optimizer state at its step, which DeepSpeed "
                   "keeps in its own partitions; use DDP or FSDP (trainer=8xh100_fsdp), or deep_from_step=0 (or auto: "
                   "0 under DeepSpeed)")
    if s.optimizer == "muon":
        out.append("train.module.optimizer=muon: DeepSpeed ZeRO hands the optimizer flattened partitions of the "
                   "head's tensors, not the matrices Muon orthogonalises; use FSDP (trainer=8xh100_fsdp) or DDP for "
                   "Muon, or optimizer=auto (AdamW under DeepSpeed) or adamw")
    if s.clip_scope == "module":
        out.append("train.module.clip_scope=module: DeepSpeed clips the whole gradient inside its engine; use "
                   "clip_scope=all (or auto) with a DeepSpeed strategy")
    return out
