"""One writer per directory (core/lock.py): a second writer is refused at once, naming the holder; a stale lock
(its process gone on this host, or its pid reused) is taken over with a warning, another host's never; the
stages take it where they write — precompute's store (or rank) directory, training's checkpoint, head and
untrained directories — so two precomputes into one store or two trainings into one checkpoint directory
cannot mix their files; a run killed with SIGKILL is resumed by a rerun. And the run status: pid, host and
start time recorded, a `running` entry of a dead process read as stale, Ctrl-C recorded as `interrupted`."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from core.lock import LockHeld, acquire, lock_path, process_identity, same_launch, writer_lock
from data.store import FeatureStore, IncompleteRanksError, merge_rank_manifests, rank_dir
from scripts.runtime import interrupted, read_status, record_status, status_lines
from experiments.stages import run_precompute
from tests.conftest import CONVERSATIONS, ROOT, compose_config

ENV = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def dead_pid() -> int:
    """A pid no process has on this host right now."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1 if Path("/proc/sys/kernel/pid_max").exists() else 99999
    while pid > 1:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1
    raise AssertionError("no free pid")


def plant(path: Path, **record) -> Path:
    """A lock file for `path` as another process would have left it: this process's identity, overridden."""
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({**process_identity(), "stage": "precompute", "started": "2024-01-01T00:00:00+0000",
                                "command": "spechead precompute", "token": "planted", **record}))
    return lock


# ---- the lock ---------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_second_holder_is_refused_at_once_naming_the_first(tmp_path):
    store = tmp_path / "run" / "features"
    with writer_lock(store, "precompute") as held:
        assert held.lock == tmp_path / "run" / ".features.lock" and held.lock.exists()
        assert json.loads(held.lock.read_text())["pid"] == os.getpid()
        t0 = time.monotonic()
        with pytest.raises(LockHeld) as e:
            acquire(store, "train")
        assert time.monotonic() - t0 < 5  # refused, not waited for
        msg = str(e.value)
        assert "\n" not in msg and str(store) in msg and f"pid {os.getpid()} on host {socket.gethostname()}" in msg
        assert "stage precompute" in msg and "started 20" in msg
        assert f"Wait for it, or stop it; if that process is gone, remove {held.lock}" in msg
        (tmp_path / "alias").symlink_to(tmp_path / "run")
        with pytest.raises(LockHeld):  # another spelling of the same directory: the same lock
            acquire(tmp_path / "alias" / "features", "precompute")
    assert not held.lock.exists()  # released
    for err in (RuntimeError("boom"), KeyboardInterrupt()):  # released however the block ends
        with pytest.raises(type(err)):
            with writer_lock(store, "precompute"):
                raise err
        assert not lock_path(store).exists()


@pytest.mark.unit
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    store = tmp_path / "features"
    me = process_identity()
    stale = {"a dead pid": ({"pid": dead_pid()}, "is gone"),
             "a pid reused by another process": ({"proc_start": (me["proc_start"] or 0) - 1}, "another process"),
             "a lock from before a reboot": ({"boot_id": "another-boot"}, "reboot")}
    for name, (record, reason) in stale.items():
        if name != "a dead pid" and me["proc_start"] is None:
            continue  # no /proc: only the dead pid can be told
        plant(store, **record)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="core.lock"):
            with writer_lock(store, "precompute") as held:
                assert json.loads(held.lock.read_text())["pid"] == os.getpid()
        assert "taking over a stale lock" in caplog.text and reason in caplog.text, name
        assert not lock_path(store).exists()


@pytest.mark.unit
def test_a_lock_of_another_host_or_unreadable_is_never_taken_over(tmp_path):
    store = tmp_path / "features"
    lock = plant(store, host="node-elsewhere", pid=dead_pid())
    with pytest.raises(LockHeld) as e:
        acquire(store, "precompute")
    assert "on host node-elsewhere (another host)" in str(e.value)
    assert "never taken over automatically" in str(e.value) and f"remove {lock}" in str(e.value)
    assert json.loads(lock.read_text())["host"] == "node-elsewhere"  # left as it was
    lock.write_text("{not json")
    with pytest.raises(LockHeld, match=f"if no other process writes there, remove {lock}"):
        acquire(store, "precompute")


