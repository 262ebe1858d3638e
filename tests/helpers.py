"""Checks and loops shared by the head and training tests."""

import torch

from inference_eval.engine import engine_generate
from inference_eval.speculative import GREEDY, Sampling, SpecStats
from tests.numerics import assert_close_float32, assert_same_function, decoder_chain, float64_copy


def assert_cached_steps_equal_full_forward(head, seq: int = 12, prefill: int = 5) -> None:
    """A prefill chunk then single cached steps give the same states as one full causal forward."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, seq, head.args.hidden_size, generator=g)
    tokens = torch.randint(0, head.args.vocab_size, (1, seq), generator=g)
    full = head(hidden, tokens, torch.arange(seq).expand(1, seq))
    cache = head.new_cache(1, seq + 4)
    got = [head(hidden[:, :prefill], tokens[:, :prefill], torch.arange(prefill).expand(1, prefill), cache, 0)]
    got += [head(hidden[:, i:i + 1], tokens[:, i:i + 1], torch.tensor([[i]]), cache, i) for i in range(prefill, seq)]
    # float32 both ways (the head's tied target tensors stay float32): one decoder layer after the fusion
    assert_close_float32(torch.cat(got, 1), full, terms=head.args.intermediate_size, layers=decoder_chain(1) + 1)


def train_on_batch(module, batch, steps: int, lr: float = 3e-3) -> list[float]:
    """AdamW steps of `module.compute_loss` on one fixed batch; the loss before each step."""
    opt = torch.optim.AdamW(module.head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = module.compute_loss(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return losses


class StubHead:
    """The engine-facing attributes of a plain chain head over the target's last state, for stub
    drafters that only override `__call__`, `logits` and `new_cache`."""

    layers = [None]
    kind, chain, capture_layers, separate_modules, max_depth, draft_ids = "stub", True, (), False, None, None

    def target_input(self, hidden, aux=None):
        return hidden

    def to_target_ids(self, ids):
        return ids

    def key_writers(self, depth, k):
        return range(0)  # one drafter, no separate modules' keys to write


def pool_and_tables(model, lengths, block_size: int = 4, num_blocks: int = 64):
    """A paged pool in the model's cache layout (`KVPool.for_args`, as the engine builds it) and one block
    table per sequence length."""
    from inference_eval.paged import BlockAllocator, BlockTable, KVPool

    a = model.args
    pool = KVPool.for_args(a, a.num_hidden_layers, num_blocks, block_size, model.dtype)
    alloc, tables = BlockAllocator(num_blocks), []
    for n in lengths:
        t = BlockTable(block_size)
        t.extend(alloc.allocate(-(-n // block_size)))
        tables.append(t)
    return pool, tables


def paged_steps_per_sequence(model, seqs: list[list[int]], steps: list[list[int]], prefill_per_sequence: bool,
                             block_size: int = 4) -> list[torch.Tensor]:
    """Prefill `seqs` together into a paged pool (the first sequence's blocks scattered in reverse), then
    feed every sequence the rows of each step in one padded batch (decode, verification); returns each
    sequence's logits [len(seq) + Σ len(step), V] in order."""
    from inference_eval.paged import PagedBatch, PagedCache, SeqSlice

    pool, tables = pool_and_tables(model, [len(s) + sum(map(len, steps)) for s in seqs], block_size)
    tables[0].blocks.reverse()
    tables[0].slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in tables[0].blocks])
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    batch = PagedBatch([SeqSlice(t, 0, len(s)) for t, s in zip(tables, seqs)], per_sequence=prefill_per_sequence)
    assert batch.per_sequence == prefill_per_sequence
    got = [model(ids, pos, cache=PagedCache(pool, batch)).logits[0]]
    lens = [len(s) for s in seqs]
    for rows in steps:
        n = len(rows)
        pos = torch.cat([torch.arange(m, m + n) for m in lens])[None]
        batch = PagedBatch([SeqSlice(t, m, n) for t, m in zip(tables, lens)])
        assert not batch.per_sequence
        got.append(model(torch.tensor(rows * len(seqs))[None], pos, cache=PagedCache(pool, batch)).logits[0])
        lens = [m + n for m in lens]
    out = []
    for i, s in enumerate(seqs):
        mine = [got[0][sum(map(len, seqs[:i])): sum(map(len, seqs[: i + 1]))]]
        mine += [r[i * len(st): (i + 1) * len(st)] for r, st in zip(got[1:], steps)]
        out.append(torch.cat(mine))
    return out


def random_hf_model(model_cls, config, seed: int, norm_jitter: float = 0.1):
    """An HF model of `config`, seeded, in eval mode, its norm weights moved off their init by
    `norm_jitter`·N(0, 1) (so a norm applied in the wrong form shows in the logits)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(norm_jitter * torch.randn_like(p))
    return model


def assert_tree_verification_equals_branches(model, ctx: list[int]) -> None:
    """Two branches (root→5→6, root→7→8) verified in one pass through a tree mask after the context `ctx`
    give each branch's own full-forward logits (in float64: the same function, other summation orders)."""
    from inference_eval.engine import Tree
    from inference_eval.paged import PagedBatch, PagedCache, SeqSlice

    model = float64_copy(model)
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, 0, -1, 2], depths=[1, 2, 1, 2])
    pool, (table,) = pool_and_tables(model, [len(ctx) + 8])
    model(torch.tensor([ctx]), torch.arange(len(ctx))[None],
          cache=PagedCache(pool, PagedBatch([SeqSlice(table, 0, len(ctx))])))
    m, root = len(ctx), 99
    batch = PagedBatch([SeqSlice(table, m, 5, mask=tree.ancestry())])
    pos = torch.tensor([[m, m + 1, m + 2, m + 1, m + 2]])
    got = model(torch.tensor([[root, 5, 6, 7, 8]]), pos, cache=PagedCache(pool, batch)).logits[0]
    for branch, rows in (([5, 6], [1, 2]), ([7, 8], [3, 4])):
        want = model(torch.tensor([ctx + [root] + branch])).logits[0, -3:]
        assert_same_function(got[[0, *rows]], want)


