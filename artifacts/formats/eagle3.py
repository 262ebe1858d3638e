"""`eagle3`: the EAGLE-3 head for vLLM `method="eagle3"` and SGLang `EAGLE3`, one artifact for both
(docs/reference/export_formats.md §3.2, §4.2, §9.3): arch `LlamaForCausalLMEagle3`, `midlayer.*`, `norm`,
`lm_head` [V_d, H], `d2t` (int64 offsets: target id = draft id + d2t) and `t2d` when the draft vocabulary is
smaller, `draft_vocab_size` always written, the aux layer ids ("input of layer i") top-level and in
`eagle_config`, never starting at 1 (SGLang shifts such lists)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.formats.base import ExportFormat, dtype_name, head_state, loaded, read_json, t2d_of, write_config
from artifacts.formats.checks import (check_against_target, check_eagle_draft_config, check_keys, check_own_tensors,
                                      check_shipped_embedding, llama_args)
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.layers import LlamaArgs

EAGLE3_ARCH = "LlamaForCausalLMEagle3"


def eagle3_config(head: Eagle3Head, target_cfg: dict[str, Any]) -> dict[str, Any]:
    """§9.3: one config for vLLM and SGLang; aux ids top-level and in eagle_config, never starting at 1."""
    a, c = head.args, head.cfg
    dtype = dtype_name(head)
    ids = list(c.aux_layers)
    cfg = {
        "architectures": [EAGLE3_ARCH], "model_type": "llama",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": max(a.max_position_embeddings, target_cfg.get("max_position_embeddings", 0)),
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
        "norm_output": c.norm_output,
        "num_aux_hidden_states": len(ids),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True,
                         "norm_before_fc": c.norm_before_fc},
    }
    if "rope_parameters" in target_cfg:
        cfg["rope_parameters"] = target_cfg["rope_parameters"]
    return cfg


def eagle3_shapes(a: LlamaArgs, num_aux: int, draft_vocab: int, norm_before_fc: bool = False
                  ) -> dict[str, tuple[int, ...]]:
    """EAGLE-3 keys of §9.3 (without d2t / t2d / embed_tokens, checked separately); `input_norm` with
    EAGLE-3.1's norm_before_fc."""
    h, d, i = a.hidden_size, a.head_dim, a.intermediate_size
    mid = {
        "self_attn.q_proj.weight": (a.num_attention_heads * d, 2 * h),
        "self_attn.k_proj.weight": (a.num_key_value_heads * d, 2 * h),
        "self_attn.v_proj.weight": (a.num_key_value_heads * d, 2 * h),
        "self_attn.o_proj.weight": (h, a.num_attention_heads * d),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    return ({"fc.weight": (h, num_aux * h), "norm.weight": (h,), "lm_head.weight": (draft_vocab, h)}
            | ({"input_norm.weight": (num_aux * h,)} if norm_before_fc else {})
            | {f"midlayer.{k}": s for k, s in mid.items()})


class Eagle3(ExportFormat):
    name = "eagle3"
    head_kind = "eagle3"
    vllm_method = "eagle3"

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return cfg.get("architectures") == [EAGLE3_ARCH] or "eagle_aux_hidden_state_layer_ids" in cfg

    def write(self, head: Eagle3Head, out: Path, target_dir: Path) -> None:
        ids = list(head.cfg.aux_layers)
        if ids[0] == 1:
            raise ValueError(f"eagle3 export refused: aux layer ids {ids} start at 1, which SGLang reads in its older "
                             "'output of layer' convention and shifts by one (docs/reference/export_formats.md "
                             "§1.2, PR #25454): train with aux_layers that start at 2 or later")
        state = head_state(head)
        if head.draft_ids is None:  # V_d = V: the engines need no mapping (§1.3)
            state.pop("d2t"), state.pop("t2d")
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        cfg = eagle3_config(head, read_json(target_dir / "config.json"))
        write_config(out, cfg)

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg, infos = read_json(path / "config.json"), scan_tensors(path)
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        norms = {k: bool(cfg.get(k, False)) for k in ("norm_before_residual", "norm_output")}
        norms["norm_before_fc"] = bool(cfg.get("norm_before_fc",
                                               (cfg.get("eagle_config") or {}).get("norm_before_fc", False)))
        head = Eagle3Head(args, Eagle3Config(aux_layers=ids, draft_vocab_size=cfg["draft_vocab_size"], **norms), tied)
        state = {k: load_tensor(info, k) for k, info in infos.items() if k != "embed_tokens.weight"}
        if "d2t" not in state:  # V_d = V (validated): the identity mapping
            state["d2t"], state["t2d"] = head.d2t.clone(), head.t2d.clone()
        elif "t2d" not in state:
            state["t2d"] = t2d_of(state["d2t"], args.vocab_size)
        return loaded(head, state, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        check_eagle_draft_config(cfg, EAGLE3_ARCH, "EAGLE-3", problems)
        norms = {}
        for flag in ("norm_before_residual", "norm_output"):
            norms[flag] = cfg.get(flag, "<missing>")
            if not isinstance(norms[flag], bool):  # the engines' defaults differ when the key is missing (§10.5)
                problems.append(f"{flag} must be written as true or false (the defaults differ between engines, "
                                f"§10.5), got {norms[flag]!r}")
        nested_fc = (cfg.get("eagle_config") or {}).get("norm_before_fc", cfg.get("norm_before_fc", False))
        if bool(cfg.get("norm_before_fc", False)) != bool(nested_fc):
            problems.append(f"norm_before_fc differs: top-level {cfg.get('norm_before_fc')!r}, "
                            f"eagle_config {nested_fc!r}")
        if cfg.get("fc_norm") or (cfg.get("eagle_config") or {}).get("fc_norm"):
            problems.append("fc_norm is set: per-chunk fc norms are not what spechead's eagle3 head computes")
        vd = cfg.get("draft_vocab_size")
        if not isinstance(vd, int) or isinstance(vd, bool) or vd < 1:
            problems.append(f"draft_vocab_size must be a positive integer (SGLang reads the key; null means 'use the "
                            f"target's head', §10.6), got {vd!r}")
            vd = None
        ids = _eagle3_aux_ids(cfg, tcfg, problems)
        a = llama_args(cfg, problems, "the export's")
        if a is None or ids is None or vd is None:
            return
        check_against_target(a, cfg, tcfg, problems)
        if vd > a.vocab_size:
            problems.append(f"draft_vocab_size {vd} exceeds vocab_size {a.vocab_size}")
        expected = eagle3_shapes(a, len(ids), vd, bool(cfg.get("norm_before_fc", False)))
        check_keys(infos, expected, problems, eagle=True, optional=("d2t", "t2d", "embed_tokens.weight"))
        _check_vocab_maps(infos, vd, a.vocab_size, problems)
        if "embed_tokens.weight" in infos:
            check_shipped_embedding(infos, target, problems)
        check_own_tensors(infos, expected, cfg, problems)


def _eagle3_aux_ids(cfg: dict[str, Any], tcfg: dict[str, Any] | None, problems: list[str]) -> list[int] | None:
    """The aux layer ids an EAGLE-3 export names (top-level and in eagle_config, which must agree), checked
    against what the engines and the target accept; None when they cannot be read."""
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        problems.append("eagle_config.use_aux_hidden_state is false: the engines then build no fc")
    ids = None
    if top is None or nested is None:
        problems.append("eagle_aux_hidden_state_layer_ids must be written top-level and in eagle_config (§10.3), "
                        f"got top-level {top!r}, eagle_config {nested!r}")
    elif top != nested:
        problems.append(f"eagle_aux_hidden_state_layer_ids differ: top-level {top}, eagle_config {nested}")
    else:
        ids = top
    if ids is not None:
        if not ids or not all(isinstance(i, int) for i in ids) or ids != sorted(set(ids)):
            problems.append(f"aux layer ids {ids} must be distinct integers in ascending order")
        elif ids[0] == 1:
            problems.append(f"aux layer ids {ids} start at 1: SGLang then shifts every id by one (§1.2, PR #25454)")
        elif ids[0] < 1:
            problems.append(f"aux layer ids {ids}: id 0 is the embedding output, not a layer input")
        if tcfg is not None and ids and max(ids) >= tcfg.get("num_hidden_layers", 0):
            problems.append(f"aux layer ids {ids} exceed the target's {tcfg.get('num_hidden_layers')} layers")
        if "num_aux_hidden_states" in cfg and cfg["num_aux_hidden_states"] != len(ids):
            problems.append(f"num_aux_hidden_states {cfg['num_aux_hidden_states']} != {len(ids)} aux layer ids")
    return ids


def _check_vocab_maps(infos: dict[str, TensorInfo], vd: int, vocab_size: int, problems: list[str]) -> None:
    """d2t (draft id → target id offsets) and t2d (target ids in the draft vocabulary): present when the
    draft vocabulary is smaller, well-formed, and consistent with each other."""
    if vd < vocab_size and "d2t" not in infos:
        problems.append(f"missing tensor 'd2t': required when draft_vocab_size {vd} < vocab_size {vocab_size} "
                        "(vLLM leaves it at zeros and maps draft ids to target ids 0..V_d-1, §1.3)")
    if "d2t" in infos:
        d2t = infos["d2t"]
        if d2t.shape != (vd,) or d2t.dtype != "int64":
            problems.append(f"d2t is {d2t.dtype} {list(d2t.shape)}, expected int64 [{vd}] offsets (§1.3)")
        else:
            offsets = load_tensor(d2t, "d2t")
            tgt = offsets + torch.arange(vd)
            if bool((tgt < 0).any() or (tgt >= vocab_size).any()):
                problems.append("d2t maps draft ids outside the target vocabulary (offsets, not absolute ids? §10.12)")
            elif tgt.unique().numel() != vd:
                problems.append("d2t maps two draft ids to the same target id")
            elif "t2d" in infos and infos["t2d"].shape == (vocab_size,):
                t2d = load_tensor(infos["t2d"], "t2d")
                if not (t2d.dtype == torch.bool and int(t2d.sum()) == vd and bool(t2d[tgt].all())):
                    problems.append("t2d does not mark exactly the target ids that d2t maps to")
    if "t2d" in infos and infos["t2d"].shape != (vocab_size,):
        problems.append(f"t2d has shape {list(infos['t2d'].shape)}, expected [{vocab_size}] bool")


EAGLE3 = Eagle3()
