"""Export of a trained head: the native checkpoint and the engine formats of
docs/reference/export_formats.md (docs/design.md §8).

| format           | head   | layout                                                                      |
| ---------------- | ------ | --------------------------------------------------------------------------- |
| `native`         | any    | config.json + model.safetensors, frozen target weights excluded              |
| `eagle1-vllm`    | eagle1 | §9.1: arch `LlamaForCausalLM`, `fc` without bias, no embed_tokens            |
| `eagle1-sglang`  | eagle1 | §9.2: arch `LlamaForCausalLMEagle`, `fc.bias` shipped (zeros if none)        |
| `mtp-stitched`   | mtp    | §9.5: copy of the target + `model.layers.{N+k}.*`, `num_nextn_predict_layers` |
| `mtp-standalone` | mtp    | §4.3: SGLang's NextN layout, `model.layers.0.*`, `num_hidden_layers: 1`       |
| `eagle3`         | eagle3 | §9.3: one artifact for vLLM and SGLang, `LlamaForCausalLMEagle3`, `midlayer.*`, `d2t` |
| `medusa-vllm`    | medusa | §9.6: `MedusaModel`, `blocks.{h}.layers.{l}.*`, the target's lm_head as `lm_heads.0` |
| `draft-hf`       | draft_lm | a plain HF checkpoint of the target's class (`LlamaForCausalLM`): the draft LM's layers + the target's embedding; a vLLM / SGLang draft model |
| `mtp-vllm`       | mtp    | spechead's vLLM plugin (inference_eval/vllm_plugin.py) via `method: "eagle3"`: arch `Eagle3SpecheadMTPForCausalLM`, the head's own names, aux ids [head.aux_layers…, L] |

Every export is validated (artifacts/validate.py), read back into a head by `load_export` and compared with
the live head on fixed inputs (`probe_logits`, bit for bit) before it is reported. Each directory is
written by `artifacts.checkpoint.atomic_artifact_dir` (marker `.spechead-artifact.json`, kind `export:<format>`,
with the head's target fingerprint); an existing directory that is not an export of the same format is
never replaced. docs/export.md says which engine loads what.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.checkpoint import (
    NATIVE_KIND,
    artifact_info,
    atomic_artifact_dir,
    check_replaceable,
    check_target_fingerprint,
    copy_target_files,
    export_kind,
    load_native,
    save_native,
)
from artifacts.draft_hf import EXPORT_FORMAT as DRAFT_HF
from artifacts.draft_hf import read_draft_hf, write_draft_hf
from artifacts.speculators import SPECULATORS_EAGLE3, is_speculators_dir, read_speculators_eagle3
from artifacts.validate import (
    EAGLE1_ARCH,
    EAGLE3_ARCH,
    MTP_VLLM_ARCH,
    check_export,
    read_json,
    target_embed_and_head,
)
from core.files import recover_interrupted_save
from core.safetensors_io import INDEX_FILE, load_safetensors_dir, load_tensor, scan_tensors
from heads.base import TiedTarget
from heads.draft_lm import DraftLMHead
from heads.eagle1 import Eagle1Config, Eagle1Head
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.layers import LLAMA_FAMILY, LlamaArgs, TiedConventions
from heads.medusa import MedusaConfig, MedusaHead
from heads.mtp import MTPConfig, MTPHead

log = logging.getLogger(__name__)
Head = MTPHead | Eagle1Head | Eagle3Head | MedusaHead
ENGINE_FORMATS = {"mtp": ("mtp-stitched", "mtp-standalone", "mtp-vllm"), "eagle1": ("eagle1-vllm", "eagle1-sglang"),
                  "eagle3": ("eagle3",), "medusa": ("medusa-vllm",), "draft_lm": (DRAFT_HF,)}


@torch.no_grad()
def probe_logits(head: Head, seed: int = 0, length: int = 8) -> torch.Tensor:
    """Head logits (and, for a sub-vocabulary, the target ids of its rows) on a fixed random
    (state, token) sequence at every depth the head defines up to 3 — a fingerprint of the function."""
    if isinstance(head, DraftLMHead):  # a draft LM reads tokens only: its logits on a fixed token sequence
        return head.probe(seed, length)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, head.args.hidden_size, generator=gen).to(head.dtype)
    tokens = torch.randint(0, head.args.vocab_size, (1, length), generator=gen)
    if head.capture_layers:  # the state the head reads from H and its aux layers (EAGLE-3's fc, mtp's fusion)
        aux = torch.randn(1, length, len(head.capture_layers) * head.args.hidden_size, generator=gen)
        hidden = head.target_input(hidden, aux.to(head.dtype))
    positions = torch.arange(length).expand(1, length)
    depths = min(head.max_depth or 3, 3)
    outs, state = [], hidden
    for d in range(1, depths + 1):
        if head.chain:
            state = head(state, tokens, positions + d - 1, depth=d)
        else:
            state = head(hidden, depth=d)
        outs.append(head.logits(state, depth=d).float())
    ids = head.draft_ids
    if ids is not None:
        outs.append(ids.float()[None, None].expand(1, 1, -1))
    return torch.cat([o.reshape(-1) for o in outs])


def export_native(head: Head, out_dir: str | Path, fingerprint: dict[str, Any] | None = None,
                  expected_fingerprint: dict[str, Any] | None = None) -> Path:
    """Write the native checkpoint and prove the round trip: the reloaded head's logits must equal
    the live head's bit for bit (and its fingerprint must agree with `expected_fingerprint`, if given)."""
    out = save_native(head, out_dir, fingerprint)
    reloaded = load_native(out, head.tied, head.args, expected_fingerprint)
    if not torch.equal(probe_logits(head), probe_logits(reloaded)):
        raise RuntimeError(f"{out}: reloaded head gives different logits than the exported one")
    return out


