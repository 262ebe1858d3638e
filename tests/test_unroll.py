"""The training unroll and the engine's draft loop compute the same thing: for every position i and
depth d, the unrolled Ĥ^d_i equals the head's cached step-by-step decode after the target accepted
up to i (teacher-forced tokens)."""

import pytest
import torch

from heads.registry import build_head
from heads.unroll import unroll
from inference_eval.model import tied_target
from tests.numerics import assert_close_float32, decoder_chain


pytestmark = pytest.mark.unit


@pytest.fixture
def head(tiny_target):
    tied, args, parts = tied_target(tiny_target)
    h = build_head({"type": "mtp", "init": "random"}, args, tied)
    h.reset_parameters(0, parts.first_input_norm)
    return h


def _engine_chain(head, hidden, ids, i, depth):
    """What the engine does: prefill the draft cache with (H_j, t_{j+1}) for j ≤ i, then draft
    steps 2..D at slots i+1.. with the previous step's output and teacher-forced tokens."""
    cache = head.new_cache(1, hidden.shape[1] + depth)
    out = head(hidden[:, : i + 1], ids[:, 1 : i + 2], torch.arange(i + 1).expand(1, i + 1), cache, 0)
    h = out[:, -1:]
    chain = [h]
    for d in range(2, depth + 1):
        pos = i + d - 1
        h = head(h, ids[:, i + d : i + d + 1], torch.tensor([[pos]]), cache, pos, depth=d)
        chain.append(h)
    return chain


@torch.no_grad()
def test_unroll_equals_engine_draft_chain(head):
    g = torch.Generator().manual_seed(0)
    t, depth = 14, 4
    hidden = torch.randn(1, t, head.args.hidden_size, generator=g)
    ids = torch.randint(0, head.args.vocab_size, (1, t), generator=g)
    outs = unroll(head, hidden, ids, depth)
    assert [o.shape for o in outs] == [(1, t - 1, head.args.hidden_size)] * depth
    for i in range(0, t - depth):
        chain = _engine_chain(head, hidden, ids, i, depth)
        for d in range(depth):
            # float32 both ways (the tied tensors): within the reordering bound of `depth` fused layers
            assert_close_float32(outs[d][:, i], chain[d][:, 0], terms=max(head.args.intermediate_size, t), layers=depth * (decoder_chain(1) + 1))
    # depth 1 is the plain causal forward
    torch.testing.assert_close(outs[0], head(hidden[:, :-1], ids[:, 1:], torch.arange(t - 1).expand(1, t - 1)))


@torch.no_grad()
def test_rows_do_not_see_other_rows_deeper_states(head):
    """Changing depth-2 inputs at row 3 must leave every other row's depth-2 output unchanged."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 10, head.args.hidden_size, generator=g)
    ids = torch.randint(0, head.args.vocab_size, (1, 10), generator=g)
    a = unroll(head, hidden, ids, 2)[1]
    ids2 = ids.clone()
    ids2[0, 5] = (ids2[0, 5] + 1) % head.args.vocab_size  # t_{i+2} for row 3 (and t_{i+1} of row 4)
    b = unroll(head, hidden, ids2, 2)[1]
    changed = (a - b).abs().amax(-1)[0] > 1e-6
    assert changed[3] and changed[4]  # row 3 through its depth-2 token, row 4 through its depth-1 token
    assert not changed[:3].any()


def test_depth3_training_lowers_every_depths_loss(tiny_overrides, tiny_target):
    from data.store import FeatureStore
    from experiments.stages import run_precompute
    from tests.conftest import compose_config
    from train.data import collate
    from train.module import DraftHeadModule
    from tests.helpers import init_head_of

    cfg = compose_config(tiny_overrides)
    store = FeatureStore(run_precompute(cfg)[0])
    batch = collate([store[i] for i in range(4)])
    module = DraftHeadModule(init_head_of(cfg, tiny_target), depth=3, kl_chunk_size=64)
    opt = torch.optim.AdamW(module.head.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        out = module.compute_loss(batch)
        first = first or {k: float(v.detach()) for k, v in out.items()}
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    with torch.no_grad():
        last = module.compute_loss(batch)
    for d in (1, 2, 3):
        assert float(last[f"kl_d{d}"]) < 0.7 * first[f"kl_d{d}"], d
    acc = [float(last[f"acc_d{d}"]) for d in (1, 2, 3)]
    assert float(last["sim_tau"]) == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2], rel=1e-5)


@pytest.mark.parametrize("name", ["mtp", "mtp3", "eagle3"])
def test_training_path_logits_equal_the_engine_draft_logits(tiny_target, name, monkeypatch, request):
    """The checks above run both sides under no_grad. Training runs with grad enabled, where
    `heads.layers.linear` is F.linear; the engine's few-row linears under no_grad run the native C
    kernel. Here the head's training path exactly as train/module.py takes it (train mode, grad
    enabled: the unroll, then features → F.linear with the student projection, as fused_linear_kl
    computes the student logits) and the engine's draft chain (its proposer, full_vocab_logits)
    give the same logits for every row and depth, and the same argmax in target ids. fp32, two
    summation orders: observed max difference 2.7e-7 on logits up to 0.64 (a few ulps); bound
    1e-6 + 1e-6·|logit| (≈ 6× that)."""
    import core.native as native
    from inference_eval.speculative import full_vocab_logits
    from tests.test_heads_family import _engine_states, inputs, make

    assert native.available(), native.error()  # the test machines have a C compiler
    head = request.getfixturevalue("head") if name == "mtp" else make(tiny_target, name)
    calls = []
    real_call = native.call
    monkeypatch.setattr(native, "call", lambda *a: calls.append(a[1].shape[0]) or real_call(*a))
    t, depth = 12, 3
    hidden, aux, ids = inputs(head, t, seed=2)

    head.train()
    with torch.enable_grad():
        outs = unroll(head, hidden, ids, depth, aux)
        train_logits = [torch.nn.functional.linear(head.features(o[0], d), head.lm_head_weight)
                        for d, o in enumerate(outs, start=1)]  # [T-1, V_s] per depth
    assert all(lg.requires_grad for lg in train_logits) and calls == []  # the autograd path, no native kernel

    head.eval()
    with torch.no_grad():
        for i in range(0, t - depth):
            states = _engine_states(head, hidden, aux, ids, i, depth)
            for d in range(1, depth + 1):
                full = full_vocab_logits(head, states[d - 1], depth=d)[0, -1]  # what the proposer picks from
                eng = full
                if head.draft_ids is not None:  # a sub-vocabulary: −inf elsewhere
                    assert torch.isinf(full).sum() == head.args.vocab_size - head.draft_ids.numel()
                    eng = full[head.draft_ids]
                ref = train_logits[d - 1][i].detach()
                # the engine's native float32 kernel against the autograd path: the reordering bound of
                # `depth` fused layers and the lm_head
                assert_close_float32(eng, ref, terms=max(head.args.intermediate_size, t),
                                     layers=depth * (decoder_chain(1) + 1),
                                     msg=lambda m: f"{name} row {i} depth {d}: {m}")
                assert int(head.to_target_ids(ref.argmax())) == int(full.argmax())
    assert calls and max(calls) <= 48  # the engine side did run the native kernel
