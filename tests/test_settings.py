"""The training module's settings (train/settings.py): the config's `train.module` and the dataclass agree key for
key, every wrong value is refused naming its setting (by the dataclass, the module, and the checks before work), and
a module built from keywords trains exactly as one built from a ModuleSettings."""

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from inference_eval.model import tied_target
from scripts.checks import ConfigError, check_training_strategy
from tests.conftest import compose_config
from train.block_loss import BlockLossConfig
from train.module import DraftHeadModule
from train.settings import ModuleSettings, deepspeed_conflicts

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(ModuleSettings)}
# the module's own default where the config sets another: the pipeline's lr (conf/config.yaml) is 1e-3, while a module
# built in code without one (tests, tools) keeps the 3e-4 it always had
CONFIG_ONLY_DEFAULTS = {"lr": (1.0e-3, 3e-4)}

# (settings, the words of the refusal): each check ModuleSettings makes
INVALID = [
    ({"offpolicy_weight": 1.5}, "train.module.offpolicy_weight=1.5: expected a weight in [0, 1]"),
    ({"offpolicy_weight": -0.1}, "train.module.offpolicy_weight=-0.1"),
    ({"optimizer": "sgd"}, "train.module.optimizer='sgd': expected one of"),
    ({"loss_on": "replies"}, "train.module.loss_on='replies': expected one of"),
    ({"clip_scope": "layer"}, "train.module.clip_scope='layer': expected one of"),
    ({"kl_temperature": 0.0}, "train.module.kl_temperature=0.0: expected a positive number"),
    ({"input_noise": -0.1}, "train.module.input_noise=-0.1: expected a number ≥ 0"),
    ({"dropout": 1.0}, "train.module.dropout=1.0: expected a probability in [0, 1)"),
    ({"dropout": -0.1}, "train.module.dropout=-0.1"),
    ({"dropout": 0.1, "gradient_checkpointing": True},
     "train.module.dropout=0.1 and train.module.gradient_checkpointing=true"),
    ({"deep_lr_scale": 0.0}, "train.module.deep_lr_scale=0.0: expected a positive number"),
    ({"deep_from_step": "half", "depth": 3}, "train.module.deep_from_step='half': expected an optimizer step"),
    ({"deep_from_step": -1, "depth": 3}, "train.module.deep_from_step=-1: expected an optimizer step"),
    ({"deep_from_step": 1.5, "depth": 3}, "train.module.deep_from_step=1.5: expected an optimizer step"),
    ({"deep_from_step": True, "depth": 3}, "train.module.deep_from_step=True: expected an optimizer step"),
    ({"deep_from_step": 3}, "train.module.deep_from_step=3 delays the depths ≥ 2, and train.module.depth is 1"),
    ({"deep_from_step": "auto"}, "train.module.deep_from_step=auto delays the depths ≥ 2"),
    ({"lr": -1e-3}, "train.module.lr=-0.001: expected a learning rate > 0"),
    ({"lr": 0}, "train.module.lr=0: expected a learning rate > 0"),
    ({"lr": "fast"}, "train.module.lr='fast': expected a learning rate > 0"),
    ({"weight_decay": -0.1}, "train.module.weight_decay=-0.1: expected a number ≥ 0"),
    ({"muon_momentum": 1.0}, "train.module.muon_momentum=1.0: expected a momentum in [0, 1)"),
    ({"warmup_steps": -5}, "train.module.warmup_steps=-5: expected a whole number of optimizer steps ≥ 0"),
    ({"warmup_steps": 2.5}, "train.module.warmup_steps=2.5: expected a whole number of optimizer steps ≥ 0"),
    ({"min_lr_ratio": 1.5}, "train.module.min_lr_ratio=1.5: expected a fraction of lr in [0, 1]"),
    ({"w_kl": -1.0}, "train.module.w_kl=-1.0: expected a loss weight ≥ 0"),
    ({"kl_chunk_size": 0}, "train.module.kl_chunk_size=0: expected a whole number of rows ≥ 1"),
    ({"depth": 0}, "train.module.depth=0: expected a whole number of draft steps ≥ 1"),
    ({"depth_decay": 0.0}, "train.module.depth_decay=0.0: expected a weight > 0"),
    ({"betas": [0.9, 1.0]}, "train.module.betas=[0.9, 1.0]: expected two moment decays in [0, 1)"),
    ({"betas": [0.9]}, "train.module.betas=[0.9]: expected two moment decays in [0, 1)"),
    ({"schedule": "step"}, "train.module.schedule='step': expected one of ('cosine', 'linear')"),
    ({"detach_depths": "no"}, "train.module.detach_depths='no': expected true or false"),
    ({"kl_temperature": "warm"}, "train.module.kl_temperature='warm': expected a positive number"),
    ({"block": {"anchors": 0}}, "train.module.block.anchors=0"),
    ({"block": {"weights": "flat"}}, "train.module.block.weights='flat'"),
]


