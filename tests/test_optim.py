"""train/optim.py: the Muon + AdamW optimizer against torch's own, its groups, its checkpoint resume, and
the schedules."""

import copy

import pytest
import torch

from heads.registry import build_head
from inference_eval.model import tied_target
from train.optim import MuonAdamW, build_optimizer, lr_multiplier, newton_schulz, parameter_groups, resolve_optimizer


pytestmark = pytest.mark.unit


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_muon_group_equals_torch_muon(shape):
    """With bf16 Newton–Schulz (torch's), three steps equal torch.optim.Muon(adjust_lr_fn=match_rms_adamw)."""
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    ref = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w], "muon": True}], lr=2e-3, weight_decay=0.1, momentum=0.9, ns_dtype=torch.bfloat16)
    theirs = torch.optim.Muon([ref], lr=2e-3, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        _grads([w], step)
        _grads([ref], step)
        ours.step()
        theirs.step()
        torch.testing.assert_close(w, ref, atol=0, rtol=0)
    assert (w - torch.randn(shape, generator=torch.Generator().manual_seed(0))).abs().max() > 1e-3  # it moved


def test_adamw_group_equals_torch_adamw():
    w = torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(1)))
    ref = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w]}], lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-8)
    for step in range(4):
        _grads([w], step)
        _grads([ref], step)
        ours.step()
        theirs.step()
    torch.testing.assert_close(w, ref, atol=1e-7, rtol=1e-6)


def test_newton_schulz_orthogonalises():
    g = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    s = torch.linalg.svdvals(newton_schulz(g, dtype=torch.float64))
    assert 0.5 < s.min() and s.max() < 1.3  # singular values pushed to ≈ 1 (the quintic's band)
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 3  # from a spread-out start


def test_muon_refuses_vectors():
    with pytest.raises(ValueError, match="matrices only"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.ones(3))], "muon": True}])


