"""The target as one typed object (inference_eval/targets.py `TargetConfig`, built by data/sources.py
`target_config`): built once from the config's `target` section, its settings checked, its fingerprint the one
stores and heads record — and the product resolves the directory and the fingerprint through it alone."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from data.sources import target_config
from inference_eval.model import target_fingerprint
from inference_eval.targets import TargetConfig, load_target
from tests.conftest import compose_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("core", "heads", "inference_eval", "artifacts", "data", "train", "evaluation", "experiments", "scripts",
           "bench")


def test_the_config_section_becomes_the_typed_target(tiny_overrides, tiny_target):
    cfg = compose_config([*tiny_overrides, "target.fingerprint=full", "target.device=cpu"])
    target = target_config(cfg.target)
    assert target.dir == Path(tiny_target) and target.name == "tiny" and target.dtype == "float32"
    assert (target.fingerprint_mode, target.device, target.trust_remote_code) == ("full", "cpu", False)
    assert target.torch_dtype == torch.float32
    # what stores and heads record: the fingerprint of that directory, name, dtype and hashing method
    assert target.fingerprint == target_fingerprint(tiny_target, "tiny", "float32", "full")
    assert target.fingerprint != target_fingerprint(tiny_target, "tiny", "float32", "header")
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.dtype = "bfloat16"
    model = load_target(target, "engine")
    assert model.device == torch.device("cpu") and model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("field, value, words", [
    ("dtype", "fp32", "target.dtype='fp32': expected one of bfloat16, float16, float32"),
    ("fingerprint_mode", "sha", "target.fingerprint='sha': expected one of header, full"),
])
def test_a_wrong_setting_is_refused_naming_it(tiny_target, field, value, words):
    good = TargetConfig(dir=Path(tiny_target), name="tiny", dtype="float32")
    with pytest.raises(ValueError) as err:
        dataclasses.replace(good, **{field: value})
    assert words in str(err.value)


def test_load_target_refuses_a_backend_it_does_not_run(tiny_target):
    with pytest.raises(ValueError, match="backend 'vllm'"):
        load_target(TargetConfig(dir=Path(tiny_target), name="tiny", dtype="float32"), "vllm")


def _calls(name: str) -> list[str]:
    """`file:line` of every call of `name` in the product's code."""
    out = []
    for pkg in PRODUCT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Call):
                    fn = node.func
                    called = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                    if called == name:
                        out.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    return out


def test_the_product_reads_the_target_through_target_config_alone():
    """The directory is resolved, and the fingerprint computed from the config, in one place each: no stage
    unpacks `cfg.target` into `target_fingerprint(dir, name, dtype, mode)` of its own."""
    resolves = _calls("resolve_target_dir")
    assert resolves and all(c.startswith("data/sources.py:") for c in resolves), resolves
    fingerprints = [c for c in _calls("target_fingerprint") if not c.startswith("inference_eval/targets.py:")]
    # bench/precompute.py fingerprints a store it writes outside the pipeline, for a fixed target and dtype
    assert fingerprints == [c for c in fingerprints if c.startswith("bench/precompute.py:")], fingerprints


def test_a_checkpoints_own_code_left_off_is_said(tiny_target, tmp_path, caplog):
    """config.json's `auto_map` with target.trust_remote_code off: the checks before work warn, naming the file's
    classes and the setting that runs them; with it on, or without an auto_map, nothing is said."""
    import json
    import shutil

    from scripts.checks import check_target

    custom = tmp_path / "custom"
    shutil.copytree(tiny_target, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (custom / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="scripts.checks"):
        assert check_target({"path": str(custom)}) == custom
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "AutoConfig, AutoModelForCausalLM" in said[0]
    assert "target.trust_remote_code=true" in said[0] and str(custom) in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="scripts.checks"):
        check_target({"path": str(custom), "trust_remote_code": True})
        check_target({"path": str(tiny_target)})
    assert not caplog.records


def test_a_target_without_tokenizer_files_is_refused_naming_the_directory(tiny_target, tmp_path):
    """A checkpoint directory without any tokenizer file is refused before work, naming the directory and what to
    copy there — not transformers' message from inside a stage, nor "no chat template"."""
    import shutil

    from scripts.checks import ConfigError, check_target

    bare = tmp_path / "bare"
    shutil.copytree(tiny_target, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=rf"target.path={bare}: no tokenizer files \(none of tokenizer.json"):
        check_target({"path": str(bare)})
    assert check_target({"path": str(tiny_target)}) == tiny_target
