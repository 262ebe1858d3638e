"""Every numeric and path setting is checked before any work: each bad value is refused by the checks before work
of every stage that reads it (scripts/checks.py `RULES`; the typed configs train/settings.py ModuleSettings and
inference_eval/targets.py TargetConfig for theirs), naming the setting and what it accepts, in well under a second
and with no model, tokenizer or data loaded; and no shipped preset is refused."""

from __future__ import annotations

import copy
import functools
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from scripts.checks import EVERY, ONLINE, RULES, RULES_BY_KEY, ConfigError, check_before_work, check_settings
from tests.conftest import ROOT, compose_config
from tests.helpers import forbid_work

pytestmark = pytest.mark.unit

FAST_S = 2.0  # a check before work reads the config and a few bytes on disk; loading a model takes longer

# The values the hostile user tried: each was taken silently, or failed only after the model loaded, before
# these checks. (stage, override, the setting, words of what it accepts)
HOLES = [
    ("precompute", "data.max_length=-5", "data.max_length", "a whole number of tokens ≥ 1"),
    ("train", "train.data.batch_tokens=0", "train.data.batch_tokens", "a whole number of tokens ≥ 1"),
    ("train", "train.data.batch_tokens=-512", "train.data.batch_tokens", "a whole number of tokens ≥ 1"),
    ("train", "train.data.val_fraction=1.0", "train.data.val_fraction", "a fraction in [0, 1)"),
    ("train", "train.data.val_fraction=-0.1", "train.data.val_fraction", "a fraction in [0, 1)"),
    ("train", "train.module.lr=-0.001", "train.module.lr", "a learning rate > 0"),
    ("train", "train.module.lr=0", "train.module.lr", "a learning rate > 0"),
    ("evaluate", "evaluate.num_prompts=0", "evaluate.num_prompts",
     "null (every prompt) or a whole number of prompts ≥ 1"),
    ("evaluate", "evaluate.num_prompts=-3", "evaluate.num_prompts", "a whole number of prompts ≥ 1"),
    ("evaluate", "evaluate.temperature=-0.5", "evaluate.temperature", "a temperature ≥ 0"),
    ("precompute", "run_name='../evil'", "run_name", "a plain name"),
    ("precompute", "run_name=a/b", "run_name", "no '/'"),
    ("precompute", "precompute.batch_tokens=0", "precompute.batch_tokens", "a whole number of tokens ≥ 1"),
    ("precompute", "threads=abc", "threads", "a positive number of threads"),
]

