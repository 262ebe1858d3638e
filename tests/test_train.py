"""Training: the loss falls on a fixed batch, the hydra config composes and trains end to end."""

import torch
import pytest

from artifacts.checkpoint import load_native
from artifacts.export import probe_logits
from inference_eval.model import tied_target
from experiments.stages import run_precompute, run_training
from tests.conftest import compose_config
from tests.helpers import init_head_of, train_on_batch
from train.data import TokenBudgetBatches, collate
from train.module import DraftHeadModule


@pytest.mark.unit
def test_loss_decreases_on_fixed_batch(tiny_overrides, tiny_target):
    cfg = compose_config(tiny_overrides)
    store_dir, _ = run_precompute(cfg)
    from data.store import FeatureStore
    store = FeatureStore(store_dir)
    batch = collate([store[i] for i in range(4)])
    module = DraftHeadModule(init_head_of(cfg, tiny_target), kl_chunk_size=16)
    losses = train_on_batch(module, batch, 40)
    assert losses[-1] < 0.5 * losses[0]
    final = module.compute_loss(batch)
    assert float(final["acc_d1"]) > 0.5
    assert int(final["n_tokens"]) == int(batch["loss_mask"][:, 2:].sum())


@pytest.mark.unit
def test_token_budget_batches_cover_all_within_budget():
    lengths = [5, 90, 33, 12, 64, 64, 7, 100, 3]
    sampler = TokenBudgetBatches(lengths, batch_tokens=128, shuffle=True, seed=0)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 128 or len(b) == 1 for b in batches)
    sampler.set_epoch(1)
    assert list(sampler) != batches or len(batches) == 1


@pytest.mark.unit
def test_config_composes_with_each_group():
    cfg = compose_config([])
    assert cfg.head.type == "mtp" and cfg.trainer._target_ == "lightning.Trainer"
    assert cfg.logger._target_.endswith("WandbLogger") and cfg.logger.offline is True
    assert cfg.target.source == "smollm2_gguf" and cfg.store_dir == "runs/demo/features"
    smoke = compose_config(["experiment=smoke"])
    assert smoke.run_name == "smoke" and smoke.data.max_samples == 24 and smoke.store_dir == "runs/smoke/features"


def test_train_entry_trains_and_saves(tiny_overrides, tiny_target):
    cfg = compose_config(tiny_overrides)
    run_precompute(cfg)
    head_dir, metrics = run_training(cfg)
    assert metrics["val/acc_d1"] >= 0 and metrics["train/loss"] > 0
    tied, args, _ = tied_target(tiny_target)
    trained = load_native(head_dir, tied, args)
    untrained = load_native(cfg.train.untrained_dir, tied, args)
    assert not torch.equal(probe_logits(trained), probe_logits(untrained))
    assert torch.equal(probe_logits(untrained), probe_logits(init_head_of(cfg, tiny_target)))


def test_training_with_packed_rows(tiny_overrides):
    from experiments.stages import run_precompute
    from tests.conftest import compose_config
    from train.data import FeatureDataModule

    cfg = compose_config(tiny_overrides + ["train.data.packing=true", "train.data.batch_tokens=512",
                                           "trainer.max_epochs=2", "train.engine_validation.enabled=false"])
    run_precompute(cfg)
    dm = FeatureDataModule(cfg.store_dir, None, batch_tokens=512, val_fraction=0.2, packing=True)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert all(b["input_ids"].shape[0] == 1 and b["input_ids"].shape[1] <= 512 for b in batches)
    assert max(int(b["segments"].max()) for b in batches) >= 1  # several samples in one row
    assert sum(int(b["segments"].max()) + 1 for b in batches) == len(dm.train_idx)
    _, metrics = run_training(cfg)
    assert 0.0 <= metrics["val/acc_d1"] <= 1.0 and metrics["train/loss"] == metrics["train/loss"]  # finite


