"""Sharded training strategies that need more than a preset: FSDP2 over every rank.

`FSDP2Strategy` is Lightning's ModelParallelStrategy with the mesh fixed to pure data parallelism (every
rank in one `data_parallel` dimension, tensor parallel 1); the sharding itself is applied by
`DraftHeadModule.configure_model` (train/module.py): each decoder layer of the head is an FSDP unit
(`fully_shard`), and the module itself is the root unit, so the head's own tensors outside its layers
(fc, norms, EAGLE-3's lm_head) are gathered around the module call that computes the loss
(`DraftHeadModule.forward`). The frozen target tensors are buffers: never sharded, never gathered.
Unlike Lightning's FSDP (v1) strategy it runs on CPU processes too (gloo), which is how
tests/test_multiprocess.py executes it."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from heads.registry import build_head


class FSDP2Strategy(ModelParallelStrategy):
    strategy_name = "spechead_fsdp2"

    def __init__(self, save_distributed_checkpoint: bool = False, reshard_after_forward: bool = True,
                 **kwargs) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        # every process of every node shards the head: one data-parallel dimension of world size
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


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
