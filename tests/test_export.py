"""Engine export formats (docs/reference/export_formats.md): golden key sets and configs on the tiny target, validators
that reject planted defects, read-back round trips, and the engines' name mappings re-implemented as
pure functions so that every engine parameter is shown to be covered by exactly one checkpoint key
(§11 step 2)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads.medusa import MedusaConfig, MedusaHead
from heads.registry import build_head
from artifacts.export import (ENGINE_FORMATS, VLLM_METHODS, default_formats, detect_format, export_head, load_any,
                              load_export, probe_logits)
from artifacts.formats import FORMATS, register
from artifacts.formats.base import ExportFormat, head_state, loaded, read_json, write_config
from artifacts.integrity import write_manifest
from artifacts.validate import ExportValidationError, check_export, main as validate_main, validate_export
from inference_eval.model import LlamaForCausalLM, tied_target
from tests.helpers import engine_speculative

pytestmark = pytest.mark.unit

LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight",
         *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
EAGLE1 = {"fc.weight", *(f"layers.0.{k}" for k in LAYER - {"input_layernorm.weight"})}
MTP_OWN = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
MTP_COPIES = {"embed_tokens.weight", "shared_head.head.weight"}
N_TARGET_LAYERS = 2  # tests/conftest.py TINY


def _perturb(head, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return head


@pytest.fixture(scope="module")
def heads(tiny_target):
    tied, args, parts = tied_target(tiny_target)
    out = {}
    for name, cfg in {"mtp": {"type": "mtp"}, "eagle1": {"type": "eagle1", "bias": False},
                      "eagle1_bias": {"type": "eagle1", "bias": True}}.items():
        h = build_head(cfg, args, tied)
        h.reset_parameters(0, parts.first_input_norm)
        out[name] = _perturb(h, len(out))
    return out


@pytest.fixture(scope="module")
def exported(heads, tiny_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    dirs = export_head(heads["mtp"], {f: root / f for f in ("native", "mtp-stitched", "mtp-standalone")}, tiny_target)
    dirs |= export_head(heads["eagle1"], {f: root / f for f in ("eagle1-vllm", "eagle1-sglang")}, tiny_target)
    dirs |= {"eagle1-sglang-bias": export_head(heads["eagle1_bias"], {"eagle1-sglang": root / "sglang-bias"},
                                               tiny_target)["eagle1-sglang"]}
    return dirs


def _keys(path: Path) -> set[str]:
    return {k for f in path.glob("*.safetensors") for k in load_file(f)}


def _target_cfg(tiny_target) -> dict:
    return json.loads((tiny_target / "config.json").read_text())


# ---- golden layouts -------------------------------------------------------------------------------
EAGLE1_VLLM_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "vocab_size": 512, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32", "bias": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


def test_golden_eagle1(exported):
    vllm, sglang = exported["eagle1-vllm"], exported["eagle1-sglang"]
    assert _keys(vllm) == EAGLE1 and _keys(sglang) == EAGLE1 | {"fc.bias"}
    assert json.loads((vllm / "config.json").read_text()) == EAGLE1_VLLM_CONFIG
    assert json.loads((sglang / "config.json").read_text()) == EAGLE1_VLLM_CONFIG | {
        "architectures": ["LlamaForCausalLMEagle"], "bias": True}
    assert not load_file(sglang / "model.safetensors")["fc.bias"].any()  # trained without: zeros shipped
    assert load_file(exported["eagle1-sglang-bias"] / "model.safetensors")["fc.bias"].any()
    assert sorted(p.name for p in vllm.iterdir()) == [".spechead-artifact.json", "checksums.json", "config.json",
                                                      "model.safetensors"]
    assert json.loads((vllm / ".spechead-artifact.json").read_text())["kind"] == "export:eagle1-vllm"


def test_golden_mtp(exported, tiny_target, heads):
    stitched, standalone = exported["mtp-stitched"], exported["mtp-standalone"]
    tcfg, tkeys = _target_cfg(tiny_target), _keys(tiny_target)
    L = N_TARGET_LAYERS
    assert _keys(stitched) == tkeys | {f"model.layers.{L}.{k}" for k in MTP_OWN | MTP_COPIES | LAYER}
    assert json.loads((stitched / "config.json").read_text()) == tcfg | {"num_nextn_predict_layers": 1}
    index = json.loads((stitched / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == _keys(stitched) and index[f"model.layers.{L}.eh_proj.weight"] == "model-mtp.safetensors"
    mtp = load_file(stitched / "model-mtp.safetensors")
    embed = load_file(tiny_target / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(mtp[f"model.layers.{L}.embed_tokens.weight"], embed)
    assert torch.equal(mtp[f"model.layers.{L}.shared_head.head.weight"], embed)  # tied target: W_lm = E
    assert torch.equal(mtp[f"model.layers.{L}.eh_proj.weight"], heads["mtp"].layers[0].eh_proj.weight)
    assert torch.equal(mtp[f"model.layers.{L}.input_layernorm.weight"],
                       heads["mtp"].layers[0].layer.input_layernorm.weight)
    for f in tiny_target.glob("*.safetensors"):  # the target's own shards are copied byte for byte
        assert (stitched / f.name).read_bytes() == f.read_bytes()
    assert _keys(standalone) == {f"model.layers.0.{k}" for k in MTP_OWN | LAYER}
    assert json.loads((standalone / "config.json").read_text()) == tcfg | {
        "architectures": ["LlamaForCausalLMNextN"], "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    assert (standalone / "tokenizer.json").exists() and not (standalone / "model.safetensors.index.json").exists()


def test_default_formats_and_refusals(heads, tiny_target, tmp_path):
    tied, args, _ = tied_target(tiny_target)
    # only what an engine serves on a Llama-family target; mtp-stitched / mtp-standalone on request only
    assert default_formats(heads["mtp"]) == ["native", "mtp-vllm"]
    assert default_formats(heads["eagle1"]) == ["native", "eagle1-vllm", "eagle1-sglang"]
    assert default_formats(heads["eagle1_bias"]) == ["native", "eagle1-sglang"]  # non-zero bias: no vLLM
    assert default_formats(build_head({"type": "mtp", "num_modules": 2}, args, tied)) == ["native", "mtp-vllm"]
    assert default_formats(build_head({"type": "mtp", "num_modules": 3}, args, tied)) == ["native", "mtp-vllm"]
    qk = dataclasses.replace(args, qk_norm=True)  # a Qwen3 target: vLLM's eagle3 layer has no q/k norms
    assert default_formats(build_head({"type": "mtp"}, qk, tied)) == ["native"]
    with pytest.raises(ValueError, match=r"non-zero fc\.bias .*head\.bias=false"):
        export_head(heads["eagle1_bias"], {"eagle1-vllm": tmp_path / "v"}, tiny_target)
    assert not (tmp_path / "v").exists()  # nothing half-written
    with pytest.raises(ValueError, match="does not apply to a 'mtp' head"):
        export_head(heads["mtp"], {"eagle1-sglang": tmp_path / "s"}, tiny_target)


def test_two_mtp_modules_stitch_as_consecutive_layers(tiny_target, tmp_path):
    tied, args, _ = tied_target(tiny_target)
    head = _perturb(build_head({"type": "mtp", "num_modules": 2}, args, tied), 7)
    out = export_head(head, {"mtp-stitched": tmp_path / "s"}, tiny_target)["mtp-stitched"]
    L = N_TARGET_LAYERS
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert {k for k in _keys(out) if k.endswith("eh_proj.weight")} == {f"model.layers.{L}.eh_proj.weight",
                                                                       f"model.layers.{L + 1}.eh_proj.weight"}
    back = load_export(out, "mtp-stitched", tied, args)
    x, tok, pos = torch.randn(1, 5, args.hidden_size), torch.arange(5)[None], torch.arange(5)[None]
    with torch.no_grad():  # module 2 (depth 2) came back too, in its place
        assert torch.equal(back.logits(back(x, tok, pos, depth=2), 2), head.logits(head(x, tok, pos, depth=2), 2))
        assert not torch.equal(head(x, tok, pos, depth=2), head(x, tok, pos, depth=1))
    with pytest.raises(ValueError, match="num_nextn_predict_layers == 1"):
        export_head(head, {"mtp-standalone": tmp_path / "a"}, tiny_target)
    # the same τ through the engine, which drafts depth d with module d
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    for prompt in (list(range(40, 60)), [7, 3, 11]):
        before = engine_speculative(target, head, prompt, 2, 16)
        after = engine_speculative(target, back, prompt, 2, 16)
        assert before[0] == after[0] and before[1].accepted == after[1].accepted and before[1].tau == after[1].tau


# ---- round trips ------------------------------------------------------------------------------------
def test_every_format_reads_back_to_the_same_function(exported, heads, tiny_target):
    tied, args, _ = tied_target(tiny_target)
    owner = {"native": "mtp", "mtp-stitched": "mtp", "mtp-standalone": "mtp", "eagle1-vllm": "eagle1",
             "eagle1-sglang": "eagle1", "eagle1-sglang-bias": "eagle1_bias"}
    for fmt, path in exported.items():
        back = load_export(path, fmt.removesuffix("-bias"), tied, args)
        assert torch.equal(probe_logits(back), probe_logits(heads[owner[fmt]])), fmt
        assert validate_export(path, fmt.removesuffix("-bias"), tiny_target) == []
    # docs/design.md §8: the same τ in the engine after export, for every format, on a fixed prompt set
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    for fmt, path in exported.items():
        back = load_export(path, fmt.removesuffix("-bias"), tied, args)
        for prompt in (list(range(40, 60)), [7, 3, 11]):
            before = engine_speculative(target, heads[owner[fmt]], prompt, 3, 16)
            after = engine_speculative(target, back, prompt, 3, 16)
            assert before[0] == after[0] and before[1].tau == after[1].tau, fmt
            assert before[1].accepted == after[1].accepted, fmt


# ---- validators reject planted defects ---------------------------------------------------------------
def _plant(src: Path, dst: Path, *, drop=(), add=None, rename=None, cast=None, config=None) -> Path:
    """A copy of an export with one defect: tensors dropped / added / renamed / cast, config keys changed."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    head_file = dst / "model-mtp.safetensors" if (dst / "model-mtp.safetensors").exists() else files[0]
    state = load_file(head_file)
    for k in drop:
        state.pop(k)
    for old, new in (rename or {}).items():
        state[new] = state.pop(old)
    for k, dtype in (cast or {}).items():
        state[k] = state[k].to(dtype)
    state |= add or {}
    save_file(state, head_file)
    index = dst / "model.safetensors.index.json"
    if index.exists():  # keep the index consistent, so only the planted defect is reported
        data = json.loads(index.read_text())
        data["weight_map"] = {k: f.name for f in dst.glob("*.safetensors") for k in load_file(f)}
        index.write_text(json.dumps(data))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(cfg | config))
    write_manifest(dst)  # record the edited files, so only the planted defect is reported
    return dst