def test_every_epoch_validates_at_its_end_when_epochs_differ_in_batches(tiny_overrides, tiny_target, monkeypatch):
    """Token-budget batches regroup each epoch, so epochs differ in their number of batches; Lightning
    read the count once and validated when an epoch reached it — a shorter later epoch skipped its
    end-of-epoch validation and the run reported an epoch-old val metric. Every epoch validates once,
    after its last batch, and the final val/acc_d1 is the final head's held-out agreement."""
    import lightning as L

    from data.store import FeatureStore
    from train.data import FeatureDataModule
    from train.module import DraftHeadModule, heldout_agreement

    cfg = compose_config(tiny_overrides)
    store_dir, _ = run_precompute(cfg)
    dm = FeatureDataModule(str(store_dir), None, val_fraction=0.2)
    dm.setup("fit")
    lengths = [FeatureStore(store_dir).lengths()[i] for i in dm.train_idx]
    # sort windows of 2 batches' worth (64 in use): the tiny store's few samples then regroup per epoch,
    # as a real store's hundreds do under the 64-batch windows
    monkeypatch.setattr(TokenBudgetBatches, "window_batches", 2)
    epochs = 4

    def counts(bt):
        sampler = TokenBudgetBatches(lengths, bt, shuffle=True, seed=int(cfg.seed))
        return [(sampler.set_epoch(e), len(sampler))[1] for e in range(epochs)]

    # a budget whose later epochs have fewer batches than the first (the case that lost the validation)
    bt = next(b for b in range(64, 2048, 8) if min(counts(b)[1:]) < counts(b)[0])
    per_epoch = counts(bt)

    class Record(L.Callback):
        def __init__(self):
            self.seen, self.validated = [0] * epochs, []

        def on_train_batch_end(self, trainer, *args):
            self.seen[trainer.current_epoch] += 1

        def on_validation_epoch_end(self, trainer, module):
            if not trainer.sanity_checking:
                self.validated.append((trainer.current_epoch, self.seen[trainer.current_epoch]))

    record = Record()
    run_cfg = compose_config([*tiny_overrides, f"train.data.batch_tokens={bt}", f"trainer.max_epochs={epochs}",
                              "train.engine_validation.enabled=false"])
    head_dir, metrics = run_training(run_cfg, extra_callbacks=[record])
    assert record.seen == per_epoch, (record.seen, per_epoch)
    assert record.validated == [(e, per_epoch[e]) for e in range(epochs)]  # once per epoch, after its last batch
    tied, args, _ = tied_target(tiny_target)
    dm = FeatureDataModule(str(store_dir), None, batch_tokens=bt, val_fraction=0.2)
    dm.setup("validate")
    grad_modes = []  # the held-out scoring builds no autograd graph
    score = DraftHeadModule.compute_loss
    monkeypatch.setattr(DraftHeadModule, "compute_loss",
                        lambda self, batch: (grad_modes.append(torch.is_grad_enabled()), score(self, batch))[1])
    final = heldout_agreement(load_native(head_dir, tied, args), dm.val_dataloader(), 1)
    assert grad_modes and not any(grad_modes)
    assert abs(metrics["val/acc_d1"] - final["acc"][0]) < 1e-5  # the last validation scored the final head


def test_heldout_split_follows_split_seed_not_seed(tiny_overrides, tmp_path):
    """The training seed orders batches and initialises the head; the held-out conversations are chosen
    by split_seed and the sample ids alone, and each run records them (ids and digest)."""
    import json
    from pathlib import Path

    from train.data import FeatureDataModule, heldout_ids_digest, split_order

    cfg = compose_config(tiny_overrides)
    store_dir, _ = run_precompute(cfg)

    def held(**kw):
        dm = FeatureDataModule(str(store_dir), None, val_fraction=0.4, verify_store="header", **kw)
        dm.setup("fit")
        assert sorted(dm.val_idx + dm.train_idx) == list(range(len(dm.store)))
        return dm.val_ids

    assert held(seed=0) == held(seed=1) == held(seed=7, split_seed=0)
    assert set(held(split_seed=1)) != set(held(split_seed=0))
    ids = [f"conv-{i}" for i in range(40)]  # the order the ids come in (shards, ranks) does not matter
    first = [ids[i] for i in split_order(ids, 0)]
    assert [ids[::-1][i] for i in split_order(ids[::-1], 0)] == first
    assert [ids[i] for i in split_order(ids[:-1], 0)] == [x for x in first if x != ids[-1]]  # another store
    # two training runs at different seeds record the same held-out ids
    recorded = []
    for seed in (0, 1):
        run = compose_config([*tiny_overrides, f"seed={seed}", f"run_dir={tmp_path / f'run{seed}'}",
                              f"store_dir={store_dir}",
                              "trainer.max_epochs=1", "train.engine_validation.enabled=false"])
        run_training(run)
        recorded.append(json.loads((Path(run.run_dir) / "heldout.json").read_text()))
    assert recorded[0]["heldout_ids"] == recorded[1]["heldout_ids"] and recorded[0]["split_seed"] == 0
    assert recorded[0]["heldout_sha256"] == heldout_ids_digest(recorded[1]["heldout_ids"])
    assert len(recorded[0]["heldout_ids"]) == round(0.2 * recorded[0]["store_samples"])


