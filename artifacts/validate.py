"""Structural validators for exported heads — docs/reference/export_formats.md §11 step 1.

Engines are poor validators: SGLang skips unknown names, vLLM silently drops an EAGLE-1 `fc.bias` and
leaves missing tensors at random init (§10, §14). So every export directory is checked here, without
running an engine, against the key set, shapes, dtypes and config rules of its format:

- `native`         spechead's own checkpoint (artifacts/checkpoint.py);
- `eagle1-vllm`    EAGLE-1 for vLLM `method="eagle"` (§3.1, §9.1): arch `LlamaForCausalLM`, no `fc.bias`;
- `eagle1-sglang`  EAGLE-1 for SGLang `--speculative-algorithm EAGLE` (§4.1, §9.2): arch
                   `LlamaForCausalLMEagle`, `fc.bias` shipped;
- `mtp-stitched`   DeepSeek-style MTP layers `model.layers.{N+k}.*` in a copy of the target (§8, §9.5);
- `mtp-standalone` SGLang's standalone NextN layout (`model.layers.0.*`, `num_hidden_layers: 1`, §4.3);
- `eagle3`         EAGLE-3 for vLLM `method="eagle3"` and SGLang `EAGLE3` (§3.2, §4.2, §9.3): arch
                   `LlamaForCausalLMEagle3`, `midlayer.*`, `d2t` when the draft vocabulary is smaller,
                   aux ids top-level and in `eagle_config`, never starting at 1;
- `mtp-vllm`       the `mtp` head for spechead's vLLM plugin (inference_eval/vllm_plugin.py, `method="eagle3"`):
                   arch `Eagle3SpecheadMTPForCausalLM`, the head's own names, the single aux id L;
- `draft-hf`       the `draft_lm` head as a plain HF checkpoint of the target's class (`LlamaForCausalLM` for a
                   Llama target; heads/draft_lm.py, artifacts/draft_hf.py), a separate draft model;
- `medusa-vllm`    vLLM's `MedusaModel` (§3.4, §9.6): `blocks.{h}.layers.{l}.*`, `medusa_fc_bias`
                   matching the biases, the target's lm_head as `lm_heads.0.weight`.

Every violation is collected, then one error lists them all. The target, when given, is read from its
`config.json` and safetensors directly (artifacts/ imports nothing from data/ or train/).

CLI: `python -m artifacts.validate <dir> --format <fmt> [--target <target_dir>]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from artifacts.checkpoint import FORMAT_VERSION
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import TiedTarget
from heads.layers import LlamaArgs
from heads.registry import HEAD_TYPES, build_head
from inference_eval.families import args_from_hf_config

FORMATS = ("native", "eagle1-vllm", "eagle1-sglang", "mtp-stitched", "mtp-standalone", "mtp-vllm", "eagle3",
           "medusa-vllm", "draft-hf")
MTP_VLLM_ARCH = "Eagle3SpecheadMTPForCausalLM"  # = inference_eval/vllm_plugin.py MTP_ARCH (tests/test_export.py)
EAGLE1_ARCH = {"eagle1-vllm": "LlamaForCausalLM", "eagle1-sglang": "LlamaForCausalLMEagle"}
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
class ExportValidationError(ValueError):
    """One error that lists every violation found in an export directory."""

    def __init__(self, path: Path, fmt: str, violations: list[str]) -> None:
        self.violations = violations
        lines = "\n".join(f"  - {v}" for v in violations)
        super().__init__(f"{path} is not a valid {fmt!r} export ({len(violations)} violation(s)):\n{lines}")


# ---- reading HF-style directories ----------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def target_embed_and_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's E and W_lm exactly as stored (dtype included); W_lm = E for tied embeddings."""
    cfg = read_json(target_dir / "config.json")
    infos = scan_tensors(target_dir)
    embed = load_tensor(infos["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in infos:
        return embed, embed
    return embed, load_tensor(infos["lm_head.weight"], "lm_head.weight")


# ---- expected tensors ------------------------------------------------------------------------------
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


def eagle1_shapes(a: LlamaArgs, bias: bool) -> dict[str, tuple[int, ...]]:
    """EAGLE-1 keys (§3.1): fc, then layer 0 without input_layernorm. No embed_tokens, no lm_head."""
    h = a.hidden_size
    shapes = {"fc.weight": (h, 2 * h)} | ({"fc.bias": (h,)} if bias else {})
    return shapes | {f"layers.0.{k}": s for k, s in llama_layer_shapes(a, input_norm=False).items()}


MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # frozen target copies (§8)


def mtp_layer_shapes(a: LlamaArgs, layer_id: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3 MTP module keys (§8) with a Llama decoder layer, without the frozen copies."""
    h = a.hidden_size
    own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}
    return {f"model.layers.{layer_id}.{k}": s for k, s in (own | llama_layer_shapes(a)).items()}


# ---- the checks ------------------------------------------------------------------------------------
def validate_export(path: str | Path, fmt: str, target_dir: str | Path | None = None) -> list[str]:
    """Every violation of format `fmt` found in the export directory `path` (empty list: valid)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(FORMATS)}")
    if not (path / "config.json").exists():
        return [f"no config.json in {path}"]
    problems: list[str] = []
    cfg = read_json(path / "config.json")
    infos = scan_tensors(path, problems)
    target = Path(target_dir) if target_dir is not None else None
    tcfg = read_json(target / "config.json") if target is not None else None
    if fmt == "native":
        _check_native(cfg, infos, tcfg, problems)
    elif fmt.startswith("eagle1"):
        _check_eagle1(fmt, cfg, infos, target, tcfg, problems)
    elif fmt == "eagle3":
        _check_eagle3(cfg, infos, target, tcfg, problems)
    elif fmt == "medusa-vllm":
        _check_medusa(cfg, infos, target, tcfg, problems)
    elif fmt == "mtp-vllm":
        _check_mtp_vllm(cfg, infos, target, tcfg, problems)
    elif fmt == "draft-hf":  # the draft_lm head as a plain HF checkpoint (heads/draft_lm.py)
        problems.extend(validate_draft_hf(cfg, path, target, tcfg))
    else:
        _check_mtp(fmt, cfg, infos, target, tcfg, problems)
    return problems


def check_export(path: str | Path, fmt: str, target_dir: str | Path | None = None) -> None:
    """Raise ExportValidationError listing every violation, if there is any."""
    problems = validate_export(path, fmt, target_dir)
    if problems:
        raise ExportValidationError(Path(path), fmt, problems)


def _check_keys(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], problems: list[str],
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


def _check_uniform_dtype(infos: dict[str, TensorInfo], keys: list[str], declared: str | None,
                         problems: list[str]) -> None:
    dtypes = {infos[k].dtype for k in keys if k in infos}
    if len(dtypes) > 1:
        problems.append(f"head tensors mix dtypes {sorted(dtypes)}: one dtype expected")
    elif declared is not None and dtypes and dtypes != {declared}:
        problems.append(f"config says dtype {declared!r} but the tensors are {dtypes.pop()!r}")
    for k in keys:
        if k in infos and not infos[k].dtype.startswith(("float", "bfloat")):
            problems.append(f"tensor {k!r} has non-floating dtype {infos[k].dtype}")


def _check_finite(infos: dict[str, TensorInfo], keys: list[str], problems: list[str]) -> None:
    for k in keys:
        if k in infos and not torch.isfinite(load_tensor(infos[k], k).float()).all():
            problems.append(f"tensor {k!r} holds NaN or Inf values")


def _args(cfg: dict[str, Any], problems: list[str], what: str) -> LlamaArgs | None:
    try:
        return LlamaArgs.from_hf_config(cfg)
    except (KeyError, ValueError, TypeError) as e:
        problems.append(f"{what} config.json is not a Llama-family config: {e!r}")
        return None


def _check_positions(cfg: dict[str, Any], tcfg: dict[str, Any] | None, problems: list[str]) -> None:
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


def _check_same_as_target(name: str, info: TensorInfo, reference: torch.Tensor, problems: list[str]) -> None:
    got = load_tensor(info, name)
    if got.dtype != reference.dtype or got.shape != reference.shape:
        diff = f"{got.dtype} {list(got.shape)} vs the target's {reference.dtype} {list(reference.shape)}"
    elif not torch.equal(got, reference):
        diff = f"max |difference| {float((got.float() - reference.float()).abs().max()):.3g}"
    else:
        return
    problems.append(f"tensor {name!r} is not bit-identical to the target's ({diff}); "
                    "a stale or random copy destroys acceptance (§1.4)")


def _check_native(cfg: dict[str, Any], infos: dict[str, TensorInfo], tcfg: dict[str, Any] | None,
                  problems: list[str]) -> None:
    for key in ("spechead_format", "head", "target_args"):
        if key not in cfg:
            problems.append(f"config.json lacks {key!r}")
    if problems:
        return
    if cfg["spechead_format"] != FORMAT_VERSION:
        problems.append(f"spechead_format {cfg['spechead_format']} is not {FORMAT_VERSION}")
    if cfg["head"].get("type") not in HEAD_TYPES:
        problems.append(f"head type {cfg['head'].get('type')!r} is not one of {sorted(HEAD_TYPES)}")
        return
    args = LlamaArgs(**cfg["target_args"])
    with torch.device("meta"):  # shapes only: build the head without allocating it
        empty = torch.empty(0)
        head = build_head(cfg["head"], args, TiedTarget(empty, empty, empty, args.rms_norm_eps))
    state = head.state_dict()
    expected = {k: tuple(v.shape) for k, v in state.items()}
    _check_keys(infos, expected, problems)
    floats = [k for k, v in state.items() if v.is_floating_point()]  # not eagle3's d2t / t2d maps
    for k in set(state) - set(floats):
        want = str(state[k].dtype).removeprefix("torch.")
        if k in infos and infos[k].dtype != want:
            problems.append(f"tensor {k!r} is {infos[k].dtype}, expected {want}")
    _check_uniform_dtype(infos, floats, None, problems)
    _check_finite(infos, floats, problems)
    if tcfg is not None:
        ta = args_from_hf_config(tcfg).layer_args()  # a head's layer is a Llama layer sized from any family's target
        for field in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(args, field) != getattr(ta, field):
                problems.append(f"head was built for {field}={getattr(args, field)}, the target has {getattr(ta, field)}")


def _check_shipped_embedding(infos: dict[str, TensorInfo], target: Path | None, problems: list[str]) -> None:
    """A shipped `embed_tokens.weight` must be the target's, bit for bit (§1.4)."""
    if target is None:
        problems.append("embed_tokens.weight is shipped: pass --target to check it equals the target's (§1.4)")
    else:
        _check_same_as_target("embed_tokens.weight", infos["embed_tokens.weight"],
                              target_embed_and_head(target)[0], problems)


def _check_own_tensors(infos: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]], cfg: dict[str, Any],
                       problems: list[str]) -> None:
    own = [k for k in expected if k in infos]
    _check_uniform_dtype(infos, own, cfg.get("torch_dtype") or cfg.get("dtype"), problems)
    _check_finite(infos, own, problems)


