"""One writer per directory: an exclusive lock file beside what a stage writes.

`writer_lock(path, stage)` holds `<parent>/.<name>.lock` for the stage's life (a context manager: released
on return, on an exception and on Ctrl-C). The lock file is a small JSON record of its holder — pid, host,
the process's start time (/proc/<pid>/stat), the machine's boot id, its pid namespace, the stage, when it
started and the command line — so a second writer is refused at once with one line naming the directory
and the holder (`LockHeld`), and a lock left by a dead process is recognised:

- a pid of this host that no longer exists (`os.kill(pid, 0)` → ProcessLookupError), has exited (a
  zombie), belongs to another process now (its start time differs), or a lock from before this host's
  last reboot is stale: it is taken over with a warning (a rerun after `kill -9` resumes);
- a lock of another host, or of another pid namespace of this one, is never taken over automatically:
  this host cannot tell whether that process lives. Its message says to remove the file by hand.

The lock sits beside the path, not inside it: head and export directories are swapped in whole
(core/files.py `atomic_dir`), which would carry a lock file inside them away, and a lock inside a
directory would make it look non-empty to whatever checks that.

Why an exclusively created file rather than `fcntl.flock`: flock is not reliable on the shared
filesystems a multi-node run writes to — Lustre refuses it unless mounted with `-o flock` (or keeps it
node-local with `localflock`), NFS mounted `local_lock=flock` or `nolock` keeps it per client — and it
records no holder to name. Creating a file that must not exist is atomic on local filesystems, NFSv3+
and Lustre alike. The record is written to a temp file first and published with `link()` (atomic, and
never seen half-written; on NFS a lost reply is recognised by the temp file's link count), with
`O_CREAT | O_EXCL` where a filesystem has no hard links. flock serves only to serialise two processes
of one host taking over the same stale lock, best effort.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

MAX_RECORD = 1 << 16
UNREADABLE = {"unreadable": True}  # a lock file whose record cannot be read (being written, or damaged)


class LockHeld(RuntimeError):
    """Another live process (or one this host cannot check) holds the lock of a path."""

    def __init__(self, message: str, lock: Path, holder: dict) -> None:
        super().__init__(message)
        self.lock, self.holder = lock, holder


def lock_path(path: str | Path) -> Path:
    """The lock file of `path` (a directory or a file): `.<name>.lock` beside it, symlinks resolved so
    that two spellings of one directory share one lock."""
    p = Path(path).expanduser().resolve()
    return p.with_name(f".{p.name}.lock")


# ---- who a process is, and whether it is gone ------------------------------------------------------------
def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc/<pid>/stat; None where
    there is no /proc or no such process."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    try:
        return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity() -> dict:
    """This process as a lock record or a status entry names it: pid, host, start ticks, boot id, pid namespace."""
    stat = _proc_stat(os.getpid())
    return {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": stat[1] if stat else None,
            "boot_id": _boot_id(), "pid_ns": _pid_ns()}


def process_gone(ident: dict) -> str | None:
    """Why the process `ident` (`process_identity`'s keys) is known to be gone, or None when it lives —
    or when this process cannot tell: another host, another pid namespace, an unreadable record."""
    pid = ident.get("pid")
    if ident.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    if ident.get("pid_ns") and _pid_ns() and ident["pid_ns"] != _pid_ns():
        return None  # another container on this host: its pids are not ours to probe
    if ident.get("boot_id") and _boot_id() and ident["boot_id"] != _boot_id():
        return f"process {pid} ran before this host's last reboot"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} is gone"
    except PermissionError:
        pass  # it exists, under another user
    stat = _proc_stat(pid)
    if stat is not None:
        if stat[0] in ("Z", "X"):
            return f"process {pid} has exited"
        if ident.get("proc_start") is not None and stat[1] != ident["proc_start"]:
            return f"process {pid} is gone (its pid now belongs to another process)"
    return None


# ---- the lock file ----------------------------------------------------------------------------------------
def _parse(data: bytes) -> dict:
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return dict(UNREADABLE)
    return record if isinstance(record, dict) else dict(UNREADABLE)


def read_holder(lock: Path, wait_s: float = 1.0) -> dict | None:
    """The record in `lock`; None when there is no lock file. A record still being written (the
    `O_EXCL` fallback writes after creating) is read again for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            record = _parse(lock.read_bytes()[:MAX_RECORD])
        except FileNotFoundError:
            return None
        except OSError:
            record = dict(UNREADABLE)
        if record != UNREADABLE or time.monotonic() >= deadline:
            return record
        time.sleep(0.05)


def _create(lock: Path, data: bytes) -> bool:
    """Publish `data` as `lock` if no lock file is there; False if one is."""
    tmp = lock.with_name(f"{lock.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.new")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # NFS: the link was made, its reply was lost
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV):
                raise
        try:  # no hard links here: create the lock itself, then write it
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(lock: Path, stale: dict, reason: str) -> None:
    """Remove `lock` if it still holds the stale record `stale`. Processes of this host that take over one
    lock at once are serialised by flock on it, and each checks that the path still names the file it
    locked and that file the record it judged stale; the loser finds the winner's fresh lock next."""
    import fcntl

    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock: the checks below still apply
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            st, now = os.fstat(fd), os.stat(lock)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            return  # another process took it over already
        if _parse(os.pread(fd, MAX_RECORD, 0)).get("token") != stale.get("token"):
            return
        log.warning("%s: taking over a stale lock (stage %s on %s, started %s): %s", lock, stale.get("stage"),
                    stale.get("host"), stale.get("started"), reason)
        os.unlink(lock)
    finally:
        os.close(fd)