# Formats no engine serves for a target of the families the engine implements (Llama, Mistral, Qwen2/3):
# vLLM's `mtp` method and SGLang's NEXTN need a DeepSeek/MiMo-style target class, and SGLang has no Llama
# NextN layer (docs/export.md). They are written on request (`export.formats`) only.
UNSERVED_FORMATS = ("mtp-stitched", "mtp-standalone")
# the target families whose heads' engine formats the validators and the real-vLLM tests cover


def engine_format_blocker(head: Head) -> str | None:
    """Why no engine format can hold this head, or None: the engines' draft classes (and `draft-hf`'s
    target class with Llama layers) apply Llama's conventions to a Llama-family target."""
    conventions = getattr(head.tied, "conventions", TiedConventions())
    if conventions != TiedConventions():
        return (f"the head follows its target's conventions {conventions} (embedding scale, (1 + w) final norm, "
                "logit cap), which the engines' Llama draft classes do not apply")
    if head.args.model_type not in LLAMA_FAMILY:  # DeepSeek-V2 (MLA, YaRN): no engine format checked against it
        return f"its target is a {head.args.model_type!r} model, not one of the Llama family {LLAMA_FAMILY}"
    return None


def servable_formats(head: Head) -> list[str]:
    """The engine formats an engine serves for this head on its target, without loss: eagle1-vllm only when
    fc has no non-zero bias, mtp-vllm on a target without q/k norms. None for a
    target whose tied tensors follow other conventions than Llama's (Gemma 3: E·√H, (1 + w) final norm):
    the engines' draft classes apply Llama's, and no export of such a head is validated yet."""
    if engine_format_blocker(head) is not None:
        return []
    formats = []
    for fmt in ENGINE_FORMATS.get(head.kind, ()):
        if fmt in UNSERVED_FORMATS:
            continue
        if fmt == "eagle1-vllm" and _nonzero_bias(head):
            continue
        if fmt == "mtp-vllm" and head.args.qk_norm:
            continue
        formats.append(fmt)
    return formats


# the speculative `method` vLLM serves each format with (docs/export.md's matrix; always pass it: vLLM guesses
# from the path otherwise). mtp-vllm goes through vLLM's eagle3 method with spechead's plugin; medusa-vllm
# needs vLLM ≤ 0.32; draft-hf is vLLM's draft_model method (tests/test_vllm_serving.py serves it)
VLLM_METHODS = {"mtp-vllm": "eagle3", "eagle1-vllm": "eagle", "eagle3": "eagle3", "medusa-vllm": "medusa",
                DRAFT_HF: "draft_model", SPECULATORS_EAGLE3: "eagle3"}