def _embed(tiny_target, noise=0.0):
    e = load_file(tiny_target / "model.safetensors")["model.embed_tokens.weight"]
    return e + noise * torch.randn_like(e) if noise else e.clone()


L0, LS = "layers.0.", f"model.layers.{N_TARGET_LAYERS}."
DEFECTS = {
    "eagle1-vllm": [
        ("renamed key", dict(rename={f"{L0}mlp.up_proj.weight": f"{L0}mlp.upproj.weight"}),
         [f"missing tensor '{L0}mlp.up_proj.weight'", f"unexpected tensor '{L0}mlp.upproj.weight'"]),
        ("model. prefix", dict(rename={"fc.weight": "model.fc.weight"}), ["no `model.` prefix"]),
        ("missing o_proj", dict(drop=[f"{L0}self_attn.o_proj.weight"]), [f"missing tensor '{L0}self_attn.o_proj.weight'"]),
        ("non-zero fc.bias", dict(add={"fc.bias": torch.full((64,), 0.1)}), ["fc.bias is present and non-zero"]),
        ("embed_tokens", lambda t: dict(add={"embed_tokens.weight": _embed(t)}), ["must be omitted for vLLM"]),
        ("input_layernorm", dict(add={f"{L0}input_layernorm.weight": torch.ones(64)}), ["has no input norm"]),
        ("short positions", dict(config={"max_position_embeddings": 2048}), ["shorter than the target's 4096"]),
        ("tied", dict(config={"tie_word_embeddings": True}), ["tie_word_embeddings must be false"]),
        ("rope", dict(config={"rope_theta": 5e5, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}),
         ["rope_theta 500000.0 differs from the target's 10000.0"]),
        ("wrong shape", dict(add={"fc.weight": torch.zeros(64, 64)}), ["'fc.weight' has shape [64, 64], expected [64, 128]"]),
        ("mixed dtype", dict(cast={"fc.weight": torch.bfloat16}), ["mix dtypes"]),
    ],
    "eagle1-sglang": [
        ("missing fc.bias", dict(drop=["fc.bias"]), ["missing tensor 'fc.bias'"]),
        ("extra lm_head", dict(add={"lm_head.weight": torch.zeros(512, 64)}), ["unexpected tensor 'lm_head.weight'"]),
        ("stale embed_tokens", lambda t: dict(add={"embed_tokens.weight": _embed(t, 0.01)}), ["not bit-identical"]),
        ("short positions", dict(config={"max_position_embeddings": 1024}), ["shorter than the target's"]),
        ("wrong arch", dict(config={"architectures": ["LlamaForCausalLM"]}), ["['LlamaForCausalLMEagle']"]),
    ],
    "mtp-stitched": [
        ("renamed key", dict(rename={f"{LS}eh_proj.weight": f"{LS}e_h_proj.weight"}),
         [f"missing tensor '{LS}eh_proj.weight'", f"unexpected tensor '{LS}e_h_proj.weight'"]),
        ("missing head copy", dict(drop=[f"{LS}shared_head.head.weight"]), [f"missing tensor '{LS}shared_head.head.weight'"]),
        ("stale embed copy", lambda t: dict(add={f"{LS}embed_tokens.weight": _embed(t, 0.01)}), ["not bit-identical"]),
        ("short positions", dict(config={"max_position_embeddings": 2048}), ["shorter than the target's"]),
        ("no nextn count", dict(config={"num_nextn_predict_layers": 0}), ["num_nextn_predict_layers must be"]),
        ("config drift", dict(config={"rms_norm_eps": 1e-6}), ["config 'rms_norm_eps' is 1e-06"]),
    ],
    "mtp-standalone": [
        ("extra key", dict(add={"model.layers.0.mtp_block.extra": torch.zeros(3)}),
         ["unexpected tensor 'model.layers.0.mtp_block.extra'"]),
        ("missing key", dict(drop=["model.layers.0.hnorm.weight"]), ["missing tensor 'model.layers.0.hnorm.weight'"]),
        ("stale embed", lambda t: dict(add={"model.layers.0.embed_tokens.weight": _embed(t, 0.01)}), ["not bit-identical"]),
        ("short positions", dict(config={"max_position_embeddings": 100}), ["shorter than the target's"]),
        ("layers", dict(config={"num_hidden_layers": 2}), ["num_hidden_layers must be 1"]),
    ],
    "native": [
        ("missing key", dict(drop=["layers.0.hnorm.weight"]), ["missing tensor 'layers.0.hnorm.weight'"]),
        ("frozen weight shipped", lambda t: dict(add={"tied.embed": _embed(t)}), ["unexpected tensor 'tied.embed'"]),
    ],
}