@pytest.mark.unit
def test_mtp_layer_init_target_starts_every_module_from_the_targets_last_layer(tiny_overrides, tiny_target):
    """`head.layer_init: target`: each module's decoder layer is the target's last decoder layer, tensor for tensor
    (the default's random layer is not); a target of another family, or a layer of other tensors, is refused."""
    import dataclasses

    import pytest

    from artifacts.draft_hf import read_target_layer

    head = init_head_of(compose_config([*tiny_overrides, "head.layer_init=target", "head.num_modules=2"]), tiny_target)
    last = read_target_layer(tiny_target, head.args.num_hidden_layers - 1)
    assert last and not read_target_layer(tiny_target, head.args.num_hidden_layers)  # the last layer, no further
    for m in head.layers:
        state = m.layer.state_dict()
        assert state.keys() == last.keys()
        for k, v in last.items():
            torch.testing.assert_close(state[k], v.to(state[k].dtype), atol=0, rtol=0, msg=k)
    default = init_head_of(compose_config(tiny_overrides), tiny_target)
    assert not torch.equal(default.layers[0].layer.mlp.down_proj.weight, last["mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="input_layernorm"):
        head.copy_target_layer({k: v for k, v in last.items() if k != "input_layernorm.weight"})
    head.args = dataclasses.replace(head.args, model_type="gemma3_text")
    with pytest.raises(ValueError, match="gemma3_text"):
        head.copy_target_layer(last)


@pytest.mark.unit
def test_dropout_drops_the_residual_branches_in_training_only(tiny_overrides, tiny_target):
    """`train.module.dropout: p`: in training each residual branch of the head's layers keeps an element with
    probability 1 − p, scaled by 1/(1 − p); the masks are a function of (seed, step, rank); validation and anything
    after the loss (the engine) run the layers as they are. Refused where it would do nothing or draw wrong masks."""
    import types

    import pytest

    from heads.layers import DecoderLayer, dropped

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    from data.store import FeatureStore

    store = FeatureStore(store_dir)
    batch = collate([store[i] for i in range(4)])
    head = init_head_of(compose_config(tiny_overrides), tiny_target)
    clean, drop = DraftHeadModule(head, kl_chunk_size=16), DraftHeadModule(head, kl_chunk_size=16, dropout=0.3)
    layer = next(m for m in head.modules() if isinstance(m, DecoderLayer))

    drop.train()
    with drop.residual_dropout():
        x = dropped(layer, torch.ones(64, 512))
    kept = x[x != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7))
    assert float((x == 0).float().mean()) == pytest.approx(0.3, abs=0.01)
    assert getattr(layer, "residual_dropout", None) is None  # removed after the loss: the engine runs the layer as it is

    clean.train()
    base = float(clean.compute_loss(batch)["loss"])
    first = float(drop.compute_loss(batch)["loss"])
    assert first != pytest.approx(base, rel=1e-6)  # the tiny layer's branches are small: a small change, not none
    assert float(drop.compute_loss(batch)["loss"]) == first  # the same step draws the same masks
    drop._trainer = types.SimpleNamespace(global_step=1, global_rank=0)
    assert float(drop.compute_loss(batch)["loss"]) != pytest.approx(first, rel=1e-6)  # another step, other masks
    drop._trainer = None
    drop.eval(), clean.eval()
    torch.testing.assert_close(drop.compute_loss(batch)["loss"], clean.compute_loss(batch)["loss"], atol=0, rtol=0)
    with torch.no_grad():  # the engine's path (no gradient) even in training mode: nothing dropped
        drop.train(), clean.train()
        torch.testing.assert_close(drop.compute_loss(batch)["loss"], clean.compute_loss(batch)["loss"], atol=0, rtol=0)
    for bad, match in (({"dropout": 1.0}, "dropout=1.0"), ({"dropout": -0.1}, "dropout=-0.1"),
                       ({"dropout": 0.1, "gradient_checkpointing": True}, "gradient_checkpointing")):
        with pytest.raises(ValueError, match=match):
            DraftHeadModule(head, **bad)


@pytest.mark.unit
def test_input_noise_perturbs_what_the_head_reads_in_training_only(tiny_overrides, tiny_target, monkeypatch):
    """`train.module.input_noise: σ`: in training the head reads each state plus noise of σ × the state's RMS,
    drawn from (seed, global step, rank) alone; the teacher reads the stored states; in eval mode (validation,
    held-out scores) nothing changes. A negative σ is refused."""
    import types

    import pytest

    import train.module as tm
    from data.store import FeatureStore

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batch = collate([store[i] for i in range(4)])
    head = init_head_of(compose_config(tiny_overrides), tiny_target)
    clean, noisy = DraftHeadModule(head, kl_chunk_size=16), DraftHeadModule(head, kl_chunk_size=16, input_noise=0.3)
    hidden = batch["hidden"].to(head.dtype)

    noisy.train()
    torch.manual_seed(0)
    a, _ = noisy.noisy_inputs(hidden, None)
    torch.manual_seed(0)
    again, _ = noisy.noisy_inputs(hidden, None)
    torch.testing.assert_close(again, a, atol=0, rtol=0)  # a function of (seed, step, rank), not of the global RNG's use
    rel = ((a - hidden).norm(dim=-1) / hidden.norm(dim=-1))[batch["valid"]]
    assert float(rel.mean()) == pytest.approx(0.3, rel=0.1), float(rel.mean())
    noisy._trainer = types.SimpleNamespace(global_step=1, global_rank=0)
    torch.manual_seed(0)
    later, _ = noisy.noisy_inputs(hidden, None)
    assert not torch.allclose(later, a)  # another step, other noise
    torch.manual_seed(1)
    other_seed, _ = noisy.noisy_inputs(hidden, None)
    assert not torch.allclose(other_seed, later)
    noisy._trainer = None

    seen = {}
    unroll, depth_terms = tm.unroll, tm.depth_terms

    def seen_unroll(h, x, *args, **kwargs):
        seen["input"] = x
        return unroll(h, x, *args, **kwargs)

    def seen_depth_terms(h, preds, teacher, *args, **kwargs):
        seen["teacher"] = teacher
        return depth_terms(h, preds, teacher, *args, **kwargs)

    monkeypatch.setattr(tm, "unroll", seen_unroll)
    monkeypatch.setattr(tm, "depth_terms", seen_depth_terms)
    loss = noisy.compute_loss(batch)["loss"]
    assert not torch.allclose(seen["input"], hidden)
    rows = hidden.shape[1] - 2
    mask = batch["loss_mask"][:, 2:] & batch["valid"][:, 2:]
    torch.testing.assert_close(seen["teacher"], hidden[:, 1:1 + rows][mask], atol=0, rtol=0)
    clean.train()
    assert float(loss) != pytest.approx(float(clean.compute_loss(batch)["loss"]), rel=1e-4)
    noisy.eval(), clean.eval()
    torch.testing.assert_close(noisy.compute_loss(batch)["loss"], clean.compute_loss(batch)["loss"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="input_noise=-0.1"):
        DraftHeadModule(head, input_noise=-0.1)


@pytest.mark.unit
def test_offpolicy_weight_leans_training_towards_the_rows_of_greedy_inputs(tiny_overrides, tiny_target, monkeypatch):
    """`train.module.offpolicy_weight: λ`: a row whose input tokens t_{i+1..i+d} are not all the target's greedy
    choices (argmax W_lm N_f(H_j), from the stored states) weighs λ in the loss (a weighted mean), the others 1.
    On a batch whose tokens are made greedy at a known half of the positions: the flags are those positions; λ = 0
    is the loss (and gradient) of the same batch with the other rows out of the loss mask; λ = 0.5 is the weighted
    mean of the two groups' losses; depth 2 weighs a row by both its inputs; λ = 1 computes nothing new; the
    held-out scores count the greedy rows' agreement apart (`acc_onpolicy`). λ outside [0, 1] is refused."""
    import pytest

    import train.module as tm
    from data.store import FeatureStore
    from train.losses import greedy_inputs
    from train.module import heldout_agreement

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batch = collate([store[i] for i in range(4)])
    head = init_head_of(compose_config(tiny_overrides), tiny_target)
    hidden = batch["hidden"].to(head.dtype)
    with torch.no_grad():
        top = head.tied.teacher_logits(hidden[:, :-1]).argmax(-1)  # [B, T-1]
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(top.shape, generator=g) < 0.5
    vocab = head.tied.lm_head.shape[0]
    ids = batch["input_ids"].clone()
    ids[:, 1:] = torch.where(chosen, top, (top + 1) % vocab)
    batch = {**batch, "input_ids": ids}
    flags = greedy_inputs(head, hidden, ids, chunk_size=7)
    torch.testing.assert_close(flags, chosen, atol=0, rtol=0)

    def masked(keep_rows: torch.Tensor) -> dict:  # depth 1: row i (target t_{i+2}) kept where keep_rows[:, i]
        lm = batch["loss_mask"].clone()
        lm[:, 2:] &= keep_rows[:, :lm.shape[1] - 2]
        return {**batch, "loss_mask": lm}

    def loss_and_grad(module, b):
        head.zero_grad()
        out = module.compute_loss(b)
        out["loss"].backward()
        return out, [p.grad.clone() for p in head.parameters() if p.requires_grad]

    plain = DraftHeadModule(head, kl_chunk_size=16)
    out0, grad0 = loss_and_grad(DraftHeadModule(head, kl_chunk_size=16, offpolicy_weight=0.0), batch)
    out_on, grad_on = loss_and_grad(plain, masked(chosen))
    out_off, _ = loss_and_grad(plain, masked(~chosen))
    torch.testing.assert_close(out0["loss"], out_on["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(grad0, grad_on):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    n_on, n_off = int(out_on["n_count_d1"]), int(out_off["n_count_d1"])
    assert n_on > 10 and n_off > 10 and int(out0["n_count_d1"]) == n_on + n_off  # every row still counted
    assert float(out0["onpolicy_d1"]) == pytest.approx(n_on / (n_on + n_off))
    half = DraftHeadModule(head, kl_chunk_size=16, offpolicy_weight=0.5).compute_loss(batch)
    expected = (float(out_on["loss"]) * n_on + 0.5 * float(out_off["loss"]) * n_off) / (n_on + 0.5 * n_off)
    assert float(half["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(half["loss"]) != pytest.approx(float(plain.compute_loss(batch)["loss"]), rel=1e-4)
    assert "onpolicy_d1" not in plain.compute_loss(batch)  # λ = 1: no flags computed

    seen = {}
    depth_terms = tm.depth_terms

    def seen_depth_terms(h, preds, teacher, depth, *args, **kwargs):
        seen[depth] = args[3]  # row_weight
        return depth_terms(h, preds, teacher, depth, *args, **kwargs)

    monkeypatch.setattr(tm, "depth_terms", seen_depth_terms)
    deep = DraftHeadModule(head, kl_chunk_size=16, depth=2, offpolicy_weight=0.25).compute_loss(batch)
    rows = ids.shape[1] - 3
    mask = batch["loss_mask"][:, 3:] & batch["valid"][:, 3:]
    both = (chosen[:, :rows] & chosen[:, 1:1 + rows])[mask]
    torch.testing.assert_close(seen[2], torch.where(both, 1.0, 0.25), atol=0, rtol=0)
    assert float(deep["onpolicy_d2"]) == pytest.approx(float(both.float().mean()))
    monkeypatch.undo()

    held = heldout_agreement(head, [batch], depth=1)
    only_on = heldout_agreement(head, [masked(chosen)], depth=1)
    assert held["tokens_onpolicy"] == [n_on] and held["acc_onpolicy"] == pytest.approx(only_on["acc"])
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match=f"offpolicy_weight={bad}"):
            DraftHeadModule(head, offpolicy_weight=bad)


def test_head_mtp3_preset_trains_a_module_per_depth_whose_first_is_the_default_head(tiny_overrides, tiny_target,
                                                                                    tmp_path):
    """`head=mtp3` (conf/head/mtp3.yaml) sets a 3-module head, 3 TTT steps at equal weights, `detach_depths`,
    `clip_scope: auto` (module), depths ≥ 2 on every real token from half the run (`loss_on: deep_all`,
    `deep_from_step: auto` = 0.5),
    and trains through the whole entry point (run_training: checkpoint, validation): module 1
    of the saved head equals the default `head=mtp` run's one module, trained on the same store with the same seed
    and clipping (made to bind: 0.05; with the whole gradient clipped together module 1 ends elsewhere), while
    modules 2–3 leave their start."""
    common = tiny_overrides + ["train.engine_validation.enabled=false", "trainer.gradient_clip_val=0.05"]
    cfg = compose_config(common + ["head=mtp3"])
    assert (cfg.head.type, cfg.head.num_modules) == ("mtp", 3)
    assert (cfg.train.module.depth, cfg.train.module.depth_decay) == (3, 1.0)
    assert cfg.train.module.detach_depths is True and cfg.train.module.clip_scope == "auto"
    assert (cfg.train.module.loss_on, cfg.train.module.deep_from_step) == ("deep_all", "auto")
    run_precompute(cfg)
    deep_dir, metrics = run_training(cfg)
    assert {"val/acc_d1", "val/acc_d2", "val/acc_d3"} <= set(metrics)
    one = compose_config(common + [f"run_dir={tmp_path / 'one'}", f"store_dir={cfg.store_dir}"])
    one_dir, _ = run_training(one)
    tied, args, _ = tied_target(tiny_target)
    deep, alone = load_native(deep_dir, tied, args), load_native(one_dir, tied, args)
    start = load_native(cfg.train.untrained_dir, tied, args)
    assert len(deep.layers) == 3 and len(alone.layers) == 1
    first = deep.layers[0].state_dict()
    for key, value in alone.layers[0].state_dict().items():
        assert float((value - start.layers[0].state_dict()[key]).abs().max()) > 0 or "norm" in key
        torch.testing.assert_close(first[key], value, atol=1e-5, rtol=1e-4)
    for d in (1, 2):
        assert any(float((p - q).abs().max()) > 1e-4 for p, q in
                   zip(deep.layers[d].state_dict().values(), start.layers[d].state_dict().values()))


def test_clip_scope_module_trains_module_one_as_a_depth_one_head_alone(tiny_overrides, tiny_target):
    """`train.module.clip_scope: module` with `detach_depths`: through real Lightning steps whose clipping binds
    (gradient_clip_val 0.05), module 1 of a 3-module head trained at depth 3 ends equal to a 1-module head trained
    at depth 1 from the same start on the same batches; with the whole gradient clipped together (`all`) the
    other depths' gradients scale module 1's steps and it ends elsewhere. A bad scope and DeepSpeed are refused."""
    import lightning as L
    import pytest
    from torch.utils.data import DataLoader

    from data.store import FeatureStore

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batches = [collate([store[i], store[i + 1]]) for i in (0, 2, 4, 0, 2)]

    def fit(num_modules: int, depth: int, scope: str):
        head = init_head_of(compose_config(tiny_overrides + [f"head.num_modules={num_modules}"]), tiny_target)
        start = {k: v.clone() for k, v in head.layers[0].state_dict().items()}
        module = DraftHeadModule(head, lr=3e-3, warmup_steps=0, kl_chunk_size=16, depth=depth, depth_decay=1.0,
                                 detach_depths=depth > 1, clip_scope=scope)
        trainer = L.Trainer(accelerator="cpu", max_steps=len(batches), gradient_clip_val=0.05, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
        assert trainer.global_step == len(batches)
        return start, head

    start1, alone = fit(1, 1, "all")
    start3, per_module = fit(3, 3, "module")
    _, together = fit(3, 3, "all")
    for key, value in start1.items():  # one start: module 1 draws the generator's first numbers either way
        torch.testing.assert_close(start3[key], value, atol=0, rtol=0)
    moved = max(float((p - start1[k]).abs().max()) for k, p in alone.layers[0].state_dict().items())
    assert moved > 1e-3
    for key, value in alone.layers[0].state_dict().items():
        torch.testing.assert_close(per_module.layers[0].state_dict()[key], value, atol=1e-6, rtol=1e-5)
    apart = max(float((together.layers[0].state_dict()[k] - v).abs().max())
                for k, v in alone.layers[0].state_dict().items())
    assert apart > 1e-4, apart
    for d in (1, 2):  # the deeper modules trained too
        assert any(float((p - q).abs().max()) > 1e-4 for p, q in
                   zip(per_module.layers[d].state_dict().values(), together.layers[d].state_dict().values()))
    groups = DraftHeadModule(per_module, clip_scope="module").clip_groups()
    assert [len(g) for g in groups] == [len(list(m.parameters())) for m in per_module.layers]

    with pytest.raises(ValueError, match="clip_scope='layer'"):
        DraftHeadModule(alone, clip_scope="layer")
    module = DraftHeadModule(alone, clip_scope="module")

    class DeepSpeedStrategy:  # stands for Lightning's: DeepSpeed refuses a CPU-only machine
        pass

    module.trainer = type("T", (), {"strategy": DeepSpeedStrategy()})()
    with pytest.raises(ValueError, match="DeepSpeed clips the whole gradient"):
        module.setup("fit")


@pytest.mark.unit
def test_the_default_head_is_mtp3_and_its_auto_settings_follow_the_strategy(tiny_target):
    """The default config's head is `mtp3` (3 modules, Muon); its `clip_scope: auto` and `deep_from_step: auto` are
    `module` and half the run (step 5 of 10) under DDP, FSDP or one process, and `all` and 0 where DeepSpeed runs the
    optimizer (it clips inside its engine and keeps the state the copy drops): setup there keeps Lightning's
    clipping, and the explicit settings stay refused there. `auto` on a 1-module head clips the whole gradient."""
    import pytest

    from heads.registry import build_head
    from tests.test_multiprocess import DeepSpeedStrategy

    cfg = compose_config([])
    assert (cfg.head.type, cfg.head.num_modules, cfg.train.module.depth) == ("mtp", 3, 3)
    assert (cfg.train.module.optimizer, cfg.train.module.clip_scope, cfg.train.module.deep_from_step) == \
        ("auto", "auto", "auto")
    tied, args, _ = tied_target(tiny_target)
    settings = {k: v for k, v in cfg.train.module.items() if k in ("depth", "depth_decay", "detach_depths", "loss_on",
                                                                  "clip_scope", "deep_from_step", "optimizer")}

    def module(strategy=None, num_modules=3, **over):
        m = DraftHeadModule(build_head({"type": "mtp", "num_modules": num_modules}, args, tied), **{**settings, **over})
        m.trainer = type("T", (), {"estimated_stepping_batches": 10, "global_step": 0, "global_rank": 0,
                                   **({"strategy": strategy} if strategy else {})})()
        return m

    plain = module()
    plain.setup("fit")
    assert (plain.clip_scope(), plain.deep_from(), plain.deep_start_step(), plain.optimizer_name()) == \
        ("module", 0.5, 5, "muon")
    assert "configure_gradient_clipping" in vars(plain)  # each module clipped by its own norm
    zero = module(DeepSpeedStrategy())
    zero.setup("fit")  # no refusal
    assert (zero.clip_scope(), zero.deep_from(), zero.optimizer_name()) == ("all", 0, "adamw")
    assert "configure_gradient_clipping" not in vars(zero)
    zero.train()
    assert zero.deep_started()  # every depth from the first step
    one = module(num_modules=1)
    assert one.clip_scope() == "all" and "configure_gradient_clipping" not in vars(one)
    for over, match in (({"deep_from_step": 0.5}, "deep_from_step drops"), ({"clip_scope": "module"}, "clips the whole")):
        with pytest.raises(ValueError, match=match):
            module(DeepSpeedStrategy(), **over).setup("fit")
    with pytest.raises(ValueError, match="deep_from_step='half'"):
        module(deep_from_step="half")


def test_deep_all_and_deep_lr_scale_change_the_deeper_modules_only(tiny_overrides, tiny_target):
    """`train.module.loss_on: deep_all` trains depth 1 on the store's loss mask and depths ≥ 2 on every real token;
    `train.module.deep_lr_scale: s` gives the per-depth modules of depth ≥ 2 the peak lr s × lr (its own optimizer
    groups, the schedule over both). Through real Lightning steps with `detach_depths` and `clip_scope: module`,
    module 1 of a 3-module head trained with both ends equal to the plain 3-module run's (and so to the default
    head's), while modules 2–3 end elsewhere. s ≠ 1 on a head without separate modules, or s ≤ 0, is refused."""
    import lightning as L
    import pytest
    from torch.utils.data import DataLoader

    from data.store import FeatureStore

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batches = [collate([store[i], store[i + 1]]) for i in (0, 2, 4, 0, 2)]
    batch = batches[0]

    def head3():
        return init_head_of(compose_config(tiny_overrides + ["head.num_modules=3"]), tiny_target)

    def module(head, **kw):
        return DraftHeadModule(head, lr=3e-3, warmup_steps=0, kl_chunk_size=16, depth=3, depth_decay=1.0,
                               detach_depths=True, clip_scope="module", **kw)

    # the rows: depth 1 as `assistant`, depths 2–3 as `all`, each to the count and the value
    h = head3()
    deep, masked, every = (module(h, loss_on=v).compute_loss(batch) for v in ("deep_all", "assistant", "all"))
    assert int(deep["n_count_d1"]) == int(masked["n_count_d1"]) < int(every["n_count_d1"])
    for d in (2, 3):
        assert int(deep[f"n_count_d{d}"]) == int(every[f"n_count_d{d}"]) > int(masked[f"n_count_d{d}"])
        torch.testing.assert_close(deep[f"kl_d{d}"], every[f"kl_d{d}"], atol=0, rtol=0)
    torch.testing.assert_close(deep["kl_d1"], masked["kl_d1"], atol=0, rtol=0)

    # the optimizer: the deeper modules' tensors at s × lr, every other tensor at lr, none lost or doubled
    m = module(h, deep_lr_scale=2.5)
    m.trainer = type("T", (), {"estimated_stepping_batches": 10})()
    opt = m.configure_optimizers()["optimizer"]
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(lr_of) == len(list(h.parameters()))
    deep_ids = {id(p) for layer in h.layers[1:] for p in layer.parameters()}
    assert deep_ids and all(lr_of[i] == pytest.approx(7.5e-3) for i in deep_ids)
    rest = [v for i, v in lr_of.items() if i not in deep_ids]
    assert rest and all(v == pytest.approx(3e-3) for v in rest)

    def fit(**kw):
        head = head3()
        trainer = L.Trainer(accelerator="cpu", max_steps=len(batches), gradient_clip_val=0.05, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module(head, **kw), train_dataloaders=DataLoader(batches, batch_size=None))
        return head

    plain, both = fit(), fit(loss_on="deep_all", deep_lr_scale=2.0)
    for key, value in plain.layers[0].state_dict().items():
        torch.testing.assert_close(both.layers[0].state_dict()[key], value, atol=1e-6, rtol=1e-5)
    for d in (1, 2):
        apart = max(float((p - q).abs().max()) for p, q in
                    zip(both.layers[d].state_dict().values(), plain.layers[d].state_dict().values()))
        assert apart > 1e-4, (d, apart)

    one = init_head_of(compose_config(tiny_overrides), tiny_target)
    with pytest.raises(ValueError, match="deep_lr_scale=2.0 .*no separate per-depth modules"):
        DraftHeadModule(one, deep_lr_scale=2.0)
    with pytest.raises(ValueError, match="deep_lr_scale=0.0"):
        DraftHeadModule(h, deep_lr_scale=0.0)


def test_deep_from_step_trains_depth_one_first_then_starts_the_deeper_modules_from_module_one(tiny_overrides,
                                                                                              tiny_target):
    """`train.module.deep_from_step: N` (or a fraction of the run's steps): through real Lightning steps, steps before
    N unroll depth 1 alone and leave
    the deeper modules untouched; at step N each deeper module becomes a copy of module 1 as trained so far (its
    optimizer state dropped) and every depth trains from there, while module 1 trains exactly as without the
    setting (`detach_depths`, `clip_scope: module`). Over several processes the deeper depths run before N at
    weight 0 (the same loss, zero gradients), so every rank's graph uses every tensor. Refused: a negative step, or
    N > 0 with depth 1."""
    import lightning as L
    import pytest
    from torch.utils.data import DataLoader

    import train.module as tm
    from data.store import FeatureStore

    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batches = [collate([store[i], store[i + 1]]) for i in (0, 2, 4, 0, 2)]

    def module(head, **kw):
        return DraftHeadModule(head, lr=3e-3, warmup_steps=0, kl_chunk_size=16, depth=3, depth_decay=1.0,
                               detach_depths=True, clip_scope="module", **kw)

    def head3():
        return init_head_of(compose_config(tiny_overrides + ["head.num_modules=3"]), tiny_target)

    class Watch(L.Callback):  # each step: the depth unrolled, and the modules before the optimizer moves them
        def __init__(self):
            self.depths, self.states = [], []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.states.append([{k: v.clone() for k, v in m.state_dict().items()} for m in pl_module.head.layers])

    def fit(**kw):
        head, watch = head3(), Watch()
        start = [{k: v.clone() for k, v in m.state_dict().items()} for m in head.layers]
        trainer = L.Trainer(accelerator="cpu", max_steps=len(batches), gradient_clip_val=0.05, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[watch])
        unroll = tm.unroll

        def seen_unroll(h, x, ids, depth, *args, **kwargs):
            if h.training:
                watch.depths.append(depth)
            return unroll(h, x, ids, depth, *args, **kwargs)

        tm.unroll = seen_unroll
        try:
            trainer.fit(module(head, **kw), train_dataloaders=DataLoader(batches, batch_size=None))
        finally:
            tm.unroll = unroll
        return head, start, watch

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    plain, _, _ = fit()
    late, start, watch = fit(deep_from_step=2)
    assert watch.depths == [1, 1, 3, 3, 3]
    frac, _, frac_watch = fit(deep_from_step=0.4)  # a fraction of the run's 5 steps: step 2 again
    assert frac_watch.depths == watch.depths
    for a, b in zip(frac.layers, late.layers):
        for key, value in b.state_dict().items():
            torch.testing.assert_close(a.state_dict()[key], value, atol=0, rtol=0)
    for step in (0, 1):
        assert all(same(watch.states[step][d], start[d]) for d in (1, 2))  # untouched before N
    assert not same(watch.states[2][0], start[0])
    assert all(same(watch.states[2][d], watch.states[2][0]) for d in (1, 2))  # copies of module 1 at N
    for key, value in plain.layers[0].state_dict().items():  # module 1 as without the setting
        torch.testing.assert_close(late.layers[0].state_dict()[key], value, atol=1e-6, rtol=1e-5)
    end = [m.state_dict() for m in late.layers]
    assert not same(end[1], watch.states[2][1]) and not same(end[2], watch.states[2][2])  # trained from there
    assert not same(end[1], end[2])

    # several processes: before N every depth runs at weight 0 — the single process's loss, zero deeper gradients
    import types

    batch = batches[0]
    h = head3()
    m = module(h, deep_from_step=2)
    m.train()
    m._trainer = types.SimpleNamespace(global_step=0, world_size=1, global_rank=0)
    alone = m.compute_loss(batch)
    m._trainer.world_size = 2
    ranks = m.compute_loss(batch)
    torch.testing.assert_close(ranks["loss"], alone["loss"], atol=1e-6, rtol=1e-6)
    assert "kl_d3" in ranks and "kl_d2" not in alone
    ranks["loss"].backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for layer in h.layers[1:] for p in layer.parameters())
    assert any(p.grad is not None and float(p.grad.abs().max()) > 0 for p in h.layers[0].parameters())
    m._trainer.global_step = 2
    assert float(m.compute_loss(batch)["loss"]) > float(alone["loss"]) + 1e-3  # the deeper depths count from N
    m._trainer = None

    for bad in (-1, 1.5, 0.0, True):
        with pytest.raises(ValueError, match=f"deep_from_step={bad!r}: expected an optimizer step"):
            module(h, deep_from_step=bad)
    with pytest.raises(ValueError, match="deep_from_step=3 delays the depths ≥ 2, and train.module.depth is 1"):
        DraftHeadModule(h, deep_from_step=3)
