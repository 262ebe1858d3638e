"""The checksum manifest of an artifact directory: `checksums.json`, the sha256 and size of every file a save
wrote, so that a file changed after the save (a flipped bit on disk, a partial copy, an edit, a rename) is
refused by every reader instead of served.

Every spechead save (a native head, every export format: `artifacts.checkpoint.atomic_artifact_dir`) writes
the manifest last, after the artifact marker, which it covers too; the whole directory is then swapped in at
once, so a directory whose save finished always has one. The readers (`artifacts.checkpoint.verify_artifact`:
`load_native`, every format's `load`, `load_any`, the validator) recompute the hashes before they read a
tensor, streaming each file in chunks (about 0.1 s per 100 MB). This module holds the manifest itself; which
directory must have one, and what a reader does without it, is `artifacts.checkpoint.verify_artifact`'s.

CLI: `python -m artifacts.integrity <dir>` checks a directory; `--write` records its files as they are now
(a directory saved before manifests existed, or one changed on purpose).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from core.files import atomic_write_bytes, sha256_file

MANIFEST = "checksums.json"
MANIFEST_VERSION = 1
HASH_CHUNK = 1 << 20  # bytes read at a time: memory stays flat however large the file
REMEDY = ("restore the directory from a good copy, or export the head again (retrain it if its native "
          "checkpoint is the damaged one); if you changed it on purpose, record its files as they are now with "
          "`python -m artifacts.integrity --write <dir>`")


class IntegrityError(RuntimeError):
    """An artifact's files differ from what its save recorded in its checksum manifest."""


class DamagedFileError(IntegrityError):
    """A file of a head or export cannot be read (truncated, a garbled header, a header claiming an absurd length)
    — what the manifest does not catch when the directory has none, or one rewritten after the damage."""


def artifact_files(directory: Path) -> list[str]:
    """The files under `directory` (relative POSIX paths, sorted), the manifest itself excluded."""
    out = []
    for dirpath, dirs, files in os.walk(directory):
        dirs.sort()
        for name in files:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def file_entry(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path, HASH_CHUNK), "size": path.stat().st_size}


def write_manifest(directory: str | Path) -> dict[str, Any]:
    """Hash every file under `directory` and write the manifest there atomically (a temp file renamed
    over `checksums.json`). Call it after the last file is written. Returns the manifest."""
    directory = Path(directory)
    manifest = {"format": "spechead-checksums", "version": MANIFEST_VERSION, "algorithm": "sha256",
                "files": {rel: file_entry(directory / rel) for rel in artifact_files(directory)}}
    atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of `directory`; None when it has none. An unreadable one is an IntegrityError (naming
    it, without advice: `integrity_error` adds that)."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path}: the checksum manifest cannot be read ({e})") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or manifest.get("algorithm") != "sha256"
            or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in files.values())):
        raise IntegrityError(f"{path}: not a spechead checksum manifest (no sha256 per file)")
    return manifest


def manifest_problems(directory: str | Path) -> list[str] | None:
    """What differs between `directory` and its manifest: each listed file missing or with another sha256
    (expected and found named, with their sizes), each file the manifest does not list. [] when all agree;
    None when the directory has no manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    listed: dict[str, dict[str, Any]] = manifest["files"]
    problems = []
    for rel, want in sorted(listed.items()):
        path = directory / rel
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists it: sha256 {want['sha256']}, {want.get('size')} "
                            "bytes) — renamed or deleted after the save")
            continue
        found = file_entry(path)
        if found["sha256"] != want["sha256"]:
            problems.append(f"{path}: sha256 {found['sha256']} ({found['size']} bytes), expected "
                            f"{want['sha256']} ({want.get('size')} bytes) — its content changed after the save")
    for rel in sorted(set(artifact_files(directory)) - set(listed)):
        problems.append(f"{directory / rel}: not in the manifest — added or renamed after the save")
    return problems


def integrity_error(directory: Path, problems: list[str]) -> IntegrityError:
    lines = "\n".join(f"  - {p}" for p in problems)
    return IntegrityError(f"{directory}: {len(problems)} file(s) differ from what the save recorded in "
                          f"{directory / MANIFEST}:\n{lines}\nRefusing to load it: {REMEDY}.")


# ---- CLI -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artifacts.integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a head or export directory")
    p.add_argument("--write", action="store_true", help="record the files as they are now (replaces the manifest)")
    ns = p.parse_args(argv)
    if not ns.dir.is_dir():
        print(f"{ns.dir}: not a directory", file=sys.stderr)
        return 2
    if ns.write:
        n = len(write_manifest(ns.dir)["files"])
        print(f"wrote {ns.dir / MANIFEST}: {n} file(s)")
        return 0
    try:
        problems = manifest_problems(ns.dir)
    except IntegrityError as e:
        problems = [str(e)]
    if problems is None:
        print(f"{ns.dir}: no {MANIFEST}; nothing to check (add one with --write)", file=sys.stderr)
        return 1
    if problems:
        print(integrity_error(ns.dir, problems), file=sys.stderr)
        return 1
    print(f"OK: {ns.dir}: every file matches {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
