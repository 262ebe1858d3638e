"""Validation through the engine (train/validation.py): its teacher-forced numbers equal an
independent computation (the training forward over the stored features) on a tiny float32 target,
its τ is the speculative decoder's, and the callback logs τ inside a small training run."""

import csv

import pytest
import torch

from data.store import FeatureStore
from inference_eval.model import LlamaForCausalLM
from experiments.stages import run_precompute
from tests.reference_decoding import reference_speculative
from tests.conftest import compose_config
from tests.test_heads_family import make
from train.validation import (engine_teacher_forced, first_reply_prompt, select_rows, speculative_scores,
                              training_forward_scores)


@pytest.fixture
def store(tiny_overrides):
    cfg = compose_config(tiny_overrides + ["precompute.aux_layers=[1]"])  # eagle3 reads layer 1's input
    return FeatureStore(run_precompute(cfg)[0])


@pytest.mark.unit
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


@pytest.mark.unit
def test_speculative_scores_match_the_decoder(store, tiny_target):
    head = make(tiny_target, "mtp3").eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    prompts = [first_reply_prompt(store[i]["input_ids"], store[i]["loss_mask"]) for i in range(3)]
    assert all(p and len(p) < store[i]["input_ids"].shape[0] for i, p in enumerate(prompts))
    got = speculative_scores(target, head, prompts, 2, 12, set())
    emitted = steps = 0
    for p in prompts:  # the batch-1 loop, now only a reference: the same acceptance, so the same τ
        _, st = reference_speculative(target, head, p, 2, 12)
        emitted, steps = emitted + st.emitted, steps + st.steps
    assert got["tau"] == pytest.approx(emitted / steps)
    a1, a2 = got["tf_acc"]
    assert got["sim_tau"] == pytest.approx(1 + a1 + a1 * a2)


def test_callback_logs_engine_tau_during_training(tiny_overrides, tiny_target, tmp_path):
    from experiments.stages import run_training

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


@pytest.mark.unit
def test_bf16_divergence_is_counted_not_fatal(store, tiny_target, monkeypatch):
    """In bf16 a near-tie can round differently in verification and in decode: such prompts are
    counted (`mismatches`); in float32 (`strict`) a difference is a bug and raises."""
    import train.validation as V

    head = make(tiny_target, "mtp3").eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    real = V.engine_decode

    def flipped(target, head, *args, **kwargs):  # the speculative run diverges at the third new token
        outs, eng = real(target, head, *args, **kwargs)
        if head is not None:
            outs = [outs[0][:2] + [(outs[0][2] + 1) % 512] + outs[0][3:], *outs[1:]]
        return outs, eng

    monkeypatch.setattr(V, "engine_decode", flipped)
    prompt = first_reply_prompt(store[0]["input_ids"], store[0]["loss_mask"])
    got = speculative_scores(target, head, [prompt], 2, 8, set(), strict=False)
    assert got["mismatches"] == 1 and got["tau"] >= 1.0
    with pytest.raises(AssertionError, match="at new token 2"):
        speculative_scores(target, head, [prompt], 2, 8, set(), strict=True)


# ---- failures: bugs fail the run with their figures, transient errors are logged ---------------------

