"""Build a head from its config and save / load the native checkpoint (DESIGN.md §8).

Native format: `config.json` (head type, head hyper-parameters, target shapes and fingerprint,
spechead version) + `model.safetensors` with the head's own weights only — the frozen target
embedding, final norm and lm_head are excluded and re-attached from the target at load.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from heads.eagle1 import Eagle1Config, Eagle1Head
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.layers import LlamaArgs
from heads.base import DraftHead, TiedTarget
from heads.medusa import MedusaConfig, MedusaHead
from heads.mtp import MTPConfig, MTPHead

HEAD_TYPES = {"mtp": (MTPConfig, MTPHead), "eagle1": (Eagle1Config, Eagle1Head),
              "eagle3": (Eagle3Config, Eagle3Head), "medusa": (MedusaConfig, MedusaHead)}
FORMAT_VERSION = 1


def build_head(head_cfg: dict[str, Any], args: LlamaArgs, tied: TiedTarget) -> DraftHead:
    cfg = dict(head_cfg)
    kind = cfg.pop("type", "mtp")
    cfg.pop("_target_", None)
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown head type {kind!r}; known: {sorted(HEAD_TYPES)}")
    config_cls, head_cls = HEAD_TYPES[kind]
    return head_cls(args, config_cls(**cfg), tied)


def save_native(head: DraftHead, out_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (temp dir, then rename)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "spechead-native"})
    config = {
        "spechead_format": FORMAT_VERSION,
        "spechead_version": _version(),
        "head": head.cfg.to_dict(),
        "target_args": asdict(head.args),
        "target_fingerprint": fingerprint or {},
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        _rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def load_native(path: str | Path, tied: TiedTarget, args: LlamaArgs | None = None) -> DraftHead:
    """Rebuild a head from a native checkpoint and attach the target's frozen tensors."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: not a spechead head checkpoint (no config.json)")
    config = json.loads(cfg_file.read_text())
    if "head" not in config or "target_args" not in config:
        raise ValueError(f"{cfg_file}: missing 'head' or 'target_args' — not a native spechead checkpoint")
    saved_args = LlamaArgs(**config["target_args"])
    if args is not None and (args.hidden_size, args.vocab_size) != (saved_args.hidden_size, saved_args.vocab_size):
        raise ValueError(f"{path}: head was trained for hidden={saved_args.hidden_size}, vocab={saved_args.vocab_size}; "
                         f"the target has hidden={args.hidden_size}, vocab={args.vocab_size}")
    head = build_head(config["head"], saved_args, tied)
    state = load_file(path / "model.safetensors")
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("spechead")
    except Exception:  # running from a source tree without installing
        return "0+unknown"


def _rmtree(p: Path) -> None:
    import shutil
    shutil.rmtree(p, ignore_errors=True)


__all__ = ["build_head", "save_native", "load_native", "read_config", "HEAD_TYPES"]
