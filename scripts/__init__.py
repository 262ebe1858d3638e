"""Thin hydra entry points: precompute, train, evaluate, export, pipeline (the demo).

Every entry point is `@stage_main`: hydra's main over conf/config.yaml plus the process-wide settings
each stage shares — the CPU thread policy (`threads`) — and the `pid` resolver that keeps the run
directories of invocations started in the same second apart (`hydra.run.dir`).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
CONF = Path(__file__).resolve().parents[1] / "conf"  # absolute: a stage may be defined anywhere


def busy_elsewhere() -> float:
    """How many CPUs other processes keep busy right now: the kernel's count of runnable tasks less
    this one (/proc/loadavg), else the 1-minute load average. A snapshot, not an average, so work that
    just ended (an install before the demo) does not count."""
    try:
        running = int(open("/proc/loadavg").read().split()[3].split("/")[0])
        return max(0, running - 1)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def resolve_threads(spec, cpus: int | None = None, load: float | None = None) -> int | None:
    """`threads`: null = torch's default (every core); an int; or `auto` = the cores the machine's other
    work leaves free (cores minus what other processes keep busy, at least 1) — several spechead
    processes on one machine then share the cores instead of each taking all of them."""
    if spec is None:
        return None
    cpus = cpus or os.cpu_count() or 1
    if spec == "auto":
        load = busy_elsewhere() if load is None else load
        return max(1, min(cpus, cpus - int(load + 0.5)))
    n = int(spec)
    if n < 1:
        raise ValueError(f"threads={spec!r}: expected null, auto or a positive number of threads")
    return n


def apply_threads(spec) -> int:
    import torch

    n = resolve_threads(spec)
    if n is not None:
        torch.set_num_threads(n)
        log.info("threads=%s: torch uses %d of %d CPU threads", spec, n, os.cpu_count() or 1)
    return torch.get_num_threads()


def stage_main(fn):
    """hydra's main for a stage function `fn(cfg)`, with the thread policy applied first."""
    import hydra

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    @functools.wraps(fn)
    def main(cfg):
        apply_threads(cfg.get("threads"))
        return fn(cfg)

    return main
