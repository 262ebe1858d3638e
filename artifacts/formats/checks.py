"""The checks the format validators share (artifacts/formats/*.py `validate`), each appending what it finds
to a list of violations: exact key sets and shapes, one floating dtype, finite values, a Llama-family
config sized like the target with its RoPE and positions, and frozen copies bit-identical to the target's
(docs/reference/export_formats.md §1, §10, §11 step 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from artifacts.formats.base import target_embed_and_head
from core.safetensors_io import TensorInfo, load_tensor
from heads.layers import LlamaArgs


def llama_layer_shapes(a: LlamaArgs, input_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of one Llama-family decoder layer (heads/layers.py DecoderLayer)."""
    h, d, i = a.hidden_size, a.head_dim, a.intermediate_size
    shapes = {
        "self_attn.q_proj.weight": (a.num_attention_heads * d, h),
        "self_attn.k_proj.weight": (a.num_key_value_heads * d, h),
        "self_attn.v_proj.weight": (a.num_key_value_heads * d, h),
        "self_attn.o_proj.weight": (h, a.num_attention_heads * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if input_norm:
        shapes["input_layernorm.weight"] = (h,)
    if a.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (a.num_attention_heads * d,),
                   "self_attn.k_proj.bias": (a.num_key_value_heads * d,),
                   "self_attn.v_proj.bias": (a.num_key_value_heads * d,)}
    if a.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    return shapes


def check_keys(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], problems: list[str],
                optional: tuple[str, ...] = (), eagle: bool = False) -> None:
    """Exact key set and shapes. Keys in `optional` may be absent (their content is checked elsewhere)."""
    for key in sorted(set(expected) - set(infos)):
        problems.append(f"missing tensor {key!r} (shape {list(expected[key])})")
    for key in sorted(set(infos) - set(expected) - set(optional)):
        hint = "; EAGLE heads carry no `model.` prefix (the engines add it, §1.5)" if eagle and key.startswith("model.") else ""
        problems.append(f"unexpected tensor {key!r} {list(infos[key].shape)}{hint}")
    for key in sorted(set(expected) & set(infos)):
        if infos[key].shape != expected[key]:
            problems.append(f"tensor {key!r} has shape {list(infos[key].shape)}, expected {list(expected[key])}")


def check_uniform_dtype(infos: dict[str, TensorInfo], keys: list[str], declared: str | None,
                         problems: list[str]) -> None:
    dtypes = {infos[k].dtype for k in keys if k in infos}
    if len(dtypes) > 1:
        problems.append(f"head tensors mix dtypes {sorted(dtypes)}: one dtype expected")
    elif declared is not None and dtypes and dtypes != {declared}:
        problems.append(f"config says dtype {declared!r} but the tensors are {dtypes.pop()!r}")
    for k in keys:
        if k in infos and not infos[k].dtype.startswith(("float", "bfloat")):
            problems.append(f"tensor {k!r} has non-floating dtype {infos[k].dtype}")


def check_finite(infos: dict[str, TensorInfo], keys: list[str], problems: list[str]) -> None:
    for k in keys:
        if k in infos and not torch.isfinite(load_tensor(infos[k], k).float()).all():
            problems.append(f"tensor {k!r} holds NaN or Inf values")


def llama_args(cfg: dict[str, Any], problems: list[str], what: str) -> LlamaArgs | None:
    try:
        return LlamaArgs.from_hf_config(cfg)
    except (KeyError, ValueError, TypeError) as e:
        problems.append(f"{what} config.json is not a Llama-family config: {e!r}")
        return None


