"""eagle3 and medusa exports (docs/reference/export_formats.md §3.2, §3.4, §4.2, §9.3, §9.6): golden key sets and
configs, round trips (same logits, same τ through the engine), validators rejecting planted defects."""

from __future__ import annotations

import json

import pytest
import torch

from heads.registry import build_head
from artifacts.export import default_formats, export_head, load_export, probe_logits
from artifacts.validate import validate_export
from inference_eval.model import LlamaForCausalLM, tied_target
from tests.helpers import engine_speculative
from tests.test_export import _embed, _keys, _perturb, assert_rejects_planted_defect

pytestmark = pytest.mark.unit

MID = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
       *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
EAGLE3 = {"fc.weight", "norm.weight", "lm_head.weight", *(f"midlayer.{k}" for k in MID)}


@pytest.fixture(scope="module")
def heads(deep_target):
    tied, args, parts = tied_target(deep_target)
    out = {}
    for name, cfg in {"eagle3": {"type": "eagle3", "draft_vocab_size": 300},
                      "eagle3_full": {"type": "eagle3"},
                      "eagle3_31": {"type": "eagle3", "draft_vocab_size": 300, "norm_before_fc": True,
                                    "norm_before_residual": True, "norm_output": True},
                      "medusa": {"type": "medusa", "num_heads": 3, "num_layers": 2}}.items():
        h = build_head(cfg, args, tied)
        if hasattr(h, "set_draft_vocab"):
            h.set_draft_vocab(torch.arange(args.vocab_size) % 7)  # some tokens more frequent than others
        h.reset_parameters(0, parts.first_input_norm)
        out[name] = _perturb(h, len(out))
    return out


