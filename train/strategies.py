"""Sharded training strategies that need more than a preset: FSDP2 over every rank, and DeepSpeed whose
checkpoints are swapped in whole (`AtomicDeepSpeedStrategy`).

`FSDP2Strategy` is Lightning's ModelParallelStrategy with the mesh fixed to pure data parallelism (every
rank in one `data_parallel` dimension, tensor parallel 1); the sharding itself is applied by
`DraftHeadModule.configure_model` (train/module.py): each decoder layer of the head is an FSDP unit
(`fully_shard`), and the module itself is the root unit, so the head's own tensors outside its layers
(fc, norms, EAGLE-3's lm_head) are gathered around the module call that computes the loss
(`DraftHeadModule.forward`). The frozen target tensors are buffers: never sharded, never gathered.
`fsdp_unit_settings` says how each unit is sharded: under bf16 precision the gathered weights are bf16 and the
gradients reduced in fp32 (`MixedPrecisionPolicy`; the sharded master weights and optimizer states stay fp32), and a
layer the training-time-test unroll calls at several depths keeps its gathered weights until its backward
(`reshard_after_forward=False`) instead of one all-gather per call — the others follow the preset's setting.
Unlike Lightning's FSDP (v1) strategy it runs on CPU processes too (gloo), which is how
tests/test_multiprocess.py executes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from core.files import disk_full, disk_full_error, remove_tree, seal_temp_dir, swap_in_dir, temp_dir_for

from heads.registry import build_head


class FSDP2Strategy(ModelParallelStrategy):
    strategy_name = "spechead_fsdp2"

    def __init__(self, save_distributed_checkpoint: bool = False, reshard_after_forward: bool = True,
                 mixed_precision: bool = True, **kwargs) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.reshard_after_forward = reshard_after_forward
        # bf16 gathers with fp32 reduction where the trainer's precision is bf16 (`fsdp_mixed_precision`)
        self.mixed_precision = mixed_precision

    def setup_environment(self) -> None:
        # every process of every node shards the head: one data-parallel dimension of world size
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


class AtomicDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy (the 8xh100 presets) with its checkpoints written whole or not at all. A
    DeepSpeed checkpoint is a directory every rank writes its partitions into (Lightning's checkpoint IO, and so
    train/run.py `AtomicCheckpointIO`, is not used): written in place, a full disk or a kill mid-save left a
    directory of some ranks' files over the last good checkpoint, which `train.resume=last` then failed on. Here
    the ranks write into one temp directory beside it (rank 0 makes it, core/files.py `temp_dir_for` as
    `atomic_dir` does, and sends its name); when every rank has written, rank 0 swaps it in for the old one
    (`swap_in_dir`: an atomic exchange where the filesystem has one) — else removes it, the previous checkpoint
    untouched, and every rank raises (a full disk as `DiskFull` naming the checkpoint). A killed save's temp directory is removed by the next save. Remote paths
    keep Lightning's writer."""

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(str(filepath)):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        out = Path(self.broadcast(str(filepath)))
        tmp = str(temp_dir_for(out)) if self.is_global_zero else None  # a killed save's leftovers removed first
        tmp = Path(self.broadcast(tmp))
        error: Exception | None = None
        try:
            super().save_checkpoint(checkpoint, tmp)
        except Exception as err:  # this rank's part failed: the others are told before anything is swapped
            error = err
        everyone = self.reduce_boolean_decision(error is None, all=True)
        if self.is_global_zero:
            try:
                if everyone:
                    seal_temp_dir(tmp)
                    swap_in_dir(tmp, out)
                else:
                    remove_tree(tmp)
            except Exception as err:
                error = error or err
        self.barrier("spechead_deepspeed_checkpoint")
        if error is not None:
            if (cause := disk_full(error)) is not None:
                raise disk_full_error(out, cause) from error
            raise error
        if not everyone:
            raise RuntimeError(f"{out}: another rank could not write its part of this checkpoint (its log names the "
                               "error); the previous checkpoint there is kept")


def fsdp_mixed_precision(precision: str | None):
    """FSDP2's policy for a trainer precision: bf16 parameters in forward and backward (the all-gathers move half
    the bytes) with gradients reduce-scattered in fp32 for `bf16-mixed` / `bf16-true`; None (fp32 throughout) else."""
    if not str(precision).startswith("bf16"):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def unroll_calls(head: torch.nn.Module, layer: torch.nn.Module, depth: int) -> int:
    """How many of the unrolled depths 1..`depth` run `layer` (a head's decoder layer): 1 for a module per depth
    (mtp3), `depth` for one layer reused at every depth (mtp, eagle3). A head that drafts another way: `depth`."""
    try:
        return sum(any(m is layer for m in head.decoder(d).modules()) for d in range(1, depth + 1))
    except (NotImplementedError, AttributeError, IndexError):
        return depth


def fsdp_unit_settings(module: torch.nn.Module, strategy, depth: int) -> list[tuple[torch.nn.Module, dict]]:
    """(unit, fully_shard keyword arguments) for the training module under FSDP2, the head's layers first and the
    module itself (the root unit) last: the precision policy of the trainer (`fsdp_mixed_precision`, unless the
    strategy's `mixed_precision` is off), and `reshard_after_forward=False` for a layer the unroll calls more than
    once in a step (each call would gather it again; it is freed after its backward instead)."""
    reshard = getattr(strategy, "reshard_after_forward", True)
    policy = None
    if getattr(strategy, "mixed_precision", False):
        policy = fsdp_mixed_precision(getattr(getattr(strategy, "precision_plugin", None), "precision", None))
    extra = {"mp_policy": policy} if policy is not None else {}
    head = module.head
    units = [m for m in head.modules() if getattr(m, "fsdp_unit", False)]
    out = [(m, {"reshard_after_forward": reshard and unroll_calls(head, m, depth) <= 1, **extra}) for m in units]
    return out + [(module, {"reshard_after_forward": reshard, **extra})]


def whole_head_state(trainer: L.Trainer, head: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The head's whole state dict on global rank 0 (None elsewhere) when its parameters are sharded —
    FSDP2's DTensors, gathered by every rank together; DeepSpeed ZeRO-3's partitions, gathered likewise
    — and None when the head is whole on every rank (DDP, ZeRO-2, one process): save it as it is."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in head.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(head, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if trainer.is_global_zero else None
    if any(hasattr(p, "ds_id") for p in head.parameters()):  # ZeRO-3 partitioned parameters
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
            state = {k: v.detach().clone().cpu() for k, v in head.state_dict().items()}
        return state if trainer.is_global_zero else None
    return None


def whole_head(trainer: L.Trainer, head: torch.nn.Module) -> torch.nn.Module | None:
    """On global rank 0: the head itself when it is whole, else a whole copy gathered from the shards
    (`whole_head_state`, collective: every rank must call) on the device and in the dtype of the target
    tensors it shares with the head (`head.tied`, this rank's device); None on the other ranks."""
    state = whole_head_state(trainer, head)
    if not trainer.is_global_zero:
        return None
    if state is None:
        return head
    copy = build_head(head.cfg.to_dict(), head.args, head.tied)
    copy.load_state_dict(state, strict=True)
    # the gathered state is on the CPU (offloaded), the tied tensors where training runs (a GPU): the copy goes to
    # them, never they to it — they are the training head's own (a no-op for them, as they are already there)
    return copy.to(head.tied.embed.device, head.tied.embed.dtype)