def _check_against_target(a: LlamaArgs, cfg: dict[str, Any], tcfg: dict[str, Any] | None,
                          problems: list[str]) -> None:
    """A draft sized like the target (hidden, vocab), with the target's RoPE and positions."""
    if tcfg is not None:
        ta = LlamaArgs.from_hf_config(tcfg)
        for field in ("hidden_size", "vocab_size"):
            if getattr(a, field) != getattr(ta, field):
                problems.append(f"{field} {getattr(a, field)} differs from the target's {getattr(ta, field)}")
    _check_positions(cfg, tcfg, problems)


def _check_eagle_draft_config(cfg: dict[str, Any], arch: str, what: str, problems: list[str]) -> None:
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


def _check_eagle1(fmt: str, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                  tcfg: dict[str, Any] | None, problems: list[str]) -> None:
    vllm = fmt == "eagle1-vllm"
    _check_eagle_draft_config(cfg, EAGLE1_ARCH[fmt], "EAGLE-1", problems)
    if "bias" in cfg and cfg["bias"] is not (not vllm):
        problems.append(f"config 'bias' is {cfg['bias']!r} but the {fmt} variant {'has no' if vllm else 'has a'} fc.bias")
    a = _args(cfg, problems, "the export's")
    if a is None:
        return
    _check_against_target(a, cfg, tcfg, problems)
    expected = eagle1_shapes(a, bias=not vllm)
    if "layers.0.input_layernorm.weight" in infos:
        problems.append("layers.0.input_layernorm.weight is present: EAGLE-1's layer 0 has no input norm "
                        "(the engines replace it by Identity and reject the key)")
    if vllm and "fc.bias" in infos:
        b = load_tensor(infos["fc.bias"], "fc.bias")
        if bool(b.ne(0).any()):
            problems.append(f"fc.bias is present and non-zero (max |b| = {float(b.abs().max()):.3g}): vLLM's EAGLE-1 "
                            "has no fc.bias and silently drops it (§14), so the served head computes a different function")
        else:
            problems.append("fc.bias is present (all zeros): vLLM's EAGLE-1 has no fc.bias parameter "
                            "(a KeyError in the loader of §3.1, dropped by vLLM 0.32, §14): omit the key")
    _check_keys(infos, expected, problems, eagle=True,
                optional=("embed_tokens.weight", "fc.bias", "layers.0.input_layernorm.weight"))  # checked here
    if "embed_tokens.weight" in infos:
        if vllm:
            problems.append("embed_tokens.weight must be omitted for vLLM EAGLE-1 (its loader skips the key but "
                            "flags an own embedding, §2.1)")
        else:
            _check_shipped_embedding(infos, target, problems)
    _check_own_tensors(infos, expected, cfg, problems)