@pytest.mark.parametrize("fmt,label,defect,expected",
                         [(fmt, label, d, e) for fmt, cases in DEFECTS.items() for label, d, e in cases],
                         ids=[f"{fmt}:{label}" for fmt, cases in DEFECTS.items() for label, _, _ in cases])
def test_validator_rejects_planted_defect(exported, tiny_target, tmp_path, fmt, label, defect, expected):
    assert_rejects_planted_defect(exported[fmt], tmp_path / "bad", fmt, tiny_target, defect, expected)


def assert_rejects_planted_defect(src: Path, dst: Path, fmt: str, target: Path, defect, expected: list[str]) -> None:
    """Plant `defect` (kwargs of `_plant`, or a function of the target giving them) in a copy of the export
    at `src`; the validator must reject it with a violation containing each `expected` text."""
    bad = _plant(src, dst, **(defect(target) if callable(defect) else defect))
    with pytest.raises(ExportValidationError) as err:
        check_export(bad, fmt, target)
    for text in expected:
        assert any(text in v for v in err.value.violations), (text, err.value.violations)


def test_all_violations_are_listed_and_cli(exported, tiny_target, tmp_path, capsys):
    bad = _plant(exported["eagle1-vllm"], tmp_path / "bad", drop=["layers.0.mlp.down_proj.weight"],
                 add={"fc.bias": torch.ones(64)}, config={"max_position_embeddings": 16, "tie_word_embeddings": True})
    problems = validate_export(bad, "eagle1-vllm", tiny_target)
    assert len(problems) == 4, problems
    assert validate_main([str(bad), "--format", "eagle1-vllm", "--target", str(tiny_target)]) == 1
    err = capsys.readouterr().err
    assert "4 violation(s)" in err and all(p in err for p in problems)
    assert validate_main([str(exported["eagle1-vllm"]), "--format", "eagle1-vllm", "--target", str(tiny_target)]) == 0
    assert "OK:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown export format"):
        validate_export(bad, "eagle2", tiny_target)


