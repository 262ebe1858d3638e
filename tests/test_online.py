"""Online training (train/online.py): the target computes each batch's states; an online run and an
offline run (precompute, then train on the store) over the same conversations, seed and batches give the
same per-step losses and the same head — float32, tiny target, tolerance below."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from data.store import FeatureStore
from experiments.stages import run_precompute, run_training
from tests.conftest import compose_config
from tests.helpers import data_module_of
from train.data import collate, collate_packed
from train.online import OnlineSamples, TargetStates

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


def store_files(root) -> dict[str, bytes]:
    """A store's manifest and shards, by relative path (what precompute writes; not the verification stamp)."""
    from pathlib import Path

    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in [root / "manifest.json", *root.rglob("*.safetensors")]}


# eagle3-aux also writes its first epoch's states through to a store (train.data.online.write_store); mtp-packed
# computes each batch's states one batch ahead on a thread (train.data.online.prefetch)
@pytest.mark.parametrize("head,packing,online", [("mtp", False, []), ("eagle3", False, ["write_store"]),
                                                 ("mtp", True, ["train.data.online.prefetch=true"])],
                         ids=["mtp", "eagle3-aux-write-through", "mtp-packed-prefetch"])
def test_online_training_equals_offline(tiny_overrides, tmp_path, head, packing, online, caplog):
    caplog.set_level(logging.INFO, logger="train.online")
    extra = [f"head={head}", f"train.data.packing={str(packing).lower()}"]
    if head == "eagle3":
        extra += ["head.draft_vocab_size=64"]
    if not packing:  # in-loop validation at the end, its held-out states computed online: the same figures
        extra += ENGINE_VAL
    offline_over = _overrides(tiny_overrides, tmp_path, "offline", *extra)
    store_dir, _ = run_precompute(compose_config(offline_over))
    offline = _train(offline_over)
    online = [f"train.data.online.write_store={tmp_path / 'written'}" if o == "write_store" else o for o in online]
    online_run = _train(_overrides(tiny_overrides, tmp_path, "online", *extra, "train.data.source=online", *online))
    _assert_same_run(online_run, offline)
    ahead = "states are computed one batch ahead" in caplog.text
    assert ahead == any("prefetch=true" in o for o in online)
    if "write_store" in str(online):  # the store precompute wrote, byte for byte; no spill left
        written = store_files(tmp_path / "written")
        assert written.keys() == store_files(store_dir).keys() and len(written) >= 2
        for name, data in store_files(store_dir).items():
            assert written[name] == data, name
        assert not (tmp_path / "written" / ".pending").exists()


def _write_through(tiny_overrides, tmp_path, *extra):
    from train.online_store import WriteThrough

    over = _overrides(tiny_overrides, tmp_path, "run", "head=eagle3", "precompute.shard_tokens=400", *extra)
    store_dir, _ = run_precompute(compose_config(over))
    cfg = compose_config([*over, "train.data.source=online", f"train.data.online.write_store={tmp_path / 'written'}"])
    dm, _ = data_module_of(cfg)
    dm.setup("fit")
    assert isinstance(dm.write_through, WriteThrough)
    return store_dir, dm


