"""The training stage's parts: the head initialised and tied to the target, the data module (the store, or online
states), Lightning's checkpoint callback and atomic checkpoint writer, the run directory every rank must see, the
precision, the locks' check, the fit and the saves. experiments/stages.py `run_training` assembles them, with the
trainer, logger and callbacks the config names."""

from __future__ import annotations

import json
import logging
import secrets
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from artifacts.checkpoint import save_native
from core.files import atomic_write, atomic_write_bytes
from core.launch import env_rank_zero
from core.lock import check_free, same_launch
from data.precompute import PrecomputeConfig, open_store_writer, tokenize_source
from heads.base import DraftHead
from heads.registry import build_head, resolve_aux_layers
from inference_eval.model import cpu_has_fast_bf16, first_input_norm, tied_from_model, tied_target
from inference_eval.targets import TargetConfig, load_target
from train.data import FeatureDataModule, heldout_ids_digest
from train.module import DraftHeadModule
from train.online import OnlineDataModule, OnlineSamples, TargetStates
from train.online_store import WriteThrough
from train.strategies import whole_head_state
from train.validation import EngineValidation

log = logging.getLogger(__name__)


def init_head(spec: dict[str, Any], seed: int, target_dir: Path, dm: FeatureDataModule | None = None,
              target=None) -> DraftHead:
    """The head `spec` configures (the `head` section as a mapping), freshly initialised (seeded by `seed`) and tied
    to the target's frozen tensors — with `target` (a loaded engine model: online training), to that model's own
    tensors, not a copy. With the data module (set up): an EAGLE-3 head's draft vocabulary is chosen from the training
    split's token frequencies, and the head's aux layers are read from the store (all it captured, or a subset)."""
    if target is None:
        tied, args, parts = tied_target(target_dir)
        first_norm = parts.first_input_norm
    else:
        tied, args, first_norm = tied_from_model(target), target.args, first_input_norm(target_dir)
    head = build_head(spec, args, tied)
    if dm is not None:
        dm.read_layers_of(head)
        if hasattr(head, "set_draft_vocab"):
            head.set_draft_vocab(dm.store.token_counts(args.vocab_size, dm.train_idx))
    head.reset_parameters(int(seed), first_norm)
    if head.kind == "draft_lm" and head.cfg.init == "target":  # the target's first N layers (heads/draft_lm.py)
        from artifacts.draft_hf import read_target_layers

        head.copy_target_layers(read_target_layers(target_dir, head.cfg.num_layers))
    if head.kind == "mtp" and head.cfg.layer_init == "target":  # the target's last decoder layer
        from artifacts.draft_hf import read_target_layer

        head.copy_target_layer(read_target_layer(target_dir, args.num_hidden_layers - 1))
    return head