def _check_mtp(fmt: str, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
               tcfg: dict[str, Any] | None, problems: list[str]) -> None:
    stitched = fmt == "mtp-stitched"
    n = cfg.get("num_nextn_predict_layers")
    if not isinstance(n, int) or n < 1:
        problems.append(f"num_nextn_predict_layers must be a positive integer, got {n!r}")
        return
    if not stitched:
        if cfg.get("num_hidden_layers") != 1:
            problems.append(f"num_hidden_layers must be 1 in a standalone NextN dir, got {cfg.get('num_hidden_layers')}")
        if n != 1:
            problems.append(f"num_nextn_predict_layers must be 1 in a standalone NextN dir (SGLang requires it), got {n}")
        if not all(str(x).endswith("NextN") for x in cfg.get("architectures") or [None]):
            problems.append(f"architectures must name a NextN class, got {cfg.get('architectures')}")
    a = _args(cfg, problems, "the export's")
    if a is None:
        return
    if tcfg is not None:
        changed = {"num_nextn_predict_layers"} | (set() if stitched else {"num_hidden_layers", "architectures"})
        for key in sorted((set(cfg) | set(tcfg)) - changed - {"max_position_embeddings"}):
            if cfg.get(key) != tcfg.get(key):
                problems.append(f"config {key!r} is {cfg.get(key)!r}, the target's is {tcfg.get(key)!r} "
                                "(an MTP dir keeps the target's config)")
    _check_positions(cfg, tcfg, problems)
    base = cfg["num_hidden_layers"] if stitched else 0
    expected: dict[str, tuple[int, ...]] = {}
    copies = {}
    for k in range(n):
        expected |= mtp_layer_shapes(a, base + k)
        copies |= {f"model.layers.{base + k}.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                   f"model.layers.{base + k}.shared_head.head.weight": (a.vocab_size, a.hidden_size)}
    own = list(expected)
    if stitched:
        expected |= copies  # vLLM computes logits with shared_head.head: required (§3.3)
        if target is not None:
            tinfos = scan_tensors(target)
            for key in sorted(set(tinfos) - set(infos)):
                problems.append(f"missing target tensor {key!r}")
            for key in sorted(set(tinfos) & set(infos)):
                if (tinfos[key].shape, tinfos[key].dtype) != (infos[key].shape, infos[key].dtype):
                    problems.append(f"target tensor {key!r} changed: {infos[key].dtype} {list(infos[key].shape)} "
                                    f"vs the target's {tinfos[key].dtype} {list(tinfos[key].shape)}")
            expected |= {k: v.shape for k, v in tinfos.items()}
        else:  # without the target, accept the main model's tensors of the dir itself
            mtp_prefixes = tuple(f"model.layers.{base + k}." for k in range(n))
            expected |= {k: v.shape for k, v in infos.items() if not k.startswith(mtp_prefixes)}
    _check_keys(infos, expected, problems, optional=() if stitched else tuple(copies))
    present_copies = [k for k in copies if k in infos]
    if present_copies:
        if target is not None:
            embed, lm_head = target_embed_and_head(target)
        elif "model.embed_tokens.weight" in infos:
            embed = load_tensor(infos["model.embed_tokens.weight"], "model.embed_tokens.weight")
            lm_key = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") or "lm_head.weight" not in infos \
                else "lm_head.weight"
            lm_head = load_tensor(infos[lm_key], lm_key)
        else:
            embed = lm_head = None
            problems.append(f"{present_copies} shipped without the target to compare with: pass --target (§1.4)")
        for key in present_copies:
            if embed is not None and infos[key].shape == copies[key]:
                _check_same_as_target(key, infos[key], embed if key.endswith("embed_tokens.weight") else lm_head,
                                      problems)
    _check_uniform_dtype(infos, own, None, problems)
    _check_finite(infos, own, problems)


def _check_mtp_vllm(cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                    tcfg: dict[str, Any] | None, problems: list[str]) -> None:
    """The plugin's contract: its architecture, a Llama config with `num_hidden_layers` = the modules
    (≥ 1), the aux ids ending in L = the target's layer count (top-level and in eagle_config,
    use_aux_hidden_state true: vLLM then passes the pre-norm H) after the head's own aux layers, if any, in
    ascending order, `draft_vocab_size` = `vocab_size`, no EAGLE-3.1 flags, and exactly the head's tensors
    `layers.{d}.*` (and `aux_norm.{i}` / `aux_fc` with aux layers; no embed_tokens / lm_head: shared)."""
    if cfg.get("architectures") != [MTP_VLLM_ARCH]:
        problems.append(f"architectures must be [{MTP_VLLM_ARCH!r}] (the class spechead's vLLM plugin registers), "
                        f"got {cfg.get('architectures')}")
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type must be 'llama', got {cfg.get('model_type')!r}")
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        problems.append(f"num_hidden_layers (the MTP modules) must be an integer ≥ 1, got {n!r}")
        return
    if cfg.get("tie_word_embeddings") is not False:
        problems.append(f"tie_word_embeddings must be false, got {cfg.get('tie_word_embeddings')!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
    if cfg.get("qk_norm") or cfg.get("model_type") == "qwen3" or cfg.get("bias"):
        problems.append("the plugin's layer is Llama's: no q/k norms, no `bias` flag")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag) or (cfg.get("eagle_config") or {}).get(flag):
            problems.append(f"{flag} is set: the plugin has no such step")
    if cfg.get("draft_vocab_size") != cfg.get("vocab_size"):
        problems.append(f"draft_vocab_size must equal vocab_size (the head drafts over the target's vocabulary), "
                        f"got {cfg.get('draft_vocab_size')!r}")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    econf = cfg.get("eagle_config") or {}
    if econf.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state must be true (vLLM then passes the aux state H, not N_f(H))")
    num_aux = 0
    if (top != econf.get("eagle_aux_hidden_state_layer_ids") or not isinstance(top, list) or not top
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in top)):
        problems.append(f"eagle_aux_hidden_state_layer_ids must be a list of ids, top-level and in eagle_config alike, "
                        f"got {top!r} / {econf.get('eagle_aux_hidden_state_layer_ids')!r}")
    else:
        num_aux = len(top) - 1
        if top != sorted(set(top)) or top[0] < 1:
            problems.append(f"eagle_aux_hidden_state_layer_ids must ascend from ≥ 1 without repeats "
                            f"(vLLM passes the states in ascending id order), got {top}")
        if tcfg is not None and top[-1] != tcfg.get("num_hidden_layers"):
            problems.append(f"the last aux id must be the target's layer count {tcfg.get('num_hidden_layers')} (its last "
                            f"pre-norm state H, what hnorm reads; the others are the head's aux_layers), got {top}")
        if cfg.get("num_aux_hidden_states", len(top)) != len(top):
            problems.append(f"num_aux_hidden_states must be {len(top)} (the aux ids), got "
                            f"{cfg.get('num_aux_hidden_states')!r}")
    a = _args(cfg, problems, "the export's")
    if a is None:
        return
    _check_against_target(a, cfg, tcfg, problems)
    h = a.hidden_size
    own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}
    expected = {f"layers.{d}.{k}": s for d in range(n) for k, s in own.items()}
    expected |= {f"layers.{d}.layer.{k}": s for d in range(n) for k, s in llama_layer_shapes(a).items()}
    if num_aux:  # the head's fusion of its aux layers into H (heads/mtp.py)
        expected |= {f"aux_norm.{i}.weight": (h,) for i in range(num_aux)} | {"aux_fc.weight": (h, num_aux * h)}
    _check_keys(infos, expected, problems)
    _check_own_tensors(infos, expected, cfg, problems)


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