# ---- engines' name mappings as pure functions (docs/reference/export_formats.md §3.1, §3.3, §4.1, §4.3) ---------------
STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
SKIP = "skip"  # the loader ignores the key on purpose (shared from the target, or not an MTP layer)


def _stack(name: str) -> tuple[str, object]:
    """vLLM / SGLang fuse q/k/v and gate/up into one parameter; a key loads one shard of it."""
    for param, weight, shard in STACKED:
        if f".{weight}." in name:
            return name.replace(weight, param), shard
    return name, None


def _layer_params(prefix: str, input_norm: bool = True) -> set:
    names = {(f"{prefix}self_attn.qkv_proj.weight", s) for s in "qkv"}
    names |= {(f"{prefix}mlp.gate_up_proj.weight", s) for s in (0, 1)}
    names |= {(f"{prefix}{k}", None) for k in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                                               "post_attention_layernorm.weight")}
    return names | ({(f"{prefix}input_layernorm.weight", None)} if input_norm else set())


def vllm_eagle1(key: str):
    """vLLM llama_eagle.py: `model.` prefix unless lm_head; embed_tokens skipped at PP == 1; stacked params."""
    if key.startswith("lm_head"):
        return None  # no module: unloadable
    name = "model." + key
    return SKIP if ".embed_tokens." in name else _stack(name)