class Checkpoints(ModelCheckpoint):
    """ModelCheckpoint that also saves when the step reaching trainer.max_steps ends. Lightning's
    own save after a mid-epoch max_steps stop happens at the epoch end, whose state marks the cut
    epoch finished: resuming from it would skip the rest of that epoch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if 0 < trainer.max_steps <= trainer.global_step and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)  # the same two saves as Lightning's step trigger
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint files written atomically (core/files.py `atomic_write`): torch.save into a temp file
    beside the `.ckpt`, fsynced and renamed over it, the temp file removed when the write fails — so a full disk
    (`DiskFull`, naming the file) leaves the previous checkpoint as it was and no partial one. Lightning's own
    writer buffers the checkpoint in memory, writes it to the system's temp directory and moves it into place;
    where that directory is on another filesystem the move is a copy, and a disk that filled during it left a
    truncated `.ckpt` that `train.resume=last` then failed on. Remote paths (s3://, ...) keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a Python file: a failed write's OSError stays in torch's error's context
                torch.save(checkpoint, f)

        atomic_write(path, write)


class TrainingClock(Callback):
    """Seconds of training behind the weights a run ends with, across resumes: the seconds up to a checkpoint are
    saved in it (the callback's state) and restored with it. A killed run's steps after its last checkpoint are
    trained again, so their seconds count once."""

    def __init__(self) -> None:
        self.before, self.t0 = 0.0, time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.t0

    def state_dict(self) -> dict[str, float]:
        return {"seconds": self.seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = float(state_dict["seconds"])


class LastValidation(Callback):
    """The global step at which held-out validation last ran in this process (None: not yet), so the scores
    training reports are known to be the saved head's (`final_heldout_scores`)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


def final_heldout_scores(trainer: L.Trainer, module: DraftHeadModule, dm,
                         validated: LastValidation) -> dict[str, float]:
    """val/* of the weights training ends with, i.e. of the head it saves: {} when the last validation ran on them
    (an epoch end at the last step: its scores are in the trainer's metrics), else a held-out validation now —
    after a stop mid-epoch (max_steps) the last epoch end's scores belong to older weights, and a resumed run that
    crossed no epoch end has none. Every rank takes part (the validation sums over the ranks)."""
    if validated.step == trainer.global_step or not trainer.limit_val_batches:
        return {}
    results = trainer.validate(module, datamodule=dm, verbose=False)
    return {k: float(v) for k, v in (results[0] if results else {}).items() if k.startswith("val/")}


RUN_DIR_TOKEN = ".rank0-token"  # written by global rank 0 at start-up, read by every rank, removed


class RunDirNotShared(RuntimeError):
    """A rank does not see the run directory global rank 0 writes to."""


def run_dir_problem(run_dir: str | Path, rank: int, token: str, wait_s: float = 10.0) -> str | None:
    """None when this rank reads `token` in <run_dir>/.rank0-token — what global rank 0 wrote there before
    this call (`check_run_dir_shared`) — else what is wrong, naming the directory and the rank. A shared
    filesystem may show another node's new file a little late: it is read again for up to `wait_s` seconds.
    A file left by an earlier run holds another token, so a directory local to each node cannot pass."""
    path = Path(run_dir) / RUN_DIR_TOKEN
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seen = path.read_text()
        except OSError:  # absent, or a stale handle to a file another node replaced
            seen = None
        if seen == token or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if seen == token:
        return None
    found = "no such file" if seen is None else "a file from another run (a token other than rank 0's)"
    return (f"rank {rank} does not see the run directory {Path(run_dir).resolve()} that global rank 0 writes: "
            f"its {path.name} there reads as {found} ({wait_s:g} s after rank 0 wrote it). Every rank must see one "
            "run directory (checkpoints, the held-out split, the saved head, locks and store merges assume it): "
            "put run_dir on a filesystem every node mounts at the same path (NFS, Lustre, ...)")


def check_run_dir_shared(run_dir: str | Path, strategy) -> None:
    """Collective, every rank at start-up (`SharedRunDir`): global rank 0 writes a random token to
    <run_dir>/.rank0-token and sends it to every rank (Lightning's `strategy.broadcast`, which rank 0 enters
    after the write: the barrier), each reads the file (`run_dir_problem`), and all fail together — naming the
    ranks that do not see it — rather than some training on while others stop."""
    rank = strategy.global_rank
    path = Path(run_dir) / RUN_DIR_TOKEN
    token = None
    if rank == 0:
        token = secrets.token_hex(16)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, token.encode())
    token = strategy.broadcast(token, src=0)
    problem = run_dir_problem(run_dir, rank, token)
    if problem:
        log.error("train: %s", problem)
    everyone = strategy.reduce_boolean_decision(problem is None, all=True)  # after every rank has read it
    if rank == 0:
        path.unlink(missing_ok=True)
    if not everyone:
        raise RunDirNotShared(problem or f"rank {rank}: another rank does not see the run directory "
                              f"{Path(run_dir).resolve()} (its log names it): every rank must see one run directory; "
                              "put run_dir on a filesystem every node mounts at the same path")