from tests.test_unroll import head  # noqa: E402,F401  the 1-module mtp head of the tiny target (a fixture)


def test_every_config_key_is_a_setting_with_the_configs_default():
    """conf/config.yaml's `train.module` and ModuleSettings: the same keys, the same defaults (but the lr the config
    sets for the pipeline), and the section builds the settings it states."""
    section = OmegaConf.load(ROOT / "conf" / "config.yaml").train.module
    yaml = OmegaConf.to_container(section, resolve=True)
    assert sorted(yaml) == sorted(FIELDS)
    defaults = ModuleSettings()
    for key, value in yaml.items():
        if key in CONFIG_ONLY_DEFAULTS:
            assert (value, getattr(defaults, key)) == CONFIG_ONLY_DEFAULTS[key], key
        elif key == "block":
            assert BlockLossConfig(**value) == defaults.block
        elif key == "betas":
            assert tuple(value) == defaults.betas
        else:
            assert (type(value), value) == (type(getattr(defaults, key)), getattr(defaults, key)), key
    built = ModuleSettings.from_config(section)
    assert built == dataclasses.replace(defaults, lr=yaml["lr"])
    assert built.as_dict() == {**yaml, "betas": tuple(yaml["betas"])}


@pytest.mark.parametrize("overrides", [[], ["head=mtp"], ["head=eagle3"], ["head=dflash"], ["head=dspark"],
                                       ["head=medusa"], ["trainer=gpu"], ["trainer=8xh100_fsdp"], ["experiment=smoke"]])
def test_the_composed_presets_build_their_settings(overrides):
    cfg = compose_config(overrides)
    settings = ModuleSettings.from_config(cfg.train.module)
    assert settings.as_dict() == {**OmegaConf.to_container(cfg.train.module, resolve=True),
                                  "betas": tuple(cfg.train.module.betas)}
    check_training_strategy(cfg)  # the checks before work accept them


def test_every_train_module_setting_the_config_files_name_exists():
    """A `train.module.<key>` (or `.block.<key>`) named anywhere under conf/ — presets, study overrides, comments
    that give a command — is a setting."""
    blocks = {f.name for f in dataclasses.fields(BlockLossConfig)}
    named = set()
    for f in sorted((ROOT / "conf").rglob("*.yaml")):
        named.update(re.findall(r"train\.module\.(\w+)(?:\.(\w+))?", f.read_text()))
    assert named
    for key, sub in named:
        assert key in FIELDS, key
        assert key != "block" or not sub or sub in blocks, sub


def test_an_unknown_key_is_refused_naming_it_and_the_known_ones(head):
    with pytest.raises(ValueError, match=r"train\.module\.lrr: no such setting of the training module; known: lr, "
                                         r"weight_decay, .*, block$"):
        ModuleSettings.from_config({"lrr": 1e-3})
    with pytest.raises(ValueError, match=r"train\.module\.lrr, train\.module\.dept: no such setting"):
        ModuleSettings.from_config(OmegaConf.create({"lrr": 1e-3, "depth": 2, "dept": 2}))
    with pytest.raises(ValueError, match=r"train\.module\.block\.anchor: no such setting of the block loss; known: "
                                         r"anchors, gamma"):
        ModuleSettings.from_config({"block": {"anchor": 8}})
    with pytest.raises(ValueError, match=r"train\.module\.lrr: no such setting"):
        DraftHeadModule(head, lrr=1e-3)
    cfg = compose_config(["+train.module.lrr=0.001"])
    with pytest.raises(ConfigError, match=r"train\.module\.lrr: no such setting"):
        check_training_strategy(cfg)


