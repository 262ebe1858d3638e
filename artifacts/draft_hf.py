"""The `draft-hf` format of the `draft_lm` head (heads/draft_lm.py): a plain HF checkpoint of the target's
own class — the target's config with `num_hidden_layers: N`, `model.embed_tokens.weight` copied from the
target (and `lm_head.weight` for an untied target), the draft's layers and norm — which vLLM / SGLang load
as a separate draft model and spechead's engine loads with `LlamaForCausalLM.from_pretrained`. Also: the
target's first N layers for `init: target` and reading an export back (its validator: artifacts/validate.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.checkpoint import copy_target_files
from artifacts.validate import read_json, target_embed_and_head
from core.safetensors_io import checkpoint_tensor_names, load_safetensors_dir
from heads.base import TiedTarget
from heads.draft_lm import DraftLMConfig, DraftLMHead
from heads.layers import LlamaArgs

EXPORT_FORMAT = "draft-hf"


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


# ---- export: a plain HF checkpoint of the target's class -------------------------------------------
def draft_hf_config(head: DraftLMHead, target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The target's config.json with the draft's depth and dtype (class, RoPE, vocabulary, token ids kept)."""
    dtype = str(head.dtype).removeprefix("torch.")
    cfg = {**target_cfg, "architectures": target_cfg.get("architectures") or ["LlamaForCausalLM"],
           "num_hidden_layers": head.cfg.num_layers,
           "torch_dtype": dtype, "dtype": dtype}  # transformers < 5 reads the first, >= 5 the second
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][: head.cfg.num_layers]
    cfg.pop("num_nextn_predict_layers", None)
    return cfg


def write_draft_hf(head: DraftLMHead, out: Path, target_dir: Path) -> None:
    """config.json + model.safetensors (+ the target's tokenizer files): the draft's layers and final
    norm, `model.embed_tokens.weight` (and `lm_head.weight` for an untied target) copied from the
    target in the draft's dtype."""
    tcfg = read_json(target_dir / "config.json")
    copy_target_files(target_dir, out, skip_weights=True)
    embed, lm_head = target_embed_and_head(target_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    state["model.embed_tokens.weight"] = embed.to(head.dtype).contiguous()
    if not tcfg.get("tie_word_embeddings", False):
        state["lm_head.weight"] = lm_head.to(head.dtype).contiguous()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft_hf_config(head, tcfg), indent=2))


def read_draft_hf(path: str | Path, tied: TiedTarget, args: LlamaArgs) -> DraftLMHead:
    """A `draft-hf` export as a spechead head over the target's frozen tensors (`args`: the target's)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    head = DraftLMHead(args, DraftLMConfig(num_layers=int(cfg["num_hidden_layers"])), tied)
    state = load_safetensors_dir(path, {k for k in checkpoint_tensor_names(path)
                                        if k.startswith(("model.layers.", "model.norm."))})
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)
