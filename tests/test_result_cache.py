"""Result caches of the study scripts (experiments/cache.py, used by experiments/ablation.py and
experiments/fp8_study.py): a head or report on disk is reused only when its recorded key — the resolved
config sections and the store's / checkpoints' hashes — matches exactly and the result is unchanged;
otherwise it is recomputed. The expensive stages (training, evaluation, held-out scoring) are
replaced by counting fakes; precompute and the checkpoints are real."""

import json
import logging
from pathlib import Path

import pytest
import torch

from experiments import cache
from tests.conftest import compose_config
from tests.helpers import init_head_of, patch_everywhere


# ---- the helper ----------------------------------------------------------------------------------------

@pytest.mark.unit
def test_lookup_reuses_only_an_exact_key_and_an_unchanged_result(tmp_path, caplog):
    result = tmp_path / "report.json"
    key = {"config": {"evaluate": {"k": 3, "max_new_tokens": 64}}, "heads": {"a": {"model.safetensors": "ab"}}}
    with caplog.at_level(logging.INFO, logger="experiments.cache"):
        assert cache.lookup(result, key, "r") is None
    assert "no " in caplog.text
    result.write_text('{"tau": 2.0}')
    assert cache.lookup(result, key, "r") is None  # a result without a key: made before keys, or interrupted
    cache.record(result, key, seconds=12.5)
    rec = cache.lookup(result, json.loads(json.dumps(key)), "r")  # the same key after a JSON round trip
    assert rec is not None and rec["meta"] == {"seconds": 12.5}

    changed = {"config": {"evaluate": {"k": 3, "max_new_tokens": 65}}, "heads": key["heads"]}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="experiments.cache"):
        assert cache.lookup(result, changed, "r") is None
    assert "config.evaluate.max_new_tokens" in caplog.text and "config.evaluate.k" not in caplog.text
    assert not cache.key_path(result).exists()  # the stale key is gone: no later run can reuse the result
    assert cache.lookup(result, key, "r") is None

    cache.record(result, key)
    result.write_text('{"tau": 3.0}')  # overwritten by something else since
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="experiments.cache"):
        assert cache.lookup(result, key, "r") is None
    assert "changed since" in caplog.text


@pytest.mark.unit
def test_keys_follow_config_store_and_checkpoint(tiny_overrides, tmp_path):
    cfg = compose_config(tiny_overrides)
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text('{"shards": [1]}')
    a = cache.training_key(cfg, store)
    assert a == cache.training_key(compose_config(tiny_overrides), store)
    assert a != cache.training_key(compose_config(tiny_overrides + ["train.module.lr=2e-3"]), store)
    assert a["config"]["train"]["module"]["lr"] == 1e-3  # resolved values, not interpolations
    # a setting added later leaves the key at its neutral value (a head trained before it is still found)
    assert not {"detach_depths", "loss_on", "kl_temperature"} & set(a["config"]["train"]["module"])
    assert cache.training_key(compose_config(tiny_overrides + ["train.module.kl_temperature=0.5"]), store) != a
    assert cache.training_key(compose_config(tiny_overrides + ["train.module.detach_depths=false"]), store) == a
    cut = cache.training_key(compose_config(tiny_overrides + ["train.module.detach_depths=true"]), store)
    assert cut != a and cut["config"]["train"]["module"]["detach_depths"] is True
    # a key recorded while the setting was written out at its neutral value still matches
    written = json.loads(json.dumps(a))
    written["config"]["train"]["module"].update(loss_on="assistant", kl_temperature=1.0, detach_depths=False)
    result = tmp_path / "result.json"
    result.write_text("{}")
    cache.record(result, written)
    assert cache.lookup(result, a, "the result") is not None
    assert cache.lookup(result, cut, "the result") is None  # another setting: recomputed
    (store / "manifest.json").write_text('{"shards": [1, 2]}')
    assert a != cache.training_key(cfg, store)

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"weights")
    cfg.evaluate.heads = {"h": str(head)}
    e = cache.evaluation_key(cfg, {"weights_sha256": "t"})
    assert e == cache.evaluation_key(cfg, {"weights_sha256": "t"})
    assert e != cache.evaluation_key(cfg, {"weights_sha256": "u"})  # another target
    (head / "model.safetensors").write_bytes(b"weightz")
    assert e != cache.evaluation_key(cfg, {"weights_sha256": "t"})  # another checkpoint


# ---- the scripts -----------------------------------------------------------------------------------------

