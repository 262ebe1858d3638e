"""The batched engine (inference_eval/engine/, paged.py): the paged batch's layout choice, continuous
batching with requests joining at different steps, preemption + recompute, and speculative rounds for a
batch (heads, draft model, tree) — every output equal to plain greedy decoding token for token, acceptance
equal to the batch-1 reference loop, and sampling that keeps the target's distribution. Paged attention
== contiguous attention, for every model family: tests/test_family_conformance.py."""

from collections import Counter

import pytest
import torch

from inference_eval.engine import Engine, PagedTreeProposer, Tree, engine_generate
from inference_eval.model import LlamaForCausalLM, tied_target
from inference_eval.paged import BlockAllocator, OutOfBlocks, PagedBatch, SeqSlice
from inference_eval.speculative import Sampling
from tests.reference_decoding import reference_plain, reference_speculative
from tests.conftest import make_hf_model

ARRIVALS = [0, 0, 1, 2, 3, 5, 8, 13]


def _train(path, batch, head_cfg, steps=60):
    from heads.registry import build_head
    from tests.helpers import train_on_batch
    from train.module import DraftHeadModule

    tied, args, parts = tied_target(path)
    head = build_head(head_cfg, args, tied)
    if hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(torch.bincount(batch["input_ids"].flatten(), minlength=args.vocab_size))
    head.reset_parameters(0, parts.first_input_norm)
    torch.manual_seed(0)
    train_on_batch(DraftHeadModule(head, kl_chunk_size=64, depth=3), batch, steps, lr=1e-2)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """A tiny random Llama whose greedy continuations do not repeat (weights at std 0.3), and an mtp
    head trained for a few steps on its own continuations of 16 prompts — it drafts those
    continuations well but not perfectly, so rounds accept and reject."""
    path = tmp_path_factory.mktemp("varied_target")
    make_hf_model("llama", seed=0, tie_word_embeddings=True, initializer_range=0.3).save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    starts = [torch.randint(0, 512, (4,), generator=g).tolist() for _ in range(16)]
    ids = torch.tensor([s + reference_plain(target, s, 60) for s in starts])
    with torch.no_grad():
        out = target(ids, logits="none", capture_layers=(1,))
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": out.hidden, "aux_hidden": out.aux[0]}
    head = _train(path, batch, {"type": "mtp"})
    prompts = [ids[i, : 4 + 5 * i].tolist() for i in range(8)]  # 4..39 tokens, continuations seen in training
    return target, head, prompts, path, batch


@pytest.fixture(scope="module")
def reference(varied):
    target, _, prompts, *_ = varied
    return [reference_plain(target, p, 20) for p in prompts]


