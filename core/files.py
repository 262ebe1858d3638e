"""Writing files and directories so that a kill never leaves a half-written one, and hashing them.

`atomic_write(path, write)`: write to a temp name beside `path`, fsync, rename over it, fsync the directory —
a reader sees the old file or the new one, never a prefix. `atomic_dir(out_dir)`: build a directory in a
temp dir beside it and swap it in with one `renameat2(RENAME_EXCHANGE)` where the kernel has it (elsewhere
the old one is parked at `.<name>.old` for an instant, which the next save moves back after a kill).
What they write gets the modes a plain write under the process's umask gives (files 0o666 & ~umask,
directories 0o777 & ~umask): a head, an export or a store is readable by the user who serves it.
A write that runs out of space (ENOSPC, EDQUOT — from an OSError, or from safetensors' or torch's own error that
wraps one) is raised as `DiskFull`, naming the file being written and the space left, after its temp file or
dir is removed.
These primitives import nothing of spechead.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status); elsewhere
    set and restored at once, under a lock."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def apply_umask_modes(root: Path) -> None:
    """Give `root` and everything under it the modes a plain write under the umask gives: directories
    0o777 & ~umask, files 0o666 & ~umask (mkdtemp makes its dir 0700; copy2 copies its source's mode)."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in files:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


class DiskFull(OSError):
    """A write that ran out of disk space or quota; the message names the file being written."""

    def __str__(self) -> str:
        return str(self.strerror)


# how safetensors (Rust: "No space left on device (os error 28)") and other wrappers spell ENOSPC / EDQUOT
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|os error (28|122)\b")


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the errors it was raised from or while handling (at most 16)."""
    seen = 0
    while err is not None and seen < 16:
        yield err
        err, seen = err.__cause__ or err.__context__, seen + 1


def disk_full(err: BaseException | None) -> BaseException | None:
    """The error that says the disk (or the user's quota) is full: `err` or one it was raised from; None when
    none does. torch.save writing to a file object raises a RuntimeError whose context is the OSError;
    safetensors raises its own error with the OS message in its text."""
    return next((e for e in _chain(err) if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
                 or _NO_SPACE.search(str(e))), None)


def disk_full_error(path: Path, cause: BaseException) -> DiskFull:
    """The DiskFull to raise for a failed write of `path` (`cause`: what `disk_full` found): the path, the space
    left on its filesystem, and that nothing partial was kept."""
    try:
        free = f"; {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there now"
    except OSError:
        free = ""
    return DiskFull(errno.ENOSPC, f"{path}: cannot be written: the disk is full (no space left on its filesystem"
                                  f"{free}: {cause}); nothing partial was kept. Free some space there (or write to "
                                  "another disk) and run it again", str(path))


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temp name in the same directory, fsync it, rename it over `path`, fsync the
    directory: a reader (or a killed writer's successor) sees the old file or the new one, never a
    prefix. The temp name carries the process and thread ids: concurrent writers never share one.
    A full disk is raised as `DiskFull` naming `path`, the temp file removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # whatever made the temp file (mkstemp: 0600)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        try:
            tmp.unlink(missing_ok=True)  # a failed write leaves no temp file behind
        except OSError:
            pass
        if (cause := disk_full(err)) is not None and not isinstance(err, DiskFull):
            raise disk_full_error(path, cause) from err
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def save_leftovers(out_dir: Path) -> tuple[Path, list[Path]]:
    """`.<name>.old` (where a swap without RENAME_EXCHANGE parks the old artifact) and the temp dirs
    `.<name>.XXXXXXXX[.tmp]` that `tempfile.mkdtemp` made for a save into `out_dir`."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.[a-z0-9_]{{8}}(\.tmp)?")
    temps = []
    if out_dir.parent.is_dir():
        temps = sorted(p for p in out_dir.parent.iterdir()
                       if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    return old, temps


def leftover_hint(path: Path) -> str:
    old, _ = save_leftovers(path)
    if not path.exists() and old.is_dir():
        return f" — an interrupted save left the previous version in {old}; the next save to {path} restores it"
    return ""


def recover_interrupted_save(out_dir: str | Path) -> None:
    """Undo or clean what a killed save left next to `out_dir`: `.<name>.old` is moved back when
    `out_dir` is missing (the previous artifact) and removed otherwise (the new one is in place); temp
    dirs of unfinished saves are removed."""
    out_dir = Path(out_dir)
    old, temps = save_leftovers(out_dir)
    if old.is_dir() and not old.is_symlink():
        if not out_dir.exists() and not out_dir.is_symlink():
            log.warning("%s: missing after an interrupted save; restoring the previous version from %s", out_dir, old)
            os.replace(old, out_dir)
            fsync_dir(out_dir.parent)
        else:
            log.warning("%s: removing %s, left by an interrupted save", out_dir, old)
            remove_tree(old)
    for tmp in temps:
        log.warning("%s: removing %s, the temp dir of an interrupted save", out_dir, tmp)
        remove_tree(tmp)


def swap_in_dir(tmp: Path, out_dir: Path) -> None:
    if not (out_dir.exists() or out_dir.is_symlink()):
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
        return
    try:
        _rename_exchange(tmp, out_dir)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        old = out_dir.with_name(f".{out_dir.name}.old")  # absent: recover_interrupted_save ran
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
        remove_tree(old)
        return
    fsync_dir(out_dir.parent)
    remove_tree(tmp)  # now the old artifact


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _rename_exchange(a: Path, b: Path) -> None:
    """Atomically exchange two paths (Linux renameat2 RENAME_EXCHANGE); OSError(ENOSYS) elsewhere."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def remove_tree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    if p.exists():
        log.warning("%s: could not be removed entirely (the next save retries)", p)


@contextmanager
def atomic_dir(out_dir: str | Path, check: Callable[[Path], None] | None = None,
               finish: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir` to build a directory in; on success call `finish(tmp)` (e.g. a
    marker file), give the tree the umask's modes (`apply_umask_modes`), fsync it and swap it in for
    `out_dir` (`swap_in_dir`). Leftovers of an interrupted save are recovered first
    (`recover_interrupted_save`); `check(out_dir)`, when given, runs before the write and again just before
    the swap (a directory may not be replaced: it raises). A full disk is raised as `DiskFull` naming the file
    of `out_dir` being written, the temp dir removed."""
    out_dir = Path(out_dir)
    tmp = temp_dir_for(out_dir, check)
    try:
        yield tmp
        if finish is not None:
            finish(tmp)
        seal_temp_dir(tmp)
        if check is not None:
            check(out_dir)  # in case something appeared there while we wrote
    except BaseException as err:
        remove_tree(tmp)
        if (cause := disk_full(err)) is not None and not isinstance(err, DiskFull):
            raise disk_full_error(_destination(err, tmp, out_dir), cause) from err
        raise
    swap_in_dir(tmp, out_dir)


def temp_dir_for(out_dir: Path, check: Callable[[Path], None] | None = None) -> Path:
    """A new temp dir beside `out_dir` to build its next version in, after recovering what an interrupted save
    left there (`recover_interrupted_save`) and `check(out_dir)`; `seal_temp_dir`, then `swap_in_dir`, put it in
    place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(out_dir)
    if check is not None:
        check(out_dir)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))


def seal_temp_dir(tmp: Path) -> None:
    """A temp dir built completely, made ready to swap in: the umask's modes, every file and directory fsynced."""
    apply_umask_modes(tmp)
    fsync_tree(tmp)


def _destination(err: BaseException, tmp: Path, out_dir: Path) -> Path:
    """Where in `out_dir` the file an error of a write into `tmp` names will be (the first OSError in its chain
    with a file name under `tmp`); `out_dir` itself when none names one."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.filename:
            try:
                return out_dir / Path(os.fsdecode(e.filename)).relative_to(tmp)
            except ValueError:
                pass
    return out_dir