def refusal(path: Path, lock: Path, holder: dict) -> str:
    """The one line a refused writer raises."""
    if holder == UNREADABLE:
        return (f"{path} is locked by another writer ({lock} exists but names no holder that can be read): wait for "
                f"it, or stop it; if no other process writes there, remove {lock}")
    here = holder.get("host") == socket.gethostname()
    command = str(holder.get("command") or "")
    command = command if len(command) <= 160 else command[:157] + "..."
    return (f"{path} is being written by another process: pid {holder.get('pid')} on host {holder.get('host')}"
            f"{'' if here else ' (another host)'}, stage {holder.get('stage')}, started {holder.get('started')}"
            f"{f' ({command})' if command else ''}. Wait for it, or stop it; if that process is gone, remove {lock}"
            + ("" if here else " (a lock of another host is never taken over automatically)"))


def live_holder(path: str | Path) -> dict | None:
    """The holder of `path`'s lock, unless there is none or it is known to be gone (a peek: takes nothing)."""
    holder = read_holder(lock_path(path))
    if holder is None or (holder != UNREADABLE and process_gone(holder)):
        return None
    return holder


def check_free(path: str | Path, same_writer: Callable[[dict], bool] = lambda holder: False) -> None:
    """Raise `LockHeld` if a live process holds `path`'s lock, unless `same_writer(holder)` says it is one
    this process works with (another rank of its own launch)."""
    holder = live_holder(path)
    if holder is not None and (holder == UNREADABLE or not same_writer(holder)):
        raise LockHeld(refusal(Path(path), lock_path(path), holder), lock_path(path), holder)


class WriterLock:
    """A held lock (`acquire`); `release()` removes the lock file if it is still this one's."""

    def __init__(self, path: Path, lock: Path, record: dict) -> None:
        self.path, self.lock, self.record = path, lock, record

    def release(self) -> None:
        holder = read_holder(self.lock, wait_s=0)
        if holder is not None and holder.get("token") == self.record["token"]:
            self.lock.unlink(missing_ok=True)
        else:
            log.warning("%s: the lock of this writer was removed or taken over while it ran (now: %s)", self.lock,
                        "none" if holder is None else f"pid {holder.get('pid')} on {holder.get('host')}")


def acquire(path: str | Path, stage: str) -> WriterLock:
    """Take `path`'s lock for `stage` at once, or raise `LockHeld` naming its holder; a stale lock (its
    process gone, on this host) is taken over with a warning."""
    path = Path(path)
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    record = {**process_identity(), "ppid": os.getppid(), "stage": stage,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:1000],
              "path": str(path.expanduser().resolve()), "launch": launch_id(), "token": secrets.token_hex(16)}
    data = json.dumps(record, indent=1).encode()
    for _ in range(8):
        if _create(lock, data):
            return WriterLock(path, lock, record)
        holder = read_holder(lock)
        if holder is None:
            continue  # released meanwhile: try again
        reason = None if holder == UNREADABLE else process_gone(holder)
        if reason is None:
            raise LockHeld(refusal(path, lock, holder), lock, holder)
        _take_over(lock, holder, reason)
    raise LockHeld(f"{path}: could not take {lock}: other processes keep taking it; retry", lock, {})


@contextlib.contextmanager
def writer_lock(path: str | Path, stage: str) -> Iterator[WriterLock]:
    """Hold `path`'s lock while the block runs (`acquire`); released however the block ends."""
    held = acquire(path, stage)
    try:
        yield held
    finally:
        held.release()


@contextlib.contextmanager
def writer_locks(paths, stage: str) -> Iterator[list[WriterLock]]:
    """`writer_lock` over several paths (each once, in the order given); none is kept if one is refused."""
    with contextlib.ExitStack() as stack:
        seen, held = set(), []
        for p in paths:
            if lock_path(p) not in seen:
                seen.add(lock_path(p))
                held.append(stack.enter_context(writer_lock(p, stage)))
        yield held


# ---- ranks of one launch ----------------------------------------------------------------------------------
LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID")


def launch_id() -> str:
    """What the ranks of one launch share (torchrun's run id and rendezvous address, SLURM's job and step);
    empty for a process started alone."""
    return " ".join(f"{v}={os.environ[v]}" for v in LAUNCH_VARS if os.environ.get(v))


def same_launch(holder: dict) -> bool:
    """Whether the lock `holder` is this process's own launcher (Lightning starts ranks 1.. as children of
    rank 0), a rank started beside it (torchrun's and srun's ranks of a node share a parent), or a rank of
    the same multi-node launch (same launch variables)."""
    here = holder.get("host") == socket.gethostname()
    if here and holder.get("pid") == os.getppid():
        return True
    if here and holder.get("ppid") == os.getppid() and os.getppid() != 1:
        return True
    return bool(launch_id()) and holder.get("launch") == launch_id()