@pytest.mark.unit
def test_paged_batch_layout_and_packed_rows_refusal():
    """Without `per_sequence` a prefill of sequences of 9, 39 and 4 tokens runs per sequence: padding each
    to the longest would more than double its rows (3·39 > 2·52). Packed rows refuse an empty sample.
    (Either path's values, and packed rows', equal the contiguous cache's: tests/test_family_conformance.py.)"""
    from inference_eval.paged import BlockTable, PackedRows

    alloc, tables = BlockAllocator(64), []
    for n in (9, 39, 4):
        tables.append(BlockTable(4))
        tables[-1].extend(alloc.allocate(-(-n // 4)))
    assert PagedBatch([SeqSlice(t, 0, n) for t, n in zip(tables, (9, 39, 4))]).per_sequence
    with pytest.raises(ValueError, match="≥ 1"):
        PackedRows([3, 0])


@pytest.mark.unit
def test_block_allocator_and_errors(varied):
    target = varied[0]
    alloc = BlockAllocator(3)
    assert alloc.allocate(2) == [0, 1] and alloc.num_free == 1
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    alloc.release([0, 1])
    with pytest.raises(RuntimeError, match="twice"):
        alloc.release([0])
    eng = Engine(target, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 6 blocks"):
        eng.add_request(list(range(10)), 10)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([], 4)


@pytest.mark.unit
@pytest.mark.parametrize("max_batch", [8, 3])
def test_continuous_batching_plain_equals_reference(varied, reference, max_batch):
    target, _, prompts, *_ = varied
    out, eng = engine_generate(target, prompts, 20, arrivals=ARRIVALS, max_batch=max_batch, block_size=8)
    assert out == reference
    assert eng.stats.steps == sum(len(o) - 1 for o in out)  # one target pass per token after the prefill


@pytest.mark.unit
def test_stop_ids_and_lengths(varied, reference):
    target, _, prompts, *_ = varied
    stop = {reference[0][5]}
    out, _ = engine_generate(target, prompts, 20, stop_ids=stop, arrivals=ARRIVALS)
    for o, r in zip(out, reference):
        cut = next((i + 1 for i, t in enumerate(r) if t in stop), len(r))
        assert o == r[:cut]
    lengths = [3, 20, 1, 7, 12, 2, 9, 5]
    eng = Engine(varied[0], max_batch=4)
    rids = [eng.add_request(p, n) for p, n in zip(prompts, lengths)]
    res = eng.run()
    assert [res[r].tokens for r in rids] == [r[:n] for r, n in zip(reference, lengths)]
    assert eng.alloc.num_free == eng.num_blocks  # every page came back


@pytest.mark.unit
@pytest.mark.parametrize("proposer", [None, "head", "draft_model"])
def test_preemption_and_recompute_give_identical_output(varied, reference, proposer):
    target, head, prompts, *_ = varied
    drafter = {"head": head, "draft_model": target.truncated(1), None: None}[proposer]
    out, eng = engine_generate(target, prompts, 20, proposer=drafter, k=2, block_size=4, num_blocks=30)
    assert eng.preemptions >= 1 and out == reference
    # sampled: each request's own generator continues where it stopped, so the output is identical too
    def run(num_blocks):
        samplings = [Sampling(0.9, top_k=20, generator=torch.Generator().manual_seed(i)) for i in range(8)]
        return engine_generate(target, prompts, 20, proposer=drafter, k=2, sampling=samplings,
                               block_size=4, num_blocks=num_blocks)
    (small, eng), (big, _) = run(30), run(200)
    assert eng.preemptions >= 1 and small != reference
    if proposer != "draft_model":  # the draft model's steps that re-admit a preempted request decode
        assert small == big  # plainly (the seed's schedule), so its rounds — and its draws — differ


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_head_speculative_batch_equals_plain_and_batch1(varied, reference, k):
    target, head, prompts, *_ = varied
    out, eng = engine_generate(target, prompts, 20, proposer=head, k=k, arrivals=ARRIVALS, block_size=8)
    assert out == reference
    ref = [reference_speculative(target, head, p, k, 20)[1] for p in prompts]
    assert eng.stats.accepted == [sum(x) for x in zip(*[s.accepted for s in ref])]
    assert eng.stats.steps == sum(s.steps for s in ref)
    assert 0 < eng.stats.alpha[0] < 1 and eng.stats.tau > 1.5  # rounds both accept and reject


@pytest.mark.unit
def test_draft_model_batch(varied, reference):
    """The seed's draft-model schedule is lossless in a batch joining at different steps (steps that
    prefill a newcomer decode plainly, so its acceptance counts differ from the batch-1 loop's)."""
    target, _, prompts, *_ = varied
    for k in (1, 3):
        out, eng = engine_generate(target, prompts, 20, proposer=target.truncated(1), k=k, arrivals=ARRIVALS)
        assert out == reference and 0 < eng.stats.alpha[0] < 1
    full = target.truncated(target.args.num_hidden_layers)  # the target drafting for itself: all accepted
    out, eng = engine_generate(target, prompts, 2 * 4 + 1, proposer=full, k=3)
    assert out == [r[:9] for r in reference] and eng.stats.alpha == [1.0, 1.0, 1.0]


@pytest.mark.unit
def test_draft_model_schedule_pass_counts(varied, reference):
    """Per speculative round k draft passes and one target pass: d_1 comes from the logits carried
    from the last round (no pass), d_2..d_k take k-1, and one pass after acceptance feeds the bonus
    token. The first round also feeds the prompt; under the seed's schedule (`speculate_beside_prefill=False`;
    the default is vLLM's, tests/test_draft_lm.py) a step that prefills a request decodes plainly."""
    from inference_eval.engine import PagedDraftModelProposer

    target, _, prompts, *_ = varied
    for k in (1, 2, 3):
        prop = PagedDraftModelProposer(target.truncated(1), speculate_beside_prefill=False)
        eng = Engine(target, prop, k=k, max_batch=2, max_seq_len=80)
        kinds = []
        for name in ("_decode", "_chain_round"):
            real = getattr(eng, name)
            setattr(eng, name, lambda real=real, name=name: (kinds.append(name), real())[1])
        rid = eng.add_request(prompts[3], 20)
        res = eng.run()
        rounds = kinds.count("_chain_round")
        assert kinds[0] == "_decode" and kinds.count("_decode") == 1  # the prefill's step decodes plainly
        assert prop.passes == 1 + rounds * k, (k, prop.passes, rounds)
        assert res[rid].tokens == reference[3] and eng.stats.steps == rounds + 1
    # a newcomer's prefill makes the whole batch decode plainly in that step
    prop = PagedDraftModelProposer(target.truncated(1), speculate_beside_prefill=False)
    eng = Engine(target, prop, k=2, max_batch=2, max_seq_len=80)
    kinds = []
    for name in ("_decode", "_chain_round"):
        real = getattr(eng, name)
        setattr(eng, name, lambda real=real, name=name: (kinds.append((name, len(eng.running))), real())[1])
    rids = [eng.add_request(p, 20, arrival=a) for p, a in zip(prompts[:2], (0, 3))]
    res = eng.run()
    assert kinds[0] == ("_decode", 1) and ("_decode", 2) in kinds and ("_chain_round", 2) in kinds
    assert [res[r].tokens for r in rids] == reference[:2]


@pytest.fixture(scope="module")
def mtp3(varied):
    """An mtp head of 3 separate modules (module d drafts depth d), trained like the others."""
    _, _, _, path, batch = varied
    return _train(path, {k: v for k, v in batch.items() if k != "aux_hidden"}, {"type": "mtp", "num_modules": 3})


@pytest.mark.parametrize("name", ["mtp3", "eagle3", "medusa", "eagle1"])
def test_head_family_batch(varied, reference, name, request):
    """Every head family, trained like the mtp head: lossless in a batch, and the same acceptance as
    the batch-1 loop."""
    target, _, prompts, path, batch = varied
    cfg = {"eagle1": {"type": "eagle1"}, "eagle3": {"type": "eagle3", "aux_layers": [1], "draft_vocab_size": 300},
           "medusa": {"type": "medusa", "num_heads": 3}}.get(name)
    head = request.getfixturevalue("mtp3") if name == "mtp3" else \
        _train(path, batch if name == "eagle3" else {k: v for k, v in batch.items() if k != "aux_hidden"}, cfg)
    out, eng = engine_generate(target, prompts, 20, proposer=head, k=3, arrivals=ARRIVALS)
    assert out == reference
    ref = [reference_speculative(target, head, p, 3, 20)[1] for p in prompts]
    assert eng.stats.accepted == [sum(x) for x in zip(*[s.accepted for s in ref])]
    assert eng.stats.tau > (1.3 if name != "medusa" else 1.03), eng.stats  # medusa learns least in 60 steps


class OracleTree:
    """A tree proposer that knows each request's greedy continuation: decoy branches first, the true
    path last, so the accepted nodes are never the first rows and the cache must be compacted."""

    # the Proposer protocol's declared capabilities (inference_eval/engine/base.py)
    tree, capture_layers, supports_k1, speculate_beside_prefill = True, (), False, True

    def __init__(self, continuations, depth=3):
        self.cont, self.depth = continuations, depth

    def check(self, k):
        return None

    def stats_depth(self, k):
        return self.depth

    def lookahead(self, k):
        return 3 * self.depth + 1

    def attach(self, engine):
        self.vocab = engine.target.args.vocab_size

    def prefill(self, reqs, out, rows):
        return None

    def release(self, req):
        return None

    def propose_tree(self, reqs):
        trees = []
        for r in reqs:
            true = self.cont[r.rid][len(r.output): len(r.output) + self.depth]
            toks, parents, depths = [], [], []
            for j, t in enumerate(true):  # decoy children of the root, then of each true node
                toks.append((t + 1) % self.vocab)
                parents.append(-1)
                depths.append(1)
            prev = -1
            for j, t in enumerate(true):
                wrong = j == len(true) - 1 and r.rid % 2  # odd requests: the last true node is wrong
                toks.append((t + 7) % self.vocab if wrong else t)
                parents.append(prev)
                depths.append(j + 1)
                prev = len(toks) - 1
            trees.append(Tree(toks, parents, depths))
        return trees

    def update_tree(self, reqs, vout, rows, paths, emitted):
        return None


@pytest.mark.unit
def test_tree_verification_compacts_the_cache(varied, reference):
    target, _, prompts, *_ = varied
    full = [r + [0] * 8 for r in reference]
    out, eng = engine_generate(target, prompts, 20, proposer=OracleTree(full), arrivals=ARRIVALS)
    assert out == reference
    assert eng.stats.tau > 2.5  # paths of 2-3 accepted nodes, stored after the decoys


@pytest.mark.unit
def test_eagle_tree_proposer(varied, reference):
    target, head, prompts, *_ = varied
    chain, ceng = engine_generate(target, prompts, 20, proposer=head, k=3)
    tree = PagedTreeProposer(head, depth=3, topk=3, total=10)
    out, eng = engine_generate(target, prompts, 20, proposer=tree, arrivals=ARRIVALS)
    assert out == reference and chain == reference
    assert eng.stats.tau > ceng.stats.tau  # the tree's extra branches catch some of the chain's misses
    with pytest.raises(ValueError, match="chain head"):
        PagedTreeProposer(type("Parallel", (), {"chain": False, "kind": "medusa"})())


@pytest.mark.unit
@pytest.mark.parametrize("proposer", ["head", "draft_model"])
def test_engine_sampling_matches_the_targets_joint_distribution(tiny_target, proposer):
    from tests.test_heads_family import make
    from tests.test_sampling import _exact, chi2, chi2_critical

    target = LlamaForCausalLM.from_pretrained(tiny_target)
    prompt = [5, 17, 42, 9]
    exact = _exact(target, prompt, Sampling(temperature=0.8, top_k=6))
    drafter = make(tiny_target, "mtp3") if proposer == "head" else target.truncated(1)
    n = 1000
    sampling = Sampling(temperature=0.8, top_k=6, generator=torch.Generator().manual_seed(0))
    out, eng = engine_generate(target, [prompt] * n, 3, proposer=drafter, k=2, sampling=sampling, max_batch=32,
                               num_blocks=32 * 2)
    counts = Counter(tuple(o[:2]) for o in out)
    stat, df = chi2(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)
    assert sum(eng.stats.reached) - sum(eng.stats.accepted) > n // 4  # the residual path ran often


@pytest.mark.unit
def test_draft_vocabulary_pruning(varied, reference):
    """FR-Spec style drafting among frequent tokens only: the whole vocabulary gives the unpruned
    drafts exactly; a small one drafts only its ids and stays lossless (chain and tree)."""
    from inference_eval.engine import PagedHeadProposer, frequent_ids

    target, head, prompts, _, batch = varied
    assert frequent_ids(torch.tensor([5, 9, 9, 1, 0]), 2).tolist() == [1, 2]
    _, plain_eng = engine_generate(target, prompts, 20, proposer=head, k=3)
    out, eng = engine_generate(target, prompts, 20, proposer=PagedHeadProposer(head, torch.arange(512)), k=3)
    assert out == reference and eng.stats.accepted == plain_eng.stats.accepted

    class Recording(PagedHeadProposer):
        seen: set = set()

        def propose(self, reqs, k):
            drafts, qs = super().propose(reqs, k)
            self.seen.update(t for row in drafts for t in row)
            return drafts, qs

    few = frequent_ids(torch.bincount(batch["input_ids"].flatten(), minlength=512), 60)
    rec = Recording(head, few)
    out, eng = engine_generate(target, prompts, 20, proposer=rec, k=3)
    assert out == reference and rec.seen <= set(few.tolist()) and eng.stats.tau > 1.3
    tree = PagedTreeProposer(head, depth=3, topk=3, total=8, draft_vocab=few)
    assert engine_generate(target, prompts, 20, proposer=tree)[0] == reference
    from tests.test_heads_family import make

    with pytest.raises(ValueError, match="own sub-vocabulary"):
        PagedHeadProposer(make(varied[3], "eagle3"), few)


@pytest.mark.unit
def test_a_one_wide_tree_is_the_chain(varied, reference):
    """topk = 1, total = depth = k: the tree is the chain (same drafts through the tree-mask path with
    offsets), so it accepts exactly what the chain head accepts; sampled requests are refused."""
    target, head, prompts, *_ = varied
    for k in (2, 3):
        chain_out, chain = engine_generate(target, prompts, 20, proposer=head, k=k, arrivals=ARRIVALS)
        tree_out, tree = engine_generate(target, prompts, 20, proposer=PagedTreeProposer(head, k, 1, k),
                                         arrivals=ARRIVALS)
        assert tree_out == chain_out == reference
        assert tree.stats.accepted == chain.stats.accepted and tree.stats.steps == chain.stats.steps
    eng = Engine(target, PagedTreeProposer(head, 3, 2, 6), max_seq_len=128)
    with pytest.raises(ValueError, match="verifies greedily"):
        eng.add_request(prompts[0], 8, sampling=Sampling(0.8))


@pytest.mark.unit
def test_a_one_wide_tree_is_the_chain_with_separate_modules(varied, reference, mtp3):
    """The same with 3 separate modules: at each level the tree runs every module of a deeper level on that
    level's nodes too (their entries in its own cache, as the chain writes slot m+j−2 of every deeper module),
    so a one-wide tree drafts and accepts exactly what the chain does — depth 3 included."""
    target, _, prompts, *_ = varied
    chain_out, chain = engine_generate(target, prompts, 20, proposer=mtp3, k=3, arrivals=ARRIVALS)
    tree_out, tree = engine_generate(target, prompts, 20, proposer=PagedTreeProposer(mtp3, 3, 1, 3),
                                     arrivals=ARRIVALS)
    assert tree_out == chain_out == reference
    assert tree.stats.accepted == chain.stats.accepted and tree.stats.steps == chain.stats.steps
    assert chain.stats.accepted[2] > 0, chain.stats  # depth 3 (module 3) accepted drafts: its keys mattered


@pytest.mark.unit
def test_greedy_and_sampled_requests_share_a_batch(varied, reference):
    target, head, prompts, *_ = varied
    samplings = [Sampling(0.9, top_k=20, generator=torch.Generator().manual_seed(i)) if i % 2 else Sampling()
                 for i in range(8)]
    for drafter in (head, target.truncated(1)):
        out, eng = engine_generate(target, prompts, 20, proposer=drafter, k=3, sampling=samplings, arrivals=ARRIVALS)
        assert [o for i, o in enumerate(out) if i % 2 == 0] == [r for i, r in enumerate(reference) if i % 2 == 0]
        assert [o for i, o in enumerate(out) if i % 2] != [r for i, r in enumerate(reference) if i % 2]
        assert all(len(o) == 20 for o in out)


@pytest.mark.unit
def test_grouped_attention_takes_a_strided_sdpa_output(monkeypatch):
    """CUDA's SDPA returned [B, nKV, g·T, d] in a strided layout on an H200 (`view` failed there, never
    on CPU): folding the query heads back must not assume a contiguous result."""
    import torch.nn.functional as F

    from inference_eval.paged import grouped_attention

    g = torch.Generator().manual_seed(0)
    b, n_heads, n_kv, t, kk, d = 2, 6, 2, 3, 5, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n, s in ((n_heads, t), (n_kv, kk), (n_kv, kk)))
    mask = torch.rand(b, 1, t, kk, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    grouped = mask.repeat(1, 1, n_heads // n_kv, 1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    real = F.scaled_dot_product_attention

    def strided(*args, **kw):  # same values, memory in [B, g·T, nKV, d] order
        out = real(*args, **kw)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", strided)
    assert not strided(q.reshape(b, n_kv, -1, d), k, v, attn_mask=grouped).is_contiguous()
    got = grouped_attention(q, k, v, grouped)
    assert got.shape == (b, n_heads, t, d) and torch.allclose(got, want, atol=1e-6)


# ---- the seed's k = 1 schedule --------------------------------------------------------------------------
def _k1(target, head, prompts, k1_schedule=True, guard=False, arrivals=ARRIVALS, **kw):
    if "num_blocks" not in kw:
        kw["max_seq_len"] = max(len(p) for p in prompts) + 30
    eng = Engine(target, proposer=head, k=1, k1_schedule=k1_schedule, max_batch=kw.pop("max_batch", 8), **kw)
    eng.guard_host_reads = guard
    rounds = []
    real = eng._k1_round
    eng._k1_round = lambda: (rounds.append(len(eng.running)), real())[1]
    rids = [eng.add_request(p, 20, arrival=a) for p, a in zip(prompts, arrivals)]
    res = eng.run()
    return [res[r].tokens for r in rids], eng, rounds


@pytest.mark.unit
def test_k1_round_reads_nothing_back_inside_its_device_part(varied, reference):
    """The whole device part — drafting the fresh sequences, the 2-token verification, acceptance, the
    head's re-run on both rows and the next drafts — runs under a guard that raises on any value read
    back to the host; the output is plain greedy's, token for token, in a batch of 8 joining at
    different steps."""
    from inference_eval.engine import HostSyncError, forbid_host_reads

    target, head, prompts, *_ = varied
    out, eng, rounds = _k1(target, head, prompts, guard=True)
    assert out == reference and max(rounds) >= 6 and len(set(rounds)) >= 4  # the batch grew and shrank
    assert 0 < eng.stats.alpha[0] < 1  # rounds both accepted and rejected their draft
    # the guard itself: the generic chain round reads drafts and acceptance on the host, so it must trip
    generic = Engine(target, proposer=head, k=1, k1_schedule=False, max_batch=8, max_seq_len=64)
    generic.add_request(prompts[0], 4)
    generic.step()  # prefill
    with forbid_host_reads(), pytest.raises(HostSyncError):
        generic.step()


@pytest.mark.unit
@pytest.mark.parametrize("max_batch", [8, 1])
def test_k1_round_equals_the_generic_chain_round(varied, reference, max_batch):
    """Same verification rows, same acceptance: the same tokens and the same counts as the generic
    round at k = 1 (batch 1 and batch 8), and the k = 1 round is what runs by default."""
    target, head, prompts, *_ = varied
    fast, eng_fast, rounds = _k1(target, head, prompts, max_batch=max_batch)
    slow, eng_slow, none = _k1(target, head, prompts, k1_schedule=False, max_batch=max_batch)
    assert fast == slow == reference and rounds and not none
    assert eng_fast.stats.accepted == eng_slow.stats.accepted and eng_fast.stats.steps == eng_slow.stats.steps
    assert eng_fast.stats.emitted == eng_slow.stats.emitted


@pytest.mark.unit
def test_k1_round_with_preemption_in_the_middle(varied, reference):
    target, head, prompts, *_ = varied
    out, eng, rounds = _k1(target, head, prompts, block_size=4, num_blocks=30, arrivals=[0] * 8)
    assert eng.preemptions >= 1 and rounds and out == reference


@pytest.mark.unit
def test_k1_round_mixes_with_sampled_requests(varied, reference):
    """A sampled request in the batch sends its rounds to the generic path; the greedy ones stay exact."""
    target, head, prompts, *_ = varied
    samplings = [Sampling(0.9, generator=torch.Generator().manual_seed(0))] + [Sampling()] * 7
    out, _ = engine_generate(target, prompts, 20, proposer=head, k=1, sampling=samplings, arrivals=ARRIVALS)
    assert out[1:] == reference[1:]


@pytest.mark.unit
def test_round_cost_counts_a_round_in_plain_steps(varied):
    """inference_eval.engine.round_cost: plain steps and speculative rounds interleaved, medians. A
    proposer made slower by a known delay per round costs that delay more, in plain-step units; τ is
    the rounds' own, and the prediction is τ / cost."""
    import time as _time

    from inference_eval.engine import PagedHeadProposer, round_cost

    target, head, prompts, *_ = varied
    base = round_cost(target, PagedHeadProposer(head), 2, prompts[:3], 20)
    assert base["rounds"] > 5 and 1.0 <= base["tau"] <= 3.0 and base["cost"] > 0
    assert base["predicted_speedup"] == pytest.approx(base["tau"] / base["cost"])
    _, eng = engine_generate(target, prompts[:3], 20, proposer=head, k=2, max_batch=1)
    assert base["tau"] >= 1.0 and abs(base["tau"] - eng.stats.tau) < 0.5  # the same rounds, less the first ones

    class Slow(PagedHeadProposer):
        def propose(self, reqs, k):
            _time.sleep(0.02)
            return super().propose(reqs, k)

    slow = round_cost(target, Slow(head), 2, prompts[:3], 20)
    assert slow["tau"] == pytest.approx(base["tau"])  # the same drafts
    extra = slow["cost"] - base["cost"]
    assert extra > 0.5 * 0.02 / slow["plain_step_s"]  # 20 ms more per round, in plain steps
    assert slow["predicted_speedup"] < base["predicted_speedup"]


@pytest.mark.unit
def test_evaluate_paired_rotates_the_sides_and_keeps_the_outputs(varied, monkeypatch):
    """evaluation.evaluate.evaluate_paired: plain decoding and each proposer on the same prompt groups,
    the order rotating group by group; τ, α and outputs equal one unpaired pass (greedy), one speedup
    ratio per group."""
    import evaluation.evaluate as ev
    from inference_eval.engine import PagedHeadProposer

    target, head, prompts, *_ = varied
    items = [{"ids": p, "category": "a" if i % 2 else "b"} for i, p in enumerate(prompts[:6])]
    order, real = [], ev.run_engine

    def recording(target_, proposer, ids, *args, **kw):
        order.append(("plain" if proposer is None else "head", len(ids)))
        return real(target_, proposer, ids, *args, **kw)

    monkeypatch.setattr(ev, "run_engine", recording)
    out, plain = ev.evaluate_paired(target, {"head": (PagedHeadProposer(head), 2)}, items, 12, set(), 1, pairs=3)
    assert order == [("plain", 2), ("head", 2), ("head", 2), ("plain", 2), ("plain", 2), ("head", 2)]
    res, outputs, speed = out["head"]
    assert len(speed.ratios) == 3 and plain.tau == 1.0 and plain.new_tokens == 6 * 12
    single: list = []
    ref = ev.evaluate_batched(target, PagedHeadProposer(head), items, 2, 12, set(), 1, outputs=single)
    assert outputs == single and res.tau == pytest.approx(ref.tau) and res.alpha == pytest.approx(ref.alpha)
    assert res.per_category_tau == pytest.approx(ref.per_category_tau) and res.new_tokens == ref.new_tokens
    # per-prompt counts (evaluation/tau_stats.py reads them): the same in both runs, adding up to τ
    from evaluation.tau_stats import tau_standard_error
    assert res.per_prompt == ref.per_prompt and len(ref.per_prompt) == len(items)
    assert sum(s for s, _ in ref.per_prompt) == ref.target_passes
    assert sum(e for _, e in ref.per_prompt) / ref.target_passes == pytest.approx(ref.tau)
    assert ref.tau_se == pytest.approx(tau_standard_error(ref.per_prompt)) and ref.tau_se > 0
    # plain decoding: one token per pass after the prefill's first (12 new tokens, 11 passes counted)
    assert plain.per_prompt == [[11, 11]] * len(items) and plain.tau_se == 0.0
    assert ev.groups_of(24, 4, 8) == [list(range(i, i + 8)) for i in (0, 8, 16)]  # each group fills a batch of 8
    assert ev.groups_of(5, 2) == [[0, 1], [2, 3, 4]] and ev.groups_of(1, 4) == [[0]]


@pytest.mark.unit
def test_bf16_stored_weights_are_the_model_with_rounded_weights(varied):
    """`store_weights(bfloat16)` on a float32 target (W16A32) is, bit for bit, the same model with each linear weight
    rounded to bf16 and kept in fp32: its logits at decode-sized (the native kernel widening as it reads), middle (W·xᵀ
    on a widened copy) and prefill-sized (F.linear) forwards, and so its greedy tokens, plain and speculative (which
    stay equal to each other); the embedding stays exact, the lm_head is untied from it; other combinations are
    refused. A head's `store_weights` likewise equals the head with rounded weights and drafts the same."""
    import copy

    from torch import nn

    from heads.layers import Linear

    target, head, prompts, *_ = varied
    w16 = copy.deepcopy(target).store_weights(torch.bfloat16)
    rounded = copy.deepcopy(target)
    for m in rounded.modules():
        if isinstance(m, Linear):
            m.weight = nn.Parameter(m.weight.bfloat16().float(), requires_grad=False)
    assert w16.dtype == torch.float32 and w16.weight_dtype == torch.bfloat16
    assert torch.equal(w16.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert w16.lm_head.weight.data_ptr() != w16.model.embed_tokens.weight.data_ptr()
    assert all(m.weight.dtype == torch.bfloat16 for m in w16.modules() if isinstance(m, Linear))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in ((1, 3), (2, 50), (3, 100)):  # 3, 100 and 300 rows
            ids = torch.randint(0, 512, shape, generator=g)
            got, want = w16(ids).logits, rounded(ids).logits
            assert torch.equal(got, want), shape
            assert not torch.equal(got, target(ids).logits)  # the rounding is real: another model than the fp32 one
    plain, _ = engine_generate(w16, prompts, 20)
    assert plain == engine_generate(rounded, prompts, 20)[0]
    spec, eng = engine_generate(w16, prompts, 20, proposer=head, k=3)
    assert spec == plain and sum(eng.stats.accepted) > 0
    # the head alike: its linear weights and the lm_head it projects with in bf16, its states fp32
    from heads.base import TiedTarget

    head16 = copy.deepcopy(head).store_weights(torch.bfloat16)
    head_rounded = copy.deepcopy(head)
    for m in head_rounded.modules():
        if isinstance(m, Linear):
            m.weight = nn.Parameter(m.weight.bfloat16().float(), requires_grad=False)
    t = head.tied
    head_rounded.tied = TiedTarget(t.embed, t.lm_head.bfloat16().float(), t.norm_weight, t.eps, t.conventions)
    assert head16.dtype == torch.float32 and head16.tied.lm_head.dtype == torch.bfloat16
    assert head.tied.lm_head.dtype == torch.float32  # the shared tensors are not touched
    h = torch.randn(5, target.args.hidden_size, generator=g)
    with torch.inference_mode():
        assert torch.equal(head16.logits(h), head_rounded.logits(h))
        assert not torch.equal(head16.logits(h), head.logits(h))
    spec16, eng16 = engine_generate(w16, prompts, 20, proposer=head16, k=3)
    assert spec16 == plain and sum(eng16.stats.accepted) > 0
    assert engine_generate(rounded, prompts, 20, proposer=head_rounded, k=3)[1].stats.accepted == eng16.stats.accepted
    with pytest.raises(ValueError, match="only bfloat16 weights under a float32 model"):
        copy.deepcopy(target).store_weights(torch.float16)
    with pytest.raises(ValueError, match="computes in torch.bfloat16"):
        copy.deepcopy(target).to(torch.bfloat16).store_weights(torch.float32)
    assert target.store_weights(torch.float32) is target and target.weight_dtype == torch.float32
