"""`draft-hf`: the `draft_lm` head (heads/draft_lm.py) as a plain HF checkpoint of the target's own class —
the target's config with `num_hidden_layers: N`, `model.embed_tokens.weight` copied from the target (and
`lm_head.weight` for an untied target), the draft's layers and norm — which vLLM (`method="draft_model"`) /
SGLang (`STANDALONE`) load as a separate draft model and spechead's engine loads with
`LlamaForCausalLM.from_pretrained`. Its config is a target's: only the artifact marker tells it apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.checkpoint import artifact_info, copy_target_files
from artifacts.formats.base import (ExportFormat, dtype_name, head_state, loaded, read_json, target_embed_and_head,
                                    write_config)
from artifacts.formats.checks import check_finite, check_keys, check_positions, llama_layer_shapes
from core.safetensors_io import TensorInfo, checkpoint_tensor_names, load_safetensors_dir, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.draft_lm import DraftLMConfig, DraftLMHead
from heads.layers import LlamaArgs


def draft_hf_config(head: DraftLMHead, target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The target's config.json with the draft's depth and dtype (class, RoPE, vocabulary, token ids kept)."""
    dtype = dtype_name(head)
    cfg = {**target_cfg, "architectures": target_cfg.get("architectures") or ["LlamaForCausalLM"],
           "num_hidden_layers": head.cfg.num_layers,
           "torch_dtype": dtype, "dtype": dtype}  # transformers < 5 reads the first, >= 5 the second
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][: head.cfg.num_layers]
    cfg.pop("num_nextn_predict_layers", None)
    return cfg


class DraftHF(ExportFormat):
    name = "draft-hf"
    head_kind = "draft_lm"
    vllm_method = "draft_model"

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return (artifact_info(path) or {}).get("kind") == self.artifact_kind

    def write(self, head: DraftLMHead, out: Path, target_dir: Path) -> None:
        """config.json + model.safetensors (+ the target's tokenizer files): the draft's layers and final
        norm, `model.embed_tokens.weight` (and `lm_head.weight` for an untied target) copied from the
        target in the draft's dtype."""
        tcfg = read_json(target_dir / "config.json")
        copy_target_files(target_dir, out, skip_weights=True)
        embed, lm_head = target_embed_and_head(target_dir)
        state = head_state(head)
        state["model.embed_tokens.weight"] = embed.to(head.dtype).contiguous()
        if not tcfg.get("tie_word_embeddings", False):
            state["lm_head.weight"] = lm_head.to(head.dtype).contiguous()
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        write_config(out, draft_hf_config(head, tcfg))

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg = read_json(path / "config.json")
        head = DraftLMHead(args, DraftLMConfig(num_layers=int(cfg["num_hidden_layers"])), tied)
        state = load_safetensors_dir(path, {k for k in checkpoint_tensor_names(path)
                                            if k.startswith(("model.layers.", "model.norm."))})
        return loaded(head, state, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        problems.extend(validate_draft_hf(cfg, path, target, tcfg))


def validate_draft_hf(cfg: dict[str, Any], path: Path, target: Path | None, tcfg: dict[str, Any] | None) -> list[str]:
    """Violations of the `draft-hf` layout: a config of the target's class sized like the target, exactly
    the tensors of a num_hidden_layers-layer model of it, and an embedding (lm_head) equal to the target's."""
    problems: list[str] = []
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and str(archs[0]).endswith("ForCausalLM")):
        problems.append(f"architectures must name one causal LM class, got {archs}")
    if tcfg is not None and (archs, cfg.get("model_type")) != (tcfg.get("architectures") or ["LlamaForCausalLM"],
                                                               tcfg.get("model_type")):
        problems.append(f"architectures/model_type {archs}/{cfg.get('model_type')!r} are not the target's "
                        f"{tcfg.get('architectures')}/{tcfg.get('model_type')!r}")
    if problems:
        return problems
    try:
        a = LlamaArgs.from_hf_config(cfg)
    except (KeyError, ValueError, TypeError) as e:
        return [f"config.json is not a Llama-family config: {e!r}"]
    infos = scan_tensors(path, problems)
    expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                                            "model.norm.weight": (a.hidden_size,)}
    for i in range(a.num_hidden_layers):
        expected |= {f"model.layers.{i}.{k}": s for k, s in llama_layer_shapes(a).items()}
    if not a.tie_word_embeddings:
        expected["lm_head.weight"] = (a.vocab_size, a.hidden_size)
    check_keys(infos, expected, problems)
    check_finite(infos, [k for k in expected if k.startswith("model.layers.") or k == "model.norm.weight"], problems)
    if tcfg is not None:
        ta = LlamaArgs.from_hf_config(tcfg)
        for field in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "tie_word_embeddings"):
            if getattr(a, field) != getattr(ta, field):
                problems.append(f"{field} {getattr(a, field)} differs from the target's {getattr(ta, field)}")
        check_positions(cfg, tcfg, problems)
    if target is not None and not problems:
        embed, lm_head = target_embed_and_head(target)
        for name, ref in (("model.embed_tokens.weight", embed), ("lm_head.weight", lm_head)):
            if name in infos:
                got = load_tensor(infos[name], name)
                if not torch.equal(got, ref.to(got.dtype)):
                    problems.append(f"tensor {name!r} is not the target's (cast to {got.dtype}): a stale or "
                                    "random copy destroys acceptance")
    return problems


DRAFT_HF = DraftHF()
