"""`medusa-vllm`: the Medusa head as vLLM's `MedusaModel` (docs/reference/export_formats.md §3.4, §9.6;
vLLM `method="medusa"`, ≤ 0.32: vLLM 0.33 removed Medusa): `blocks.{h}.layers.{l}.*`, `medusa_fc_bias`
matching the biases, and the target's frozen lm_head shipped bit-identical as `lm_heads.0.weight` with
`original_lm_head: true`. Serve with `num_speculative_tokens` = `num_heads` exactly (vLLM overwrites
`num_heads` with it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from artifacts.formats.base import (ExportFormat, dtype_name, head_state, loaded, read_json, target_embed_and_head,
                                    write_config)
from artifacts.formats.checks import check_finite, check_keys, check_same_as_target, check_uniform_dtype
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.layers import LlamaArgs
from heads.medusa import MedusaConfig, MedusaHead


class Medusa(ExportFormat):
    name = "medusa-vllm"
    head_kind = "medusa"
    vllm_method = "medusa"

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return cfg.get("model_type") == "medusa" or cfg.get("architectures") == ["MedusaModel"]

    def write(self, head: MedusaHead, out: Path, target_dir: Path) -> None:
        """§3.4 / §9.6: vLLM's MedusaModel. The head projects with the target's frozen lm_head, so it ships
        as `lm_heads.0.weight` (bit-identical) with `original_lm_head: true`."""
        c, a = head.cfg, head.args
        state = head_state(head)
        lm_head = target_embed_and_head(target_dir)[1]
        state["lm_heads.0.weight"] = lm_head.clone()
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        dtype = dtype_name(head)
        cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": a.hidden_size,
               "vocab_size": a.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
               "medusa_fc_bias": c.bias, "original_lm_head": True, "truncated_vocab_size": None,
               "torch_dtype": dtype, "dtype": dtype}
        write_config(out, cfg)

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg, infos = read_json(path / "config.json"), scan_tensors(path)
        head = MedusaHead(args, MedusaConfig(num_heads=cfg["num_heads"], num_layers=cfg["num_hidden_layers"],
                                             bias=bool(cfg["medusa_fc_bias"])), tied)
        return loaded(head, {k: load_tensor(info, k) for k, info in infos.items() if k.startswith("blocks.")}, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        if cfg.get("model_type") != "medusa":
            problems.append(f"model_type must be 'medusa', got {cfg.get('model_type')!r}")
        if cfg.get("architectures") != ["MedusaModel"]:
            problems.append(f"architectures must be ['MedusaModel'], got {cfg.get('architectures')}")
        heads, layers = cfg.get("num_heads"), cfg.get("num_hidden_layers")
        for name, v in (("num_heads", heads), ("num_hidden_layers", layers)):
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        h, v = cfg.get("hidden_size"), cfg.get("vocab_size")
        if tcfg is not None:
            for field in ("hidden_size", "vocab_size"):
                if cfg.get(field) != tcfg.get(field):
                    problems.append(f"{field} {cfg.get(field)} differs from the target's {tcfg.get(field)}")
        if cfg.get("truncated_vocab_size") not in (None, v):
            problems.append("truncated_vocab_size is set: spechead's Medusa predicts over the whole vocabulary")
        if problems or not isinstance(h, int) or not isinstance(v, int):
            return
        bias = cfg.get("medusa_fc_bias", False)
        expected = {f"blocks.{j}.layers.{l}.weight": (h, h) for j in range(heads) for l in range(layers)}
        has_bias = any(k.endswith(".bias") for k in infos)
        if has_bias and not bias:
            problems.append("block biases are shipped but medusa_fc_bias is not true: vLLM drops them silently "
                            "(§10.1)")
        if bias:
            expected |= {f"blocks.{j}.layers.{l}.bias": (h,) for j in range(heads) for l in range(layers)}
        original = cfg.get("original_lm_head", False)
        lm_keys = ["lm_heads.0.weight"] if original else [f"lm_heads.{j}.weight" for j in range(heads)]
        expected |= {k: (v, h) for k in lm_keys}
        check_keys(infos, expected, problems, optional=() if bias else tuple(k for k in infos if k.endswith(".bias")))
        if original and target is not None and "lm_heads.0.weight" in infos:
            check_same_as_target("lm_heads.0.weight", infos["lm_heads.0.weight"], target_embed_and_head(target)[1],
                                 problems)
        own = [k for k in expected if k in infos and not k.startswith("lm_heads.")]
        check_uniform_dtype(infos, own, cfg.get("torch_dtype") or cfg.get("dtype"), problems)
        check_finite(infos, own, problems)


MEDUSA_VLLM = Medusa()