def _check_eagle3(cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                  tcfg: dict[str, Any] | None, problems: list[str]) -> None:
    _check_eagle_draft_config(cfg, EAGLE3_ARCH, "EAGLE-3", problems)
    norms = {}
    for flag in ("norm_before_residual", "norm_output"):
        norms[flag] = cfg.get(flag, "<missing>")
        if not isinstance(norms[flag], bool):  # the engines' defaults differ when the key is missing (§10.5)
            problems.append(f"{flag} must be written as true or false (the defaults differ between engines, §10.5), "
                            f"got {norms[flag]!r}")
    nested_fc = (cfg.get("eagle_config") or {}).get("norm_before_fc", cfg.get("norm_before_fc", False))
    if bool(cfg.get("norm_before_fc", False)) != bool(nested_fc):
        problems.append(f"norm_before_fc differs: top-level {cfg.get('norm_before_fc')!r}, eagle_config {nested_fc!r}")
    if cfg.get("fc_norm") or (cfg.get("eagle_config") or {}).get("fc_norm"):
        problems.append("fc_norm is set: per-chunk fc norms are not what spechead's eagle3 head computes")
    vd = cfg.get("draft_vocab_size")
    if not isinstance(vd, int) or isinstance(vd, bool) or vd < 1:
        problems.append(f"draft_vocab_size must be a positive integer (SGLang reads the key; null means 'use the "
                        f"target's head', §10.6), got {vd!r}")
        vd = None
    ids = _eagle3_aux_ids(cfg, tcfg, problems)
    a = _args(cfg, problems, "the export's")
    if a is None or ids is None or vd is None:
        return
    _check_against_target(a, cfg, tcfg, problems)
    if vd > a.vocab_size:
        problems.append(f"draft_vocab_size {vd} exceeds vocab_size {a.vocab_size}")
    expected = eagle3_shapes(a, len(ids), vd, bool(cfg.get("norm_before_fc", False)))
    _check_keys(infos, expected, problems, eagle=True, optional=("d2t", "t2d", "embed_tokens.weight"))
    _check_vocab_maps(infos, vd, a.vocab_size, problems)
    if "embed_tokens.weight" in infos:
        _check_shipped_embedding(infos, target, problems)
    _check_own_tensors(infos, expected, cfg, problems)


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


