"""Validation through the engine (train/validation.py): its teacher-forced numbers equal an
independent computation (the training forward over the stored features) on a tiny float32 target,
its τ is the speculative decoder's, and the callback logs τ inside a small training run."""

import csv

import pytest
import torch

from data.precompute import run_precompute
from data.store import FeatureStore
from inference_eval.model import LlamaForCausalLM
from inference_eval.speculative import generate_speculative
from tests.conftest import compose_config
from tests.test_heads_family import make
from train.validation import (engine_teacher_forced, first_reply_prompt, select_rows, speculative_scores,
                              training_forward_scores)


@pytest.fixture
def store(tiny_overrides):
    cfg = compose_config(tiny_overrides + ["precompute.aux_layers=[1]"])  # eagle3 reads layer 1's input
    return FeatureStore(run_precompute(cfg)[0])


@pytest.mark.parametrize("name,depth", [("mtp3", 3), ("eagle3", 3), ("medusa", 3)])
def test_engine_scores_equal_the_training_forward(store, tiny_target, name, depth):
    head = make(tiny_target, name).eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    for i in range(3):
        s = store[i]
        rows = select_rows(s["loss_mask"], 12)
        assert 0 < len(rows) <= 12
        eng = engine_teacher_forced(target, head, s["input_ids"], s["loss_mask"], depth, rows)
        ref = training_forward_scores(head, s, depth, rows)
        for d, (e, r) in enumerate(zip(eng, ref), start=1):
            assert e.n == r.n > 0 and e.agree == r.agree, (name, i, d)
            assert e.kl == pytest.approx(r.kl, rel=1e-4, abs=1e-4)
            assert e.reg == pytest.approx(r.reg, rel=1e-4, abs=1e-5)
    # a different function gives different scores (the comparison can fail)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.5)
    moved = engine_teacher_forced(target, head, s["input_ids"], s["loss_mask"], depth, rows)
    assert moved[0].kl != pytest.approx(ref[0].kl, rel=1e-3)


def test_speculative_scores_match_the_decoder(store, tiny_target):
    head = make(tiny_target, "mtp3").eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    prompts = [first_reply_prompt(store[i]["input_ids"], store[i]["loss_mask"]) for i in range(3)]
    assert all(p and len(p) < store[i]["input_ids"].shape[0] for i, p in enumerate(prompts))
    got = speculative_scores(target, head, prompts, 2, 12, set())
    emitted = steps = 0
    for p in prompts:
        _, st = generate_speculative(target, head, p, 2, 12)
        emitted, steps = emitted + st.emitted, steps + st.steps
    assert got["tau"] == pytest.approx(emitted / steps)
    a1, a2 = got["tf_acc"]
    assert got["sim_tau"] == pytest.approx(1 + a1 + a1 * a2)


def test_callback_logs_engine_tau_during_training(tiny_overrides, tiny_target, tmp_path):
    from train.run import run_training

    cfg = compose_config(tiny_overrides + ["trainer.max_epochs=2", "train.engine_validation.every_n_steps=2",
                                           "train.engine_validation.prompts=2", "train.engine_validation.conversations=2",
                                           "train.engine_validation.max_new_tokens=6", "train.engine_validation.k=2",
                                           "train.module.depth=2", "train.engine_validation.temperature=0.8"])
    run_precompute(cfg)
    _, metrics = run_training(cfg)
    assert metrics["engine_val/tau"] >= 1.0 and 0.0 <= metrics["engine_val/acc_d1"] <= 1.0
    assert metrics["engine_val/tau_sampled"] >= 1.0 and 0.0 <= metrics["engine_val/alpha_sampled_1"] <= 1.0
    assert metrics["engine_val/gap_acc_d1"] < 1e-6 and metrics["engine_val/gap_acc_d2"] < 1e-6  # float32: same numbers
    rows = list(csv.DictReader(open(next((tmp_path / "run").rglob("metrics.csv")))))
    logged = [r for r in rows if r.get("engine_val/tau")]
    assert len(logged) >= 2  # every 2 steps and at the end
    assert {int(r["step"]) for r in logged} >= {2}
    assert list((tmp_path / "run" / "engine_val").glob("engine_val_alpha_step*.png"))


def test_bf16_divergence_is_counted_not_fatal(store, tiny_target, monkeypatch):
    """In bf16 a near-tie can round differently in verification and in decode: such prompts are
    counted (`mismatches`); in float32 (`strict`) a difference is a bug and raises."""
    import train.validation as V

    head = make(tiny_target, "mtp3").eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    real = V.generate_speculative

    def flipped(*args, **kwargs):  # a divergence at the third new token
        out, st = real(*args, **kwargs)
        return out[:2] + [(out[2] + 1) % 512] + out[3:], st

    monkeypatch.setattr(V, "generate_speculative", flipped)
    prompt = first_reply_prompt(store[0]["input_ids"], store[0]["loss_mask"])
    got = speculative_scores(target, head, [prompt], 2, 8, set(), strict=False)
    assert got["mismatches"] == 1 and got["tau"] >= 1.0
    with pytest.raises(AssertionError, match="at new token 2"):
        speculative_scores(target, head, [prompt], 2, 8, set(), strict=True)
