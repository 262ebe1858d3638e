"""A target's own decoder layers read from its HF checkpoint, by name: what `draft_lm` (`init: target`, its
first N layers) and `mtp` (one layer) heads start from. The `draft-hf` export format of the `draft_lm` head is
artifacts/formats/draft_hf.py."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from core.safetensors_io import checkpoint_tensor_names, load_safetensors_dir


def read_target_layers(target_dir: str | Path, num_layers: int) -> dict[str, torch.Tensor]:
    """`model.layers.{i}.*` for i < num_layers from a target checkpoint directory (one tensor at a time)."""
    pattern = re.compile(r"model\.layers\.(\d+)\..+")
    names = {k for k in checkpoint_tensor_names(Path(target_dir))
             if (m := pattern.fullmatch(k)) is not None and int(m.group(1)) < num_layers}
    return load_safetensors_dir(Path(target_dir), names)


def read_target_layer(target_dir: str | Path, index: int) -> dict[str, torch.Tensor]:
    """Decoder layer `index` of a target checkpoint directory, by the names within the layer (`self_attn.q_proj.weight`, …)."""
    prefix = f"model.layers.{index}."
    names = {k for k in checkpoint_tensor_names(Path(target_dir)) if k.startswith(prefix)}
    return {k.removeprefix(prefix): v for k, v in load_safetensors_dir(Path(target_dir), names).items()}