def _stub_run(store, head, tmp_path, step=5):
    """What EngineValidation.run reads from Lightning's trainer and module."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(global_step=step, is_global_zero=True, logger=None, default_root_dir=str(tmp_path),
                              datamodule=SimpleNamespace(store=store, val_idx=[0, 1, 2]))
    return trainer, SimpleNamespace(head=head)


@pytest.mark.unit
def test_strict_defaults_to_float32_and_is_configurable(tiny_overrides, tiny_target):
    from train.validation import EngineValidation, EngineValidationSettings

    assert EngineValidation(EngineValidationSettings(tiny_target, "float32")).strict is True
    assert EngineValidation(EngineValidationSettings(tiny_target, "bfloat16")).strict is False
    assert EngineValidation(EngineValidationSettings(tiny_target, "float32", strict=False)).strict is False
    assert EngineValidation(EngineValidationSettings(tiny_target, "bfloat16", strict=True)).strict is True
    cfg = compose_config(tiny_overrides)
    assert cfg.train.engine_validation.strict is None  # null: the dtype decides
    off = compose_config(tiny_overrides + ["train.engine_validation.strict=false"])
    assert off.train.engine_validation.strict is False


def test_lossless_violation_in_float32_fails_the_run(tiny_overrides, monkeypatch):
    """A speculative output that parts from plain greedy output with a float32 target raises out of
    trainer.fit (it used to become engine_val/failed = 1), with the position and both tokens."""
    import train.validation as V
    from experiments.stages import run_training

    real, seen = V.engine_decode, {}

    def flipped(target, head, *args, **kwargs):  # the speculative run diverges at the third new token
        outs, eng = real(target, head, *args, **kwargs)
        if head is None:
            return outs, eng
        seen["real"] = list(outs[0])
        return [outs[0][:2] + [(outs[0][2] + 1) % 512] + outs[0][3:], *outs[1:]], eng

    monkeypatch.setattr(V, "engine_decode", flipped)
    ev = "train.engine_validation."
    cfg = compose_config(tiny_overrides + ["trainer.max_epochs=1", "train.module.depth=2", f"{ev}every_n_steps=null",
                                           f"{ev}prompts=1", f"{ev}conversations=1", f"{ev}max_new_tokens=6", f"{ev}k=2"])
    run_precompute(cfg)
    with pytest.raises(V.LosslessViolation, match="at new token 2 .* the engine is not lossless") as info:
        run_training(cfg)
    f = info.value.figures
    plain = seen["real"][2]  # float32: the unpatched speculative output is the plain one
    assert (f["new_token"], f["plain_token"], f["speculative_token"]) == (2, plain, (plain + 1) % 512)
    assert f["prompt"] == 0 and f["k"] == 2 and f["plain_len"] == f["speculative_len"] == len(seen["real"])
    assert f"speculative token {(plain + 1) % 512} vs plain {plain}" in str(info.value)


@pytest.mark.unit
def test_gap_above_tolerance_raises_in_strict_mode_and_warns_otherwise(store, tiny_target, tmp_path, monkeypatch,
                                                                       caplog):
    """The training forward's agreement is forced far from the engine's (≥ 0.5 apart at every depth):
    non-strict logs a warning with the figures and reports the gap; strict raises EngineTrainingGap
    with the same figures out of the callback."""
    import train.validation as V

    real = V.training_forward_scores

    def off(*args, **kwargs):
        scores = real(*args, **kwargs)
        for s in scores:  # the far side of one half
            s.agree = 0 if 2 * s.agree > s.n else s.n
        return scores

    monkeypatch.setattr(V, "training_forward_scores", off)
    head = make(tiny_target, "mtp3").train()
    kw = dict(conversations=1, max_rows=12, depth=2, prompts=0, tolerance=0.02)
    lenient = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", strict=False, **kw))
    with caplog.at_level("WARNING", logger="train.validation"):
        m = lenient.run(*_stub_run(store, head, tmp_path))
    assert "engine_val/failed" not in m
    gaps = [m[f"engine_val/gap_acc_d{d}"] for d in (1, 2)]
    assert min(gaps) >= 0.5
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"gap {gaps[0]:.4f}" in warned[0] and f"gap {gaps[1]:.4f}" in warned[0]

    strict = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", **kw))  # float32: strict by default
    assert strict.strict
    with pytest.raises(V.EngineTrainingGap, match="beyond tolerance 0.02") as info:
        strict.run(*_stub_run(store, head, tmp_path))
    assert head.training  # the callback restored the head's mode on the way out
    got = info.value.figures["gaps"]
    assert [g["depth"] for g in got] == [1, 2]
    for d, g in enumerate(got, start=1):
        assert g["gap"] == pytest.approx(m[f"engine_val/gap_acc_d{d}"])
        assert g["engine_acc"] == pytest.approx(m[f"engine_val/acc_d{d}"])
        assert g["train_acc"] == pytest.approx(m[f"engine_val/train_acc_d{d}"])
        assert f"{g['engine_acc']:.4f} in the engine vs {g['train_acc']:.4f} in the training forward" in str(info.value)
    assert strict.results == []  # nothing reported as measured


@pytest.mark.unit
def test_gap_within_tolerance_passes_strict(store, tiny_target, tmp_path):
    """The unpatched float32 run: engine and training forward agree, strict mode reports numbers."""
    import train.validation as V

    head = make(tiny_target, "mtp3")
    m = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", conversations=2, max_rows=12, depth=2, prompts=0)).run(
        *_stub_run(store, head, tmp_path))
    assert m["engine_val/gap_acc_d1"] == 0.0 and m["engine_val/gap_acc_d2"] == 0.0
    assert "engine_val/failed" not in m and m["step"] == 5


@pytest.mark.unit
def test_the_decoded_prompts_are_written_for_evaluate_to_read_back(store, tiny_target, tmp_path):
    """engine_val/prompts.jsonl holds the prompts validation decoded, as token ids; evaluate.dataset=jsonl reads
    them back unchanged (data/prompts.py `input_ids` records), so the same prompts can be evaluated apart."""
    import train.validation as V
    from data.prompts import jsonl_prompts

    head = make(tiny_target, "mtp3")
    cb = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", conversations=1, max_rows=4, depth=1,
                                                       prompts=2, max_new_tokens=3, plot_dir=tmp_path / "ev"))
    m = cb.run(*_stub_run(store, head, tmp_path))
    assert m["engine_val/tau"] >= 1.0
    want = [V.first_reply_prompt(store[i]["input_ids"], store[i]["loss_mask"]) for i in (0, 1, 2)]
    got = jsonl_prompts(None, tmp_path / "ev" / "prompts.jsonl", None)
    assert [p["ids"] for p in got] == [w for w in want if w is not None][:2] and len(got) == 2
    assert {p["category"] for p in got} == {"held-out"}
    bad = tmp_path / "bad.jsonl"
    for line, words in (('{"input_ids": []}', "non-empty list"), ('{"input_ids": [3, -1]}', "non-negative"),
                        ('{"input_ids": [3, "a"]}', "token ids")):
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=rf"bad.jsonl:1: `input_ids` must be .*{words}"):
            jsonl_prompts(None, bad, None)


@pytest.mark.unit
def test_transient_error_is_logged_as_failed(store, tiny_target, tmp_path, monkeypatch, caplog):
    """A file gone (the target's): no number is wrong, the run goes on with engine_val/failed."""
    import train.validation as V

    err = FileNotFoundError("model.safetensors: no such file")

    def boom(*args, **kwargs):
        raise err

    head = make(tiny_target, "mtp3").train()
    cb = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", conversations=1, max_rows=4, depth=1, prompts=0))
    monkeypatch.setattr(cb, "_load", boom)  # the target's files gone: loading it fails
    with caplog.at_level("ERROR", logger="train.validation"):
        m = cb.run(*_stub_run(store, head, tmp_path, step=7))
    assert m == {"engine_val/failed": 1.0, "step": 7} and cb.results == [m]
    assert head.training
    assert any("transient" in r.getMessage() and r.exc_info and r.exc_info[1] is err for r in caplog.records)


@pytest.mark.unit
@pytest.mark.parametrize("err", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"),
                                 MemoryError()],
                         ids=["cuda-oom", "cpu-oom", "memory-error"])