@pytest.fixture(scope="module")
def exported(heads, deep_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("export3")
    dirs = {}
    for name, fmt in (("eagle3", "eagle3"), ("eagle3_full", "eagle3"), ("eagle3_31", "eagle3"), ("medusa", "medusa-vllm")):
        assert default_formats(heads[name]) == ["native", fmt]
        written = export_head(heads[name], {"native": root / name / "native", fmt: root / name / fmt}, deep_target)
        dirs[name] = written[fmt]
        dirs[name + "_native"] = written["native"]
    return dirs


def test_golden_eagle3(exported, deep_target):
    assert _keys(exported["eagle3"]) == EAGLE3 | {"d2t", "t2d"}
    assert _keys(exported["eagle3_full"]) == EAGLE3  # V_d = V: no mapping (§1.3)
    cfg = json.loads((exported["eagle3"] / "config.json").read_text())
    tcfg = json.loads((deep_target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["draft_vocab_size"] == 300 and cfg["vocab_size"] == 512
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False
    assert cfg["max_position_embeddings"] == tcfg["max_position_embeddings"]
    assert "target_hidden_size" not in cfg and cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert (cfg["norm_before_fc"], cfg["norm_output"], cfg["eagle_config"]["norm_before_fc"]) == (False, False, False)
    v31 = json.loads((exported["eagle3_31"] / "config.json").read_text())  # EAGLE-3.1: every flag written
    assert (v31["norm_before_residual"], v31["norm_before_fc"], v31["norm_output"], v31["eagle_config"]["norm_before_fc"]) == (True,) * 4
    assert _keys(exported["eagle3_31"]) == EAGLE3 | {"d2t", "t2d", "input_norm.weight"}
    full = json.loads((exported["eagle3_full"] / "config.json").read_text())
    assert full["draft_vocab_size"] == 512  # written, never null (§9.3)
    from safetensors.torch import load_file
    st = load_file(exported["eagle3"] / "model.safetensors")
    assert st["d2t"].dtype == torch.int64 and st["lm_head.weight"].shape == (300, 64)
    assert st["fc.weight"].shape == (64, 3 * 64)
    assert st["midlayer.self_attn.q_proj.weight"].shape == (64, 128)


def test_golden_medusa(exported, deep_target):
    keys = {f"blocks.{h}.layers.{l}.{p}" for h in range(3) for l in range(2) for p in ("weight", "bias")}
    assert _keys(exported["medusa"]) == keys | {"lm_heads.0.weight"}
    cfg = json.loads((exported["medusa"] / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"], cfg["original_lm_head"]) == (3, 2, True, True)
    assert cfg["vocab_size"] == 512 and cfg["hidden_size"] == 64


def test_round_trip_same_logits_and_tau(exported, heads, deep_target):
    tied, args, _ = tied_target(deep_target)
    target = LlamaForCausalLM.from_pretrained(deep_target)
    prompts = [list(range(40, 60)), [5, 9, 13, 2]]
    for name, fmt in (("eagle3", "eagle3"), ("eagle3_full", "eagle3"), ("eagle3_31", "eagle3"), ("medusa", "medusa-vllm")):
        for path, f in ((exported[name], fmt), (exported[name + "_native"], "native")):
            back = load_export(path, f, tied, args)
            assert torch.equal(probe_logits(back), probe_logits(heads[name])), (name, f)
            assert validate_export(path, f, deep_target) == []
            for p in prompts:
                before = engine_speculative(target, heads[name], p, 3, 16)
                after = engine_speculative(target, back, p, 3, 16)
                assert before[0] == after[0] and before[1].accepted == after[1].accepted, (name, f)
                assert before[1].tau == after[1].tau


def test_eagle3_export_refuses_aux_ids_starting_at_1(tiny_target, tmp_path):
    tied, args, parts = tied_target(tiny_target)
    head = build_head({"type": "eagle3", "aux_layers": [1]}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    with pytest.raises(ValueError, match="start at 1"):
        export_head(head, {"eagle3": tmp_path / "e3"}, tiny_target)
    assert not (tmp_path / "e3").exists()


E3_DEFECTS = [
    ("missing d2t", dict(drop=["d2t"]), ["missing tensor 'd2t'"]),
    ("absolute d2t", dict(add={"d2t": torch.arange(300) * 2}), ["outside the target vocabulary"]),
    ("aux ids start at 1", dict(config={"eagle_aux_hidden_state_layer_ids": [1, 4, 5],
                                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 5],
                                                         "use_aux_hidden_state": True}}), ["start at 1"]),
    ("aux ids only top-level", dict(config={"eagle_config": {"use_aux_hidden_state": True}}),
     ["top-level and in eagle_config"]),
    ("short positions", dict(config={"max_position_embeddings": 2048}), ["shorter than the target's 4096"]),
    ("stale embed_tokens", lambda t: dict(add={"embed_tokens.weight": _embed(t, 0.01)}), ["not bit-identical"]),
    ("layers.0 naming", dict(rename={"midlayer.hidden_norm.weight": "layers.0.hidden_norm.weight"}),
     ["missing tensor 'midlayer.hidden_norm.weight'", "unexpected tensor 'layers.0.hidden_norm.weight'"]),
    ("null draft vocab", dict(config={"draft_vocab_size": None}), ["draft_vocab_size must be a positive integer"]),
    ("wrong arch", dict(config={"architectures": ["LlamaForCausalLM"]}), ["LlamaForCausalLMEagle3"]),
    ("no norm_before_residual", dict(config={"norm_before_residual": None}), ["norm_before_residual must be written"]),
    ("norm_before_fc without input_norm", dict(config={"norm_before_fc": True, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True, "norm_before_fc": True}}),
     ["missing tensor 'input_norm.weight'"]),
    ("norm_before_fc in one place", dict(config={"norm_before_fc": True}), ["norm_before_fc differs"]),
    ("fc for 2 layers", dict(add={"fc.weight": torch.zeros(64, 128)}), ["'fc.weight' has shape [64, 128], expected [64, 192]"]),
    ("tied", dict(config={"tie_word_embeddings": True}), ["tie_word_embeddings must be false"]),
]
MEDUSA_DEFECTS = [
    ("bias flag off", dict(config={"medusa_fc_bias": False}), ["vLLM drops them silently"]),
    ("missing block", dict(drop=["blocks.2.layers.1.weight"]), ["missing tensor 'blocks.2.layers.1.weight'"]),
    ("stale lm_head", lambda t: dict(add={"lm_heads.0.weight": _embed(t, 0.01)}), ["not bit-identical"]),
    ("wrong vocab", dict(config={"vocab_size": 32001}), ["vocab_size 32001 differs"]),
]


@pytest.mark.parametrize("name,fmt,label,defect,expected",
                         [("eagle3", "eagle3", *c) for c in E3_DEFECTS] + [("medusa", "medusa-vllm", *c) for c in MEDUSA_DEFECTS],
                         ids=[f"eagle3:{c[0]}" for c in E3_DEFECTS] + [f"medusa:{c[0]}" for c in MEDUSA_DEFECTS])
def test_validator_rejects_planted_defect(exported, deep_target, tmp_path, name, fmt, label, defect, expected):
    assert_rejects_planted_defect(exported[name], tmp_path / "bad", fmt, deep_target, defect, expected)
