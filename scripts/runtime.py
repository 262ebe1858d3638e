"""What every entry point shares (`@stage_main`): hydra's main over conf/config.yaml plus the process-wide
settings each stage shares — the CPU thread policy (`threads`), the checks before work
(scripts/checks.py: what the config can tell is refused before anything loads) — the `pid` resolver that keeps the run
directories of invocations started in the same second apart (`hydra.run.dir`), and the run's status
file `<run_dir>/status.json`: each stage records `running`, then `done` or `failed` (with the error, and
which partial artifacts it left and how to resume them), so a failed run is never mistaken for a
finished one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from core.launch import local_ranks
from core.paths import CONF

log = logging.getLogger(__name__)

# the checks each entry point runs before its stage function (scripts/checks.py STAGES); None: none
CHECKS = {"precompute": "precompute", "regenerate": "regenerate", "train": "train", "evaluate": "evaluate",
          "export": "export", "study": "train", "ablation": None, "fp8_study": None, "peer_compare": "train",
          "pipeline": None}  # run_pipeline checks every stage's settings itself (it is called directly too)


def register_resolvers() -> None:
    """The config's resolvers: `pid` (`hydra.run.dir`, conf/config.yaml: runs started in the same second
    apart) and `compute_dtype` (`target.dtype: auto` in conf/target/smollm2.yaml: bfloat16 on a GPU or a
    CPU with bf16 matrix instructions, else float32 — inference_eval/model.py `auto_compute_dtype`)."""
    from inference_eval.targets import register_target_resolvers

    OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
    register_target_resolvers()


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
    processes on one machine then share the cores instead of each taking all of them. Under a launcher
    that starts several ranks per node (torchrun and srun set LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE),
    `auto` is the node's cores split evenly over its ranks: they start together, so a load snapshot
    would not see each other yet."""
    if spec is None:
        return None
    cpus = cpus or os.cpu_count() or 1
    if spec == "auto":
        local = local_ranks()
        if local > 1:
            return max(1, cpus // local)
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


# what a stage leaves behind when it stops part-way, and how to go on from there
PARTIAL = {
    "precompute": ("store_dir", "finished shards are kept; rerun the same command to resume"),
    "regenerate": ("regenerate.out", "finished records are kept; rerun the same command to resume"),
    "train": ("train.checkpoint_dir", "resume with train.resume=last"),
    "pipeline": ("run_dir", "each stage resumes where it stopped: rerun the same command (training: add train.resume=last)"),
}


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None)


def record_status(cfg, stage: str, state: str, error: BaseException | None = None) -> Path | None:
    """Update `<run_dir>/status.json` (atomically): {stage: {state, time, pid, error?, partial?, resume?}}.
    Returns the file (None without a run_dir)."""
    run_dir = _select(cfg, "run_dir")
    if not run_dir or os.environ.get("RANK", "0") not in ("", "0"):  # one writer: global rank 0
        return None
    import fcntl

    from core.files import atomic_write_bytes

    path = Path(str(run_dir)) / "status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(".status.lock"), "a") as lock:  # stages of one run may run at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            status = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, json.JSONDecodeError):
            status = {}
        status[stage] = status_entry(cfg, stage, state, error)
        atomic_write_bytes(path, json.dumps(status, indent=2).encode())
    return path


def status_entry(cfg, stage: str, state: str, error: BaseException | None) -> dict:
    entry = {"state": state, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid()}
    if error is not None:
        entry["error"] = f"{type(error).__name__}: {error}"[:2000]
        entry["where"] = "".join(traceback.format_tb(error.__traceback__)[-1:]).strip()[:1000]
        if stage in PARTIAL:
            key, how = PARTIAL[stage]
            partial = _select(cfg, key)
            if stage == "regenerate" and partial in (None, "auto"):  # the per-machine cache file
                try:
                    from data.regenerate import regenerated_path

                    partial = regenerated_path(cfg)
                except Exception:  # noqa: BLE001 — the status line must not hide the stage's own error
                    partial = None
            if partial and Path(str(partial)).exists():
                entry["partial"], entry["resume"] = str(partial), how
    return entry


def run_checked(stage: str, fn, cfg):
    """`stage`'s checks before work (`CHECKS`, scripts/checks.py), then `fn(cfg)`: what `python -m
    scripts.<stage>` runs inside hydra, callable without it."""
    from scripts.checks import check_before_work

    if CHECKS.get(stage):
        check_before_work(cfg, CHECKS[stage])
    return fn(cfg)


def stage_main(fn):
    """hydra's main for a stage function `fn(cfg)`: the thread policy applied first, the stage's state
    recorded in `<run_dir>/status.json` (running → done, or failed with the error and what is partial)."""
    import hydra

    stage = Path(fn.__code__.co_filename).stem  # scripts/<stage>.py (its __module__ is __main__ under -m)
    register_resolvers()

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    @functools.wraps(fn)
    def main(cfg):
        apply_threads(cfg.get("threads"))
        record_status(cfg, stage, "running")
        try:
            out = run_checked(stage, fn, cfg)
        except BaseException as err:
            path = record_status(cfg, stage, "failed", err)
            entry = json.loads(path.read_text())[stage] if path is not None else {}
            log.error("%s failed: %s: %s%s", stage, type(err).__name__, err,
                      f"; partial artifacts at {entry['partial']} ({entry['resume']})" if entry.get("partial") else "")
            raise
        record_status(cfg, stage, "done")
        close_process_group()
        return out

    return main


def close_process_group() -> None:
    """Several processes (torchrun): every rank waits here until all have finished the stage, then the process
    groups are destroyed. Left to interpreter exit, each rank tears its gloo (or NCCL) groups down on its own
    while another may still be writing the head or in a collective — a rank can abort that way (SIGABRT at
    exit). Nothing to do in one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
