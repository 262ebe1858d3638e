"""The on-disk formats of a head, one module each (torchtune's checkpointer classes: one class per format that
recognises, writes, reads and validates it; base.py `ExportFormat`), and the registry that the export stage
(artifacts/export.py `export_head`, `default_formats`), the loaders (`load_any`, `load_export`) and the
validator (artifacts/validate.py and its CLI) read. A new format is one module plus one `register` line below.

    native.py         `native`                           any head; spechead's own checkpoint
    speculators_dflash.py `speculators-dflash`, `-dspark`  the peer trainer's DFlash / DSpark checkpoints, read only
    speculators.py    `speculators-eagle3`               the peer trainer's EAGLE-3 checkpoints, read only
    draft_hf.py       `draft-hf`                         draft_lm; vLLM `draft_model`
    medusa.py         `medusa-vllm`                      medusa; vLLM `medusa` (≤ 0.32)
    mtp_deepseek.py   `mtp-stitched`, `mtp-standalone`   mtp; no engine serves them on a Llama-family target
    mtp_vllm.py       `mtp-vllm`                         mtp; vLLM `eagle3` with spechead's plugin
    eagle3.py         `eagle3`                           eagle3; vLLM `eagle3`, SGLang `EAGLE3`
    eagle1.py         `eagle1-vllm`, `eagle1-sglang`     eagle1; vLLM `eagle`, SGLang `EAGLE`
    dflash.py         `dflash-vllm`, `dspark-vllm`       dflash, dspark; vLLM `dflash`, `dspark` (GPU runner only)

Registration order matters twice: `detect_format` answers the first format whose `detect` holds (the
peer's config and mtp-vllm's also carry EAGLE-3's aux ids, so both come before `eagle3`; the peer's block drafters
come before its EAGLE-3, whose detect holds for any speculators config), and a head kind's
formats are listed, and written by default, in this order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from artifacts.formats import (
    dflash, draft_hf, eagle1, eagle3, medusa, mtp_deepseek, mtp_vllm, native, speculators, speculators_dflash,
)
from artifacts.checkpoint import verify_artifact
from artifacts.formats.base import ExportFormat, read_json

FORMATS: dict[str, ExportFormat] = {}


def register(fmt: ExportFormat) -> ExportFormat:
    """Add a format to the registry (after those registered before it)."""
    if fmt.name in FORMATS:
        raise ValueError(f"export format {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (native.NATIVE, speculators_dflash.SPECULATORS_DFLASH_FORMAT, speculators_dflash.SPECULATORS_DSPARK_FORMAT,
             speculators.SPECULATORS, draft_hf.DRAFT_HF, medusa.MEDUSA_VLLM,
             mtp_deepseek.MTP_STITCHED, mtp_deepseek.MTP_STANDALONE, mtp_vllm.MTP_VLLM, eagle3.EAGLE3,
             eagle1.EAGLE1_VLLM, eagle1.EAGLE1_SGLANG, dflash.DFLASH_VLLM, dflash.DSPARK_VLLM):
    register(_fmt)


def get_format(name: str) -> ExportFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown export format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_format(path: str | Path) -> str:
    """The format of a head directory, from its config.json (and, for draft-hf, its artifact marker). When it
    cannot tell, the checksum manifest is checked first: a config.json damaged or renamed after the save is
    named as such (`artifacts.checkpoint.verify_artifact`), not reported as an unknown format."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        verify_artifact(path)
        raise FileNotFoundError(f"{path}: no config.json — not a head checkpoint or export")
    try:
        cfg = read_json(cfg_file)
    except ValueError:  # not JSON: damaged after the save, if the manifest says so
        verify_artifact(path)
        raise
    for fmt in FORMATS.values():
        if fmt.detect(path, cfg):
            return fmt.name
    verify_artifact(path)
    raise ValueError(f"{path}: cannot tell which head format this is (architectures {cfg.get('architectures') or []}); "
                     "pass a native spechead checkpoint or an export made by artifacts/export.py")


class _RegistryView(Mapping):
    """A read-only table computed from the registry on each use, so a format registered later shows in it."""

    def __init__(self, build: Callable[[], dict]) -> None:
        self._build = build

    def __getitem__(self, key: str):
        return self._build()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return repr(self._build())


def _engine_formats() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for fmt in FORMATS.values():
        if fmt.head_kind is not None:
            out[fmt.head_kind] = (*out.get(fmt.head_kind, ()), fmt.name)
    return out


# head kind → the engine formats spechead writes it in; format → the speculative `method` vLLM serves it with
# (always pass it: vLLM guesses from the path otherwise)
ENGINE_FORMATS: Mapping[str, tuple[str, ...]] = _RegistryView(_engine_formats)
VLLM_METHODS: Mapping[str, str] = _RegistryView(
    lambda: {f.name: f.vllm_method for f in FORMATS.values() if f.vllm_method is not None})