def sglang_eagle1(key: str):
    """SGLang llama_eagle.py: `model.` prefix, lm_head dropped (the target's is used), stacked params."""
    if key.startswith("lm_head"):
        return SKIP
    return _stack("model." + key)


def vllm_deepseek_mtp(key: str, n_layers: int, n_mtp: int):
    """vLLM deepseek_mtp.py: only `model.layers.{N+k}.*`; embed_tokens hoisted (first MTP layer only);
    enorm/hnorm/eh_proj/shared_head stay at the layer; the rest goes under `.mtp_block.`."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    if m is None or not n_layers <= int(m.group(1)) < n_layers + n_mtp:
        return SKIP
    i, rest = int(m.group(1)), m.group(2)
    if rest.startswith("embed_tokens."):
        return ("model.embed_tokens.weight", None) if i == n_layers else SKIP
    if any(s in rest for s in ("enorm", "hnorm", "eh_proj", "shared_head")):
        return f"model.layers.{i}.{rest}", None
    return _stack(f"model.layers.{i}.mtp_block.{rest}")


def sglang_nextn(key: str, n_layers: int):
    """SGLang deepseek_nextn.py: layer id 0 when num_hidden_layers == 1 else N; embed_tokens and
    shared_head.head come from the target; enorm/hnorm/eh_proj/shared_head.norm → `model.*`, the rest →
    `model.decoder.*`."""
    prefix = f"model.layers.{0 if n_layers == 1 else n_layers}."
    if not key.startswith(prefix):
        return SKIP
    rest = key[len(prefix):]
    if "shared_head.head" in rest or "embed_tokens" in rest:
        return SKIP
    if any(s in rest for s in ("shared_head.norm", "eh_proj", "enorm", "hnorm")):
        return "model." + rest, None
    return _stack("model.decoder." + rest)


def _assert_covers(keys: set[str], mapping, params: set) -> None:
    """Every engine parameter (or stacked shard) is loaded by exactly one key; no key is unloadable."""
    hits: dict = {}
    for key in sorted(keys):
        target = mapping(key)
        assert target is not None, f"{key!r} has no engine parameter (KeyError or silently dropped)"
        if target != SKIP:
            assert target in params, f"{key!r} → {target} is not an engine parameter"
            hits.setdefault(target, []).append(key)
    assert set(hits) == params, f"never loaded: {sorted(params - set(hits), key=str)}"
    assert all(len(v) == 1 for v in hits.values()), {k: v for k, v in hits.items() if len(v) > 1}


def test_engine_name_mappings_cover_every_parameter(exported):
    L = N_TARGET_LAYERS
    vllm_eagle_params = {("model.fc.weight", None)} | _layer_params("model.layers.0.", input_norm=False)
    _assert_covers(_keys(exported["eagle1-vllm"]), vllm_eagle1, vllm_eagle_params)
    sglang_params = vllm_eagle_params | {("model.fc.bias", None)}
    _assert_covers(_keys(exported["eagle1-sglang"]), sglang_eagle1, sglang_params)
    # the SGLang variant in vLLM: fc.bias has no parameter — exactly why the variants differ
    with pytest.raises(AssertionError, match="fc.bias"):
        _assert_covers(_keys(exported["eagle1-sglang-bias"]), vllm_eagle1, vllm_eagle_params)

    mtp_layer = {(f"model.layers.{L}.{k}", None) for k in MTP_OWN | {"shared_head.head.weight"}}
    vllm_mtp_params = mtp_layer | _layer_params(f"model.layers.{L}.mtp_block.") | {("model.embed_tokens.weight", None)}
    _assert_covers(_keys(exported["mtp-stitched"]), lambda k: vllm_deepseek_mtp(k, L, 1), vllm_mtp_params)
    nextn_params = {(f"model.{k}", None) for k in MTP_OWN} | _layer_params("model.decoder.")
    _assert_covers(_keys(exported["mtp-stitched"]), lambda k: sglang_nextn(k, L), nextn_params)
    _assert_covers(_keys(exported["mtp-standalone"]), lambda k: sglang_nextn(k, 1), nextn_params)
    # SGLang's standalone layout in vLLM loads nothing (§3.3): vLLM looks for model.layers.1.*
    with pytest.raises(AssertionError, match="never loaded"):
        _assert_covers(_keys(exported["mtp-standalone"]), lambda k: vllm_deepseek_mtp(k, 1, 1), vllm_mtp_params)


# ---- mtp-vllm: spechead's vLLM plugin (inference_eval/vllm_plugin.py; served in tests/test_vllm_serving.py) --
@pytest.mark.parametrize("modules", [1, 2, 3])
def test_mtp_vllm_layout_and_round_trip(tiny_target, tmp_path, modules):
    from artifacts.formats.mtp_vllm import MTP_VLLM_ARCH

    tied, args, _ = tied_target(tiny_target)
    head = _perturb(build_head({"type": "mtp", "num_modules": modules}, args, tied), 11)
    out = export_head(head, {"mtp-vllm": tmp_path / "v"}, tiny_target)["mtp-vllm"]  # validated + read back
    assert detect_format(out) == "mtp-vllm"
    assert _keys(out) == {f"layers.{d}.{k}" for d in range(modules) for k in MTP_OWN} | \
        {f"layers.{d}.layer.{k}" for d in range(modules) for k in LAYER}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [MTP_VLLM_ARCH] and cfg["num_hidden_layers"] == modules
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [N_TARGET_LAYERS] == \
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # the target's last pre-norm state H
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True and cfg["draft_vocab_size"] == cfg["vocab_size"]
    back = load_export(out, "mtp-vllm", tied, args)
    assert torch.equal(probe_logits(back), probe_logits(head))


def test_mtp_vllm_with_aux_layers_round_trip_and_defects(tiny_target, tmp_path):
    """An mtp head with `aux_layers`: the aux ids are [aux…, L], its fusion tensors travel, the read-back head
    computes the same fused state (probe_logits goes through target_input), a wrong fusion tensor changes the
    probe; the DeepSeek layouts refuse it before writing anything."""
    tied, args, _ = tied_target(tiny_target)
    head = _perturb(build_head({"type": "mtp", "aux_layers": [1]}, args, tied), 5)
    assert head.aux_fc.weight.abs().max() > 0  # (perturbed: the fusion is not the zero start)
    out = export_head(head, {"mtp-vllm": tmp_path / "v"}, tiny_target)["mtp-vllm"]  # validated + read back
    assert detect_format(out) == "mtp-vllm"
    assert {"aux_fc.weight", "aux_norm.0.weight"} <= _keys(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, N_TARGET_LAYERS] == \
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] and cfg["num_aux_hidden_states"] == 2
    back = load_export(out, "mtp-vllm", tied, args)
    assert back.capture_layers == (1,) and torch.equal(probe_logits(back), probe_logits(head))
    with torch.no_grad():
        back.aux_fc.weight.mul_(1.01)
    assert not torch.equal(probe_logits(back), probe_logits(head))
    for i, (defect, expected) in enumerate([
        ({"drop": ["aux_fc.weight"]}, ["missing tensor 'aux_fc.weight'"]),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [2, 1], "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [2, 1], "use_aux_hidden_state": True}}}, ["must ascend"]),
        ({"config": {"num_aux_hidden_states": 1}}, ["num_aux_hidden_states must be 2"]),
    ]):
        assert_rejects_planted_defect(out, tmp_path / f"bad{i}", "mtp-vllm", tiny_target, defect, expected)
    for fmt in ("mtp-stitched", "mtp-standalone"):
        with pytest.raises(ValueError, match=r"reads target layers \[1\] besides H"):
            export_head(head, {fmt: tmp_path / fmt}, tiny_target)
        assert not (tmp_path / fmt).exists()


def test_mtp_vllm_refusals_and_planted_defects(tiny_target, tmp_path):
    from inference_eval.vllm_plugin import MTP_ARCH  # importable without vLLM: the classes are built lazily
    from artifacts.formats.mtp_vllm import MTP_VLLM_ARCH

    assert MTP_ARCH == MTP_VLLM_ARCH
    tied, args, _ = tied_target(tiny_target)
    src = export_head(_perturb(build_head({"type": "mtp"}, args, tied), 3), {"mtp-vllm": tmp_path / "v"},
                      tiny_target)["mtp-vllm"]
    for i, (defect, expected) in enumerate([
        ({"drop": ["layers.0.hnorm.weight"]}, ["missing tensor 'layers.0.hnorm.weight'"]),
        ({"add": {"lm_head.weight": torch.zeros(512, 64)}}, ["unexpected tensor 'lm_head.weight'"]),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [1]}}, ["a list of ids, top-level and in eagle_config alike"]),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [1], "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1], "use_aux_hidden_state": True}}}, ["the target's layer count 2"]),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [1, 2], "eagle_config": {  # an aux id without its tensors
            "eagle_aux_hidden_state_layer_ids": [1, 2], "use_aux_hidden_state": True}}}, ["missing tensor 'aux_fc.weight'"]),
        ({"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2], "use_aux_hidden_state": False}}},
         ["use_aux_hidden_state must be true"]),
        ({"config": {"architectures": ["LlamaForCausalLMEagle3"]}}, ["Eagle3SpecheadMTPForCausalLM"]),
        ({"config": {"num_hidden_layers": 0}}, ["must be an integer ≥ 1, got 0"]),
        ({"config": {"num_hidden_layers": 2}}, ["missing tensor 'layers.1.hnorm.weight'"]),
    ]):
        assert_rejects_planted_defect(src, tmp_path / f"bad{i}", "mtp-vllm", tiny_target, defect, expected)


# ---- the format registry: the one table the export stage, the loader and the validator read -------------
def _speculators_block_dir(head, out):
    """A block head written in speculators' DFlash / DSpark layout (its config keys and tensor names; test_peer.py
    reads checkpoints speculators itself saves)."""
    a, c = head.args, head.cfg
    out.mkdir(parents=True)
    cfg = {"speculators_model_type": head.kind, "architectures": [f"{head.kind.capitalize()}Speculator"],
           "speculators_config": {"algorithm": head.kind},
           "transformer_layer_config": {"model_type": "qwen3", "hidden_size": a.hidden_size,
                                        "intermediate_size": a.intermediate_size, "num_hidden_layers": c.num_layers,
                                        "num_attention_heads": a.num_attention_heads,
                                        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
                                        "rms_norm_eps": a.rms_norm_eps, "hidden_act": "silu", "vocab_size": a.vocab_size,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
                                        "layer_types": ["full_attention"] * c.num_layers},
           "aux_hidden_state_layer_ids": list(c.target_layers), "mask_token_id": c.mask_token_id,
           "block_size": c.block_size, "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": a.hidden_size,
           "sample_from_anchor": head.kind == "dspark"}
    if head.kind == "dspark":
        cfg |= {"markov_rank": c.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True}
    (out / "config.json").write_text(json.dumps(cfg))
    names = {"markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight"}
    save_file({names.get(k, k): v.contiguous() for k, v in head_state(head).items()}, out / "model.safetensors")
    return out


def test_every_registered_format_is_detected_as_itself(exported, tiny_target, deep_target, tmp_path):
    """One directory per registered format, each detected as its own name, valid, and read back as the head
    that wrote it: a format registered without a case here fails the first assertion."""
    from tests.test_peer import FLAGS, our_head, write_speculators_format

    tied, args, _ = tied_target(tiny_target)
    dirs = {fmt: (path, tiny_target) for fmt, path in exported.items() if fmt != "eagle1-sglang-bias"}
    for i, (fmt, spec) in enumerate({"mtp-vllm": {"type": "mtp"}, "medusa-vllm": {"type": "medusa"},
                                     "draft-hf": {"type": "draft_lm", "num_layers": 1}}.items()):
        head = _perturb(build_head(spec, args, tied), 20 + i)
        dirs[fmt] = (export_head(head, {fmt: tmp_path / fmt}, tiny_target)[fmt], tiny_target)
    deep_tied, deep_args, _ = tied_target(deep_target)
    eagle3 = _perturb(build_head({"type": "eagle3"}, deep_args, deep_tied), 23)
    dirs["eagle3"] = (export_head(eagle3, {"eagle3": tmp_path / "eagle3"}, deep_target)["eagle3"], deep_target)
    for i, kind in enumerate(("dflash", "dspark")):
        block = _perturb(build_head({"type": kind, "num_layers": 1, "block_size": 3}, args, tied), 30 + i)
        fmt = f"{kind}-vllm"
        dirs[fmt] = (export_head(block, {fmt: tmp_path / fmt}, tiny_target)[fmt], tiny_target)
    for kind in ("dflash", "dspark"):  # the peer's block drafters, laid out as speculators saves them
        block = _perturb(build_head({"type": kind, "num_layers": 1, "block_size": 3}, args, tied), 40)
        dirs[f"speculators-{kind}"] = (_speculators_block_dir(block, tmp_path / f"peer_{kind}"), tiny_target)
    peer, _, _ = our_head(tiny_target, FLAGS["eagle31"])
    dirs["speculators-eagle3"] = (write_speculators_format(peer, tiny_target, tmp_path / "peer"), tiny_target)
    assert sorted(dirs) == sorted(FORMATS)
    for fmt, (path, target) in dirs.items():
        assert detect_format(path) == fmt
        assert validate_export(path, fmt, target) == [], fmt
    assert torch.equal(probe_logits(load_any(dirs["speculators-eagle3"][0], tied, args)), probe_logits(peer))
    for kind in ("dflash", "dspark"):
        block = load_any(dirs[f"speculators-{kind}"][0], tied, args)
        assert block.kind == kind and block.cfg.num_layers == 1 and block.block_size == 3
    # the tables other code reads are the formats' own declarations
    assert dict(VLLM_METHODS) == {"draft-hf": "draft_model", "eagle1-vllm": "eagle", "eagle3": "eagle3",
                                  "medusa-vllm": "medusa", "mtp-vllm": "eagle3", "speculators-eagle3": "eagle3",
                                  "dflash-vllm": "dflash", "dspark-vllm": "dspark", "speculators-dflash": "dflash",
                                  "speculators-dspark": "dspark"}
    assert dict(ENGINE_FORMATS) == {"mtp": ("mtp-stitched", "mtp-standalone", "mtp-vllm"),
                                    "eagle1": ("eagle1-vllm", "eagle1-sglang"), "eagle3": ("eagle3",),
                                    "medusa": ("medusa-vllm",), "draft_lm": ("draft-hf",),
                                    "dflash": ("dflash-vllm",), "dspark": ("dspark-vllm",)}
    # the peer's format is read, never written
    with pytest.raises(ValueError, match="'speculators-eagle3' does not apply to a 'eagle3' head"):
        export_head(eagle3, {"speculators-eagle3": tmp_path / "no"}, deep_target)


class ToyFormat(ExportFormat):
    """A format no artifacts/ module knows: a Medusa head's own tensors and a config that names the format."""

    name = "toy-medusa"
    head_kind = "medusa"

    def detect(self, path, cfg):
        return cfg.get("toy_format") == 1

    def write(self, head, out, target_dir):
        save_file(head_state(head), out / "toy.safetensors")
        write_config(out, {"toy_format": 1, "num_heads": head.cfg.num_heads, "num_layers": head.cfg.num_layers,
                           "bias": head.cfg.bias})

    def read(self, path, tied, args):
        cfg = read_json(path / "config.json")
        head = MedusaHead(args, MedusaConfig(num_heads=cfg["num_heads"], num_layers=cfg["num_layers"],
                                             bias=cfg["bias"]), tied)
        return loaded(head, load_file(path / "toy.safetensors"), tied)

    def validate(self, path, cfg, infos, target, tcfg, problems):
        names = ("weight", "bias") if cfg["bias"] else ("weight",)
        want = {f"blocks.{j}.layers.{l}.{n}" for j in range(cfg["num_heads"]) for l in range(cfg["num_layers"])
                for n in names}
        problems += [f"missing tensor {k!r}" for k in sorted(want - set(infos))]