def check_positions(cfg: dict[str, Any], tcfg: dict[str, Any] | None, problems: list[str]) -> None:
    """RoPE and positions equal to the target's (§1.6); an inconsistent top-level vs nested theta."""
    nested = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if nested is not None and "rope_theta" in cfg and float(cfg["rope_theta"]) != float(nested):
        problems.append(f"rope_theta {cfg['rope_theta']} disagrees with rope_parameters.rope_theta {nested}")
    if "max_position_embeddings" not in cfg:
        problems.append("config.json lacks max_position_embeddings")
    if tcfg is None:
        return
    if cfg.get("max_position_embeddings", 0) < tcfg.get("max_position_embeddings", 0):
        problems.append(f"max_position_embeddings {cfg.get('max_position_embeddings')} is shorter than the "
                        f"target's {tcfg['max_position_embeddings']} (positions beyond it break the draft, §1.6)")
    a, ta = LlamaArgs.from_hf_config(cfg), LlamaArgs.from_hf_config(tcfg)
    if a.rope_theta != ta.rope_theta:
        problems.append(f"rope_theta {a.rope_theta} differs from the target's {ta.rope_theta}")
    if (a.rope_scaling or None) != (ta.rope_scaling or None):
        problems.append(f"rope scaling {a.rope_scaling} differs from the target's {ta.rope_scaling}")


def check_same_as_target(name: str, info: TensorInfo, reference: torch.Tensor, problems: list[str]) -> None:
    got = load_tensor(info, name)
    if got.dtype != reference.dtype or got.shape != reference.shape:
        diff = f"{got.dtype} {list(got.shape)} vs the target's {reference.dtype} {list(reference.shape)}"
    elif not torch.equal(got, reference):
        diff = f"max |difference| {float((got.float() - reference.float()).abs().max()):.3g}"
    else:
        return
    problems.append(f"tensor {name!r} is not bit-identical to the target's ({diff}); "
                    "a stale or random copy destroys acceptance (§1.4)")


def check_shipped_embedding(infos: dict[str, TensorInfo], target: Path | None, problems: list[str]) -> None:
    """A shipped `embed_tokens.weight` must be the target's, bit for bit (§1.4)."""
    if target is None:
        problems.append("embed_tokens.weight is shipped: pass --target to check it equals the target's (§1.4)")
    else:
        check_same_as_target("embed_tokens.weight", infos["embed_tokens.weight"],
                              target_embed_and_head(target)[0], problems)


def check_own_tensors(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], cfg: dict[str, Any],
                       problems: list[str]) -> None:
    own = [k for k in expected if k in infos]
    check_uniform_dtype(infos, own, cfg.get("torch_dtype") or cfg.get("dtype"), problems)
    check_finite(infos, own, problems)


def check_against_target(a: LlamaArgs, cfg: dict[str, Any], tcfg: dict[str, Any] | None,
                          problems: list[str]) -> None:
    """A draft sized like the target (hidden, vocab), with the target's RoPE and positions."""
    if tcfg is not None:
        ta = LlamaArgs.from_hf_config(tcfg)
        for field in ("hidden_size", "vocab_size"):
            if getattr(a, field) != getattr(ta, field):
                problems.append(f"{field} {getattr(a, field)} differs from the target's {getattr(ta, field)}")
    check_positions(cfg, tcfg, problems)


def draft_args(cfg: dict[str, Any], tcfg: dict[str, Any] | None, problems: list[str]) -> LlamaArgs | None:
    """The export's Llama-family config, checked against the target (`check_against_target`); None, with the
    violation listed, when it is not one."""
    a = llama_args(cfg, problems, "the export's")
    if a is not None:
        check_against_target(a, cfg, tcfg, problems)
    return a


def check_eagle_draft_config(cfg: dict[str, Any], arch: str, what: str, problems: list[str]) -> None:
    """What every EAGLE draft config shares: a one-layer Llama, untied, SiLU, no q/k norms (§9)."""
    if cfg.get("architectures") != [arch]:
        problems.append(f"architectures must be [{arch!r}], got {cfg.get('architectures')}")
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type must be 'llama' ({what} drafts are Llama-architecture), got {cfg.get('model_type')!r}")
    if cfg.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers must be 1 (one {what} layer), got {cfg.get('num_hidden_layers')}")
    if cfg.get("tie_word_embeddings") is not False:
        problems.append(f"tie_word_embeddings must be false (§1.7), got {cfg.get('tie_word_embeddings')!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
    if cfg.get("qk_norm") or cfg.get("model_type") == "qwen3":
        problems.append(f"q/k norms are not part of the Llama {what} layer")
    if "target_hidden_size" in cfg and cfg["target_hidden_size"] in (None, cfg.get("hidden_size")):
        problems.append("target_hidden_size must be omitted unless it differs from hidden_size (§10.7)")
