"""eagle3, medusa and multi-module mtp: shapes and frozen tensors, training unroll == the engine's
draft loop, greedy speculative == greedy plain, the sub-vocabulary KL, and training on a store."""

from pathlib import Path

import pytest
import torch

from heads.registry import build_head
from artifacts.checkpoint import load_native, save_native
from heads.eagle3 import default_aux_layers
from heads.unroll import unroll
from inference_eval.model import LlamaForCausalLM, tied_target
from inference_eval.scoring import chain_states
from tests.helpers import engine_plain, engine_speculative
from train.losses import fused_linear_kl, naive_kl
from tests.numerics import assert_close_float32, decoder_chain

pytestmark = pytest.mark.unit

HEADS = {
    "mtp3": {"type": "mtp", "num_modules": 3, "init": "random"},
    "eagle3": {"type": "eagle3", "aux_layers": [1], "draft_vocab_size": 200, "init": "random"},
    "eagle3_full": {"type": "eagle3", "aux_layers": [1], "init": "random"},
    # the EAGLE-3.1 normalisations (speculators' defaults), all three
    "eagle3_31": {"type": "eagle3", "aux_layers": [1], "draft_vocab_size": 200, "init": "random",
                  "norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    "medusa": {"type": "medusa", "num_heads": 3, "init": "random", "init_std": 0.2},
    # mtp reading the input of target layer 1 beside H at depth 1 (head.aux_layers), one module and three
    "mtp_aux": {"type": "mtp", "aux_layers": [1], "init": "random"},
    "mtp3_aux": {"type": "mtp", "num_modules": 3, "aux_layers": [1], "init": "random"},
}


def make(tiny_target, name, seed=0):
    tied, args, parts = tied_target(tiny_target)
    head = build_head(HEADS[name], args, tied)
    if hasattr(head, "set_draft_vocab"):
        counts = torch.zeros(args.vocab_size, dtype=torch.long)
        counts[torch.arange(0, args.vocab_size, 2)] = 5  # every second token is "frequent"
        head.set_draft_vocab(counts)
    head.reset_parameters(seed, parts.first_input_norm)
    return head


def inputs(head, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, t, head.args.hidden_size, generator=g)
    aux = torch.randn(1, t, len(head.capture_layers) * head.args.hidden_size, generator=g) if head.capture_layers else None
    ids = torch.randint(0, head.args.vocab_size, (1, t), generator=g)
    return hidden, aux, ids


@pytest.mark.parametrize("name", list(HEADS))
def test_frozen_tensors_never_trained_or_saved(tiny_target, tmp_path, name):
    head = make(tiny_target, name)
    names = [n for n, _ in head.named_parameters()]
    assert not any(n.startswith("tied.") for n in names)
    state = head.state_dict()
    assert not any(k.startswith("tied.") for k in state)
    assert all(p.requires_grad for p in head.parameters())
    reloaded = load_native(save_native(head, tmp_path / "h"), head.tied, head.args)
    hidden, aux, ids = inputs(head, 6)
    x = head.target_input(hidden, aux)
    pos = torch.arange(6).expand(1, 6)
    torch.testing.assert_close(head.logits(head(x, ids, pos)), reloaded.logits(reloaded(x, ids, pos)), atol=0, rtol=0)


def test_eagle3_shapes_and_draft_vocab(tiny_target):
    head = make(tiny_target, "eagle3")
    a = head.args
    assert head.fc.weight.shape == (a.hidden_size, a.hidden_size)  # K = 1 aux layer here
    assert head.midlayer.self_attn.q_proj.weight.shape == (a.num_attention_heads * a.head_dim, 2 * a.hidden_size)
    assert head.lm_head.weight.shape == (200, a.hidden_size)
    ids = head.draft_ids
    assert ids.tolist() == list(range(0, 400, 2))  # the 200 most frequent (of 256 tied), lowest ids, ascending
    assert head.t2d.sum() == 200 and head.t2d[ids].all()
    assert head.to_target_ids(torch.tensor([0, 1, 199])).tolist() == [0, 2, 398]
    torch.testing.assert_close(head.lm_head.weight, head.tied.lm_head[ids])  # initialised from the target's rows
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(8) == (2, 4, 5)
    with pytest.raises(ValueError, match="aux_layers"):
        build_head({"type": "eagle3", "aux_layers": [3, 2]}, a, head.tied)
    with pytest.raises(ValueError, match="none were given"):
        head.target_input(torch.zeros(1, 2, a.hidden_size), None)


@torch.no_grad()
@pytest.mark.parametrize("flag", ["norm_before_fc", "norm_before_residual", "norm_output"])
def test_each_eagle31_norm_changes_the_function(tiny_target, flag):
    """Each EAGLE-3.1 flag alone, same weights otherwise: other logits at depth 1 or later (not a no-op),
    and with norm_output the state handed on is already normed (features = the state)."""
    plain = make(tiny_target, "eagle3")
    tied, args, _ = tied_target(tiny_target)
    flagged = build_head({**HEADS["eagle3"], flag: True}, args, tied)
    missing, unexpected = flagged.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing == (["input_norm.weight"] if flag == "norm_before_fc" else [])
    if flag == "norm_before_fc":
        flagged.input_norm.weight.fill_(1.0)
    hidden, aux, ids = inputs(plain, 10, seed=3)
    a, b = unroll(plain, hidden, ids, 2, aux), unroll(flagged, hidden, ids, 2, aux)
    logits_a = [plain.logits(x) for x in a]
    logits_b = [flagged.logits(x) for x in b]
    assert max((x - y).abs().max() for x, y in zip(logits_a, logits_b)) > 1e-3
    if flag == "norm_output":
        torch.testing.assert_close(b[0], flagged.norm(flagged.midlayer(flagged.fuse(aux[:, :-1], flagged.embed(ids[:, 1:])),
                                   *flagged.rotary(torch.arange(9).expand(1, 9), torch.float32))))
        torch.testing.assert_close(flagged.features(b[0]), b[0], atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("name", ["eagle3", "eagle3_31"])
def test_unroll_attention_is_speculators_ttt_definition(tiny_target, name):
    """The peer's training-time test (speculators 0.9, models/eagle3/core.py and attention.py
    `extend_dense_mask_for_draft_tokens`), written here independently: one key list that grows by a
    block of T keys per step; step 1 attends its block causally, step d attends step 1's block causally
    and, of each later block, only its own row (the diagonal); positions move +1 per step; the state
    handed on is the layer's output (normed with norm_output). The unroll must compute the same."""
    import torch.nn.functional as F

    head = make(tiny_target, name)
    t, depth = 9, 3
    hidden, aux, ids = inputs(head, t, seed=4)
    outs = unroll(head, hidden, ids, depth, aux)
    layer, attn = head.midlayer, head.midlayer.self_attn
    rows = t - 1
    state = head.target_input(hidden[:, :-1], aux[:, :-1])
    keys, values, blocks = [], [], []
    for d in range(1, depth + 1):
        tokens = torch.zeros(1, rows, dtype=ids.dtype)
        tokens[:, : t - d] = ids[:, d:]  # teacher forcing: the input ids shifted by one more per step
        a_in, residual = layer._split(head.fuse(state, head.embed(tokens), d))
        q, k, v = attn.project(a_in, *head.rotary(torch.arange(rows)[None] + d - 1, a_in.dtype))
        keys.append(k)
        values.append(v)
        blocks.append(torch.ones(rows, rows, dtype=torch.bool).tril() if d == 1 else torch.eye(rows, dtype=torch.bool))
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=torch.cat(blocks, 1),
                                             enable_gqa=attn.n_kv != attn.n_heads)
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(1, rows, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        state = head.norm(h) if head.cfg.norm_output else h
        assert_close_float32(outs[d - 1], state, terms=max(head.args.intermediate_size, t), layers=depth * (decoder_chain(1) + 1))
    assert (outs[2] - outs[1]).abs().max() > 1e-3  # the depths differ: the comparison is not vacuous


def test_eagle3_lm_head_can_stay_the_targets_rows(tiny_target):
    """train_lm_head=false (speculators' default): lm_head is the target's draft-vocabulary rows, gets no
    gradient and is in no optimizer group; the rest trains."""
    from train.optim import parameter_groups

    tied, args, parts = tied_target(tiny_target)
    head = build_head({**HEADS["eagle3"], "train_lm_head": False}, args, tied)
    head.set_draft_vocab(torch.arange(args.vocab_size) % 5)
    head.reset_parameters(0, parts.first_input_norm)
    torch.testing.assert_close(head.lm_head.weight, tied.lm_head[head.draft_ids], atol=0, rtol=0)
    hidden, aux, ids = inputs(head, 8)
    head.logits(unroll(head, hidden, ids, 2, aux)[1]).sum().backward()
    assert head.lm_head.weight.grad is None and head.fc.weight.grad is not None
    grouped = {id(p) for g in parameter_groups(head, "muon", 0.0) + parameter_groups(head, "adamw", 0.0) for p in g["params"]}
    assert id(head.lm_head.weight) not in grouped and id(head.fc.weight) in grouped


def _engine_states(head, hidden, aux, ids, i, depth):
    """The engine's proposer (inference_eval/scoring.py `chain_states`: PagedHeadProposer on a one-sequence paged
    cache) with teacher-forced tokens after the target accepted up to i: its state [1, 1, S] at each depth."""
    states = chain_states(head, head.target_input(hidden, aux), ids[0], depth, [i])
    return [states[d][0][None, None] for d in range(1, depth + 1)]


@torch.no_grad()
@pytest.mark.parametrize("name", ["mtp3", "eagle3", "eagle3_full", "eagle3_31", "mtp_aux", "mtp3_aux"])
def test_unroll_equals_engine_draft_chain(tiny_target, name):
    head = make(tiny_target, name)
    t, depth = 12, 3
    hidden, aux, ids = inputs(head, t, seed=1)
    outs = unroll(head, hidden, ids, depth, aux)
    assert [o.shape for o in outs] == [(1, t - 1, head.args.hidden_size)] * depth
    for i in range(0, t - depth):
        chain = _engine_states(head, hidden, aux, ids, i, depth)
        for d in range(depth):
            # float32 both ways (the tied tensors): within the reordering bound of `depth` fused layers
            assert_close_float32(outs[d][:, i], chain[d][:, 0], terms=max(head.args.intermediate_size, t), layers=depth * (decoder_chain(1) + 1))
            # and the depth-d draft logits (what the engine takes the argmax of), one projection more
            assert_close_float32(head.logits(outs[d][:, i], d + 1), head.logits(chain[d][:, 0], d + 1),
                                 terms=max(head.args.intermediate_size, t), layers=depth * (decoder_chain(1) + 1) + 2)


@torch.no_grad()
def test_separate_modules_differ_from_one_reused_module(tiny_target):
    """mtp with 3 modules runs module d at depth d: depth 2 must change when only module 2 changes."""
    head = make(tiny_target, "mtp3")
    hidden, _, ids = inputs(head, 8)
    before = unroll(head, hidden, ids, 3)
    head.layers[1].eh_proj.weight.mul_(1.5)
    after = unroll(head, hidden, ids, 3)
    torch.testing.assert_close(before[0], after[0], atol=0, rtol=0)
    assert (before[1] - after[1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="exceeds"):
        unroll(head, hidden, ids, 4)


@torch.no_grad()
def test_separate_module_attends_its_own_keys_of_every_earlier_draft_step(tiny_target):
    """What vLLM's draft loop computes for a head of D separate modules (its query at depth d sits at KV slot
    m+d−2 and attends module d's slots of every earlier step, inference_eval/vllm_mtp.py), written here from
    the module's pieces: module 3 at depth 3 attends its keys of (H_j, t_{j+1}) for j ≤ i, its key of depth 2's
    input (Ĥ^1_i, t_{i+2}) at position i+1, and its own at i+2. The unroll must compute the same; without the
    depth-2 key (each module writing only its own step) the result differs."""
    import torch.nn.functional as F

    head = make(tiny_target, "mtp3")
    t = 10
    hidden, _, ids = inputs(head, t, seed=5)
    outs = unroll(head, hidden, ids, 3)
    m = head.layers[2]
    layer, attn = m.layer, m.layer.self_attn

    def fuse(state, tokens):
        return m.eh_proj(torch.cat([m.enorm(head.embed(tokens)), m.hnorm(state)], dim=-1))

    def project(x, pos):
        cos, sin = head.rotary(torch.tensor([pos]).view(1, -1), x.dtype)
        return attn.project(layer.input_layernorm(x), cos, sin)

    for i in range(0, t - 3):
        _, kb, vb = project(fuse(hidden[:, : i + 1], ids[:, 1: i + 2]), list(range(i + 1)))
        _, k2, v2 = project(fuse(outs[0][:, i: i + 1], ids[:, i + 2: i + 3]), [i + 1])
        x3 = fuse(outs[1][:, i: i + 1], ids[:, i + 3: i + 4])
        q, k3, v3 = project(x3, [i + 2])

        def layer_out(keys, values):
            a = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            y = x3 + attn.o_proj(a.transpose(1, 2).reshape(1, 1, -1))
            return y + layer.mlp(layer.post_attention_layernorm(y))

        want = layer_out(torch.cat([kb, k2, k3], 2), torch.cat([vb, v2, v3], 2))
        torch.testing.assert_close(outs[2][:, i: i + 1], want, atol=2e-5, rtol=1e-5)
        without = layer_out(torch.cat([kb, k3], 2), torch.cat([vb, v3], 2))
        assert (without - want).abs().max() > 1e-4


@torch.no_grad()
def test_three_copies_of_one_module_draft_as_the_one_module_head(tiny_target):
    """With every module ≥ d writing its key of each draft step, a head of 3 separate modules holding the same
    weights is the 1-module head (one cache reused at every depth): the same unroll at depths 1–3 and the same
    engine draft chain. (Were module d to write only its own step, depth 3 would miss the depth-2 key.)"""
    one = make(tiny_target, "mtp3")
    tied, args, _ = tied_target(tiny_target)
    single = build_head({"type": "mtp", "num_modules": 1}, args, tied)
    single.layers[0].load_state_dict(one.layers[0].state_dict())
    for m in one.layers[1:]:
        m.load_state_dict(one.layers[0].state_dict())
    t = 10
    hidden, _, ids = inputs(one, t, seed=6)
    for a, b in zip(unroll(one, hidden, ids, 3), unroll(single, hidden, ids, 3)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for i in range(0, t - 3):
        for a, b in zip(_engine_states(one, hidden, None, ids, i, 3), _engine_states(single, hidden, None, ids, i, 3)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["mtp3", "eagle3"])
def test_detached_depths_keep_the_values_and_cut_the_gradient_into_earlier_passes(tiny_target, name):
    """`train.module.detach_depths`: the unroll's values are unchanged; depth 2's loss no longer reaches
    depth 1's pass through Ĥ^1 — with separate modules (mtp3) module 1 gets no gradient from it at all,
    with one reused module (eagle3) only what depth 2's own pass and shared cache give; depth 1's own
    gradient is the same. Heads that unroll their own way refuse it."""
    head = make(tiny_target, name)
    hidden, aux, ids = inputs(head, 8)
    params = [p for p in head.parameters() if p.requires_grad]

    def grads(depth_loss: int, detach: bool) -> list[torch.Tensor]:
        head.zero_grad()
        outs = unroll(head, hidden, ids, 3, aux, detach=detach)
        outs[depth_loss - 1].square().sum().backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    with torch.no_grad():
        for a, b in zip(unroll(head, hidden, ids, 3, aux), unroll(head, hidden, ids, 3, aux, detach=True)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(grads(1, False), grads(1, True)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    full, cut = grads(2, False), grads(2, True)
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(full, cut))
    if name == "mtp3":
        first = {id(p) for p in head.layers[0].parameters()}
        for p, a, b in zip(params, full, cut):
            if id(p) in first:
                assert float(b.abs().max()) == 0.0
        assert max(float(a.abs().max()) for p, a in zip(params, full) if id(p) in first) > 0
    if name == "eagle3":
        medusa = make(tiny_target, "medusa")
        with pytest.raises(ValueError, match="detach_depths"):
            unroll(medusa, hidden, ids, 2, detach=True)


@torch.no_grad()
def test_medusa_heads_predict_further_positions(tiny_target):
    head = make(tiny_target, "medusa")
    hidden, _, ids = inputs(head, 7)
    outs = unroll(head, hidden, ids, 3)
    for d, out in enumerate(outs, start=1):  # head d on F_i, i = 0..T-2
        torch.testing.assert_close(out, head.blocks[d - 1](head.tied.final_norm(hidden[:, :-1])))
    zero = build_head({"type": "medusa", "num_heads": 2}, head.args, head.tied)
    zero.reset_parameters(0)  # identity blocks: every head predicts what the target predicts
    torch.testing.assert_close(zero.logits(zero(hidden, depth=2)), head.tied.teacher_logits(hidden))


@pytest.fixture(scope="module")
def target(tiny_target):
    return LlamaForCausalLM.from_pretrained(tiny_target)


@pytest.mark.parametrize("name,ks", [("mtp3", [1, 2, 3]), ("eagle3", [1, 2, 4]), ("medusa", [1, 3]),
                                     ("mtp3_aux", [1, 3])])
def test_greedy_speculative_equals_plain(target, tiny_target, name, ks):
    head = make(tiny_target, name).eval()
    prompts = [[1, 17, 33, 250, 9], [3], list(range(40, 77))]
    for k in ks:
        for p in prompts:
            plain = engine_plain(target, p, 24)
            spec, st = engine_speculative(target, head, p, k, 24)
            assert spec == plain, (name, k, p)
            assert st.emitted >= st.steps and len(st.alpha) == k


def test_medusa_with_oracle_blocks_is_accepted(target, tiny_target):
    """Zero-initialised Medusa heads all predict t_{i+1}: α_1 is then the rate at which the target
    repeats its own next token — computed here independently from the plain greedy output."""
    tied, args, _ = tied_target(tiny_target)
    head = build_head({"type": "medusa", "num_heads": 1}, args, tied).eval()
    head.reset_parameters(0)
    prompt = [5, 9, 13]
    plain = engine_plain(target, prompt, 40)
    spec, st = engine_speculative(target, head, prompt, 1, 40)
    assert spec == plain
    assert st.accepted[0] > 0 or all(a != b for a, b in zip(plain, plain[1:]))


def test_k_beyond_the_heads_depth_is_refused(target, tiny_target):
    with pytest.raises(ValueError, match="draft steps"):
        engine_speculative(target, make(tiny_target, "medusa"), [1, 2], 4, 4)
    with pytest.raises(ValueError, match="draft steps"):
        engine_speculative(target, make(tiny_target, "mtp3"), [1, 2], 4, 4)


def test_sub_vocabulary_kl_equals_naive_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 90
    ids = torch.tensor(sorted(torch.randperm(v, generator=g)[:30].tolist()))
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    ws = torch.randn(30, h, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(n, h, generator=g, dtype=torch.float64)
    kl, agree = fused_linear_kl(s, t, w, chunk_size=8, student_weight=ws, student_ids=ids)
    kl.backward()
    gs, gw = s.grad.clone(), ws.grad.clone()
    s.grad, ws.grad = None, None
    ref = naive_kl(s, t, lambda x: x @ ws.T, lambda x: (x @ w.T)[:, ids])
    ref.backward()
    torch.testing.assert_close(kl, ref)
    torch.testing.assert_close(gs, s.grad)
    torch.testing.assert_close(gw, ws.grad)
    expected = int((ids[(s @ ws.T).argmax(-1)] == (t @ w.T).argmax(-1)).sum())
    assert int(agree) == expected


@pytest.mark.parametrize("head_name,extra", [("eagle3", ["head.draft_vocab_size=128", "head.aux_layers=[1]"]),
                                             ("medusa", ["head.num_heads=2", "train.module.depth=2"]),
                                             ("mtp", ["head.aux_layers=[1]", "train.module.w_hidden=0.0"])])
def test_training_on_a_store(tiny_overrides, tiny_target, head_name, extra):
    from data.store import FeatureStore
    from experiments.stages import run_precompute
    from tests.conftest import compose_config
    from tests.helpers import train_on_batch
    from train.data import FeatureDataModule, collate
    from train.module import DraftHeadModule
    from tests.helpers import init_head_of

    cfg = compose_config(tiny_overrides + [f"head={head_name}", *extra])
    store = FeatureStore(run_precompute(cfg)[0])
    if head_name in ("eagle3", "mtp"):  # `precompute.aux_layers: auto` captures what the head reads
        assert store.aux_layers == [1] and store.manifest["captured"]["aux_layers"] == [1]
        assert store[0]["aux_hidden"].shape == (store[0]["hidden"].shape[0], 64)
    else:
        assert store.aux_layers == [] and "aux_hidden" not in store[0]
    dm = FeatureDataModule(cfg.store_dir, None, batch_tokens=1024, val_fraction=0.2)
    dm.setup("fit")
    head = init_head_of(cfg, tiny_target, dm)
    if head_name == "eagle3":  # the draft vocabulary is the training split's most frequent loss tokens
        counts = store.token_counts(head.args.vocab_size, dm.train_idx)
        top = set(head.draft_ids.tolist())
        assert min(int(counts[i]) for i in top) >= max(int(counts[i]) for i in range(len(counts)) if i not in top)
    module = DraftHeadModule(head, kl_chunk_size=64, depth=int(cfg.train.module.depth))
    batch = collate([store[i] for i in range(4)])
    losses = train_on_batch(module, batch, 25)
    assert losses[-1] < 0.6 * losses[0]
    out = module.compute_loss(batch)
    if head_name != "mtp":  # (mtp regresses Ĥ on H_{i+1}: reported, weighted 0 here)
        assert float(out["reg_d1"]) == 0.0  # KL only


def test_store_holds_aux_layers_in_fp8(tiny_overrides, tiny_target):
    from data.store import FeatureStore
    from experiments.stages import run_precompute
    from tests.conftest import compose_config

    base = compose_config(tiny_overrides + ["precompute.aux_layers=[1]"])
    fp8 = compose_config(tiny_overrides + ["precompute.aux_layers=[1]", "precompute.store_dtype=fp8",
                                           f"store_dir={base.run_dir}/fp8"])
    a, b = FeatureStore(run_precompute(base)[0]), FeatureStore(run_precompute(fp8)[0])
    for i in range(3):
        x, y = a[i]["aux_hidden"].float(), b[i]["aux_hidden"].float()
        assert ((x - y).abs().amax(-1) <= x.abs().amax(-1) / 8 + 1e-6).all()  # e4m3: 3 mantissa bits
        assert not torch.equal(x, y)


def test_fp8_states_are_quantised_where_computed_and_store_the_same_bytes(tiny_overrides, tiny_target, monkeypatch):
    """An fp8 store's states are quantised on the device that computed them, before the copy to the host
    (data/precompute.py `batch_states`): its shards are byte for byte those of quantising in the writer."""
    import data.precompute as pre
    from experiments.stages import run_precompute
    from tests.conftest import compose_config

    over = tiny_overrides + ["precompute.aux_layers=[1]", "precompute.store_dtype=fp8"]
    real_quantize, real_states, calls = pre.quantize_states, pre.batch_states, []

    def counting(*a, **kw):
        calls.append(a[0].device)
        return real_quantize(*a, **kw)

    monkeypatch.setattr(pre, "quantize_states", counting)
    on_device = Path(run_precompute(compose_config(over))[0])
    assert calls and all(d.type == "cpu" for d in calls)  # the tiny target's device
    monkeypatch.setattr(pre, "batch_states", lambda *a: real_states(*a[:4], False))  # the writer quantises
    in_writer = Path(run_precompute(compose_config(over + [f"store_dir={on_device.parent / 'in_writer'}"]))[0])
    shards = sorted(p.name for p in (on_device / "shards").iterdir())
    assert shards and shards == sorted(p.name for p in (in_writer / "shards").iterdir())
    for name in shards:
        assert (on_device / "shards" / name).read_bytes() == (in_writer / "shards" / name).read_bytes(), name


def test_training_refuses_a_store_without_the_heads_aux_layers(tiny_overrides, tiny_target):
    from experiments.stages import run_precompute
    from tests.conftest import compose_config
    from train.data import FeatureDataModule
    from tests.helpers import init_head_of

    cfg = compose_config(tiny_overrides + ["precompute.aux_layers=none", "head=eagle3", "head.aux_layers=[1]"])
    run_precompute(cfg)
    dm = FeatureDataModule(cfg.store_dir, None)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"holds aux layers none.*reads \[1\]"):
        init_head_of(cfg, tiny_target, dm)


def test_gradient_checkpointing_same_gradients_with_recompute(tiny_target, monkeypatch):
    from heads.layers import MLP
    from train.module import DraftHeadModule

    calls = [0]
    mlp_forward = MLP.forward

    def counting(self, x):  # module hooks do not fire during checkpoint recomputation; this does
        calls[0] += 1
        return mlp_forward(self, x)

    monkeypatch.setattr(MLP, "forward", counting)
    g = torch.Generator().manual_seed(5)
    t = 16
    batch = {"hidden": torch.randn(2, t, 64, generator=g), "input_ids": torch.randint(0, 512, (2, t), generator=g),
             "loss_mask": torch.ones(2, t, dtype=torch.bool), "valid": torch.ones(2, t, dtype=torch.bool)}
    grads, counts = [], []
    for ckpt in (False, True):
        head = make(tiny_target, "mtp3")
        module = DraftHeadModule(head, depth=3, kl_chunk_size=8, gradient_checkpointing=ckpt)
        calls[0] = 0
        module.compute_loss(batch)["loss"].backward()
        grads.append({k: p.grad.clone() for k, p in head.named_parameters()})
        counts.append(calls[0])
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-5)
    # the queries of depths 1, 2 and 3 run the MLP, each recomputed in backward (the deeper modules' keys of
    # the earlier steps are projections only: no MLP)
    assert counts == [3, 6]


@pytest.mark.parametrize("name", ["mtp3", "eagle3", "medusa"])
def test_packed_rows_score_like_separate_samples(tiny_target, name):
    """Three samples packed in one row (per-sample positions, attention inside each sample) give the
    same loss sums and agreement counts, per depth, as the three samples batched with padding."""
    from train.data import collate, collate_packed
    from train.module import DraftHeadModule

    head = make(tiny_target, name)
    g = torch.Generator().manual_seed(11)
    samples = []
    for t in (9, 14, 6):
        s = {"input_ids": torch.randint(0, 512, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.3,
             "hidden": torch.randn(t, 64, generator=g)}
        if head.capture_layers:
            s["aux_hidden"] = torch.randn(t, head.state_size, generator=g)
        samples.append(s)
    module = DraftHeadModule(head, depth=3, kl_chunk_size=8)
    packed, padded = collate_packed(samples), collate(samples)
    assert packed["input_ids"].shape == (1, 29) and packed["positions"][0, 9].item() == 0
    with torch.no_grad():
        a, b = module.compute_loss(packed), module.compute_loss(padded)
    for d in (1, 2, 3):
        assert int(a[f"agree_count_d{d}"]) == int(b[f"agree_count_d{d}"])
        n = int(a[f"n_count_d{d}"])
        assert n == int(b[f"n_count_d{d}"]) > 0
        for part in ("kl", "reg"):
            assert float(a[f"{part}_d{d}"]) * n == pytest.approx(float(b[f"{part}_d{d}"]) * n, rel=1e-4, abs=1e-5)


def test_packing_batches_fit_the_budget():
    from train.data import TokenBudgetBatches

    lengths = [5, 40, 17, 3, 60, 22, 9, 31, 12, 70]
    batches = list(TokenBudgetBatches(lengths, 64, shuffle=True, seed=0, packing=True))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 or len(b) == 1 for b in batches)
    assert len(batches) < len(list(TokenBudgetBatches(lengths, 64, shuffle=True, seed=0)))  # fewer, fuller rows


@pytest.mark.parametrize("setting", ["target", "ones"])
def test_mtp_enorm_init_target_or_ones(tiny_target, setting):
    """`head.enorm_init`: `target` starts each module's enorm at the target's layer-0 input norm,
    `ones` (the default) at 1 (docs/RESULTS.md §8: SmolLM2's layer-0 input norm is ≈ 0, so `target` hides t_{i+1}); nothing
    else of the init moves with it."""
    tied, args, _ = tied_target(tiny_target)
    first = torch.full((args.hidden_size,), 0.25)

    def fresh(value):
        head = build_head({"type": "mtp", "num_modules": 2, "enorm_init": value}, args, tied)
        head.reset_parameters(0, first)
        return head

    head, base = fresh(setting), fresh("target")
    want = first if setting == "target" else torch.ones_like(first)
    for m in head.layers:
        assert torch.equal(m.enorm.weight.detach(), want.to(head.dtype))
    for name, p in head.state_dict().items():
        if not name.endswith("enorm.weight"):
            assert torch.equal(p, base.state_dict()[name]), name
    assert head.cfg.to_dict()["enorm_init"] == setting
    assert build_head({"type": "mtp"}, args, tied).cfg.enorm_init == "ones"  # the default since issue 28
    with pytest.raises(ValueError, match="enorm_init='zeros': expected target or ones"):
        build_head({"type": "mtp", "enorm_init": "zeros"}, args, tied)


def test_loss_on_all_trains_every_real_token(tiny_overrides, tiny_target):
    """`train.module.loss_on: all`: the loss runs over every real token's row, the user turns and template
    tokens too — the same loss as the store's loss mask replaced by `valid`; `assistant` (the default) keeps
    the mask; an unknown value is refused naming the setting."""
    from data.store import FeatureStore
    from experiments.stages import run_precompute
    from tests.conftest import compose_config
    from train.data import FeatureDataModule, collate
    from train.module import DraftHeadModule
    from tests.helpers import init_head_of

    cfg = compose_config(tiny_overrides)
    store = FeatureStore(run_precompute(cfg)[0])
    dm = FeatureDataModule(cfg.store_dir, None, batch_tokens=1024, val_fraction=0.2)
    dm.setup("fit")
    head = init_head_of(cfg, tiny_target, dm)
    batch = collate([store[i] for i in range(4)])
    every = DraftHeadModule(head, kl_chunk_size=64, loss_on="all").compute_loss(batch)
    masked = DraftHeadModule(head, kl_chunk_size=64).compute_loss(batch)
    n_all = int(batch["valid"][:, 2:].sum())
    n_mask = int((batch["loss_mask"] & batch["valid"])[:, 2:].sum())
    assert int(every["n_count_d1"]) == n_all > n_mask == int(masked["n_count_d1"])
    as_if_all = DraftHeadModule(head, kl_chunk_size=64).compute_loss({**batch, "loss_mask": batch["valid"].clone()})
    torch.testing.assert_close(every["loss"], as_if_all["loss"], rtol=0, atol=0)
    assert abs(float(every["loss"]) - float(masked["loss"])) > 1e-4
    with pytest.raises(ValueError, match="train.module.loss_on"):
        DraftHeadModule(head, loss_on="replies")
    with pytest.raises(ValueError, match="train.module.kl_temperature"):  # refused before training starts
        DraftHeadModule(head, kl_temperature=0.0)


@pytest.mark.parametrize("name", ["mtp3", "eagle3", "medusa"])
def test_clip_scope_module_bounds_each_depth_module_by_its_own_norm(tiny_target, name):
    """`train.module.clip_scope: module`: one group per module of its own depth (mtp's modules, medusa's blocks), the
    whole head as one group when one module serves every depth (eagle3); each group's gradient norm is cut to the
    clip value on its own, so a group under it keeps its gradient whatever the others' size."""
    from train.module import DraftHeadModule

    head = make(tiny_target, name)
    module = DraftHeadModule(head, clip_scope="module")
    groups = module.clip_groups()
    expected = head.layers if name == "mtp3" else head.blocks if name == "medusa" else [head]
    assert [len(g) for g in groups] == [len(list(m.parameters())) for m in expected]
    g = torch.Generator().manual_seed(0)
    for i, group in enumerate(groups):  # the first group small, the others large
        for p in group:
            p.grad = torch.randn(p.shape, generator=g) * (1e-4 if i == 0 and len(groups) > 1 else 10.0)
    small = [p.grad.clone() for p in groups[0]]
    module.configure_gradient_clipping(None, 0.5, "norm")
    norms = [float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grp])))
             for grp in groups]
    if len(groups) > 1:
        for p, before in zip(groups[0], small):
            torch.testing.assert_close(p.grad, before, atol=0, rtol=0)
        assert all(abs(n - 0.5) < 1e-4 for n in norms[1:]), norms
    else:
        assert abs(norms[0] - 0.5) < 1e-4, norms
    with pytest.raises(ValueError, match="clips by norm"):
        module.configure_gradient_clipping(None, 0.5, "value")