@pytest.mark.parametrize("where", ["engine", "load"])
def test_out_of_memory_ends_the_run_with_the_settings_to_change(store, tiny_target, tmp_path, monkeypatch, err, where):
    """Out of memory would recur at every interval (a target larger than the device): not retried as a
    transient, it ends the run with ValidationOutOfMemory naming engine=vllm, target.device and the sizes."""
    import train.validation as V

    def boom(*args, **kwargs):
        raise err

    head = make(tiny_target, "mtp3").train()
    cb = V.EngineValidation(V.EngineValidationSettings(tiny_target, "float32", conversations=1, max_rows=4, depth=1, prompts=0))
    if where == "load":
        monkeypatch.setattr(cb, "_load", boom)
    else:
        monkeypatch.setattr(V, "engine_teacher_forced", boom)
    with pytest.raises(V.ValidationOutOfMemory, match=r"at step 7 ran out of memory .*set "
                       r"train\.engine_validation\.engine=vllm .*tensor_parallel_size.*target\.device=cpu") as info:
        cb.run(*_stub_run(store, head, tmp_path, step=7))
    assert info.value.__cause__ is err and cb.results == [] and head.training


@pytest.mark.unit
def test_unexpected_error_propagates(store, tiny_target, tmp_path, monkeypatch):
    """An error in the validation/engine code (not OOM, not the file system) is a bug: it propagates."""
    import train.validation as V

    def boom(*args, **kwargs):
        raise IndexError("index 9 is out of bounds for dimension 1 with size 8")

    monkeypatch.setattr(V, "engine_teacher_forced", boom)
    cb = V.EngineValidation(V.EngineValidationSettings(tiny_target, "bfloat16", conversations=1, max_rows=4, depth=1, prompts=0))
    with pytest.raises(IndexError, match="index 9"):
        cb.run(*_stub_run(store, make(tiny_target, "mtp3"), tmp_path))
    assert cb.results == []