@pytest.fixture
def fakes(monkeypatch, tiny_target):
    """Counting stand-ins for training (a real native head, different weights on every call),
    evaluation (a report whose τ numbers the call) and held-out scoring."""
    import experiments.runner
    import experiments.stages
    from artifacts.checkpoint import save_native

    calls = {"train": [], "eval": []}

    def run_training(cfg, extra_callbacks=None):
        calls["train"].append(cfg.head_dir)
        head = init_head_of(cfg, tiny_target)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.01 * len(calls["train"]))
        save_native(head, cfg.head_dir)
        return Path(cfg.head_dir), {"val/acc_d1": 0.1 * len(calls["train"])}

    def run_evaluation(cfg):
        calls["eval"].append(cfg.evaluate.report)
        n = len(calls["eval"])
        report = {"prompts": 2, "results": {label: {"tau": 1.0 + n / 100, "alpha": [0.5], "tokens_per_s": 10.0,
                                                    "per_category_tau": {}} for label in cfg.evaluate.heads}}
        Path(cfg.evaluate.report).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.evaluate.report).write_text(json.dumps(report))
        return report

    def heldout_agreement(head, loader, depth):
        return {"acc": [0.5] * depth, "tokens": [1] * depth, "sim_tau": 1.5}

    patch_everywhere(monkeypatch, experiments.stages.run_training, run_training)  # experiments/ bind them at import
    patch_everywhere(monkeypatch, experiments.stages.run_evaluation, run_evaluation)
    monkeypatch.setattr(experiments.runner, "heldout_agreement", heldout_agreement)  # the runner's scoring
    return calls


def test_ablation_reuses_only_matching_results(tiny_overrides, fakes, tmp_path):
    from experiments.ablation import run_ablation

    base = tiny_overrides + ["+ablation.heads=[mtp]", "+ablation.ks=[1,2]", "+ablation.eval_depth=2"]
    first = run_ablation(compose_config(base))["results"]["mtp"]
    assert (len(fakes["train"]), len(fakes["eval"])) == (1, 2)
    assert not first["cached"] and not any(t["cached"] for t in first["tau"].values())

    again = run_ablation(compose_config(base))["results"]["mtp"]  # unchanged: everything reused
    assert (len(fakes["train"]), len(fakes["eval"])) == (1, 2)
    assert again["cached"] and all(t["cached"] for t in again["tau"].values())
    assert again["tau"] == {k: {**v, "cached": True} for k, v in first["tau"].items()}
    assert again["final_metrics"] == first["final_metrics"] == {"val/acc_d1": pytest.approx(0.1)}

    # an evaluation setting: both reports again, not the head
    run_ablation(compose_config(base + ["evaluate.max_new_tokens=9"]))
    assert (len(fakes["train"]), len(fakes["eval"])) == (1, 4)

    # a training setting: the head, and so (its weights differ) its reports
    changed = run_ablation(compose_config(base + ["evaluate.max_new_tokens=9", "train.module.lr=5e-4"]))
    assert (len(fakes["train"]), len(fakes["eval"])) == (2, 6)
    assert changed["results"]["mtp"]["final_metrics"] == {"val/acc_d1": pytest.approx(0.2)}
    assert changed["results"]["mtp"]["tau"][1]["tau"] == pytest.approx(1.05)  # the 5th evaluation, not an old one

    # the checkpoint replaced behind the script's back: retrained and re-evaluated
    head_dir = tmp_path / "run" / "heads" / "mtp"
    cfg = compose_config(base)
    from tests.helpers import init_head_of
    from artifacts.checkpoint import save_native
    save_native(init_head_of(cfg, Path(cfg.target.path)), head_dir)
    run_ablation(compose_config(base + ["evaluate.max_new_tokens=9", "train.module.lr=5e-4"]))
    assert (len(fakes["train"]), len(fakes["eval"])) == (3, 8)


def test_fp8_study_reuses_only_matching_results(tiny_overrides, fakes, tmp_path):
    from experiments.fp8_study import run_fp8_study

    base = tiny_overrides + ["+fp8_study.eval_depth=2"]
    first = run_fp8_study(compose_config(base))
    assert (len(fakes["train"]), len(fakes["eval"])) == (2, 2)
    assert first["fp8"]["cached"] == {"head": False, "evaluation": False}

    again = run_fp8_study(compose_config(base))
    assert (len(fakes["train"]), len(fakes["eval"])) == (2, 2)
    assert again["fp8"]["cached"] == {"head": True, "evaluation": True}
    assert (again["bfloat16"]["tau"], again["fp8"]["tau"]) == (first["bfloat16"]["tau"], first["fp8"]["tau"])

    run_fp8_study(compose_config(base + ["evaluate.num_prompts=3"]))  # evaluation only
    assert (len(fakes["train"]), len(fakes["eval"])) == (2, 4)

    # the fp8 head's checkpoint changed: that head retrained and re-evaluated, the bf16 one reused
    (tmp_path / "run" / "head_fp8" / "model.safetensors").write_bytes(b"not the recorded weights")
    out = run_fp8_study(compose_config(base + ["evaluate.num_prompts=3"]))
    assert fakes["train"][2:] == [str(tmp_path / "run" / "head_fp8")] and len(fakes["eval"]) == 5
    assert out["bfloat16"]["cached"] == {"head": True, "evaluation": True}
    assert out["fp8"]["cached"] == {"head": False, "evaluation": False}