@pytest.fixture
def eagle3(tiny_target):
    tied, args, parts = tied_target(tiny_target)
    head = build_head({"type": "eagle3", "draft_vocab_size": 64}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    return head


def test_groups_keep_the_vocabulary_projection_and_vectors_on_adamw(eagle3):
    groups = parameter_groups(eagle3, "muon", 0.01)
    muon = {id(p) for g in groups if g.get("muon") for p in g["params"]}
    names = {n for n, p in eagle3.named_parameters() if id(p) in muon}
    assert "fc.weight" in names and "midlayer.self_attn.q_proj.weight" in names and "midlayer.mlp.down_proj.weight" in names
    assert "lm_head.weight" not in names and not any("norm" in n for n in names)
    every = [p for g in groups for p in g["params"]]
    assert len(every) == len({id(p) for p in every}) == sum(1 for p in eagle3.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="train.module.optimizer"):
        parameter_groups(eagle3, "sgd", 0.0)


def test_resume_from_saved_state_equals_uninterrupted(eagle3):
    """Muon's momentum and AdamW's moments survive state_dict → load_state_dict: 2 + 2 steps == 4 steps."""
    def steps(head, opt, first, n):  # gradients drawn afresh each step (seeded by the step's index)
        for step in range(first, first + n):
            _grads([p for p in head.parameters() if p.requires_grad], step)
            opt.step()

    a = copy.deepcopy(eagle3)
    opt_a = build_optimizer(a, "muon", 1e-3, 0.01, (0.9, 0.95))
    steps(a, opt_a, 0, 4)
    b = copy.deepcopy(eagle3)
    opt_b = build_optimizer(b, "muon", 1e-3, 0.01, (0.9, 0.95))
    steps(b, opt_b, 0, 2)
    saved_head, saved_opt = copy.deepcopy(b.state_dict()), copy.deepcopy(opt_b.state_dict())
    c = copy.deepcopy(eagle3)
    c.load_state_dict(saved_head)
    opt_c = build_optimizer(c, "muon", 1e-3, 0.01, (0.9, 0.95))
    opt_c.load_state_dict(saved_opt)
    steps(c, opt_c, 2, 2)
    for (n, pa), pc in zip(a.named_parameters(), c.parameters()):
        torch.testing.assert_close(pa, pc, atol=0, rtol=0, msg=n)
    fresh = copy.deepcopy(eagle3)
    fresh.load_state_dict(saved_head)
    opt_f = build_optimizer(fresh, "muon", 1e-3, 0.01, (0.9, 0.95))  # momentum lost: a different result
    steps(fresh, opt_f, 2, 2)
    assert (fresh.fc.weight - a.fc.weight).abs().max() > 1e-6


def test_auto_is_muon_for_the_measured_heads_and_adamw_under_deepspeed(tiny_target, eagle3):
    """`train.module.optimizer: auto` (the default): Muon for `mtp` (measured, docs/RESULTS.md §8), AdamW for
    the other heads and under DeepSpeed ZeRO; explicit settings stay; what the module builds follows; an explicit
    Muon under DeepSpeed is refused at setup, naming what to set."""
    from tests.test_multiprocess import DeepSpeedStrategy
    from train.module import DraftHeadModule

    assert resolve_optimizer("auto", "mtp", on_deepspeed=False) == "muon"
    assert resolve_optimizer("auto", "mtp", on_deepspeed=True) == "adamw"
    for kind in ("dflash", "dspark"):  # the block heads: Muon in the peer's recipes they train with
        assert resolve_optimizer("auto", kind, on_deepspeed=False) == "muon"
        assert resolve_optimizer("auto", kind, on_deepspeed=True) == "adamw"
    for kind in ("eagle3", "eagle1", "medusa", "draft_lm"):
        assert resolve_optimizer("auto", kind, on_deepspeed=False) == "adamw", kind
    assert resolve_optimizer("adamw", "mtp", on_deepspeed=False) == "adamw"
    assert resolve_optimizer("muon", "eagle3", on_deepspeed=False) == "muon"
    with pytest.raises(ValueError, match="train.module.optimizer='sgd'"):
        resolve_optimizer("sgd", "mtp", on_deepspeed=False)

    tied, args, parts = tied_target(tiny_target)
    mtp = build_head({"type": "mtp"}, args, tied)
    mtp.reset_parameters(0, parts.first_input_norm)

    def built(head, setting, strategy=None):
        module = DraftHeadModule(head, optimizer=setting)
        module.trainer = type("T", (), {"estimated_stepping_batches": 10, "global_rank": 0,
                                        **({"strategy": strategy} if strategy else {})})()
        return module, module.configure_optimizers()["optimizer"]

    assert isinstance(built(mtp, "auto")[1], MuonAdamW)
    assert isinstance(built(eagle3, "auto")[1], torch.optim.AdamW)
    assert isinstance(built(mtp, "auto", DeepSpeedStrategy())[1], torch.optim.AdamW)
    assert isinstance(built(mtp, "adamw")[1], torch.optim.AdamW)
    module, _ = built(mtp, "muon", DeepSpeedStrategy())
    with pytest.raises(ValueError, match="optimizer=muon: DeepSpeed ZeRO"):
        module.setup("fit")
    built(mtp, "auto", DeepSpeedStrategy())[0].setup("fit")  # auto is fine there
    with pytest.raises(ValueError, match="train.module.optimizer='sgd'"):
        DraftHeadModule(mtp, optimizer="sgd")


def test_schedules():
    assert lr_multiplier(0, 100, 10, "linear", 0.0) == pytest.approx(0.1)
    assert lr_multiplier(10, 100, 10, "linear", 0.0) == 1.0
    assert lr_multiplier(55, 100, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_multiplier(100, 100, 10, "linear", 0.0) == 0.0
    assert lr_multiplier(55, 100, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_multiplier(100, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="train.module.schedule"):
        lr_multiplier(0, 10, 1, "step", 0.0)


def test_newton_schulz_runs_in_bf16_where_the_cpu_multiplies_it(eagle3, monkeypatch):
    """`ns_dtype` None: bfloat16 on a CPU with bf16 matrix instructions (faster there; torch's Muon fixes it),
    float32 on one without (bf16 ~170× slower); an explicit dtype stays (`train.module.ns_dtype`, checked). bf16's
    iteration is within 2 % of fp32's."""
    import inference_eval.model as model

    for fast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(model, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert build_optimizer(eagle3, "muon", 1e-3, 0.01, (0.9, 0.95)).ns_dtype == expected
        explicit = build_optimizer(eagle3, "muon", 1e-3, 0.01, (0.9, 0.95), ns_dtype=torch.float32)
        assert explicit.ns_dtype == torch.float32
    from train.settings import ModuleSettings

    with pytest.raises(ValueError, match=r"train.module.ns_dtype='fp16': expected one of \('auto', 'float32', "):
        ModuleSettings(ns_dtype="fp16")
    g = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    exact, half = newton_schulz(g, dtype=torch.float32), newton_schulz(g, dtype=torch.bfloat16).float()
    assert 1e-4 < float((half - exact).norm() / exact.norm()) < 0.02  # bf16 rounding, not another result