def test_validation_and_evaluation_decode_through_the_paged_engine(store, tiny_target, tiny_overrides, monkeypatch,
                                                                   tmp_path):
    """Validation's τ and evaluation's τ are the paged engine's: every decode goes through Engine.run
    (counted), the product holds no other decoder (the batch-1 loop lives in tests/reference_decoding.py
    only), and the τ reported is the one the engine measured."""
    import inference_eval.engine as G
    import evaluation.evaluate as E
    import inference_eval.speculative as S
    import train.validation as V
    from experiments.stages import run_evaluation, run_training

    for module, names in ((S, ("HeadProposer", "as_proposer", "RefDraftModelProposer")), (E, ("evaluate_head",))):
        assert not any(hasattr(module, n) for n in names)  # one decoder: no batch-1 loop left in the product
    cfg = compose_config(tiny_overrides + ["trainer.max_epochs=1", "train.engine_validation.enabled=false",
                                           "evaluate.heads.untrained=null", f"run_dir={tmp_path / 'paged'}"])
    run_precompute(cfg)
    run_training(cfg)
    runs = []
    real_run = G.Engine.run

    def counted(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        runs.append(self)
        return out

    monkeypatch.setattr(G.Engine, "run", counted)
    head = make(tiny_target, "mtp3").eval()
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    prompts = [first_reply_prompt(store[i]["input_ids"], store[i]["loss_mask"]) for i in range(2)]
    got = V.speculative_scores(target, head, prompts, 2, 8, set())
    spec_runs = [e for e in runs if e.proposer is not None]
    assert len(spec_runs) == 1 and got["tau"] == pytest.approx(spec_runs[0].stats.tau) and got["mismatches"] == 0
    runs.clear()
    report = run_evaluation(cfg)
    spec_runs = [e for e in runs if e.proposer is not None]
    assert len(spec_runs) == 2  # evaluate.warmup=1: a warm-up engine, then the timed pass over every prompt
    assert report["results"]["trained"]["tau"] == pytest.approx(spec_runs[-1].stats.tau)
    assert report["results"]["trained"]["target_passes"] == spec_runs[-1].stats.steps
    assert "simulated_tau" in report["results"]["trained"]
