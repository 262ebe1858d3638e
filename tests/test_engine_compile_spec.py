"""The compiled static step verifying speculative rounds (inference_eval/engine/static.py `StaticStep`,
`Engine(compile="on")`): the seed's k = 1 MTP round (one graph: the target's pass, the head's refresh and next
draft), its k ≥ 2 form (one graph too: the k drafts of the next round in it, their rows chosen by the acceptance on
the device; 3 separate modules at k = 3, an EAGLE-3 head at k = 2 with the captured layers it reads), the sampled
chain round, and a block head's round (its block pass a graph too, with the greedy drafts in it) give the eager
engine's tokens and acceptance exactly in float32, greedy and sampled; the compiled greedy rounds read no value back
to the host."""

from __future__ import annotations

import pytest
import torch

from inference_eval.engine import Engine, engine_generate
from inference_eval.speculative import Sampling
from tests.test_dflash import _head as block_head
from tests.test_engine_compile import _graphs
from tests.test_engine import _train, mtp3, reference, varied  # noqa: F401 (fixtures)


def _samplings(n: int) -> list[Sampling]:
    return [Sampling(0.9, top_k=20, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def test_compiled_verification_equals_the_eager_engine(varied, reference, mtp3):  # noqa: F811
    target, head, prompts, path, batch = varied
    # 4 of the prompts (9..39 tokens) joining at 4 steps, in blocks of 64: every batch bucket up to 4 sequences and
    # one key bucket for the chain heads (the block head's pass crosses into a second block). Each bucket is a graph
    # to compile (≈ 20 s on a cold inductor cache); rounds crossing block boundaries in blocks of 16 are the next
    # test's
    prompts, reference, arrivals = prompts[1::2], reference[1::2], [0, 1, 3, 6]
    eagle3 = _train(path, batch, {"type": "eagle3", "aux_layers": [1], "draft_vocab_size": 300}, steps=30)
    dflash = block_head(path, "dflash")
    for name, proposer, k in (("mtp k=1", head, 1), ("mtp3", mtp3, 3), ("eagle3", eagle3, 2), ("dflash", dflash, 3)):
        want, eager = engine_generate(target, prompts, 20, proposer=proposer, k=k, arrivals=arrivals, block_size=64)
        out, eng = engine_generate(target, prompts, 20, proposer=proposer, k=k, arrivals=arrivals, block_size=64,
                                   compile="on")
        assert out == want == reference, name
        assert eng.stats.accepted == eager.stats.accepted and eng.stats.steps == eager.stats.steps, name
        # every round's target pass went through the compiled step (each step of this schedule runs a round),
        # the verification's rows included: 4 sequences of k + 1 rows at the widest
        assert eng.static.steps == eng.steps, (name, eng.static.steps, eng.steps)
        keys = [key if isinstance(key[0], int) else key[1:] for key in eng.static.compiled]  # (rows, slots, layers)
        assert max(key[0] for key in keys) >= 4 * (k + 1), (name, sorted(eng.static.compiled, key=str))
        # a chain head's greedy round is one graph (the target's pass, the head's refresh and the next round's k
        # drafts): no target step alone
        rounds = {key[0] if isinstance(key[0], str) else "target step" for key in eng.static.compiled}
        # and a block head's pass (with its greedy drafts) is a graph of its own
        assert rounds == {"mtp k=1": {"k=1 round"}, "mtp3": {"k=3 round"}, "eagle3": {"k=2 round"},
                          "dflash": {"dflash round, k=3", "dflash block pass, blocks of 4 rows, 3 greedy drafts"}}[name], \
            rounds
        assert eager.stats.accepted[0] > 0 or name == "dflash", (name, eager.stats)  # an untrained block head
    # the round's target pass captures the layers the block head reads
    captured = [key[3] for key in eng.static.compiled if key[0] == "dflash round, k=3"]
    assert captured and all(c == dflash.capture_layers for c in captured), captured
    # sampled: each request's own generator draws the same tokens as in the eager engine
    for proposer, k in ((eagle3, 3), (dflash, 3)):
        want, eager = engine_generate(target, prompts, 20, proposer=proposer, k=k, sampling=_samplings(4),
                                      arrivals=arrivals, block_size=64)
        out, eng = engine_generate(target, prompts, 20, proposer=proposer, k=k, sampling=_samplings(4),
                                   arrivals=arrivals, block_size=64, compile="on")
        assert out == want and eng.stats.accepted == eager.stats.accepted
        assert out != reference  # sampled, not greedy
    # the sampled block round: the block pass compiled, its picks drawn on the host
    assert {key[0] for key in eng.static.compiled if isinstance(key[0], str)} == {"dflash block pass, blocks of 4 rows"}


@pytest.mark.parametrize("name, k", [("mtp", 1), ("mtp", 2), ("dflash", 3)])
def test_the_greedy_round_reads_nothing_back_with_its_target_pass_compiled(varied, reference, name, k):  # noqa: F811
    """The k = 1 round, its k ≥ 2 form and a block head's round: after the graphs exist, a round's device work runs
    under the guard that refuses any read of a value to the host (`.item()`, `.tolist()`, ...): the next round's
    drafts stay on the device."""
    target, head, prompts, path, _ = varied
    proposer = block_head(path, "dflash") if name == "dflash" else head

    def run(guard: bool):
        eng = Engine(target, proposer, k=k, num_blocks=64, block_size=16, compile="on")
        eng.guard_host_reads = guard
        rids = [eng.add_request(p, 20) for p in prompts]
        res = eng.run()
        return [res[r].tokens for r in rids], eng

    out, eng = run(False)  # compiles the buckets (tracing reads values; a replay does not)
    assert out == reference and eng.static.compiled
    assert eng.stats.accepted[0] > 0 or name == "dflash"  # an untrained block head
    fused = {"mtp": f"k={k} round", "dflash": "dflash round, k=3"}[name]
    assert fused in {key[0] for key in eng.static.compiled}
    graphs = _graphs()
    again, guarded = run(True)
    assert again == reference and guarded.stats.accepted == eng.stats.accepted
    assert _graphs() == graphs and guarded.static.steps == eng.static.steps  # the same graphs, replayed


def test_seconds_spent_compiling_are_left_out_of_the_timed_passes(varied, monkeypatch):  # noqa: F811
    """evaluate.compile=on: the evaluation's paired passes subtract the seconds a new shape bucket spent compiling
    (here a stand-in compiler that sleeps 1 s per bucket, as dynamo's cache compiles each once per process), report
    them apart (`compile_s`), and give the eager engine's outputs and τ."""
    import time

    import evaluation.evaluate as ev
    import inference_eval.engine.static as static
    from inference_eval.engine import PagedHeadProposer

    target, head, prompts, *_ = varied
    seen: set = set()

    def slow_compile(fn, **_):
        def run(*args):  # (..., meta, capture): the target step's and the k = 1 round's
            meta, capture = args[-2:]
            if (fn.__name__, tuple(meta.shape), capture) not in seen:
                seen.add((fn.__name__, tuple(meta.shape), capture))
                time.sleep(1.0)
            return fn(*args)
        return run

    items = [{"ids": p} for p in prompts[:4]]
    eager, eager_plain = ev.evaluate_paired(target, {"head": (PagedHeadProposer(head), 2)}, items, 12, set(), 1,
                                            pairs=2, warmup=1)
    monkeypatch.setattr(static.torch, "compile", slow_compile)
    out, plain = ev.evaluate_paired(target, {"head": (PagedHeadProposer(head), 2)}, items, 12, set(), 1, pairs=2,
                                    warmup=0, compile="on")
    res, outputs, _ = out["head"]
    assert outputs == eager["head"][1] and res.tau == eager["head"][0].tau and res.alpha == eager["head"][0].alpha
    assert len(seen) >= 4 and eager_plain.compile_s == 0.0
    assert len(seen) <= res.compile_s + plain.compile_s < len(seen) + 2  # every bucket's second, and the steps run
    timed = plain.new_tokens / plain.tokens_per_s + res.new_tokens / res.tokens_per_s
    assert timed < 0.5 * len(seen), (timed, len(seen))  # the sleeps are not in the timed seconds


def test_engines_with_a_compiled_step_reuse_the_pools_of_engines_gone(varied, reference):  # noqa: F811
    """paged.py `PoolCache`: an engine with the compiled step gets the target's and its head's KV pools of an
    engine that is gone (so CUDA graphs recorded against those addresses replay), never one a live engine holds,
    and decodes the same tokens on a used pool as on a fresh one. A dropped engine is freed by reference counting
    alone (its proposer holds it weakly, its compiled passes are not bound to it), so its pools return at once — once
    its graphs exist: an engine whose steps compiled a new graph waits for the collector (dynamo's tracing state
    refers to it in a cycle)."""
    import gc
    import weakref

    from inference_eval.engine import PagedHeadProposer
    from inference_eval.paged import POOLS

    target, head, prompts, *_ = varied

    def engine():
        return Engine(target, PagedHeadProposer(head), k=1, num_blocks=48, block_size=16, compile="on")

    def decode(eng):
        rids = [eng.add_request(p, 20) for p in prompts]
        res = eng.run()
        return [res[r].tokens for r in rids]

    assert decode(engine()) == reference  # compiles the buckets; dynamo's tracing holds that engine in a cycle
    gc.collect()
    first = engine()
    pools = (first.pool, first.proposer.pool)
    assert first.pool.k[0].shape[0] == 49 * 16 and first.proposer.pool.k[0].shape[0] == 49 * 16  # + the scratch block
    assert decode(first) == reference
    live = engine()  # the first is alive: pools of its own
    assert {id(live.pool), id(live.proposer.pool)}.isdisjoint(map(id, pools))
    made = POOLS.made
    gone = weakref.ref(first)
    gc.disable()  # a dropped engine is freed at once (no cycle through it), its pools back before any collection
    try:
        del first
        assert gone() is None
        again = engine()
    finally:
        gc.enable()
    assert (again.pool, again.proposer.pool) == pools and POOLS.made == made  # the gone engine's, none made
    assert decode(again) == reference and decode(live) == reference