class SharedRunDir(Callback):
    """`check_run_dir_shared` where the ranks' process group exists (the setup hook), before any step; one
    process: nothing to check."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = run_dir

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.world_size > 1:
            check_run_dir_shared(self.run_dir, trainer.strategy)


def trains_on_cpu(accelerator: Any) -> bool:
    """Whether a trainer of this `trainer.accelerator` trains on the CPU (auto: where torch sees no CUDA)."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def resolve_precision(precision: Any, accelerator: Any) -> Any:
    """`trainer.precision: auto`: bf16-mixed on an accelerator or a CPU with bf16 instructions, else
    32-true — without them a bf16 matrix product is ~170x slower than float32 (tests/README.md), so
    bf16 autocast makes training slower, not faster. Any other value is Lightning's, as given."""
    if precision != "auto":
        return precision
    if not trains_on_cpu(accelerator) or cpu_has_fast_bf16():
        return "bf16-mixed"
    log.info("train: trainer.precision=auto -> 32-true: this CPU has no bf16 matrix instructions "
             "(bf16 autocast would be slower); set trainer.precision=bf16-mixed to force it")
    return "32-true"


def place_tied(head: DraftHead, trainer: L.Trainer, shared_with_target: bool = False) -> torch.dtype:
    """The head's frozen target tensors (E, W_lm, N_f) in the dtype they train in (train/memory.py `tied_dtype`: bf16
    on a GPU under bf16 precision — half the memory of the fp32 copy they are loaded as, 4.2 GB instead of 8.4 GB per
    rank at 70B — fp32 where the head computes in fp32). Online training's are the loaded target's own tensors
    (`shared_with_target`), left as the target holds them. Returns their dtype."""
    from train.memory import tied_dtype

    if shared_with_target:
        return head.tied.embed.dtype
    dtype = tied_dtype(trainer.precision, trainer.strategy.root_device)
    if head.tied.embed.dtype != dtype:
        head.tied.to(dtype)
        log.info("train: the frozen embedding, lm_head and final norm in %s (trainer.precision=%s)",
                 str(dtype).removeprefix("torch."), trainer.precision)
    return dtype


def write_split(dm: FeatureDataModule, path: Path) -> None:
    """The held-out conversations of this run (ids in split order, their digest, the settings that chose
    them), so two runs' validation figures can be checked to come from the same rows."""
    split = {"split_seed": int(dm.split_seed), "val_fraction": float(dm.val_fraction),
             "store_samples": len(dm.store), "train_samples": len(dm.train_idx),
             "heldout_sha256": heldout_ids_digest(dm.val_ids), "heldout_ids": dm.val_ids}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(split, indent=1).encode())


def data_module(train_data: dict[str, Any], pc: PrecomputeConfig, target: TargetConfig
                ) -> tuple[FeatureDataModule, Any]:
    """(the training data module, the target model or None) for `train.data` (`train_data`, a mapping) and its
    `source`: `store` reads the feature store at `pc.store_dir`; `online` tokenizes `pc.data`'s conversations as
    precompute does and loads the target (engine backend, `target.dtype`, `target.device`), which computes each
    batch's states on the rank's device (train/online.py), writing the store precompute would (`pc`) with
    `online.write_store`."""
    data_kw = dict(train_data)
    source = data_kw.get("source", "store")
    if source == "store":
        return FeatureDataModule(str(pc.store_dir), target.fingerprint, **data_kw), None
    data_kw.pop("source")
    online = data_kw.pop("online", None) or {}
    if source != "online":
        raise ValueError(f"train.data.source={source!r}: expected `store` (a precomputed feature store) or `online` "
                         "(the target computes each batch's states)")
    samples, rejected, examples = tokenize_source(pc.data, target.dir)
    if rejected:
        log.warning("train: online — rejected %d conversations (%s), as precompute would", sum(rejected.values()),
                    ", ".join(f"{k}={v}" for k, v in sorted(rejected.items())))
    model = load_target(target, "engine")
    aux = resolve_aux_layers(pc.aux_layers, pc.head_layers, model.args.num_hidden_layers)
    log.info("train: online — %d conversations tokenized, the target (%s, %s) computes each batch's states%s",
             len(samples), target.dtype, model.device, f", aux layers {list(aux)}" if aux else "")
    dm = OnlineDataModule(OnlineSamples(samples, aux), TargetStates(model, aux), prefetch=online.get("prefetch", "auto"),
                          **data_kw)
    if online.get("write_store"):
        root = online["write_store"]
        dm.write_through = WriteThrough(root, partial(open_store_writer, pc, target, "engine", model, root,
                                                      rejected=rejected, examples=examples), dm)
        log.info("train: online — the first epoch's states are also written to %s", root)
    return dm, model


