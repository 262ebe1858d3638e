"""Online training (train/online.py): the target computes each batch's states; an online run and an
offline run (precompute, then train on the store) over the same conversations, seed and batches give the
same per-step losses and the same head — float32, tiny target, tolerance below."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from data.precompute import run_precompute
from data.store import FeatureStore
from tests.conftest import compose_config
from train.data import collate, collate_packed
from train.online import OnlineSamples, TargetStates
from train.run import data_module, run_training

# Offline states come from precompute's packed batches (other samples beside them), online ones from the
# training batch's real tokens packed into one row: the same float32 arithmetic over other matrix shapes, so
# equal to rounding at most. Measured on this CPU (2 epochs, 10 steps): equal bit for bit — states, losses,
# heads, padded and packed batches alike (the padded path ran the padded rows before: states 1.2e-7 apart,
# losses 7e-7 relative). The bounds leave room for a BLAS whose results depend on the rows beside them;
# states perturbed by 1e-3 noise fail at step 0.
STATE_ATOL = 1e-5
LOSS_RTOL = 1e-5


class RecordSteps(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rows = [ids[valid].tolist() for ids, valid in zip(batch["input_ids"], batch["valid"])]
        self.steps.append({"loss": float(outputs["loss"]), "rows": rows})


def _overrides(tiny_overrides, tmp_path, name, *extra):
    return tiny_overrides + [f"run_dir={tmp_path / name}", "trainer.max_epochs=2", "train.untrained_dir=null",
                             "train.engine_validation.enabled=false", "train.data.batch_tokens=512", *extra]


ENGINE_VAL = ["train.engine_validation.enabled=true", "train.engine_validation.every_n_steps=null",
              "train.engine_validation.conversations=2", "train.engine_validation.prompts=2",
              "train.engine_validation.max_new_tokens=6"]


def _train(overrides):
    cfg = compose_config(overrides)
    rec = RecordSteps()
    head_dir, metrics = run_training(cfg, extra_callbacks=[rec])
    return rec.steps, load_file(str(head_dir / "model.safetensors")), metrics


def _assert_same_run(online, offline):
    (on_steps, on_head, on_m), (off_steps, off_head, off_m) = online, offline
    assert len(on_steps) == len(off_steps) >= 4
    assert [s["rows"] for s in on_steps] == [s["rows"] for s in off_steps]  # the same batches, in order
    for n, (a, b) in enumerate(zip(on_steps, off_steps)):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), f"step {n}"
    assert on_head.keys() == off_head.keys()
    for k in on_head:
        torch.testing.assert_close(on_head[k], off_head[k], rtol=1e-4, atol=1e-5, msg=k)
    assert on_m["val/loss"] == pytest.approx(off_m["val/loss"], rel=LOSS_RTOL)
    engine = sorted(k for k in off_m if k.startswith("engine_val/"))
    assert sorted(k for k in on_m if k.startswith("engine_val/")) == engine
    for k in engine:  # in-loop validation: teacher-forced scores on held-out samples online, τ, α
        assert on_m[k] == pytest.approx(off_m[k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("head,packing", [("mtp", False), ("eagle3", False), ("mtp", True)],
                         ids=["mtp", "eagle3-aux", "mtp-packed"])
def test_online_training_equals_offline(tiny_overrides, tmp_path, head, packing):
    extra = [f"head={head}", f"train.data.packing={str(packing).lower()}"]
    if head == "eagle3":
        extra += ["head.draft_vocab_size=64"]
    if not packing:  # in-loop validation at the end, its held-out states computed online: the same figures
        extra += ENGINE_VAL
    offline_over = _overrides(tiny_overrides, tmp_path, "offline", *extra)
    run_precompute(compose_config(offline_over))
    offline = _train(offline_over)
    online = _train(_overrides(tiny_overrides, tmp_path, "online", *extra, "train.data.source=online"))
    _assert_same_run(online, offline)


def test_online_batches_hold_what_the_store_holds(tiny_overrides, tmp_path):
    """The same samples and split as the store, and each batch's states (aux layers included) equal the
    stored ones to rounding; the padding is zero as `collate` pads a stored batch."""
    over = _overrides(tiny_overrides, tmp_path, "run", "head=eagle3")
    cfg = compose_config(over)
    store_dir, _ = run_precompute(cfg)
    store = FeatureStore(store_dir)
    dm, target = data_module(compose_config(over + ["train.data.source=online"]), cfg.target.path, None)
    dm.setup("fit")
    samples = dm.store
    assert isinstance(samples, OnlineSamples) and samples.sample_ids() == store.sample_ids()
    assert samples.lengths() == store.lengths() and samples.aux_layers == store.aux_layers
    assert torch.equal(samples.token_counts(64, dm.train_idx), store.token_counts(64, dm.train_idx))
    states = TargetStates(target, samples.aux_layers)
    idx = [0, 3, 5]
    for pack in (collate, collate_packed):
        got = states(pack([samples[i] for i in idx]))
        want = pack([store[i] for i in idx])
        assert got.keys() == want.keys()
        for key in ("input_ids", "loss_mask", "valid"):
            assert torch.equal(got[key], want[key])
        for key in ("hidden", "aux_hidden"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=STATE_ATOL)
        if pack is collate:
            assert not got["hidden"][~got["valid"]].any()


def test_online_shares_the_targets_frozen_tensors(tiny_overrides, tmp_path):
    """The head's embedding, lm_head and final norm are the target's own tensors (one copy)."""
    from train.run import init_head

    over = _overrides(tiny_overrides, tmp_path, "run", "train.data.source=online")
    cfg = compose_config(over)
    dm, target = data_module(cfg, cfg.target.path, None)
    dm.setup("fit")
    head = init_head(cfg, cfg.target.path, dm, target)
    assert head.tied.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert head.tied.lm_head.data_ptr() == target.lm_head.weight.data_ptr()
    assert head.tied.norm_weight.data_ptr() == target.model.norm.weight.data_ptr()


def test_an_unknown_source_names_the_setting(tiny_overrides, tmp_path):
    cfg = compose_config(_overrides(tiny_overrides, tmp_path, "run", "train.data.source=disk"))
    with pytest.raises(ValueError, match=r"train.data.source='disk': expected `store`.*or `online`"):
        data_module(cfg, cfg.target.path, None)


def test_torchrun_two_ranks_online_equal_offline_and_resume(tiny_overrides, tmp_path):
    """2 processes (DDP, gloo), 10 steps: each rank's online losses equal the offline run's at every step,
    the saved heads agree, and an online run stopped at step 4 and resumed from its checkpoint continues the
    same curve (the data module's place in its epoch is restored: the same batches)."""
    from tests.test_multiprocess import STEPS, _overrides as ranked, _ranks, torchrun

    dirs = {n: tmp_path / n for n in ("offline", "online", "part", "resumed")}
    for d in dirs.values():
        d.mkdir()
    base = [*tiny_overrides, "train.engine_validation.enabled=false"]
    offline = ranked(base, "ddp", dirs["offline"], STEPS)
    cfg = compose_config(offline)
    run_precompute(cfg)
    torchrun("scripts.train", offline)
    online_run = [f"run_dir={tmp_path / 'online_run'}", "train.data.source=online", "train.untrained_dir=null"]
    proc = torchrun("scripts.train", [*ranked(base, "ddp", dirs["online"], STEPS), *online_run])
    assert "train: online" in proc.stdout + proc.stderr
    assert not (tmp_path / "online_run" / "features").exists()  # nothing stored
    part_run = [f"run_dir={tmp_path / 'part_run'}", "train.data.source=online", "train.untrained_dir=null"]
    torchrun("scripts.train", [*ranked(base, "ddp", dirs["part"], 4), *part_run])
    torchrun("scripts.train", [*ranked(base, "ddp", dirs["resumed"], STEPS), *part_run, "train.resume=last"])
    ref, got = _ranks(dirs["offline"]), _ranks(dirs["online"])
    first, rest = _ranks(dirs["part"]), _ranks(dirs["resumed"])
    assert len({round(s["loss"], 6) for s in ref[0]["steps"]}) == STEPS  # the curve moves
    for r in range(2):
        want = [s["loss"] for s in ref[r]["steps"]]
        assert [s["rows"] for s in got[r]["steps"]] == [s["rows"] for s in ref[r]["steps"]], r
        assert [s["loss"] for s in got[r]["steps"]] == pytest.approx(want, rel=LOSS_RTOL), r
        resumed = [s["loss"] for s in first[r]["steps"]] + [s["loss"] for s in rest[r]["steps"]]
        assert resumed == pytest.approx(want, rel=LOSS_RTOL), r
    want_head = load_file(str(cfg.head_dir) + "/model.safetensors")
    for run in ("online_run", "part_run"):
        head = load_file(tmp_path / run / "head" / "model.safetensors")
        for k, v in want_head.items():
            torch.testing.assert_close(head[k], v, rtol=1e-4, atol=1e-5, msg=f"{run}: {k}")


def test_online_training_is_checked_before_work_like_precompute(tiny_overrides, conversations_file, tmp_path):
    """Training online reads conversations: the checks before work that precompute runs on the data source and
    the chat template run for it too (a store-reading run needs neither)."""
    from scripts.checks import ConfigError, check_before_work

    bad_source = ["data.source=sharegpt", f"data.path={conversations_file}"]
    check_before_work(compose_config([*tiny_overrides, *bad_source]), "train")  # reads a store: not its concern
    with pytest.raises(ValueError, match="set data.source=jsonl"):
        check_before_work(compose_config([*tiny_overrides, *bad_source, "train.data.source=online"]), "train")
    base = tmp_path / "base"
    import json
    import shutil

    shutil.copytree(compose_config(tiny_overrides).target.path, base)
    tcfg = json.loads((base / "tokenizer_config.json").read_text())
    tcfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    over = [*tiny_overrides, f"target.path={base}"]
    check_before_work(compose_config(over), "train")
    with pytest.raises(ConfigError, match="no chat template .* chat_template.jinja"):
        check_before_work(compose_config([*over, "train.data.source=online"]), "train")