def assert_cached_decode_equals_full_forward(hf, model, ids: torch.Tensor) -> None:
    """The engine model's full forward equals HF's logits (float32 both, within the reordering bound of
    the decoder's chain); on its contiguous cache a 5-token prefill, a 3-token verification chunk, then
    single decode steps give the full forward's logits and states (float64: the same function)."""
    full = model(ids)
    with torch.no_grad():
        args = model.args
        assert_close_float32(full.logits, hf(ids).logits, terms=max(args.intermediate_size, ids.shape[1]),
                             layers=decoder_chain(args.num_hidden_layers))
    model = float64_copy(model)
    full = model(ids)
    cache = model.new_cache(ids.shape[0], ids.shape[1] + 8)
    parts = [model(ids[:, :5], cache=cache, start=0), model(ids[:, 5:8], cache=cache, start=5)]
    parts += [model(ids[:, i:i + 1], cache=cache, start=i) for i in range(8, ids.shape[1])]
    assert_same_function(torch.cat([p.logits for p in parts], 1), full.logits)
    assert_same_function(torch.cat([p.hidden for p in parts], 1), full.hidden)


@torch.inference_mode()
def engine_speculative(target, proposer, prompt: list[int], k: int, max_new_tokens: int,
                       stop_ids: set[int] = frozenset(), sampling: Sampling = GREEDY, **engine_kw
                       ) -> tuple[list[int], SpecStats]:
    """Speculative decoding of one prompt by the paged engine (inference_eval/engine/) with one slot —
    the one decoder every stage runs (the tests' shorthand for `engine_generate` of one prompt). `proposer`: a head from heads/, a draft LM, or an engine proposer.
    Greedy: output equal to `engine_plain`'s token for token; sampling: distributed as `engine_plain`'s
    (rejection sampling). Returns the new tokens and the acceptance stats."""
    outs, eng = engine_generate(target, [prompt], max_new_tokens, proposer, k, stop_ids, sampling,
                                **{"max_batch": 1, **engine_kw})
    return outs[0], eng.stats


@torch.inference_mode()
def engine_plain(target, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset(),
                 sampling: Sampling = GREEDY, **engine_kw) -> list[int]:
    """Plain decoding of one prompt by the paged engine with one slot."""
    outs, _ = engine_generate(target, [prompt], max_new_tokens, None, 1, stop_ids, sampling,
                              **{"max_batch": 1, **engine_kw})
    return outs[0]


def load_product_modules() -> None:
    """Import every product module that imports in this environment (the vLLM workers need vLLM's)."""
    import importlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for pkg in ("core", "heads", "inference_eval", "artifacts", "data", "train", "evaluation", "experiments",
                "scripts"):
        for f in sorted((root / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            if name.split(".")[-1] in ("vllm_worker", "vllm_serve_worker"):
                continue
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def patch_everywhere(monkeypatch, fn, replacement) -> int:
    """Replace the function (or class) `fn` in its own module and in every loaded module that imported it
    by name (`from m import fn` binds it at import): a stand-in that only its home module saw would let
    the code under test call the real one. Returns how many modules were patched."""
    import sys

    load_product_modules()  # a module first imported while patched would keep the stand-in after the test
    name, patched = fn.__name__, 0
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, name, None) is fn:
            monkeypatch.setattr(module, name, replacement)
            patched += 1
    assert patched, f"{fn!r} is bound in no loaded module"
    return patched


def forbid_work(monkeypatch) -> None:
    """Every way a stage starts real work fails the test — loading a target, a tokenizer or the data — for tests of
    what is refused before work. The stages' modules are loaded first (they bind names at import), so a check's
    timing is its own."""
    import transformers

    import data.sources
    import evaluation.evaluate  # noqa: F401
    import inference_eval.model
    import train.run  # noqa: F401
    from inference_eval.model import LlamaForCausalLM
    from scripts import export  # noqa: F401

    def never(*a, **k):
        raise AssertionError("work started before the configuration was checked")

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(never))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    patch_everywhere(monkeypatch, data.sources.load_conversations, never)
    patch_everywhere(monkeypatch, inference_eval.model.tied_target, never)


def init_head_of(cfg, target_dir, dm=None, target=None):
    """train/run.py `init_head` for a composed run config: its `head` section and seed."""
    from omegaconf import OmegaConf

    from train.run import init_head

    return init_head(OmegaConf.to_container(cfg.head, resolve=True), cfg.seed, target_dir, dm, target)


def data_module_of(cfg):
    """train/run.py `data_module` for a composed run config: its `train.data`, the store precompute would write, the
    target."""
    from omegaconf import OmegaConf

    from data.sources import target_config
    from experiments.stages import precompute_config
    from train.run import data_module

    return data_module(OmegaConf.to_container(cfg.train.data, resolve=True), precompute_config(cfg),
                       target_config(cfg.target))


def regenerated_path(cfg):
    """Where experiments/stages.py `regenerate(cfg)` writes its JSONL, known without loading the target."""
    from data.regenerate import plan_regeneration
    from data.sources import target_config
    from experiments.stages import regenerate_config

    return plan_regeneration(regenerate_config(cfg), target_config(cfg.target)).out