@pytest.mark.unit
def test_ranks_of_one_launch_pass_their_rank_0s_lock(tmp_path, monkeypatch):
    """A non-zero rank checks the lock before anything loads: its own launch's rank 0 (its parent under
    Lightning's launcher, a sibling under torchrun / srun, the same launch variables across nodes) is no reason
    to stop; another launch's training is."""
    parent = {"pid": os.getppid(), "host": socket.gethostname(), "ppid": -1, "launch": ""}
    assert same_launch(parent)
    assert same_launch({**parent, "pid": 123456789, "ppid": os.getppid()})  # a sibling
    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    other = {"pid": os.getpid(), "host": socket.gethostname(), "ppid": -1, "launch": ""}
    assert not same_launch(other) and not same_launch({**other, "host": "node-1"})
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert same_launch({**other, "host": "node-0", "launch": "MASTER_ADDR=node-0 MASTER_PORT=29500"})
    assert not same_launch({**other, "host": "node-0", "launch": "MASTER_ADDR=node-0 MASTER_PORT=29501"})


def test_a_lock_held_by_another_process_is_refused_then_taken_over_once_it_is_killed(tmp_path, caplog):
    store = tmp_path / "features"
    code = ("import sys, time\nfrom core.lock import acquire\nacquire(sys.argv[1], 'precompute')\n"
            "print('held', flush=True)\ntime.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(store)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld, match=f"pid {proc.pid} on host {socket.gethostname()}, stage precompute"):
            acquire(store, "precompute")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    with caplog.at_level(logging.WARNING, logger="core.lock"):
        with writer_lock(store, "precompute"):
            pass
    assert f"process {proc.pid} is gone" in caplog.text


# ---- the stages -------------------------------------------------------------------------------------------
def _paused(monkeypatch, module, name: str):
    """Patch `module.name` so that its first call from a thread other than the main one waits for `go` (after
    setting `started`); other calls run at once."""
    original, started, go = getattr(module, name), threading.Event(), threading.Event()

    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread() and not started.is_set():
            started.set()
            assert go.wait(300)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return started, go


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.unit
def test_two_precomputes_into_one_store_one_refuses_the_other_completes_unmixed(tiny_overrides, tmp_path, monkeypatch):
    import data.precompute as dp

    settings = [*tiny_overrides, "precompute.shard_tokens=300"]
    ref_dir, _ = run_precompute(compose_config([*settings, f"store_dir={tmp_path / 'ref'}"]))
    cfg = compose_config([*settings, f"store_dir={tmp_path / 'store'}"])
    started, go = _paused(monkeypatch, dp, "precompute")
    thread, out = _in_thread(run_precompute, cfg)  # the first: holds the lock, paused before its first batch
    try:
        assert started.wait(120), out
        with pytest.raises(LockHeld) as e:
            run_precompute(cfg)
        assert str(tmp_path / "store") in str(e.value) and f"pid {os.getpid()}" in str(e.value)
    finally:
        go.set()
        thread.join(300)
    assert "error" not in out, out
    store = FeatureStore(tmp_path / "store", verify_on_open=True)
    ids = [sid for s in store.manifest["shards"] for sid in s["sample_ids"]]
    assert store.manifest["complete"] and store.verify() == [] and sorted(ids) == sorted(set(ids))
    assert len(ids) == len(CONVERSATIONS)
    ref = json.loads((ref_dir / "manifest.json").read_text())["shards"]
    assert [s["sha256"] for s in store.manifest["shards"]] == [s["sha256"] for s in ref]  # one run's shards only
    assert not lock_path(tmp_path / "store").exists()


@pytest.mark.unit
def test_ranks_lock_their_own_directory_and_the_merge_waits_for_a_held_rank(tiny_overrides, tmp_path):
    store = tmp_path / "ranked"
    cfgs = [compose_config([*tiny_overrides, f"store_dir={store}", f"precompute.rank={r}",
                            "precompute.world_size=2"]) for r in (0, 1)]
    run_precompute(cfgs[0])
    with writer_lock(rank_dir(store, 1), "precompute rank 1 of 2"):
        with pytest.raises(LockHeld, match="rank-00001"):  # a second writer of rank 1
            run_precompute(cfgs[1])
    with writer_lock(store, "precompute"):  # a single-rank precompute writing the directory
        with pytest.raises(LockHeld, match=f"{store} is being written"):
            run_precompute(cfgs[1])
    run_precompute(cfgs[1])  # the last rank: merges
    assert json.loads((store / "manifest.json").read_text())["complete"]
    with writer_lock(rank_dir(store, 0), "precompute rank 0 of 2"):  # a rerun of rank 0, still writing
        with pytest.raises(IncompleteRanksError, match=r"still being written: .*rank-00000 \(pid"):
            merge_rank_manifests(store)
    assert merge_rank_manifests(store)["complete"]


class Pause(Callback):
    """Holds a training at its start until `go`."""

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def on_train_start(self, trainer, pl_module) -> None:
        self.started.set()
        assert self.go.wait(300)


@pytest.mark.unit
def test_two_trainings_into_one_checkpoint_dir_one_refuses(tiny_overrides, tmp_path):
    from experiments.stages import run_training

    common = [*tiny_overrides, "trainer.max_epochs=1", "train.engine_validation.enabled=false"]
    run_precompute(compose_config(common))
    cfg = compose_config(common)
    pause = Pause()
    thread, out = _in_thread(run_training, cfg, extra_callbacks=[pause])
    try:
        assert pause.started.wait(300), out
        for c in (cfg, compose_config([*common, f"head_dir={tmp_path / 'other_head'}",
                                       f"train.untrained_dir={tmp_path / 'other_untrained'}"])):
            with pytest.raises(LockHeld) as e:  # the same directories, or the same checkpoint directory alone
                run_training(c)
            assert f"{tmp_path / 'run' / 'checkpoints'} is being written" in str(e.value)
            assert f"pid {os.getpid()}" in str(e.value) and "stage train" in str(e.value)
    finally:
        pause.go.set()
        thread.join(600)
    assert "error" not in out, out
    assert (tmp_path / "run" / "head" / "model.safetensors").exists() and not (tmp_path / "other_head").exists()
    assert not list((tmp_path / "run").glob(".*.lock"))  # every lock released


# ---- killed runs, Ctrl-C and the run status -----------------------------------------------------------------
def _many(path: Path, n: int = 200) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "human", "value": f"Question {i}: " + "why? " * (1 + i % 25)},
                     {"from": "gpt", "value": f"Answer {i}. " + "because. " * (1 + i % 35)}]
            f.write(json.dumps({"id": f"m{i}", "conversations": turns}) + "\n")
    return path