def vllm_format(head: Head) -> str:
    """The format vLLM serves this head in (the first of `servable_formats` with a vLLM method); a ValueError
    that says why when there is none."""
    formats = [f for f in servable_formats(head) if f in VLLM_METHODS]
    if not formats:
        why = engine_format_blocker(head) or (f"its {', '.join(ENGINE_FORMATS.get(head.kind, ())) or 'formats'} "
                                              "are not served by vLLM for this head")
        raise ValueError(f"a {head.kind} head cannot be served by vLLM: {why}")
    return formats[0]


def check_servable(fmt: str, version: str, where: str) -> None:
    """Medusa on vLLM ≥ 0.33 is refused: that release removed it."""
    if VLLM_METHODS[fmt] == "medusa" and not version.startswith("0.32."):
        raise ValueError(f"{where}: a medusa head cannot be served by vLLM {version}: vLLM 0.33 removed "
                         "Medusa (its MedusaModel and model files); evaluate it with spechead's engine or on "
                         "vLLM 0.32")


def vllm_export(head: Head, out_root: Path, target_dir: Path, version: str, where: str,
                fingerprint: dict | None = None, expected_fingerprint: dict | None = None) -> tuple[Path, str]:
    """(directory, vLLM `method`): the head written under `out_root/<format>` in the format vLLM serves it in."""
    fmt = vllm_format(head)
    check_servable(fmt, version, where)
    out = Path(out_root) / fmt
    export_head(head, {fmt: out}, target_dir, fingerprint, expected_fingerprint=expected_fingerprint)
    return out, VLLM_METHODS[fmt]


def default_formats(head: Head) -> list[str]:
    """`export.formats: null`: `native` plus every format an engine serves for this head
    (`servable_formats`); the others only when asked for by name."""
    return ["native", *servable_formats(head)]


def export_head(head: Head, out_dirs: dict[str, str | Path], target_dir: str | Path,
                fingerprint: dict[str, Any] | None = None, *, expected_fingerprint: dict[str, Any] | None = None,
                source: str | Path | None = None) -> dict[str, Path]:
    """Write each format to its directory (`{format: dir}`), validate it against the target, read it back
    and compare logits with the live head. Returns `{format: dir}`.

    `fingerprint`: the head's stored target fingerprint (its checkpoint's), written into every export.
    `expected_fingerprint`: the configured target's (`data.store.target_fingerprint`); a head trained for
    another target or compute dtype is refused before anything is written (`source`, the checkpoint it came
    from, is named in the error). Every directory must be absent, empty or an export of the same format
    (`artifacts.checkpoint.check_replaceable`), checked for all of them before the first is written."""
    target_dir = Path(target_dir)
    for fmt in out_dirs:
        if fmt != "native" and fmt not in ENGINE_FORMATS.get(head.kind, ()):
            known = ", ".join(["native", *ENGINE_FORMATS.get(head.kind, ())])
            raise ValueError(f"format {fmt!r} does not apply to a {head.kind!r} head; it exports to: {known}")
        blocker = engine_format_blocker(head)
        if fmt != "native" and blocker is not None:
            raise ValueError(f"format {fmt!r} cannot hold this {head.kind} head: {blocker}; export it as native")
        if fmt in ("mtp-stitched", "mtp-standalone") and head.capture_layers:
            raise ValueError(f"format {fmt!r} cannot hold this mtp head: it reads target layers "
                             f"{list(head.capture_layers)} besides H (head.aux_layers), which the DeepSeek MTP layout "
                             "has no place for; export mtp-vllm (spechead's vLLM plugin) or native")
    check_target_fingerprint(fingerprint or {}, expected_fingerprint,
                             source if source is not None else f"the {head.kind} head to export")
    seen: dict[Path, str] = {}
    for fmt, out_dir in out_dirs.items():
        key = Path(out_dir).resolve()
        if key in seen:
            raise ValueError(f"{out_dir}: formats {seen[key]!r} and {fmt!r} would both be written there")
        seen[key] = fmt
        recover_interrupted_save(out_dir)
        check_replaceable(out_dir, _kind(fmt))
    written: dict[str, Path] = {}
    for n, (fmt, out_dir) in enumerate(out_dirs.items(), start=1):
        t0 = time.perf_counter()
        log.info("export %d/%d: %s → %s", n, len(out_dirs), fmt, out_dir)
        if fmt == "native":
            written[fmt] = export_native(head, out_dir, fingerprint, expected_fingerprint)
        else:
            with atomic_artifact_dir(out_dir, _kind(fmt), {"target_fingerprint": fingerprint or {}}) as tmp:
                WRITERS[fmt](head, tmp, target_dir)
            written[fmt] = Path(out_dir)
        check_export(written[fmt], fmt, target_dir)
        reloaded = load_export(written[fmt], fmt, head.tied, head.args, expected_fingerprint)
        if not torch.equal(probe_logits(head), probe_logits(reloaded)):
            raise RuntimeError(f"{written[fmt]}: the {fmt} export read back gives different logits than the live head")
        log.info("export %d/%d: %s written, validated and read back in %.1fs", n, len(out_dirs), fmt,
                 time.perf_counter() - t0)
    return written