@pytest.mark.parametrize("bad,words", INVALID, ids=[next(iter(b)) + "=" + str(b[next(iter(b))]) for b, _ in INVALID])
def test_each_invalid_value_is_refused_naming_its_setting(bad, words, head):
    """The same refusal from the dataclass, from its config section, from the module's keywords, and from the
    checks before work on a composed config (before any model or data loads)."""
    for build in (lambda: ModuleSettings(**bad), lambda: ModuleSettings.from_config(bad),
                  lambda: DraftHeadModule(head, **bad)):
        with pytest.raises(ValueError, match=re.escape(words)):
            build()
    cfg = compose_config(["head=mtp"])
    cfg.train.module = OmegaConf.merge(cfg.train.module, bad)
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_training_strategy(cfg)


def test_the_checks_that_need_the_head_stay_in_the_module(head):
    """dropout and deep_lr_scale are valid settings; this head (one module, no dropout layers off the unroll)
    refuses deep_lr_scale ≠ 1."""
    settings = ModuleSettings(deep_lr_scale=2.0)
    with pytest.raises(ValueError, match="deep_lr_scale=2.0 .*no separate per-depth modules"):
        DraftHeadModule(head, settings)


def test_deepspeed_conflicts_read_settings_or_a_mapping():
    for settings in ({"optimizer": "muon", "clip_scope": "module", "depth": 3, "deep_from_step": 2},):
        typed = deepspeed_conflicts(ModuleSettings(**settings))
        assert typed == deepspeed_conflicts(settings) == deepspeed_conflicts(OmegaConf.create(settings))
        assert [p.split(" ")[0].split("=")[0] for p in typed] == ["train.module.deep_from_step",
                                                                  "train.module.optimizer", "train.module.clip_scope"]
    assert deepspeed_conflicts({}) == deepspeed_conflicts(ModuleSettings(depth=3, deep_from_step="auto")) == []


def _batch(args, b=2, t=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, -5:] = False
    loss_mask = valid.clone()
    loss_mask[:, :6] = False
    return {"hidden": torch.randn(b, t, args.hidden_size, generator=gen),
            "input_ids": torch.randint(0, args.vocab_size, (b, t), generator=gen), "valid": valid,
            "loss_mask": loss_mask}


def _train(module, batch, steps=3):
    """The losses of `steps` optimizer steps as the module configures them (optimizer, lr schedule)."""
    module.trainer = type("T", (), {"estimated_stepping_batches": 10, "global_step": 0, "global_rank": 0})()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    losses = []
    for _ in range(steps):
        out = module.compute_loss(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        sched.step()
        losses.append(float(out["loss"].detach()))
    return losses


def test_keywords_and_a_settings_object_train_identically(head, tiny_target):
    _, args, _ = tied_target(tiny_target)
    batch = _batch(args)
    by_keywords = DraftHeadModule(copy.deepcopy(head), depth=3)
    by_settings = DraftHeadModule(copy.deepcopy(head), ModuleSettings(depth=3))
    assert by_keywords.settings == by_settings.settings == ModuleSettings(depth=3)
    assert dict(by_keywords.hparams) == dict(by_settings.hparams) == ModuleSettings(depth=3).as_dict()
    first = _train(by_keywords, batch)
    assert first == _train(by_settings, batch)
    assert first[-1] < first[0]
    with pytest.raises(TypeError, match="both"):
        DraftHeadModule(head, ModuleSettings(depth=3), depth=3)
    with pytest.raises(TypeError, match="must be a ModuleSettings"):
        DraftHeadModule(head, {"depth": 3})


def test_the_recorded_hyperparameters_are_plain_values(head):
    """What checkpoints and the logger get: plain values (the block settings a dict, betas a tuple), which a
    weights-only load reads back."""
    import io

    module = DraftHeadModule(head, ModuleSettings.from_config({"depth": 2, "betas": [0.8, 0.9],
                                                               "block": {"anchors": 16}}))
    hp = dict(module.hparams)
    assert hp["block"] == {**dataclasses.asdict(BlockLossConfig()), "anchors": 16}
    assert hp["betas"] == (0.8, 0.9) and hp["depth"] == 2
    buf = io.BytesIO()
    torch.save({"hyper_parameters": hp}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["hyper_parameters"] == hp
    assert ModuleSettings(**hp) == module.settings