@pytest.mark.unit
def test_write_through_resumes_after_a_kill(tiny_overrides, tmp_path, monkeypatch):
    """Killed while spilling and again while assembling the store: a new run over the same directory reuses
    the spills and the finished shards, recomputes a spill that holds another sample's states, and ends with
    precompute's store byte for byte — the samples no training batch carried computed at the first epoch's end."""
    from data.store import StoreWriter
    from train.online_store import PENDING, WriteThrough

    store_dir, dm = _write_through(tiny_overrides, tmp_path)
    wt = dm.write_through
    wt.open(0, 1)
    batches = list(dm.train_dataloader())
    for batch in batches[: len(batches) // 2]:  # the first half of the epoch, then killed
        dm.on_after_batch_transfer(batch, 0)
    spills = sorted((tmp_path / "written" / PENDING).glob("*.safetensors"))
    assert 0 < len(spills) < len(dm.store)
    spills[1].write_bytes(spills[0].read_bytes())  # a spill that holds another sample's states
    dm.write_through = again = WriteThrough(wt.root, wt.open_writer, dm)
    again.open(0, 1)
    for batch in batches[len(batches) // 2:]:
        dm.on_after_batch_transfer(batch, 0)
    real_add, added = StoreWriter.add, []

    def add_then_die(self, sample):
        if len(added) == len(dm.store) // 2:
            raise OSError("killed while assembling")
        added.append(sample.sample_id)
        real_add(self, sample)

    monkeypatch.setattr(StoreWriter, "add", add_then_die)
    with pytest.raises(RuntimeError, match="online write-through to .* failed: killed while assembling"):
        again.finish(background=False)
    monkeypatch.setattr(StoreWriter, "add", real_add)
    last = WriteThrough(wt.root, wt.open_writer, dm)
    last.open(0, 1)
    assert 0 < len(last.writer.done_ids) < len(dm.store)  # finished shards kept
    last.finish(background=False)
    want = store_files(store_dir)
    assert store_files(tmp_path / "written") == want and len(want) >= 4
    assert not (tmp_path / "written" / PENDING).exists()
    done = WriteThrough(wt.root, wt.open_writer, dm)
    done.open(0, 1)  # complete: left as it is
    assert done.finished


@pytest.mark.unit
def test_write_store_needs_the_online_source(tiny_overrides, tmp_path):
    cfg = compose_config(_overrides(tiny_overrides, tmp_path, "run", f"train.data.online.write_store={tmp_path}/w"))
    with pytest.raises(ValueError, match=r"write_store=.* with train.data.source=store there are none"):
        data_module_of(cfg)
    cfg = compose_config(_overrides(tiny_overrides, tmp_path, "run", "train.data.source=online",
                                    "train.data.online.prefetch=sometimes"))
    dm, _ = data_module_of(cfg)
    with pytest.raises(ValueError, match="train.data.online.prefetch='sometimes': expected auto, true or false"):
        from train.online import resolve_prefetch

        resolve_prefetch(dm.prefetch, torch.device("cpu"))


@pytest.mark.unit
def test_online_batches_hold_what_the_store_holds(tiny_overrides, tmp_path):
    """The same samples and split as the store, and each batch's states (aux layers included) equal the
    stored ones to rounding; the padding is zero as `collate` pads a stored batch."""
    over = _overrides(tiny_overrides, tmp_path, "run", "head=eagle3")
    cfg = compose_config(over)
    store_dir, _ = run_precompute(cfg)
    store = FeatureStore(store_dir)
    dm, target = data_module_of(compose_config(over + ["train.data.source=online"]))
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


@pytest.mark.unit
def test_online_shares_the_targets_frozen_tensors(tiny_overrides, tmp_path):
    """The head's embedding, lm_head and final norm are the target's own tensors (one copy)."""
    from tests.helpers import init_head_of

    over = _overrides(tiny_overrides, tmp_path, "run", "train.data.source=online")
    cfg = compose_config(over)
    dm, target = data_module_of(cfg)
    dm.setup("fit")
    head = init_head_of(cfg, cfg.target.path, dm, target)
    assert head.tied.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert head.tied.lm_head.data_ptr() == target.lm_head.weight.data_ptr()
    assert head.tied.norm_weight.data_ptr() == target.model.norm.weight.data_ptr()


@pytest.mark.unit
def test_an_unknown_source_names_the_setting(tiny_overrides, tmp_path):
    cfg = compose_config(_overrides(tiny_overrides, tmp_path, "run", "train.data.source=disk"))
    with pytest.raises(ValueError, match=r"train.data.source='disk': expected `store`.*or `online`"):
        data_module_of(cfg)


def test_torchrun_two_ranks_online_equal_offline_and_resume(tiny_overrides, tmp_path):
    """2 processes (DDP, gloo), 10 steps: each rank's online losses equal the offline run's at every step,
    the saved heads agree, and an online run stopped at step 4 and resumed from its checkpoint continues the
    same curve (the data module's place in its epoch is restored: the same batches) — with the states computed
    one batch ahead (prefetch) — and the ranks' write-through merges into a store holding the offline store's
    samples and states."""
    from tests.test_multiprocess import STEPS, _overrides as ranked, _ranks, torchrun

    dirs = {n: tmp_path / n for n in ("offline", "online", "part", "resumed")}
    for d in dirs.values():
        d.mkdir()
    base = [*tiny_overrides, "train.engine_validation.enabled=false"]
    offline = ranked(base, "ddp", dirs["offline"], STEPS)
    cfg = compose_config(offline)
    run_precompute(cfg)
    torchrun("scripts.train", offline)
    online_run = [f"run_dir={tmp_path / 'online_run'}", "train.data.source=online", "train.untrained_dir=null",
                  f"train.data.online.write_store={tmp_path / 'written'}"]
    proc = torchrun("scripts.train", [*ranked(base, "ddp", dirs["online"], STEPS), *online_run])
    assert "train: online" in proc.stdout + proc.stderr
    assert not (tmp_path / "online_run" / "features").exists()  # nothing stored
    part_run = [f"run_dir={tmp_path / 'part_run'}", "train.data.source=online", "train.untrained_dir=null",
                "train.data.online.prefetch=true"]
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
    written, stored = FeatureStore(tmp_path / "written"), FeatureStore(cfg.store_dir)
    assert sorted(written.manifest["ranks"]["dirs"]) == ["ranks/rank-00000", "ranks/rank-00001"]
    ids = written.sample_ids()
    assert sorted(ids) == sorted(stored.sample_ids()) and len(set(ids)) == len(ids)
    where = {sid: i for i, sid in enumerate(stored.sample_ids())}
    for i, sid in enumerate(ids):
        got, want = written[i], stored[where[sid]]
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        torch.testing.assert_close(got["hidden"], want["hidden"], rtol=0, atol=STATE_ATOL)


@pytest.mark.unit
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