def _kind(fmt: str) -> str:
    return NATIVE_KIND if fmt == "native" else export_kind(fmt)


# ---- EAGLE-1 ---------------------------------------------------------------------------------------
def _nonzero_bias(head: Head) -> bool:
    bias = getattr(getattr(head, "fc", None), "bias", None)
    return bias is not None and bool(bias.ne(0).any())


def eagle1_config(head: Eagle1Head, target_cfg: dict[str, Any], fmt: str) -> dict[str, Any]:
    """§9.1 / §9.2: a one-layer Llama config sized like the head, RoPE and positions equal to the target's."""
    a = head.args
    dtype = str(head.dtype).removeprefix("torch.")
    cfg = {
        "architectures": [EAGLE1_ARCH[fmt]],
        "model_type": "llama",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size,
        "max_position_embeddings": max(a.max_position_embeddings, target_cfg.get("max_position_embeddings", 0)),
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "attention_bias": a.attention_bias, "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,  # transformers < 5 reads the first, >= 5 the second
        "bias": fmt == "eagle1-sglang",  # EAGLE's own ea_model.py reads it (default true when missing)
    }
    if "rope_parameters" in target_cfg:  # transformers >= 5 configs keep theta/scaling here
        cfg["rope_parameters"] = target_cfg["rope_parameters"]
    return cfg


def write_eagle1(head: Eagle1Head, out: Path, target_dir: Path, fmt: str) -> None:
    if head.args.qk_norm:
        raise ValueError("EAGLE-1 export: the engines' Llama EAGLE-1 layer has no q/k norm (Qwen3 target)")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if fmt == "eagle1-vllm":
        if _nonzero_bias(head):
            b = head.fc.bias.detach()
            raise ValueError(f"eagle1-vllm export refused: the head has a trained non-zero fc.bias (max |b| = "
                             f"{float(b.abs().max()):.3g}). vLLM's EAGLE-1 has no fc.bias and silently drops it "
                             "(docs/reference/export_formats.md §14), so it would serve a different function. Train with "
                             "head.bias=false for vLLM, or export eagle1-sglang.")
        state.pop("fc.bias", None)
    elif "fc.bias" not in state:  # SGLang's fc always has a bias: ship zeros, or it stays random (§4.1)
        state["fc.bias"] = torch.zeros(head.args.hidden_size, dtype=head.dtype)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = eagle1_config(head, read_json(target_dir / "config.json"), fmt)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ---- DeepSeek-style MTP ----------------------------------------------------------------------------
def mtp_to_deepseek(name: str, base: int) -> str:
    """`layers.k.<own>` / `layers.k.layer.<llama>` → `model.layers.{base+k}.<own or llama name>` (§8)."""
    k, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    return f"model.layers.{base + int(k)}.{rest.removeprefix('layer.')}"


