"""What a launcher (torchrun, srun) tells a process about its place: ranks on this node."""

from __future__ import annotations

import os


def local_ranks() -> int:
    """Processes of this launch on this node: torchrun's LOCAL_WORLD_SIZE, srun's
    SLURM_NTASKS_PER_NODE, else 1."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


RANK_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")


def env_rank_zero() -> bool:
    """Whether the launcher's variables make this process global rank 0 — known before any process group:
    torchrun's RANK, Lightning's LOCAL_RANK / NODE_RANK (the ranks it starts itself inherit the rest of rank 0's
    environment), srun's SLURM_PROCID. Rank 0 when every one of them that is set is 0 (none set: one process)."""
    return all(os.environ.get(v, "0").strip() in ("", "0") for v in RANK_VARS)