# Bad values of every RULES row, as hydra overrides take them; {file} / {dir} / {missing} stand for an existing file,
# an existing directory and a path that is not there.
BAD = {
    "run_name": ["'../evil'", "a/b", "''", "'.hidden'", "'..'"],
    "run_dir": ["''", "{file}"],
    "store_dir": ["{file}"],
    "head_dir": ["{file}", "''"],
    "seed": ["-1", "4294967296", "1.5", "abc"],
    "progress_log_s": ["-1", "abc"],
    "threads": ["abc", "0", "-2", "1.5"],
    "progress": ["maybe", "1"],
    "target.device": ["gpu0", "''"],
    "target.revision": ["''", "1234567", "true", "[main]"],
    "pipeline.regenerate": ["yes"],
    "pipeline.head_modules": ["2", "0", "one"],
    "head.num_modules": ["0", "two"],
    "head.num_layers": ["0"],
    "head.num_heads": ["0"],
    "head.init_std": ["-0.02", "abc"],
    "head.draft_vocab_size": ["0"],
    "head.mask_token_id": ["-1"],
    "precompute.batch_tokens": ["0", "-1", "abc", "null"],
    "precompute.shard_tokens": ["0", "abc"],
    "precompute.workers": ["0", "-1", "two"],
    "precompute.rank": ["-1", "abc"],
    "precompute.world_size": ["0", "abc"],
    "precompute.store_dtype": ["int8", "3"],
    "precompute.aux_layers": ["[-1]", "[1,1]", "[]", "all"],
    "precompute.on_changed": ["ignore", "1", "null"],
    "precompute.vllm.in_flight": ["0"],
    "precompute.vllm.keep_worker": ["sometimes"],
    "precompute.vllm.tensor_parallel_size": ["0", "abc"],
    "precompute.vllm.gpu_memory_utilization": ["0", "1.5", "full"],
    "precompute.vllm.cpu_kvcache_space_gb": ["0", "0.5"],
    "precompute.vllm.startup_timeout_s": ["0", "-5"],
    "regenerate.out": ["{dir}", "''"],
    "regenerate.batch_size": ["0"],
    "regenerate.max_new_tokens": ["0", "-1"],
    "regenerate.max_prompt_tokens": ["0"],
    "regenerate.seed": ["-3"],
    "regenerate.temperature": ["-0.1", "hot"],
    "regenerate.top_p": ["0", "1.1"],
    "regenerate.top_k": ["-1", "0.5"],
    "regenerate.vllm.tensor_parallel_size": ["0"],
    "regenerate.vllm.data_parallel_size": ["0"],
    "regenerate.vllm.gpu_memory_utilization": ["2"],
    "regenerate.vllm.cpu_kvcache_space_gb": ["-1"],
    "regenerate.vllm.startup_timeout_s": ["0"],
    "train.resume": ["{missing}", "{dir}", "latest"],
    "train.checkpoint_dir": ["{file}", "''"],
    "train.untrained_dir": ["{file}"],
    "train.checkpoint_every_n_steps": ["0", "-100"],
    "train.data.source": ["disk"],
    "train.data.online.write_store": ["{file}"],
    "train.data.batch_tokens": ["0", "-512", "abc", "1.5"],
    "train.data.val_fraction": ["1.0", "1", "-0.1", "abc"],
    "train.data.split_seed": ["0.5", "abc"],
    "train.data.train_samples": ["0"],
    "train.data.seed": ["abc"],
    "train.data.num_workers": ["-1", "many"],
    "train.data.verify_store": ["none"],
    "train.data.packing": ["sometimes"],
    "train.data.online.prefetch": ["maybe"],
    "train.engine_validation.enabled": ["on"],
    "train.engine_validation.strict": ["very"],
    "train.engine_validation.every_n_steps": ["0"],
    "train.engine_validation.conversations": ["0"],
    "train.engine_validation.max_rows": ["0"],
    "train.engine_validation.depth": ["0"],
    "train.engine_validation.prompts": ["-1"],
    "train.engine_validation.k": ["0"],
    "train.engine_validation.max_new_tokens": ["0"],
    "train.engine_validation.tolerance": ["-0.01", "2"],
    "train.engine_validation.wait_timeout_s": ["0"],
    "train.engine_validation.temperature": ["-1"],
    "train.engine_validation.top_p": ["0"],
    "train.engine_validation.top_k": ["-1"],
    "trainer.max_epochs": ["0", "-2", "abc"],
    "trainer.max_steps": ["0", "-2"],
    "trainer.gradient_clip_val": ["-1.0"],
    "trainer.log_every_n_steps": ["0"],
    "trainer.num_nodes": ["0"],
    "trainer.num_sanity_val_steps": ["-2"],
    "trainer.devices": ["0", "-2", "gpus", "[-1]"],
    "evaluate.num_prompts": ["0", "-3", "all"],
    "evaluate.max_new_tokens": ["0"],
    "evaluate.temperature": ["-0.5", "abc"],
    "evaluate.top_p": ["0", "1.5"],
    "evaluate.top_k": ["-1"],
    "evaluate.stop_below": ["0", "1.0", "1.5", "abc"],
    "evaluate.batch_size": ["0", "true"],
    "evaluate.turns": ["[3]", "[]", "[1,1]", "1"],
    "evaluate.auto_max_k": ["0"],
    "evaluate.auto_prompts": ["0"],
    "evaluate.auto_pairs": ["0"],
    "evaluate.auto_draft_vocab": ["[0]", "[]", "8192"],
    "evaluate.tree.depth": ["0"],
    "evaluate.tree.topk": ["0"],
    "evaluate.tree.total": ["0"],
    "evaluate.head_dtype": ["int8"],
    "evaluate.weight_dtype": ["float16", "int8"],
    "evaluate.speed_pairs": ["0"],
    "evaluate.predict_prompts": ["-1"],
    "evaluate.warmup": ["-1"],
    "evaluate.repeats": ["0"],
    "evaluate.report": ["{dir}"],
    "evaluate.simulated_tau": ["perhaps"],
    "evaluate.plain_baseline": ["2"],
    "evaluate.vllm.tensor_parallel_size": ["0"],
    "evaluate.vllm.data_parallel_size": ["-1"],
    "evaluate.vllm.gpu_memory_utilization": ["0", "auto"],
    "evaluate.vllm.cpu_kvcache_space_gb": ["0"],
    "evaluate.vllm.startup_timeout_s": ["-1"],
    "export.source": ["{file}"],
    "export.root": ["{file}"],
    "export.dir": ["''"],
}
# the head type that has a head setting (tiny_overrides train the 1-module `mtp` head)
HEAD_OF = {"head.num_layers": "head=draft_lm", "head.num_heads": "head=medusa", "head.draft_vocab_size": "head=eagle3",
           "head.mask_token_id": "head=dflash"}
