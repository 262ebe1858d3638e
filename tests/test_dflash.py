"""The block drafters (heads/dflash.py: dflash, dspark) through training and the engine: the training forward's
block rows equal the engine's draft pass at every block position (float64, full and reduced vocabulary), greedy
speculative decoding equals plain decoding in a batch and equals each request decoded alone, sampling keeps the
target's distribution (χ²), the loss's parts (decay and D-PACE weights, TV, the confidence BCE) against a direct
computation, chunked == unchunked in values and gradients, and anchors drawn per row from its tokens."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from data.store import FeatureStore
from heads.dflash import block_mask, block_unroll, default_target_layers
from heads.registry import build_head
from inference_eval.engine import Engine, PagedBlockProposer, engine_generate
from inference_eval.model import LlamaForCausalLM, tied_target
from inference_eval.paged import SeqSlice
from inference_eval.speculative import Sampling
from tests.conftest import make_hf_model
from tests.helpers import train_on_batch
from tests.numerics import assert_same_function, float64_copy
from tests.reference_decoding import reference_plain
from tests.test_sampling import chi2, chi2_critical
from train.block_loss import BlockLossConfig, block_terms, dpace_weights, row_terms, select_anchors
from train.module import DraftHeadModule

KINDS = ["dflash", "dspark"]
ARRIVALS = [0, 0, 1, 2, 3, 5, 8, 13]


def _head(path, kind, vocab=None, seed=0, jitter=0.0, batch=None):
    tied, args, _ = tied_target(path)
    cfg = {"type": kind, "num_layers": 2, "block_size": 4, "target_layers": [1]}
    if vocab:
        cfg["draft_vocab_size"] = vocab
    head = build_head(cfg, args, tied)
    if vocab:
        counts = batch["input_ids"].flatten().bincount(minlength=args.vocab_size) if batch is not None else \
            torch.arange(args.vocab_size) % 3  # a vocabulary of two thirds of the ids
        head.set_draft_vocab(counts)
    head.reset_parameters(seed)
    if jitter:  # off the initialisation (zero Markov bias, unit norms) so every part shows in the logits
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(jitter * torch.randn(p.shape, generator=g))
    return head


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """A tiny random Llama whose greedy continuations do not repeat (weights at std 0.3), its continuations of 16
    prompts with the states a block head reads (the input of layer 1), and prompts whose continuations were seen."""
    path = tmp_path_factory.mktemp("block_target")
    make_hf_model("llama", seed=0, tie_word_embeddings=True, initializer_range=0.3).save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    starts = [torch.randint(0, 512, (4,), generator=g).tolist() for _ in range(16)]
    ids = torch.tensor([s + reference_plain(target, s, 60) for s in starts])
    with torch.no_grad():
        out = target(ids, logits="none", capture_layers=(1,))
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": out.hidden, "aux_hidden": out.aux[0]}
    prompts = [ids[i, : 4 + 5 * i].tolist() for i in range(8)]
    reference = [reference_plain(target, p, 20) for p in prompts]
    return target, path, batch, prompts, reference


@pytest.fixture(scope="module")
def trained(varied):
    """Each block head trained 80 steps on the continuations: it drafts some of them."""
    _, path, batch, *_ = varied
    heads = {}
    for kind in KINDS:
        head = _head(path, kind)
        torch.manual_seed(0)
        module = DraftHeadModule(head, kl_chunk_size=64, block={"anchors": 16})
        losses = train_on_batch(module, batch, 80, lr=1e-2)
        assert losses[-1] < 0.5 * losses[0], (kind, losses[0], losses[-1])
        heads[kind] = head.eval().requires_grad_(False)
    return heads


def _engine_block(target, head, ids: list[int], a: int, k: int) -> torch.Tensor:
    """The engine's block pass for the anchor t_a after the target's prefill of t_0..t_{a-1}: [rows, H]."""
    eng = Engine(target, head, k=k, max_batch=1, num_blocks=32, block_size=4)
    eng.add_request(ids[: a + 1], 4)
    req = eng.waiting[0]
    req.table.extend(eng.alloc.allocate(-(-(a + head.block_rows(k)) // 4)))
    out = eng.forward(target, eng.pool, [ids[:a]], [list(range(a))], [SeqSlice(req.table, 0, a)], eng.capture)
    eng.proposer.prefill([req], out, [(0, a)])
    return eng.proposer.block_hidden([req], k)[0]


@pytest.mark.unit
@pytest.mark.parametrize("vocab", [None, 300], ids=["full_vocab", "reduced_vocab"])
@pytest.mark.parametrize("kind", KINDS)
def test_block_training_forward_equals_engine_draft_logits(varied, kind, vocab):
    """Every draft position's logits of the training forward (several anchors at once, one mask) equal the engine's
    block pass after a prefill of the anchor's prefix (paged cache, context written from the target's states) —
    in float64, the same function up to summation order. Draft i's logits read the token before it (DSpark's
    Markov bias): the true one in both."""
    target, path, batch, *_ = varied
    head = float64_copy(_head(path, kind, vocab, jitter=0.05, batch=batch)).eval()
    target = float64_copy(target)
    ids = batch["input_ids"][:1]
    with torch.no_grad():
        out = target(ids, logits="none", capture_layers=head.capture_layers)
        anchors = torch.tensor([[3, 9, 20]])
        h = block_unroll(head, out.aux[0], ids, anchors)  # [1, 3, B, H]
        k = head.max_depth
        for j, a in enumerate(anchors[0].tolist()):
            got = _engine_block(target, head, ids[0].tolist(), a, k)
            prop = PagedBlockProposer(head)
            for i in range(1, k + 1):
                row = head.first_row + i - 1
                prev = ids[0, a + i - 1].view(1)
                want = head.row_logits(h[0, j, row][None], prev)
                assert_same_function(prop.draft_logits(got[row][None], prev)[:, head.draft_ids]
                                     if vocab else prop.draft_logits(got[row][None], prev), want)
        if vocab:  # drafts are target ids outside the draft vocabulary's rows: −inf there
            assert torch.isinf(prop.draft_logits(got[1][None], prev)[0, ~head.t2d]).all()


@pytest.mark.unit
def test_block_mask_sees_the_prefix_and_its_own_block_only():
    anchors = torch.tensor([[2, 5]])
    m = block_mask(anchors, 7, 3, segments=torch.tensor([[0, 0, 0, 1, 1, 1, 1]]))[0, 0]
    assert m.shape == (6, 7 + 6)
    assert m[:3, :7].tolist() == [[True, True, False, False, False, False, False]] * 3
    assert m[3:, :7].tolist() == [[False, False, False, True, True, False, False]] * 3  # its own sample only
    assert m[:3, 7:].tolist() == [[True] * 3 + [False] * 3] * 3 and m[3:, 7:].tolist() == [[False] * 3 + [True] * 3] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_block_head_greedy_equals_plain_in_a_batch_and_alone(varied, trained, kind):
    """Greedy speculative decoding with a trained block head: every output equals plain greedy decoding for a batch
    of requests joining at different steps, and the per-position acceptance counts equal the sum of each request
    decoded alone (the block's context depends on nothing but its own sequence)."""
    target, _, _, prompts, reference = varied
    head = trained[kind]
    k = head.max_depth
    out, eng = engine_generate(target, prompts, 20, proposer=head, k=k, arrivals=ARRIVALS)
    assert out == reference
    alone = [engine_generate(target, [p], 20, proposer=head, k=k, max_batch=1)[1].stats for p in prompts]
    assert eng.stats.accepted == [sum(x) for x in zip(*[s.accepted for s in alone])]
    assert eng.stats.steps == sum(s.steps for s in alone)
    # trained on these continuations: blocks are accepted, deeper rows too (a block head learns this tiny target's
    # continuations more slowly than a chain head: its row 2 never sees t_{a+1})
    assert eng.stats.tau > 1.1 and eng.stats.accepted[1] > 0, eng.stats
    short, _ = engine_generate(target, prompts, 20, proposer=head, k=1, arrivals=ARRIVALS)
    assert short == reference  # a shorter block (k < max) is still lossless


@pytest.mark.parametrize("kind", KINDS)
def test_block_head_sampling_keeps_the_targets_distribution(varied, trained, kind):
    """Rejection sampling over block drafts (each row's own distribution; DSpark's rows drawn left to right): the
    first two emitted tokens follow the target's exact joint distribution (χ² at p = 0.001), and drafts were
    rejected often enough for the residual path to matter."""
    target, *_ = varied
    sampling = Sampling(temperature=0.8, top_k=6, generator=torch.Generator().manual_seed(0))
    prompt = [5, 17, 42, 9]
    exact_s = Sampling(temperature=0.8, top_k=6)
    joint = {}
    with torch.no_grad():
        p1 = exact_s.probs(target(torch.tensor([prompt])).logits[0, -1])
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = exact_s.probs(target(torch.tensor([prompt + [t1]])).logits[0, -1])
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    n = 1000
    outs, eng = engine_generate(target, [prompt] * n, 3, trained[kind], 2, sampling=sampling, max_batch=16)
    stat, df = chi2(Counter(tuple(o[:2]) for o in outs), joint, n)
    assert stat < chi2_critical(df), (stat, df)
    assert sum(eng.stats.reached) - sum(eng.stats.accepted) > n // 4


def _naive_terms(head, batch, anchors, valid, cfg):
    """The block loss written out: every block row's logits at once, the weights by their definitions."""
    ids, hidden = batch["input_ids"], batch["hidden"]
    h = block_unroll(head, batch["aux_hidden"], ids, anchors)
    w_kl, w_tv = cfg.term_weights(head)
    total, rows = 0.0, 0
    per = []
    for j in range(anchors.shape[1]):
        a = int(anchors[0, j])
        if not valid[0, j]:
            continue
        kls, ces, tvs, confs, hards = [], [], [], [], []
        for i in range(1, head.max_depth + 1):
            if a + i >= ids.shape[1]:
                break
            prev = ids[0, a + i - 1].view(1)
            q = head.row_logits(h[0, j, head.first_row + i - 1][None], prev).log_softmax(-1)
            p = head.tied.teacher_logits(hidden[0, a + i - 1][None]).softmax(-1)
            kls.append((p * (p.log() - q)).sum())
            ces.append(-(p * q).sum())
            hards.append(-q[0, p.argmax()])
            tvs.append(0.5 * (p - q.exp()).abs().sum())
            c = head.confidence(h[0, j, head.first_row + i - 1][None], prev)
            confs.append(None if c is None else torch.nn.functional.binary_cross_entropy_with_logits(
                c[0], 1 - tvs[-1].detach()))
        if cfg.weights == "decay":
            ws = [torch.exp(torch.tensor(-(i - 1) / cfg.gamma, dtype=torch.float64)) for i in range(1, len(kls) + 1)]
        else:  # Σ_{j≥i} Π_{l≤j} s_l
            s = [(1 - cfg.dpace_alpha) * torch.exp(-c.detach()) + cfg.dpace_alpha for c in (hards if cfg.w_ce else ces)]
            prefix = [torch.prod(torch.stack(s[: j + 1])) for j in range(len(s))]
            ws = [sum(prefix[i:]) for i in range(len(s))]
        for i, w in enumerate(ws):
            term = (w_kl * kls[i] + w_tv * tvs[i] + cfg.w_ce * hards[i]
                    + (cfg.w_conf * confs[i] if confs[i] is not None else 0.0))
            total = total + w * term
            rows += 1
        per.append(kls)
    return total / rows


@pytest.mark.unit
@pytest.mark.parametrize("weights", ["decay", "dpace", "dpace_ce"])
@pytest.mark.parametrize("kind", KINDS)
def test_block_loss_equals_its_definition_values_and_gradients(varied, kind, weights):
    """`block_terms` (rows in chunks of 5, each recomputed in backward) against the loss written out row by row:
    the same value and the same gradient of every head tensor. TV is ½‖p − q‖₁ = 1 − Σ min(p, q)."""
    _, path, batch, *_ = varied
    # dpace_ce: speculators' DFlash loss, hard-label CE alone with D-PACE weights read from it
    cfg = (BlockLossConfig(weights="dpace", w_kl=0.0, w_tv=0.0, w_ce=1.0, gamma=2.0) if weights == "dpace_ce"
           else BlockLossConfig(weights=weights, gamma=2.0))
    # in float64: the same function in another order of operations
    sub = {k: (v.double() if v.is_floating_point() else v)[:1, :30] for k, v in batch.items()}
    anchors, valid = torch.tensor([[2, 7, 27, 1]]), torch.tensor([[True, True, True, False]])
    got_head = float64_copy(_head(path, kind, jitter=0.05))
    want_head = float64_copy(_head(path, kind, jitter=0.05))
    got = block_terms(got_head, sub, cfg, chunk=5, anchors=(anchors, valid))
    want = _naive_terms(want_head, sub, anchors, valid, cfg)
    assert_same_function(got["loss"].detach(), want.detach())
    got["loss"].backward()
    want.backward()
    for (name, p), q in zip(got_head.named_parameters(), want_head.parameters()):
        assert_same_function(p.grad, q.grad, msg=name)
    # rows past the sequence are not trained: anchor 27 of 30 has 2 drafts, the unused slot none
    assert int(got["n_count_d1"]) == 3 and int(got[f"n_count_d{got_head.max_depth}"]) == 2


@pytest.mark.unit
def test_block_loss_terms_and_weights_by_hand():
    """D-PACE's weights on a block whose rows are certain (CE 0: s = 1) count the rows from each on; TV and KL of a
    two-token distribution by hand."""
    w = dpace_weights(torch.zeros(1, 3), torch.tensor([[True, True, False]]), alpha=0.5)
    assert w.tolist() == [[2.0, 1.0, 0.0]]
    w = dpace_weights(torch.full((1, 2), 100.0), torch.tensor([[True, True]]), alpha=0.5)  # s = α
    torch.testing.assert_close(w, torch.tensor([[0.5 + 0.25, 0.25]]))

    class Two:  # a head whose row logits are given and whose teacher is fixed: p = (0.75, 0.25)
        draft_ids = None

        class tied:
            @staticmethod
            def teacher_logits(t):
                return torch.log(torch.tensor([[0.75, 0.25]])).expand(t.shape[0], 2)

        @staticmethod
        def row_logits(h, prev):
            return torch.log(h)

        @staticmethod
        def to_target_ids(ids):
            return ids

        @staticmethod
        def confidence(h, prev):
            return None

    kl, ce, tv, agree, conf, hard = row_terms(Two, torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.zeros(2),
                                              torch.zeros(2, 1))
    # the hard-label CE: −log q(the teacher's top-1, token 0)
    torch.testing.assert_close(hard, -torch.log(torch.tensor([0.5, 0.25])))
    torch.testing.assert_close(tv, torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(kl, torch.tensor([0.75 * torch.log(torch.tensor(1.5)) + 0.25 * torch.log(torch.tensor(0.5)),
                                                 0.75 * torch.log(torch.tensor(3.0)) + 0.25 * torch.log(torch.tensor(1 / 3))]))
    assert agree.tolist() == [True, False] and conf is None  # a tie picks index 0, the teacher's argmax


@pytest.mark.unit
def test_block_anchors_follow_each_rows_tokens_not_its_batch():
    """Anchors are distinct trainable columns, ascending, drawn from each row's own tokens and the salt: the same row
    draws the same anchors in another batch (so N processes train what one does), another salt draws others."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, 40), generator=g)
    trainable = torch.rand(3, 40, generator=g) > 0.3
    from train.block_loss import row_seeds

    a, v = select_anchors(trainable, 8, row_seeds(ids, 5))
    for r in range(3):
        cols = a[r][v[r]]
        assert cols.tolist() == sorted(set(cols.tolist())) and trainable[r, cols].all() and len(cols) == 8
    a1, _ = select_anchors(trainable[1:2], 8, row_seeds(ids[1:2], 5))
    assert a1[0].tolist() == a[1].tolist()
    a2, _ = select_anchors(trainable, 8, row_seeds(ids, 6))
    assert a2.tolist() != a.tolist()


@pytest.mark.unit
def test_block_head_settings_are_checked(varied):
    _, path, *_ = varied
    tied, args, _ = tied_target(path)
    with pytest.raises(ValueError, match="mask_token_id=512 is not a token id"):
        build_head({"type": "dflash", "mask_token_id": 512, "target_layers": [1]}, args, tied)
    with pytest.raises(ValueError, match="target_layers"):
        build_head({"type": "dflash", "target_layers": [2]}, args, tied)
    with pytest.raises(ValueError, match="block_size=1"):
        build_head({"type": "dspark", "block_size": 1, "target_layers": [1]}, args, tied)
    with pytest.raises(ValueError, match="block.weights='flat'"):
        BlockLossConfig(weights="flat")
    head = _head(path, "dflash")
    with pytest.raises(ValueError, match="at most 3"):
        engine_generate(LlamaForCausalLM.from_pretrained(path), [[1, 2, 3]], 4, proposer=head, k=4)
    assert default_target_layers(30) == (2, 11, 19, 28) and default_target_layers(36, 5) == (2, 10, 18, 26, 34)


@pytest.mark.parametrize("kind", KINDS)
def test_block_head_trains_validates_and_evaluates_through_the_stages(tiny_overrides, kind):
    """precompute (the store captures the head's target layers: `precompute.aux_layers: auto`) → training with
    in-loop engine validation (the engine's block pass and the training forward score the same held-out rows: equal
    KL and top-1 per draft position, float32) → evaluation in the engine, k = 3 drafts per block."""
    from data.store import FeatureStore
    from experiments.stages import run_evaluation, run_precompute, run_training
    from tests.conftest import compose_config

    cfg = compose_config([*tiny_overrides, f"head={kind}", "head.num_layers=1", "head.block_size=4",
                          "trainer.max_epochs=1", "train.module.block.anchors=8"])
    store, _ = run_precompute(cfg)
    assert FeatureStore(store).aux_layers == [1]  # default_target_layers of the 2-layer target
    _, metrics = run_training(cfg)
    for d in range(1, 4):
        # float32: a KL near 0 is a difference of two close sums, so compare at 1e-3 of its size
        assert metrics[f"engine_val/kl_d{d}"] == pytest.approx(metrics[f"engine_val/train_kl_d{d}"], rel=1e-3)
        assert metrics[f"engine_val/gap_acc_d{d}"] == 0.0 and metrics[f"engine_val/reg_d{d}"] == 0.0
        assert f"val/kl_d{d}" in metrics and f"train/tv_d{d}" in metrics
    assert ("train/conf_d1" in metrics) == (kind == "dspark")
    report = run_evaluation(cfg)
    for res in report["results"].values():
        assert res["k"] == 3 and len(res["alpha"]) == 3 and res["tau"] >= 1.0
    adaptive = compose_config([*tiny_overrides, f"head={kind}", "head.num_layers=1", "head.block_size=4",
                               "evaluate.stop_below=0.99"])
    if kind == "dspark":  # the adaptive draft length in the evaluation: the same tokens, never fewer target passes
        short = run_evaluation(adaptive)
        assert short["stop_below"] == 0.99 and report["stop_below"] is None
        for label, res in short["results"].items():
            full = report["results"][label]
            assert [p[1] for p in res["per_prompt"]] == [p[1] for p in full["per_prompt"]]
            assert res["target_passes"] >= full["target_passes"]
    else:
        with pytest.raises(ValueError, match=r"evaluate.stop_below, evaluate.heads.trained: .*no confidence head"):
            run_evaluation(adaptive)


def test_dflash_head_trains_on_a_store_capturing_more_layers_than_it_reads(tiny_overrides, deep_target, tmp_path):
    """One store serves heads reading different subsets of the layers it captured: a dflash head reading target
    layers [2, 5] trains on a store capturing [1, 2, 5, 6] exactly as on a store capturing [2, 5] alone — the same
    logged losses and the same saved weights (float32) — and scores the same held-out top-1 per block position
    (experiments/runner.py `heldout`); a layer the store lacks is refused, naming the store's layers and the head's."""
    from safetensors.torch import load_file

    from experiments.runner import heldout, heldout_split
    from experiments.stages import run_precompute, run_training
    from tests.conftest import compose_config
    from tests.helpers import data_module_of, init_head_of

    base = [*tiny_overrides, f"target.path={deep_target}", "head=dflash", "head.num_layers=1", "head.block_size=4",
            "head.target_layers=[2,5]", "trainer.max_epochs=1", "train.module.block.anchors=8",
            "train.engine_validation.enabled=false"]
    runs = {}
    for name, aux in (("exact", "auto"), ("superset", "[1,2,5,6]")):
        cfg = compose_config([*base, f"run_dir={tmp_path / name}", f"precompute.aux_layers={aux}"])
        store, _ = run_precompute(cfg)
        _, metrics = run_training(cfg)
        held = heldout(cfg, Path(cfg.head_dir), heldout_split(cfg, Path(store), None, None), 3, None)
        runs[name] = (cfg, metrics, load_file(str(next(Path(cfg.head_dir).glob("*.safetensors")))), held)
    (ex_cfg, ex_m, ex_w, ex_h), (sup_cfg, sup_m, sup_w, sup_h) = runs["exact"], runs["superset"]
    assert FeatureStore(ex_cfg.store_dir).aux_layers == [2, 5]
    assert FeatureStore(sup_cfg.store_dir).aux_layers == [1, 2, 5, 6]
    losses = sorted(k for k in ex_m if k.startswith(("train/", "val/")) and k.split("/")[1].startswith(("loss", "kl",
                                                                                                    "acc", "tv")))
    assert losses and [ex_m[k] for k in losses] == [sup_m[k] for k in losses]
    assert ex_w.keys() == sup_w.keys() and all(torch.equal(ex_w[k], sup_w[k]) for k in ex_w)
    assert ex_h["acc"] == sup_h["acc"] and len(ex_h["acc"]) == 3
    assert ex_h["tokens"] == sup_h["tokens"] and min(ex_h["tokens"]) > 0
    wrong = compose_config([*base, f"run_dir={tmp_path / 'superset'}", "head.target_layers=[3,5]"])
    dm, _ = data_module_of(wrong)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"holds aux layers \[1, 2, 5, 6\], the dflash head reads \[3, 5\]"):
        init_head_of(wrong, deep_target, dm)


def test_dspark_compiled_round_is_one_graph_and_equals_the_eager_engine(varied, trained):
    """With the compiled step (`Engine(compile="on")`) a block head's greedy round is one graph — the target's pass,
    the acceptance, the context entries of the verified rows, the next block pass at m + a + 1 and its k greedy
    drafts (scheduler.py `_fused_round`) — and gives the eager engine's tokens, per-position acceptance and rounds in
    float32 for requests joining at different steps. The head accepts drafts at the second block position, so the
    graph picks the next block's rows for acceptances beyond 0."""
    target, _, _, prompts, reference = varied
    head = trained["dspark"]
    k = head.max_depth
    # 4 prompts joining at 4 steps, in blocks of 64: every batch bucket, a block pass crossing into a second block
    # (each bucket a graph to compile)
    prompts, reference, arrivals = prompts[1::2], reference[1::2], [0, 1, 3, 6]
    want, eager = engine_generate(target, prompts, 20, proposer=head, k=k, arrivals=arrivals, block_size=64)
    out, eng = engine_generate(target, prompts, 20, proposer=head, k=k, arrivals=arrivals, block_size=64,
                               compile="on")
    assert out == want == reference
    assert eng.stats.accepted == eager.stats.accepted and eng.stats.steps == eager.stats.steps
    assert eager.stats.accepted[1] > 0, eager.stats
    names = {key[0] if isinstance(key[0], str) else "target step" for key in eng.static.compiled}
    # the round's graph, and the block pass that drafts a newcomer's first block after its prefill: no target step
    assert names == {f"dspark round, k={k}", f"dspark block pass, blocks of {head.block_rows(k)} rows, {k} greedy drafts"}, names
    assert eng.static.steps == eng.steps  # every round through the one graph


def test_dspark_confidence_ends_a_sequences_block_early_and_stays_lossless(varied, trained):
    """`stop_below`: each sequence's drafts end where the confidence head's Π σ(c) falls below it — fewer drafts
    verified (the deeper positions are reached less often), the output still plain greedy decoding, and each
    round still drafts at least one token."""
    target, _, _, prompts, reference = varied
    head = trained["dspark"]
    k = head.max_depth
    full, eng_full = engine_generate(target, prompts, 20, proposer=PagedBlockProposer(head), k=k, arrivals=ARRIVALS)
    with torch.no_grad():  # a confidence head that predicts rejection after the first draft everywhere: σ(−4) ≈ 0.02
        saved = {k: v.clone() for k, v in head.confidence_head.state_dict().items()}
        head.confidence_head.proj.bias.fill_(-4.0)
        head.confidence_head.proj.weight.zero_()
    try:
        short, eng = engine_generate(target, prompts, 20, proposer=PagedBlockProposer(head, stop_below=0.5), k=k,
                                     arrivals=ARRIVALS)
    finally:
        head.confidence_head.load_state_dict(saved)
    assert full == short == reference
    assert eng.stats.reached[0] == eng.stats.steps and sum(eng.stats.reached[1:]) == 0  # one draft per round
    assert sum(eng_full.stats.reached[1:]) > 0
    with pytest.raises(ValueError, match="no confidence head"):
        PagedBlockProposer(_head(varied[1], "dflash"), stop_below=0.5)


def _export(head, kind, tmp_path, target_dir):
    from artifacts.export import export_head

    fmt = f"{kind}-vllm"
    return export_head(head, {fmt: tmp_path / fmt}, target_dir)[fmt], fmt


@pytest.mark.unit
@pytest.mark.parametrize("vocab", [None, 300], ids=["full_vocab", "reduced_vocab"])
@pytest.mark.parametrize("kind", KINDS)
def test_block_head_export_round_trip_and_vllm_config(varied, tmp_path, kind, vocab):
    """The vLLM export (dflash-vllm / dspark-vllm) reads back to the same function, bit for bit (export_head proves
    it with the head's probe; here the engine's block pass too), with vLLM's config keys: the layer ids one lower
    (vLLM names the output of layer i, spechead the input), the mask id, the block size, Qwen3 layers."""
    import json

    from artifacts.export import load_export
    from artifacts.formats import detect_format
    from artifacts.validate import validate_export

    target, path, batch, *_ = varied
    head = _head(path, kind, vocab, jitter=0.05, batch=batch).eval()
    out, fmt = _export(head, kind, tmp_path, path)
    assert detect_format(out) == fmt and validate_export(out, fmt, path) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [0], "use_aux_hidden_state": True}
    assert (cfg["architectures"], cfg["model_type"], cfg["block_size"], cfg["num_hidden_layers"]) == \
        ([{"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}[kind]], "qwen3", 4, 2)
    assert cfg["rope_parameters"]["rope_theta"] == head.args.rope_theta
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "layers.1.self_attn.k_norm.weight" in keys and "t2d" not in keys and "embed_tokens.weight" not in keys
    assert ("d2t" in keys) == ("lm_head.weight" in keys) == (vocab is not None)
    assert ("markov_head.markov_w1.weight" in keys) == ("confidence_head.proj.bias" in keys) == (kind == "dspark")
    tied, args, _ = tied_target(path)
    back = load_export(out, fmt, tied, args).eval()
    ids = batch["input_ids"][0].tolist()
    assert torch.equal(_engine_block(target, back, ids, 9, back.max_depth),
                       _engine_block(target, head, ids, 9, head.max_depth))


def test_block_export_defects_are_named_or_change_acceptance(varied, trained, tmp_path):
    """A zeroed fc, a mask id outside the vocabulary and layer ids past the target are named by the validator; a
    mask id or layer ids that are valid but not the trained ones load — and change what the engine accepts."""
    import json

    from safetensors.torch import load_file, save_file

    from artifacts.export import load_export
    from artifacts.integrity import write_manifest
    from artifacts.validate import validate_export

    target, path, _, prompts, _ = varied
    good, fmt = _export(trained["dflash"], "dflash", tmp_path, path)

    def variant(name, edit_cfg=None, edit_state=None):
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        if edit_cfg:
            cfg = json.loads((d / "config.json").read_text())
            edit_cfg(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if edit_state:
            state = load_file(d / "model.safetensors")
            edit_state(state)
            save_file(state, d / "model.safetensors", metadata={"format": "pt"})
        write_manifest(d)  # edited on purpose: record the files as they are now
        return d

    zeroed = variant("zeroed_fc", edit_state=lambda s: s.__setitem__("fc.weight", torch.zeros_like(s["fc.weight"])))
    assert any("'fc.weight' is all zeros" in p for p in validate_export(zeroed, fmt, path))
    far = variant("mask_far", edit_cfg=lambda c: (c["dflash_config"].__setitem__("mask_token_id", 9999),
                                                  c.__setitem__("mask_token_id", 9999)))
    assert any("mask_token_id 9999 is not a token id" in p for p in validate_export(far, fmt, path))
    deep = variant("layers_far", edit_cfg=lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1]))
    assert any("target_layer_ids [1] name outputs of target layers" in p for p in validate_export(deep, fmt, path))

    tied, args, _ = tied_target(path)

    def accepted(d):
        return engine_generate(target, prompts, 20, proposer=load_export(d, fmt, tied, args), k=3)[1].stats.accepted

    base = accepted(good)
    other_mask = variant("mask_other", edit_cfg=lambda c: (c["dflash_config"].__setitem__("mask_token_id", 7),
                                                           c.__setitem__("mask_token_id", 7)))
    assert validate_export(other_mask, fmt, path) == [] and accepted(other_mask) != base
    assert accepted(zeroed) != base