def _start_and_stop(cmd: list[str], shard: Path, sig: int, log: Path) -> tuple[subprocess.Popen, str]:
    """Run `cmd`, send `sig` once `shard` exists (the run is writing), wait for it to end; its output."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not shard.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{shard} did not appear"
            time.sleep(0.005)
        proc.send_signal(sig)
        proc.wait(timeout=180)
    return proc, log.read_text()


def test_a_precompute_killed_with_sigkill_is_resumed_by_a_rerun(tiny_overrides, tmp_path, caplog):
    settings = [f"data.path={_many(tmp_path / 'many.jsonl')}", "data.max_samples=null", "precompute.shard_tokens=2000",
                "precompute.batch_tokens=1024", f"run_dir={tmp_path / 'run'}"]
    store = tmp_path / "run" / "features"
    cmd = [sys.executable, "-m", "scripts.precompute", *tiny_overrides, *settings]
    proc, output = _start_and_stop(cmd, store / "shards" / "shard-00001.safetensors", signal.SIGKILL, tmp_path / "log")
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    lock = lock_path(store)
    assert json.loads(lock.read_text())["pid"] == proc.pid  # left behind by the kill
    status = read_status(tmp_path / "run")["precompute"]
    assert status["state"] == "stale" and status["pid"] == proc.pid and status["host"] == socket.gethostname()
    assert status["detail"] == f"stale (process {proc.pid} on {socket.gethostname()} is gone)"
    assert any(line.startswith(f"precompute: stale (process {proc.pid}") for line in status_lines(tmp_path / "run"))
    with caplog.at_level(logging.WARNING, logger="core.lock"):
        _, stats = run_precompute(compose_config([*tiny_overrides, *settings]))
    assert f"process {proc.pid} is gone" in caplog.text
    assert 0 < stats.samples < 200  # resumed: the finished shards were kept
    store_ = FeatureStore(store, verify_on_open=True)
    assert store_.manifest["complete"] and len(store_) == 200 and store_.verify() == []
    assert not lock.exists()


def test_ctrl_c_releases_the_lock_and_is_recorded_as_interrupted(tiny_overrides, tmp_path):
    # 1,000 conversations, five times the tokens of 200: those were once all written (1.3 s) before the signal,
    # sent once the first shards exist, reached the run on a loaded machine
    settings = [f"data.path={_many(tmp_path / 'many.jsonl', n=1000)}", "data.max_samples=null",
                "precompute.shard_tokens=2000", "precompute.batch_tokens=1024", f"run_dir={tmp_path / 'run'}"]
    store = tmp_path / "run" / "features"
    cmd = [sys.executable, "-m", "scripts.precompute", *tiny_overrides, *settings]
    proc, output = _start_and_stop(cmd, store / "shards" / "shard-00001.safetensors", signal.SIGINT, tmp_path / "log")
    assert proc.returncode != 0 and "precompute interrupted (Ctrl-C)" in output, output[-3000:]
    assert not lock_path(store).exists(), output[-3000:]  # released on the way out
    status = json.loads((tmp_path / "run" / "status.json").read_text())["precompute"]
    assert status["state"] == "interrupted" and status["error"] == "interrupted (Ctrl-C)", status
    assert status["pid"] == proc.pid and status["host"] == socket.gethostname() and status["started"]
    assert status["partial"] == str(store) and "rerun" in status["resume"]
    # a second precompute while one holds the store: refused in one line, and the holder's status is left alone
    with writer_lock(store, "precompute"):
        record_status(OmegaConf.create({"run_dir": str(tmp_path / "run")}), "precompute", "running")
        refused = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0
        assert f"precompute refused: {store} is being written by another process: pid {os.getpid()}" in refused.stderr
        assert read_status(tmp_path / "run")["precompute"]["pid"] == os.getpid()


@pytest.mark.unit
def test_status_records_the_process_and_reads_a_dead_one_as_stale(tmp_path):
    cfg = OmegaConf.create({"run_dir": str(tmp_path)})
    path = record_status(cfg, "train", "running")
    entry = json.loads(path.read_text())["train"]
    assert entry["pid"] == os.getpid() and entry["host"] == socket.gethostname() and entry["started"]
    assert read_status(tmp_path)["train"]["state"] == "running"  # this process lives
    started = entry["started"]
    time.sleep(1.1)
    record_status(cfg, "train", "done")
    assert json.loads(path.read_text())["train"]["started"] == started  # the start is kept, the time moves on
    status = json.loads(path.read_text())
    status["train"] |= {"state": "running", "pid": dead_pid()}
    path.write_text(json.dumps(status))
    assert read_status(tmp_path)["train"]["detail"] == \
        f"stale (process {status['train']['pid']} on {socket.gethostname()} is gone)"
    status["train"]["host"] = "node-elsewhere"  # another host's process cannot be checked from here
    path.write_text(json.dumps(status))
    assert read_status(tmp_path)["train"]["state"] == "running"


@pytest.mark.unit
def test_ctrl_c_is_told_from_a_failure():
    def lightning_like():  # what Lightning's fit does on Ctrl-C: a graceful shutdown, then sys.exit(1)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            sys.exit(1)

    with pytest.raises(SystemExit) as e:
        lightning_like()
    assert interrupted(e.value) and interrupted(KeyboardInterrupt())
    assert not interrupted(SystemExit(1)) and not interrupted(RuntimeError("x"))