def deepseek_to_mtp(name: str, base: int, n: int) -> str | None:
    """Inverse of `mtp_to_deepseek` for the MTP layers; None for other tensors and the frozen copies."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or not base <= int(m.group(1)) < base + n:
        return None
    k, rest = int(m.group(1)) - base, m.group(2)
    if rest in ("embed_tokens.weight", "shared_head.head.weight"):
        return None
    own = rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    return f"layers.{k}.{rest if own else 'layer.' + rest}"


def write_mtp_stitched(head: MTPHead, out: Path, target_dir: Path) -> None:
    """§9.5: a copy of the target checkpoint plus `model.layers.{N+k}.*` in an extra shard
    (`model-mtp.safetensors`), with embed_tokens and shared_head.head copied bit for bit from the target,
    an index over all shards, and the target config with `num_nextn_predict_layers`."""
    tcfg = read_json(target_dir / "config.json")
    n_layers, n = tcfg["num_hidden_layers"], len(head.layers)
    copy_target_files(target_dir, out, skip_weights=False)
    tied = tcfg.get("tie_word_embeddings", False)
    frozen = load_safetensors_dir(target_dir, {"model.embed_tokens.weight", "lm_head.weight"})
    embed = frozen["model.embed_tokens.weight"]
    lm_head = embed if tied or "lm_head.weight" not in frozen else frozen["lm_head.weight"]
    state = {mtp_to_deepseek(k, n_layers): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    for k in range(n):
        state[f"model.layers.{n_layers + k}.embed_tokens.weight"] = embed.clone()
        state[f"model.layers.{n_layers + k}.shared_head.head.weight"] = lm_head.clone()
    save_file(state, out / "model-mtp.safetensors", metadata={"format": "pt"})
    weight_map = {name: info.file.name for name, info in scan_tensors(out).items()}
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps({**tcfg, "num_nextn_predict_layers": n}, indent=2))


def write_mtp_standalone(head: MTPHead, out: Path, target_dir: Path) -> None:
    """§4.3 (SGLang's export_deepseek_nextn.py applied to our head): target config with
    `num_hidden_layers: 1` and a `...NextN` architecture, keys `model.layers.0.*`, no frozen copies.
    No engine implements a Llama NextN class: see docs/export.md."""
    if len(head.layers) != 1:
        raise ValueError(f"mtp-standalone holds one NextN layer (SGLang requires num_nextn_predict_layers == 1); "
                         f"this head has {len(head.layers)} modules: export mtp-stitched instead")
    tcfg = read_json(target_dir / "config.json")
    copy_target_files(target_dir, out, skip_weights=True)
    state = {mtp_to_deepseek(k, 0): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    archs = [f"{a}NextN" for a in tcfg.get("architectures") or ["LlamaForCausalLM"]]
    cfg = {**tcfg, "architectures": archs, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def write_mtp_vllm(head: MTPHead, out: Path, target_dir: Path) -> None:
    """spechead's vLLM plugin (inference_eval/vllm_plugin.py, served with `method: "eagle3"`): a Llama
    config naming the plugin's architecture, `num_hidden_layers` = the number of MTP modules, the single
    aux id L = the target's layer count (vLLM then passes the target's last pre-norm state H) after the head's
    `aux_layers` if it has any (vLLM passes the states in ascending id order, H last; the plugin's
    `combine_hidden_states` fuses them into H' as the head does), and the head's own tensors under its own names
    (`layers.{d}.enorm.weight`, `layers.{d}.layer.self_attn.q_proj.weight`, `aux_fc.weight`, ...). No
    embed_tokens / lm_head: vLLM shares the target's."""
    n, a = len(head.layers), head.args
    if a.qk_norm:
        raise ValueError("mtp-vllm export: the plugin's decoder layer is Llama's (no q/k norm; a Qwen3 target)")
    tcfg = read_json(target_dir / "config.json")
    ids = [*head.capture_layers, int(tcfg["num_hidden_layers"])]
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    dtype = str(head.dtype).removeprefix("torch.")
    cfg = {
        "architectures": [MTP_VLLM_ARCH], "model_type": "llama",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "num_hidden_layers": n, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
        "vocab_size": a.vocab_size, "draft_vocab_size": a.vocab_size,
        "max_position_embeddings": max(a.max_position_embeddings, tcfg.get("max_position_embeddings", 0)),
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
        "attention_bias": a.attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype,
        "num_aux_hidden_states": len(ids),
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "spechead_head": {"type": "mtp", "num_modules": n, "aux_layers": list(head.capture_layers) or None},
    }
    if "rope_parameters" in tcfg:
        cfg["rope_parameters"] = tcfg["rope_parameters"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ---- EAGLE-3 ---------------------------------------------------------------------------------------
def eagle3_config(head: Eagle3Head, target_cfg: dict[str, Any]) -> dict[str, Any]:
    """§9.3: one config for vLLM and SGLang; aux ids top-level and in eagle_config, never starting at 1."""
    a, c = head.args, head.cfg
    dtype = str(head.dtype).removeprefix("torch.")
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


def write_eagle3(head: Eagle3Head, out: Path, target_dir: Path) -> None:
    ids = list(head.cfg.aux_layers)
    if ids[0] == 1:
        raise ValueError(f"eagle3 export refused: aux layer ids {ids} start at 1, which SGLang reads in its older "
                         "'output of layer' convention and shifts by one (docs/reference/export_formats.md §1.2, PR #25454): "
                         "train with aux_layers that start at 2 or later")
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if head.draft_ids is None:  # V_d = V: the engines need no mapping (§1.3)
        state.pop("d2t"), state.pop("t2d")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = eagle3_config(head, read_json(target_dir / "config.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ---- Medusa -----------------------------------------------------------------------------------------
def write_medusa(head: MedusaHead, out: Path, target_dir: Path) -> None:
    """§3.4 / §9.6: vLLM's MedusaModel. The head projects with the target's frozen lm_head, so it ships
    as `lm_heads.0.weight` (bit-identical) with `original_lm_head: true`."""
    c, a = head.cfg, head.args
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    lm_head = target_embed_and_head(target_dir)[1]
    state["lm_heads.0.weight"] = lm_head.clone()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    dtype = str(head.dtype).removeprefix("torch.")
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": a.hidden_size,
           "vocab_size": a.vocab_size, "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
           "medusa_fc_bias": c.bias, "original_lm_head": True, "truncated_vocab_size": None,
           "torch_dtype": dtype, "dtype": dtype}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


WRITERS = {
    "eagle1-vllm": lambda h, out, t: write_eagle1(h, out, t, "eagle1-vllm"),
    "eagle1-sglang": lambda h, out, t: write_eagle1(h, out, t, "eagle1-sglang"),
    "mtp-stitched": write_mtp_stitched,
    "mtp-standalone": write_mtp_standalone,
    "mtp-vllm": write_mtp_vllm,
    "eagle3": write_eagle3,
    "medusa-vllm": write_medusa,
    DRAFT_HF: write_draft_hf,
}


# ---- reading exports back ---------------------------------------------------------------------------
def detect_format(path: str | Path) -> str:
    """The format of a head directory, from its config.json (native or one of the engine formats)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json — not a head checkpoint or export")
    cfg = read_json(cfg_file)
    archs = cfg.get("architectures") or []
    if "spechead_format" in cfg:
        return "native"
    if is_speculators_dir(path):  # a peer's checkpoint (speculators 0.9): artifacts/speculators.py reads it
        return SPECULATORS_EAGLE3
    if (artifact_info(path) or {}).get("kind") == export_kind(DRAFT_HF):  # a plain HF model: only the marker tells
        return DRAFT_HF
    if archs == [MTP_VLLM_ARCH]:
        return "mtp-vllm"
    if cfg.get("model_type") == "medusa" or archs == ["MedusaModel"]:
        return "medusa-vllm"
    if archs == [EAGLE3_ARCH] or "eagle_aux_hidden_state_layer_ids" in cfg:
        return "eagle3"
    if archs == [EAGLE1_ARCH["eagle1-sglang"]]:
        return "eagle1-sglang"
    if cfg.get("num_nextn_predict_layers"):
        return "mtp-standalone" if any(a.endswith("NextN") for a in archs) else "mtp-stitched"
    if archs == [EAGLE1_ARCH["eagle1-vllm"]] and cfg.get("num_hidden_layers") == 1 and "fc.weight" in scan_tensors(path):
        return "eagle1-vllm"
    raise ValueError(f"{path}: cannot tell which head format this is (architectures {archs}); "
                     "pass a native spechead checkpoint or an export made by artifacts/export.py")


def load_any(path: str | Path, tied: TiedTarget, args: LlamaArgs,
             expected_fingerprint: dict[str, Any] | None = None) -> Head:
    """Load a native checkpoint or any engine export (format detected) as a spechead head."""
    return load_export(path, detect_format(path), tied, args, expected_fingerprint)


def load_export(path: str | Path, fmt: str, tied: TiedTarget, args: LlamaArgs,
                expected_fingerprint: dict[str, Any] | None = None) -> Head:
    """Rebuild a spechead head from an export directory (`args`: the target's), frozen tensors attached.

    `expected_fingerprint` (the configured target's, `data.store.target_fingerprint`): the fingerprint the
    export records (native: config.json; engine formats: the artifact marker) must agree with it
    (`artifacts.checkpoint.check_target_fingerprint`); an export without one loads with a warning. None: no check."""
    path = Path(path)
    if fmt == "native":
        return load_native(path, tied, args, expected_fingerprint)
    if expected_fingerprint is not None:
        stored = (artifact_info(path) or {}).get("target_fingerprint") or {}
        check_target_fingerprint(stored, expected_fingerprint, path)
    cfg = read_json(path / "config.json")
    infos = scan_tensors(path)
    if fmt.startswith("eagle1"):
        names = {k for k in infos if k != "embed_tokens.weight"}  # equal to the target's: validated
        head: Head = Eagle1Head(args, Eagle1Config(bias="fc.bias" in names), tied)
        state = {k: load_tensor(infos[k], k) for k in names}
    elif fmt in ("mtp-stitched", "mtp-standalone"):
        base = cfg["num_hidden_layers"] if fmt == "mtp-stitched" else 0
        n = cfg["num_nextn_predict_layers"]
        head = MTPHead(args, MTPConfig(num_modules=n), tied)
        state = {}
        for k, info in infos.items():
            name = deepseek_to_mtp(k, base, n)
            if name is not None:
                state[name] = load_tensor(info, k)
    elif fmt == "mtp-vllm":  # the aux ids before L (validated): the head's aux_layers
        aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"][:-1]
        head = MTPHead(args, MTPConfig(num_modules=cfg["num_hidden_layers"], aux_layers=aux or None), tied)
        state = {k: load_tensor(info, k) for k, info in infos.items()}
    elif fmt == "eagle3":
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        norms = {k: bool(cfg.get(k, False)) for k in ("norm_before_residual", "norm_output")}
        norms["norm_before_fc"] = bool(cfg.get("norm_before_fc", (cfg.get("eagle_config") or {}).get("norm_before_fc", False)))
        head = Eagle3Head(args, Eagle3Config(aux_layers=ids, draft_vocab_size=cfg["draft_vocab_size"], **norms), tied)
        state = {k: load_tensor(info, k) for k, info in infos.items() if k != "embed_tokens.weight"}
        if "d2t" not in state:  # V_d = V (validated): the identity mapping
            state["d2t"], state["t2d"] = head.d2t.clone(), head.t2d.clone()
        elif "t2d" not in state:
            t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
            t2d[state["d2t"] + torch.arange(state["d2t"].shape[0])] = True
            state["t2d"] = t2d
    elif fmt == DRAFT_HF:
        return read_draft_hf(path, tied, args)
    elif fmt == SPECULATORS_EAGLE3:
        return read_speculators_eagle3(path, tied, args).to(tied.embed.dtype)
    elif fmt == "medusa-vllm":
        head = MedusaHead(args, MedusaConfig(num_heads=cfg["num_heads"], num_layers=cfg["num_hidden_layers"],
                                             bias=bool(cfg["medusa_fc_bias"])), tied)
        state = {k: load_tensor(info, k) for k, info in infos.items() if k.startswith("blocks.")}
    else:
        raise ValueError(f"unknown export format {fmt!r}")
    head.load_state_dict(state, strict=True)
    return head.to(tied.embed.dtype)
