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