@torch.no_grad()
def test_mtp_aux_layers_start_as_the_plain_head_and_enter_through_the_fused_state(tiny_target, tmp_path):
    """`head.aux_layers` on mtp: the target state becomes H' = H + aux_fc[aux_norm(A) …]; with init=copy aux_fc
    starts at 0, so the head (its other weights drawn as the plain head's from the same seed) drafts exactly as
    the plain head at every depth; once aux_fc moves, every depth changes with the aux states, whose scale each
    norm removes. Bad widths and ids are refused."""
    tied, args, parts = tied_target(tiny_target)
    plain = build_head({"type": "mtp"}, args, tied)
    plain.reset_parameters(0, parts.first_input_norm)
    head = build_head({"type": "mtp", "aux_layers": [1]}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    assert head.capture_layers == (1,) and head.state_size == args.hidden_size
    assert head.aux_fc.weight.abs().max() == 0
    own = {k: v for k, v in head.state_dict().items() if not k.startswith("aux_")}
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(own.pop(k), v, atol=0, rtol=0)
    assert own == {} and sorted(k for k in head.state_dict() if k.startswith("aux_")) == ["aux_fc.weight",
                                                                                          "aux_norm.0.weight"]
    hidden, aux, ids = inputs(head, 9, seed=2)
    same = unroll(head, hidden, ids, 2, aux)
    for a, b in zip(same, unroll(plain, hidden, ids, 2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    head.aux_fc.weight.normal_(0, 0.2)
    moved = unroll(head, hidden, ids, 2, aux)
    assert all((m - s).abs().max() > 1e-3 for m, s in zip(moved, same))
    torch.testing.assert_close(head.target_input(hidden, aux), hidden + head.aux_fc(head.aux_norm[0](aux)))
    scaled = unroll(head, hidden, ids, 2, aux * 1000.0)  # aux_norm: the aux state's scale does not matter
    for a, b in zip(scaled, moved):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"reads the inputs of target layers \[1\]"):
        head.target_input(hidden, None)
    with pytest.raises(ValueError, match="wide"):
        head.target_input(hidden, torch.cat([aux, aux], dim=-1))
    with pytest.raises(ValueError, match="aux_layers"):
        build_head({"type": "mtp", "aux_layers": [args.num_hidden_layers]}, args, tied)