@pytest.fixture
def toy_format():
    fmt = register(ToyFormat())
    yield fmt
    del FORMATS[fmt.name]


def test_a_format_registered_outside_artifacts_goes_through_every_public_function(toy_format, heads, tiny_target,
                                                                                  tmp_path, capsys):
    """Registering one class is all a new format needs: the export stage lists and writes it, detection,
    the loader and the validator (and its CLI) find it, and a planted defect is reported."""
    tied, args, _ = tied_target(tiny_target)
    head = _perturb(build_head({"type": "medusa"}, args, tied), 31)
    assert ENGINE_FORMATS["medusa"] == ("medusa-vllm", "toy-medusa") and "toy-medusa" not in VLLM_METHODS
    assert default_formats(head) == ["native", "medusa-vllm", "toy-medusa"]
    out = export_head(head, {"toy-medusa": tmp_path / "toy"}, tiny_target)["toy-medusa"]  # validated, read back
    assert sorted(p.name for p in out.iterdir()) == [".spechead-artifact.json", "checksums.json", "config.json",
                                                     "toy.safetensors"]
    assert json.loads((out / ".spechead-artifact.json").read_text())["kind"] == "export:toy-medusa"
    assert detect_format(out) == "toy-medusa"
    assert torch.equal(probe_logits(load_any(out, tied, args)), probe_logits(head))
    assert validate_export(out, "toy-medusa", tiny_target) == []
    assert validate_main([str(out), "--format", "toy-medusa"]) == 0
    assert "valid toy-medusa export" in capsys.readouterr().out
    bad = _plant(out, tmp_path / "bad", drop=["blocks.0.layers.0.weight"])
    assert validate_export(bad, "toy-medusa") == ["missing tensor 'blocks.0.layers.0.weight'"]
    with pytest.raises(ExportValidationError, match="not a valid 'toy-medusa' export"):
        check_export(bad, "toy-medusa")
    with pytest.raises(ValueError, match="'toy-medusa' does not apply to a 'mtp' head; it exports to: native, "
                                         "mtp-stitched, mtp-standalone, mtp-vllm$"):
        export_head(heads["mtp"], {"toy-medusa": tmp_path / "mtp"}, tiny_target)
    with pytest.raises(ValueError, match="registered already"):
        register(ToyFormat())