def _check_medusa(cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
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
        problems.append("block biases are shipped but medusa_fc_bias is not true: vLLM drops them silently (§10.1)")
    if bias:
        expected |= {f"blocks.{j}.layers.{l}.bias": (h,) for j in range(heads) for l in range(layers)}
    original = cfg.get("original_lm_head", False)
    lm_keys = ["lm_heads.0.weight"] if original else [f"lm_heads.{j}.weight" for j in range(heads)]
    expected |= {k: (v, h) for k in lm_keys}
    _check_keys(infos, expected, problems, optional=() if bias else tuple(k for k in infos if k.endswith(".bias")))
    if original and target is not None and "lm_heads.0.weight" in infos:
        _check_same_as_target("lm_heads.0.weight", infos["lm_heads.0.weight"], target_embed_and_head(target)[1], problems)
    own = [k for k in expected if k in infos and not k.startswith("lm_heads.")]
    _check_uniform_dtype(infos, own, cfg.get("torch_dtype") or cfg.get("dtype"), problems)
    _check_finite(infos, own, problems)


# ---- CLI -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artifacts.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the export directory")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--target", type=Path, default=None, help="the target's HF checkpoint directory")
    ns = p.parse_args(argv)
    problems = validate_export(ns.dir, ns.format, ns.target)
    if problems:
        print(ExportValidationError(ns.dir, ns.format, problems), file=sys.stderr)
        return 1
    checked = "" if ns.target else " (without --target: copies and RoPE not compared with the target)"
    print(f"OK: {ns.dir} is a valid {ns.format} export{checked}")
    return 0


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
    _check_keys(infos, expected, problems)
    _check_finite(infos, [k for k in expected if k.startswith("model.layers.") or k == "model.norm.weight"], problems)
    if tcfg is not None:
        ta = LlamaArgs.from_hf_config(tcfg)
        for field in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "tie_word_embeddings"):
            if getattr(a, field) != getattr(ta, field):
                problems.append(f"{field} {getattr(a, field)} differs from the target's {getattr(ta, field)}")
        _check_positions(cfg, tcfg, problems)
    if target is not None and not problems:
        embed, lm_head = target_embed_and_head(target)
        for name, ref in (("model.embed_tokens.weight", embed), ("lm_head.weight", lm_head)):
            if name in infos:
                got = load_tensor(infos[name], name)
                if not torch.equal(got, ref.to(got.dtype)):
                    problems.append(f"tensor {name!r} is not the target's (cast to {got.dtype}): a stale or "
                                    "random copy destroys acceptance")
    return problems


if __name__ == "__main__":
    sys.exit(main())
