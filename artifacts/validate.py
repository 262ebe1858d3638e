"""Structural validators for exported heads — docs/reference/export_formats.md §11 step 1.

Engines are poor validators: SGLang skips unknown names, vLLM silently drops an EAGLE-1 `fc.bias` and
leaves missing tensors at random init (§10, §14). So every export directory is checked here, without
running an engine, against its checksum manifest (every file as the save wrote it:
`artifacts.checkpoint.artifact_problems`) and the key set, shapes, dtypes and config rules of its format:
each format's `validate` (artifacts/formats/, one module per format; the registry names them all).

Every violation is collected, then one error lists them all. The target, when given, is read from its
`config.json` and safetensors directly (artifacts/ imports nothing from data/ or train/).

CLI: `python -m artifacts.validate <dir> --format <fmt> [--target <target_dir>]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from artifacts.checkpoint import artifact_problems, damaged_error
from artifacts.integrity import REMEDY
from artifacts.formats import FORMATS, get_format
from artifacts.formats.base import read_json
from core.safetensors_io import SafetensorsError, scan_tensors


class ExportValidationError(ValueError):
    """One error that lists every violation found in an export directory."""

    def __init__(self, path: Path, fmt: str, violations: list[str]) -> None:
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"{path} is not a valid {fmt!r} export ({len(violations)} violation(s)):\n{lines}")


def validate_export(path: str | Path, fmt: str, target_dir: str | Path | None = None) -> list[str]:
    """Every violation of format `fmt` found in the export directory `path` (empty list: valid)."""
    path = Path(path)
    checker = get_format(fmt)
    problems = [f"{p}; {REMEDY}" for p in artifact_problems(path)]  # a file changed since the save, named first
    if not (path / "config.json").exists():
        return [*problems, f"no config.json in {path}"]
    try:
        cfg = read_json(path / "config.json")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return [*problems, f"config.json is not valid JSON ({e})"]
    try:
        infos = scan_tensors(path, problems)
    except SafetensorsError as e:  # truncated, a garbled header: named, with where a good copy comes from
        return [*problems, str(damaged_error(path, e))]
    target = Path(target_dir) if target_dir is not None else None
    tcfg = read_json(target / "config.json") if target is not None else None
    checker.validate(path, cfg, infos, target, tcfg, problems)
    return problems


def check_export(path: str | Path, fmt: str, target_dir: str | Path | None = None) -> None:
    """Raise ExportValidationError listing every violation, if there is any."""
    problems = validate_export(path, fmt, target_dir)
    if problems:
        raise ExportValidationError(Path(path), fmt, problems)


# ---- CLI -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artifacts.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the export directory")
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--target", type=Path, default=None, help="the target's HF checkpoint directory")
    ns = p.parse_args(argv)
    problems = validate_export(ns.dir, ns.format, ns.target)
    if problems:
        print(ExportValidationError(ns.dir, ns.format, problems), file=sys.stderr)
        return 1
    checked = "" if ns.target else " (without --target: copies and RoPE not compared with the target)"
    print(f"OK: {ns.dir} is a valid {ns.format} export{checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
