"""What every entry point shares (`@stage_main`): hydra's main over conf/config.yaml plus the process-wide
settings each stage shares — the CPU thread policy (`threads`), the checks before work
(scripts/checks.py: what the config can tell is refused before anything loads) — the `pid` resolver that keeps the run
directories of invocations started in the same second apart (`hydra.run.dir`), and the run's status
file `<run_dir>/status.json`: each stage records `running` (with its pid, host and start time), then `done`,
`interrupted` (Ctrl-C) or `failed` (with the error, and which partial artifacts it left and how to resume
them), so a failed run is never mistaken for a finished one; a reader (`read_status`, `spechead status`) shows a
`running` entry whose process is gone as `stale`. A stage stopped by one of the project's own named errors
(`REFUSALS`: a setting, a data source, a store, a damaged head, a full disk, ...) prints one line, `<stage> refused:
<what and what to do>`, with no traceback (`HYDRA_FULL_ERROR=1` shows it); any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from core.launch import env_rank_zero, local_ranks
from core.lock import LockHeld, process_gone, process_identity
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
    would not see each other yet. Anything else is refused as the checks before work refuse it (scripts/checks.py
    `RULES`): every entry point applies the policy before those checks run."""
    from scripts.checks import check_setting

    check_setting("threads", spec)
    if spec is None:
        return None
    cpus = cpus or os.cpu_count() or 1
    if spec == "auto":
        local = local_ranks()
        if local > 1:
            return max(1, cpus // local)
        load = busy_elsewhere() if load is None else load
        return max(1, min(cpus, cpus - int(load + 0.5)))
    return int(spec)


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
    """Update `<run_dir>/status.json` (atomically): {stage: {state, time, pid, host, started, error?, partial?,
    resume?}} (and the process's start ticks, boot id and pid namespace, which tell a reader whether it lives).
    Returns the file (None without a run_dir)."""
    def edit(status: dict) -> None:
        status[stage] = status_entry(cfg, stage, state, error, status.get(stage))

    return edit_status(cfg, edit)


def edit_status(cfg, edit) -> Path | None:
    """Apply `edit(status)` to `<run_dir>/status.json`'s dict and write it back (atomically, one process at a
    time); rank 0 alone writes it. Returns the file (None without a run_dir)."""
    run_dir = _select(cfg, "run_dir")
    if not run_dir or not env_rank_zero():  # one writer: global rank 0
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
        edit(status)
        atomic_write_bytes(path, json.dumps(status, indent=2).encode())
    return path


def start_status(cfg, stage: str) -> dict | None:
    """Record `stage` as running; returns the entry it replaced (`refused_status` may put it back)."""
    before: dict = {}

    def edit(status: dict) -> None:
        before["entry"] = status.get(stage)
        status[stage] = status_entry(cfg, stage, "running", None, status.get(stage))

    edit_status(cfg, edit)
    return before.get("entry")


def refused_status(cfg, stage: str, before: dict | None) -> None:
    """A stage refused because another process writes its directories (core/lock.py `LockHeld`) puts back the
    entry it found — most likely that other process's — where its own `running` one still stands."""
    def edit(status: dict) -> None:
        if (status.get(stage) or {}).get("pid") == os.getpid():
            if before is None:
                status.pop(stage, None)
            else:
                status[stage] = before

    edit_status(cfg, edit)


def status_entry(cfg, stage: str, state: str, error: BaseException | None, previous: dict | None = None) -> dict:
    now, me = time.strftime("%Y-%m-%dT%H:%M:%S%z"), process_identity()
    same = isinstance(previous, dict) and all(previous.get(k) == me[k] for k in ("pid", "host", "proc_start"))
    entry = {"state": state, "time": now, **me, "started": previous.get("started", now) if same else now}
    if error is not None:
        entry["error"] = ("interrupted (Ctrl-C)" if state == "interrupted" else f"{type(error).__name__}: {error}")[:2000]
        entry["where"] = "".join(traceback.format_tb(error.__traceback__)[-1:]).strip()[:1000]
        if stage in PARTIAL:
            key, how = PARTIAL[stage]
            partial = _select(cfg, key)
            if stage == "regenerate" and partial in (None, "auto"):  # the per-machine cache file
                try:
                    from data.regenerate import plan_regeneration
                    from data.sources import target_config
                    from experiments.stages import regenerate_config

                    partial = plan_regeneration(regenerate_config(cfg), target_config(cfg.target)).out
                except Exception:  # noqa: BLE001 — the status line must not hide the stage's own error
                    partial = None
            if partial and Path(str(partial)).exists():
                entry["partial"], entry["resume"] = str(partial), how
    return entry


def interrupted(err: BaseException) -> bool:
    """Ctrl-C: a KeyboardInterrupt, or what something raised while handling one (Lightning turns it into
    `SystemExit(1)` after its graceful shutdown)."""
    seen = 0
    while err is not None and seen < 16:
        if isinstance(err, KeyboardInterrupt):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def read_status(run_dir: str | Path) -> dict:
    """`<run_dir>/status.json` as a reader should take it: a `running` entry whose process is known to be gone
    (core/lock.py `process_gone`: a dead pid of this host, or a pid reused since) becomes `stale`, with
    `detail` "stale (process <pid> on <host> is gone)". A process of another host is not checked."""
    status = json.loads((Path(run_dir) / "status.json").read_text())
    for entry in status.values():
        if isinstance(entry, dict) and entry.get("state") == "running" and process_gone(entry):
            entry["state"] = "stale"
            entry["detail"] = f"stale (process {entry.get('pid')} on {entry.get('host')} is gone)"
    return status


def status_lines(run_dir: str | Path) -> list[str]:
    """`spechead status <run_dir>`: one line per stage — its state (`read_status`), process, times, error, resume."""
    lines = []
    for stage, e in read_status(run_dir).items():
        line = (f"{stage}: {e.get('detail') or e.get('state')} (pid {e.get('pid')} on {e.get('host', '?')}, "
                f"started {e.get('started', '?')}, updated {e.get('time')})")
        if e.get("error") and e.get("state") != "interrupted":
            line += "; " + e["error"].splitlines()[0]
        if e.get("partial"):
            line += f"; partial {e['partial']} ({e['resume']})"
        lines.append(line)
    return lines


# The errors a stage refuses with, (module, class): the project's own, each naming the file or the setting and what
# to do, so their traceback tells the user nothing more. A class is looked up only once its module is loaded (an error
# of a module never imported was never raised), so no stage imports another's modules to classify its error.
REFUSALS = (
    ("scripts.checks", "ConfigError"),  # a setting, before work
    ("data.source_files", "SourceError"),  # a data source: its setting or file
    ("data.hub", "HubTargetError"),  # a target by Hub id: not in the cache, gated, no such repo or revision
    ("data.assets", "AssetMissingError"),  # a packaged target or data set not installed
    ("data.store", "StoreError"),  # a feature store: damaged, incomplete, another target's
    ("core.lock", "LockHeld"),  # another process writes there
    ("core.files", "DiskFull"),  # a write that ran out of space
    ("core.safetensors_io", "SafetensorsError"),  # a weights file that cannot be read
    ("artifacts.integrity", "IntegrityError"),  # a head or export changed or damaged since its save
    ("artifacts.checkpoint", "ArtifactError"),  # a save would replace what is not ours
    ("artifacts.checkpoint", "TargetMismatchError"),  # a head of another target
    ("artifacts.validate", "ExportValidationError"),  # an export that breaks its format's rules
    ("train.run", "RunDirNotShared"),  # a rank that does not see the run directory
    ("train.validation", "ValidationOutOfMemory"),  # in-loop validation out of memory, with what to lower
)


def refusal_classes() -> tuple[type[BaseException], ...]:
    """`REFUSALS`' classes whose modules are loaded."""
    return tuple(getattr(sys.modules[m], name) for m, name in REFUSALS if m in sys.modules)


def is_refusal(err: BaseException) -> bool:
    """Whether `err` is a refusal (`REFUSALS`, or a FileNotFoundError that names what is missing) rather than a
    bug."""
    if isinstance(err, FileNotFoundError):
        return bool(err.filename or str(err))
    return isinstance(err, refusal_classes())


def show_tracebacks() -> bool:
    """HYDRA_FULL_ERROR=1 (hydra's own switch for its full stack traces): a refusal keeps its traceback too."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def refused(stage: str, err: BaseException, partial: str = "") -> SystemExit:
    """The exit of a stage refused by `err` (`is_refusal`): one line on stderr, `<stage> refused: <message>` and
    what it left to resume, no traceback."""
    return SystemExit(f"{stage} refused: {err}{partial}")


def run_checked(stage: str, fn, cfg):
    """`stage`'s checks before work (`CHECKS`, scripts/checks.py), then `fn(cfg)`: what `python -m
    scripts.<stage>` runs inside hydra, callable without it."""
    from scripts.checks import check_before_work

    if CHECKS.get(stage):
        check_before_work(cfg, CHECKS[stage])
    return fn(cfg)


def stage_main(fn):
    """hydra's main for a stage function `fn(cfg)`: the thread policy applied first, the stage's state
    recorded in `<run_dir>/status.json` (running → done, interrupted, or failed with the error and what is
    partial). A refusal (`is_refusal`) exits with one line and no traceback (`refused`) unless
    `show_tracebacks`; any other error propagates to hydra, which prints its traceback."""
    import hydra

    stage = Path(fn.__code__.co_filename).stem  # scripts/<stage>.py (its __module__ is __main__ under -m)
    register_resolvers()

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    @functools.wraps(fn)
    def main(cfg):
        try:
            apply_threads(cfg.get("threads"))  # `threads` is checked here, before the status records a run
            before = start_status(cfg, stage)
        except Exception as err:
            if is_refusal(err) and not show_tracebacks():
                raise refused(stage, err) from None
            raise
        try:
            out = run_checked(stage, fn, cfg)
        except LockHeld as err:  # another process writes there: the status stays that process's
            refused_status(cfg, stage, before)
            log.error("%s refused: %s", stage, err)
            if show_tracebacks():
                raise
            raise refused(stage, err) from None  # one line, no traceback: nothing went wrong here
        except BaseException as err:
            state = "interrupted" if interrupted(err) else "failed"
            try:
                path = record_status(cfg, stage, state, err)
            except OSError as status_err:  # a full disk: the stage's own error is the one to show
                log.warning("%s: could not record %r in status.json (%s)", stage, state, status_err)
                path = None
            entry = json.loads(path.read_text())[stage] if path is not None else {}
            partial = f"; partial artifacts at {entry['partial']} ({entry['resume']})" if entry.get("partial") else ""
            log.error("%s %s%s", stage, "interrupted (Ctrl-C)" if state == "interrupted" else
                      f"failed: {type(err).__name__}: {err}", partial)
            if state == "failed" and is_refusal(err) and not show_tracebacks():
                raise refused(stage, err, partial) from None
            raise
        try:
            record_status(cfg, stage, "done")
        except OSError as status_err:  # a full disk after the work: what the stage wrote stands, the status lags
            log.warning("%s done, but %s could not be updated (%s): it still says `running` (shown as stale once "
                        "this process is gone); what the stage wrote is complete", stage,
                        Path(str(cfg.run_dir)) / "status.json", status_err)
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