# settings a typed config checks, refused by the same checks before work: (stage, override, words)
DELEGATED = [
    ("train", "train.module.warmup_steps=-5",
     "train.module.warmup_steps=-5: expected a whole number of optimizer steps ≥ 0"),
    ("train", "train.module.betas=[0.9,1.0]", "train.module.betas=[0.9, 1.0]: expected two moment decays in [0, 1)"),
    ("train", "train.module.depth=0", "train.module.depth=0: expected a whole number of draft steps ≥ 1"),
    ("train", "train.module.lr=abc", "train.module.lr='abc': expected a learning rate > 0"),
    ("train", "train.module.detach_depths=maybe", "train.module.detach_depths='maybe': expected true or false"),
    ("precompute", "target.dtype=int8", "target.dtype='int8': expected one of bfloat16, float16, float32"),
    ("evaluate", "target.fingerprint=sha", "target.fingerprint='sha': expected one of header, full"),
    *[("evaluate", f"evaluate.compile={bad}", f"evaluate.compile={shown}: expected one of auto, on, off")
      for bad, shown in (("yes", "'yes'"), ("1", "'1'"), ("[on]", "\"['on']\""))],
    ("precompute", "data.max_record_bytes=0", "data.max_record_bytes=0: expected a positive whole number of bytes"),
    *[(stage, f"data.max_length={bad}", f"data.max_length={shown}: expected a whole number of tokens ≥ 1")
      for stage in ("precompute", "regenerate") for bad, shown in (("-5", "-5"), ("0", "0"), ("1.5", "1.5"),
                                                                   ("abc", "'abc'"), ("null", "None"))],
    *[(stage, f"data.skip={bad}", f"data.skip={shown}: expected a whole number of conversations ≥ 0")
      for stage in ("precompute", "evaluate") for bad, shown in (("-1", "-1"), ("abc", "'abc'"))],
    *[(stage, f"data.max_samples={bad}",
       f"data.max_samples={shown}: expected null (the whole source) or a whole number of conversations ≥ 1")
      for stage in ("regenerate", "evaluate") for bad, shown in (("0", "0"), ("-10", "-10"), ("abc", "'abc'"))],
    ("precompute", "+data.max_sample=10", "data.max_sample: not a data setting"),
    ("train", "+head.num_moduls=2", "head (head.type=mtp): MTPConfig.__init__() got an unexpected keyword argument"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Loading a target, a tokenizer or the data fails the test (tests/helpers.py `forbid_work`)."""
    forbid_work(monkeypatch)


def refused_fast(cfg, stage: str) -> str:
    """The checks before work of `stage` refuse `cfg` (in well under a second): the message."""
    t0 = time.perf_counter()
    with pytest.raises((ConfigError, ValueError)) as err:
        check_before_work(cfg, stage)
    assert time.perf_counter() - t0 < FAST_S
    return str(err.value)


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    return compose_config(list(overrides))


def compose_then_set(overrides: list[str], leaves: list[str]):
    """What `compose_config([*overrides, *leaves])` returns, for leaf overrides (`key=value`): the config composed
    from `overrides` once per process, then the leaves applied by hydra's own parser and the step compose ends with
    (hydra applies value overrides after every group is merged). Composing costs ≈ 0.1 s, and the rules below need
    several hundred configs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = copy.deepcopy(_composed(tuple(overrides)))
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(leaves), cfg)
    return cfg


def compose_tiny(tiny_overrides: list[str], groups: list[str], leaves: list[str]):
    """`compose_then_set` for the tiny target's overrides: their run directory (a fresh one per test) set as a leaf,
    so that one composed config serves every test."""
    base = [o for o in tiny_overrides if not o.startswith("run_dir=")]
    return compose_then_set([*base, *groups], [*(o for o in tiny_overrides if o.startswith("run_dir=")), *leaves])


def readers(stages: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """(stage, extra overrides) of each stage that reads a setting, and the demo's (which reads every one)."""
    out = [(s, []) for s in stages if s not in (ONLINE, "pipeline")]
    if ONLINE in stages:
        out.append(("train", ["train.data.source=online"]))
    return [*out, ("pipeline", [])]


def bad_override(key: str, value: str, tmp_path: Path) -> str:
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    value = value.format(file=tmp_path / "a_file", dir=tmp_path / "a_dir", missing=tmp_path / "missing.ckpt")
    return f"{key}={value}"


def leaves(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def presets() -> list[list[str]]:
    groups = [("trainer", "trainer"), ("head", "head"), ("experiment", "experiment"), ("target", "target")]
    return [[], *[[f"{name}={p.stem}"] for group, name in groups
                  for p in sorted((ROOT / "conf" / group).glob("*.yaml"))]]


@pytest.mark.parametrize("stage,override,key,words", HOLES, ids=[h[1] for h in HOLES])
def test_each_hole_is_refused_naming_the_setting_and_its_range(stage, override, key, words, tiny_overrides, no_work):
    message = refused_fast(compose_tiny(tiny_overrides, [], [override]), stage)
    assert message.startswith(f"{key}=") and words in message, message


CASES = [(rule.key, bad) for rule in RULES for bad in BAD.get(rule.key, [])]


def test_setting_leaves_on_a_composed_config_is_composing_them(tiny_overrides, tmp_path):
    """The shortcut the rule cases take gives the config hydra composes, bad values and their types included."""
    base = [o for o in tiny_overrides if not o.startswith("run_dir=")]
    for extra, leaves_ in ((["head=dflash"], [f"run_dir={tmp_path}", "head.mask_token_id=-1", "seed=1.5"]),
                           (["train.data.source=online"], [f"run_dir={tmp_path}", "precompute.aux_layers=[1,1]",
                                                          "target.revision=true", "run_name='../evil'"])):
        got = OmegaConf.to_container(compose_then_set([*base, *extra], leaves_), resolve=False)
        assert got == OmegaConf.to_container(compose_config([*base, *extra, *leaves_]), resolve=False)
    with pytest.raises(Exception, match="seeed"):
        compose_then_set(base, ["seeed=1"])  # as compose refuses a key the config does not have


@pytest.mark.parametrize("key,bad", CASES, ids=[f"{k}={b}" for k, b in CASES])
def test_every_rule_refuses_its_bad_values_in_every_stage_that_reads_it(key, bad, tiny_overrides, tmp_path, no_work):
    rule = RULES_BY_KEY[key]
    for stage, extra in readers(rule.stages):
        head = [HEAD_OF[key]] if key in HEAD_OF else []
        cfg = compose_tiny(tiny_overrides, [*head, *extra], [bad_override(key, bad, tmp_path)])
        message = refused_fast(cfg, stage)
        assert message.startswith(f"{key}=") and f": expected {rule.accept.text}" in message, (stage, message)


def test_every_rule_has_bad_values_and_every_stage_reads_a_rule():
    assert sorted(BAD) == sorted(RULES_BY_KEY), set(BAD) ^ set(RULES_BY_KEY)
    assert len(RULES_BY_KEY) == len(RULES)  # one row per setting
    assert all(rule.stages for rule in RULES)
    assert {s for rule in RULES for s in rule.stages} == {*EVERY, ONLINE, "pipeline"}
    for _, _, key, _ in HOLES:
        assert key in RULES_BY_KEY or key.startswith(("train.module.", "data.")), key


@pytest.mark.parametrize("stage,override,words", DELEGATED, ids=[d[1] for d in DELEGATED])
def test_settings_of_the_typed_configs_are_refused_by_the_same_checks(stage, override, words, tiny_overrides,
                                                                      no_work):
    cfg = compose_tiny(tiny_overrides, [], [override])
    for each in (stage, "pipeline"):
        assert words in refused_fast(cfg, each)


def test_a_misspelt_data_or_vllm_setting_is_refused_not_ignored(tiny_overrides, no_work):
    """The typed sections take no key they do not know: a misspelt bound or vLLM setting would otherwise be dropped
    without a word and the default used."""
    cfg = compose_config([*tiny_overrides, "precompute.backend=vllm", "+precompute.vllm.in_fligt=2"])
    assert "precompute.vllm.in_fligt: not a vLLM setting (expected " in refused_fast(cfg, "precompute")
    cfg = compose_config([*tiny_overrides, "+data.max_nesting_depth=3"])
    for stage in ("precompute", "regenerate", "evaluate", "pipeline"):
        assert "data.max_nesting_depth: not a data setting" in refused_fast(cfg, stage)


def test_every_numeric_setting_of_the_config_has_a_rule():
    """A number (or a null that stands for one) in conf/config.yaml, conf/data/, conf/trainer/ or conf/head/ is a
    `RULES` row, a ModuleSettings field, or checked by a typed config named here: adding a setting means adding its
    row."""
    typed = {"data.max_record_bytes", "data.max_nesting", "data.max_length", "data.skip",  # data/sources.py DataConfig
             "data.max_samples", "data.split", "data.name", "data.streaming", "data.columns",
             "head.block_size", "head.markov_rank"}  # heads/dflash.py DFlashConfig / DSparkConfig, through check_head
    not_numbers = {"regenerate.device", "target.path", "target.device_map", "data.path", "data.chat_template",
                   "evaluate.prompts_path", "export.formats", "head.aux_layers", "head.target_layers",
                   "logger.entity"}  # paths and lists checked elsewhere (check_source, check_target, the heads)
    presets = [[], *[[f"trainer={p.stem}"] for p in sorted((ROOT / "conf" / "trainer").glob("*.yaml"))],
               *[[f"head={p.stem}"] for p in sorted((ROOT / "conf" / "head").glob("*.yaml"))]]
    missing = set()
    for preset in presets:
        cfg = OmegaConf.to_container(compose_config(preset), resolve=False)
        for key, value in leaves(cfg):
            if key.startswith(("train.module.", "trainer.strategy.", "hydra.")):
                continue  # ModuleSettings; the strategies' own configs (DeepSpeed's, FSDP2's)
            numeric = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
            if numeric and key not in RULES_BY_KEY and key not in typed and key not in not_numbers:
                missing.add(key)
    assert not missing, sorted(missing)


@pytest.mark.parametrize("preset", presets(), ids=lambda p: p[0] if p else "defaults")
def test_no_shipped_preset_is_refused(preset, tiny_target):
    """Each preset as it ships passes every stage's rules, and the demo's whole checks before work (the packaged
    target and data: nothing is loaded); with the tiny target and data in place, every stage's checks but
    evaluation's (whose heads are trained later) pass too."""
    cfg = compose_config(preset)
    for stage in (*EVERY, "pipeline"):
        check_settings(cfg, stage)
    if not OmegaConf.select(cfg, "evaluate.engine") == "vllm" or (ROOT / ".venv-vllm").exists():
        check_before_work(cfg, "pipeline")
    local = compose_config([*preset, f"target.path={tiny_target}", "target.source=null", "target.dtype=float32"])
    for stage in ("precompute", "train", "pipeline"):
        check_before_work(local, stage)


def test_evaluate_compile_takes_yamls_on_and_off():
    """An unquoted `compile: off` in a YAML file reads as false: taken as off, not refused and not switched on."""
    from evaluation.settings import EvalConfig
    from experiments.stages import engine_compile

    assert [engine_compile(v) for v in (False, True, "auto", "on", "off")] == ["off", "on", "auto", "on", "off"]
    with pytest.raises(ValueError, match="evaluate.compile='yes': expected one of auto, on, off"):
        EvalConfig(prompts=None, report=Path("r.json"), compile="yes")