@dataclass(frozen=True)
class TrainingPaths:
    """Where a training reads and writes: the run directory (the held-out split), Lightning's checkpoints, the head,
    the untrained baseline (None: not saved), and the checkpoint it resumes from (None: a fresh run)."""

    run_dir: Path
    checkpoint_dir: Path
    head_dir: Path
    untrained_dir: Path | None = None
    resume: str | None = None

    @property
    def written(self) -> list[Path]:
        """What a training writes and locks (core/lock.py): Lightning's checkpoints, the head, the untrained
        baseline."""
        return [d for d in (self.checkpoint_dir, self.head_dir, self.untrained_dir) if d is not None]


def check_training_dirs_free(paths: TrainingPaths) -> None:
    """Refuse at once (`LockHeld`, naming the holder) when another training writes one of this one's directories.
    Every rank checks, rank 0 by the launcher's variables strictly, the others passing a holder of their own launch
    (`same_launch`): a second multi-process training then stops on every rank, not on rank 0 alone while the others
    wait for it in the process group's rendezvous. Rank 0 takes the locks once its trainer exists
    (experiments/stages.py `run_training`)."""
    same_writer = (lambda holder: False) if env_rank_zero() else same_launch
    for d in paths.written:
        check_free(d, same_writer)


def fit_and_save(paths: TrainingPaths, trainer: L.Trainer, module: DraftHeadModule, dm, head: DraftHead,
                 engine_val: EngineValidation | None, fingerprint: dict,
                 validated: LastValidation) -> tuple[Path, dict[str, float]]:
    """The training's writes, rank 0's locks held: the held-out split, the untrained baseline, Lightning's
    checkpoints (fit), the trained head. Returns the head's directory and the final metrics, whose held-out
    scores (val/*) are the saved head's (`final_heldout_scores`)."""
    if trainer.is_global_zero:
        write_split(dm, paths.run_dir / "heldout.json")
    if trainer.is_global_zero and paths.untrained_dir is not None:
        save_native(head, paths.untrained_dir, fingerprint)  # the baseline the demo compares against
    with warnings.catch_warnings():
        # the data module restores the train loader's position itself (FeatureDataModule.state_dict, resume ==
        # uninterrupted in tests/test_resume.py): Lightning's warning that the loader cannot resume does not apply
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
        if paths.resume is not None:  # resuming: the checkpoint directory holds the run's own checkpoints
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        trainer.fit(module, dm, ckpt_path=paths.resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics |= final_heldout_scores(trainer, module, dm, validated)
    if engine_val is not None and engine_val.results:
        metrics |= {k: float(v) for k, v in engine_val.results[-1].items() if k != "step"}
    out = paths.head_dir
    state = whole_head_state(trainer, head)  # collective under sharding: every rank takes part
    if trainer.is_global_zero:
        last = paths.checkpoint_dir / "last.ckpt"  # what the head can be saved again from (artifacts/checkpoint.py)
        save_native(head, out, fingerprint, state, marker={"checkpoint": str(last)} if last.is_file() else None)
        log.info("train: head saved to %s; final metrics %s", out, metrics)
    return out, metrics
