"""The batched engine (docs/design.md §5): one scheduler and one page allocation for the target and its
drafter, continuous batching, preemption with recompute, and speculative rounds for a whole batch.

    engine = Engine(target, proposer=head, k=3, max_batch=8)
    rid = engine.add_request(prompt_ids, max_new_tokens=256, stop_ids={eos})
    results = engine.run()            # {rid: Result(tokens, stats, preemptions)}

A step of the scheduler:
1. **admit** — waiting requests whose arrival step has come join, first come first served (a
   preempted request first), while the batch has room, their pages fit and the prefill token budget
   lasts, keeping back the pages the running sequences will reserve over the next two rounds; their
   prompts (or, after preemption, prompt + output so far) run as one packed varlen prefill; a new
   request samples its first token from it; a head prefills from the target's states of the same
   pass (a draft model feeds the prompt in its first proposal);
2. **reserve** — every running sequence gets the pages for the positions the round will write
   (`lookahead`: k + 1 for a chain, the tree's size for a tree) before anything runs; when the pool
   runs dry the most recently admitted sequence is preempted (its pages freed, its tokens kept) and
   re-admitted later by recomputing its prefix — the same output (tested in float32; in bf16 a
   recomputed prefix can round differently, so a near-tie argmax may flip);
3. **round** — plain decode (one token per sequence), or a speculative round: the proposer drafts for
   every sequence at once, the target verifies all of them in one packed pass, acceptance runs per
   sequence (greedy, or rejection sampling with each request's own `Sampling`), the drafter updates
   from the target's states; a sequence that emits a stop id or reaches `max_new_tokens` leaves and
   frees its pages.

Positions and slots: a running sequence has committed tokens t_0..t_m; the target's cache holds
positions < m (t_m is fed by the next round). Every pool uses the sequence's block table, so a
head's or a draft model's cache entry for position p sits in the same slot as the target's.

Proposers for the engine: `PagedHeadProposer` (chain heads mtp/eagle1/eagle3 and medusa),
`PagedDraftModelProposer` (any LM with the target's tokenizer), `PagedTreeProposer` (EAGLE-2
dynamic trees from a chain head, greedy). `engine_proposer(x)` wraps a head or a model.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from heads.layers import linear
from inference_eval.paged import BlockAllocator, BlockTable, KVPool, OutOfBlocks, PagedBatch, PagedCache, SeqSlice
from inference_eval.speculative import (
    GREEDY,
    DraftModelProposer,
    Sampling,
    SpecStats,
    _finish,
    accept_greedy,
    accept_rejection,
    full_vocab_logits,
)


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampling: Sampling
    arrival: int
    table: BlockTable
    stats: SpecStats
    output: list[int] = field(default_factory=list)
    cached: int = 0  # the target's cache holds positions < cached (= m while running)
    state: torch.Tensor | None = None  # the proposer's state for this sequence
    fed: int = 0  # draft model: positions < fed are in its cache
    draft: torch.Tensor | None = None  # k = 1 schedule: the head's next draft token, left on the device
    carry: torch.Tensor | None = None  # draft model: its logits at position fed-1, for the next d_1
    preemptions: int = 0
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def m(self) -> int:
        return len(self.prompt) + len(self.output) - 1


@dataclass
class Result:
    tokens: list[int]
    stats: SpecStats
    preemptions: int


@dataclass
class Tree:
    """A draft tree of one sequence: node i has `tokens[i]`, `parents[i]` (−1: the root t_m, else a
    node index < i) and `depths[i]` (1 for children of the root)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def ancestry(self) -> torch.Tensor:
        """[N+1, N+1] bool, row/col 0 the root: entry (i, j) true when j is i or one of its ancestors."""
        n = len(self.tokens)
        m = torch.eye(n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i + 1] |= m[p + 1]
        return m


def _target_state(head, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    return head.target_input(hidden, torch.cat(aux, dim=-1) if head.capture_layers else None)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))


class HostSyncError(RuntimeError):
    """A tensor value was read back to the host where the schedule promises not to."""


_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def forbid_host_reads():
    """Within the block, any read of a tensor's value into Python (`.item()`, `.tolist()`, `.numpy()`,
    `bool` / `int` / `float` / index use) raises HostSyncError: on an accelerator each of them waits for
    the queued work. Process-wide and not thread-safe: a test and debugging aid."""
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def refuse(name: str):
        def read(self, *args, **kwargs):
            raise HostSyncError(f"Tensor.{name} read a value back to the host inside a no-sync region")
        return read

    for name in _HOST_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


class Engine:
    """Continuous-batching engine over a paged KV cache; see the module docstring."""

    def __init__(self, target, proposer=None, k: int = 1, block_size: int = 16, num_blocks: int | None = None,
                 max_batch: int = 8, max_seq_len: int | None = None, prefill_tokens: int = 8192,
                 k1_schedule: bool = True) -> None:
        self.target = target
        # the seed's k = 1 MTP schedule (`_k1_round`) for chain heads at k = 1; False: the generic chain round
        self.k1_schedule = k1_schedule
        self.guard_host_reads = False  # tests: run the k = 1 round's device part under `forbid_host_reads`
        a = target.args
        self.device = target.model.embed_tokens.weight.device
        self.block_size, self.max_batch, self.prefill_tokens = block_size, max_batch, prefill_tokens
        if num_blocks is None:  # max_batch sequences of max_seq_len (default: the context, at most 4,096)
            num_blocks = max_batch * math.ceil((max_seq_len or min(a.max_position_embeddings, 4096)) / block_size)
        self.num_blocks = num_blocks
        self.alloc = BlockAllocator(num_blocks)
        self.pool = KVPool.for_args(a, a.num_hidden_layers, num_blocks, block_size, target.dtype, self.device)
        self.proposer = engine_proposer(proposer) if proposer is not None else None
        self.k = k
        if self.proposer is not None:
            self.proposer.check(k)
            self.proposer.attach(self)
            self.k = self.proposer.stats_depth(k)
        self.lookahead = self.proposer.lookahead(k) if self.proposer is not None else 1
        self.capture = self.proposer.capture_layers if self.proposer is not None else ()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.steps = 0
        self.stats = SpecStats(k=self.k)
        self.preemptions = 0
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], max_new_tokens: int, stop_ids=frozenset(),
                    sampling: Sampling = GREEDY, arrival: int = 0) -> int:
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        need = self._blocks_for(len(prompt) + max_new_tokens + self.lookahead)
        if need > self.num_blocks:
            raise ValueError(f"a request of {len(prompt)} prompt + {max_new_tokens} new tokens needs {need} blocks "
                             f"of {self.block_size}; the pool has {self.num_blocks}")
        if self.proposer is not None and self.proposer.tree and not sampling.greedy:
            raise ValueError("a draft tree verifies greedily: sampled requests need a chain proposer")
        rid = self._next_id
        self._next_id += 1
        self.waiting.append(Request(rid, list(prompt), max_new_tokens, frozenset(stop_ids), sampling, arrival,
                                    BlockTable(self.block_size, self.device), SpecStats(k=self.k)))
        return rid

    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @torch.inference_mode()
    def run(self, on_finish=None) -> dict[int, Result]:
        """Step until every request has finished; their results by request id. `on_finish(n)`: called
        with the number of requests that finished in a step (a progress bar)."""
        t0 = time.perf_counter()
        while self.has_work:
            before = len(self.finished)
            self.step()
            if on_finish is not None and len(self.finished) > before:
                on_finish(len(self.finished) - before)
        self.stats.seconds += time.perf_counter() - t0
        out = {rid: Result(r.output, r.stats, r.preemptions) for rid, r in sorted(self.finished.items())}
        self.stats.new_tokens = sum(len(r.tokens) for r in out.values())
        return out

    @torch.inference_mode()
    def step(self) -> None:
        admitted = self._admit()
        if self.running:
            self._reserve()
        if self.running:
            if self.proposer is None or (admitted and not getattr(self.proposer, "speculate_beside_prefill", True)):
                self._decode()  # the seed's draft-model schedule: a batch with a prefill decodes plainly
            elif self.proposer.tree:
                self._tree_round()
            elif self._k1_applies():
                self._k1_round()
            else:
                self._chain_round()
        self.steps += 1

    # ---- scheduling ------------------------------------------------------------------------------------
    def _admit(self) -> bool:
        admitted, budget = [], self.prefill_tokens
        # keep the pages the running sequences will reserve over the next two rounds, so a newcomer is
        # not admitted (and prefilled) only to be preempted by their growth at once
        free = self.alloc.num_free - sum(max(0, self._blocks_for(r.m + 2 * self.lookahead) - len(r.table.blocks))
                                         for r in self.running)
        for req in [r for r in self.waiting if r.arrival <= self.steps]:  # queue order: preempted first
            if len(self.running) + len(admitted) >= self.max_batch:
                break
            feed = len(req.tokens) if not req.output else len(req.tokens) - 1
            need = self._blocks_for(feed + 1 + self.lookahead)
            if need > free or (admitted and feed > budget):
                break
            self.waiting.remove(req)
            req.table.extend(self.alloc.allocate(need))
            free -= need
            budget -= feed
            admitted.append(req)
        if admitted:
            self._prefill(admitted)
        return bool(admitted)

    def _reserve(self) -> None:
        for req in list(self.running):
            if req not in self.running:
                continue
            need = self._blocks_for(req.m + self.lookahead) - len(req.table.blocks)
            while need > self.alloc.num_free:
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    raise OutOfBlocks(f"request {req.rid} alone needs {need} more blocks, "
                                      f"{self.alloc.num_free} are free")
                self._preempt(victim)
                if victim is req:
                    break
            if req in self.running and need > 0:
                req.table.extend(self.alloc.allocate(need))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.alloc.release(req.table.clear())
        req.cached, req.state, req.fed, req.draft = 0, None, 0, None
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _finish_check(self, req: Request) -> None:
        out, done = _finish(req.output, req.max_new_tokens, req.stop_ids)
        req.output = out
        if done:
            req.done = True
            self.running.remove(req)
            self.alloc.release(req.table.clear())
            if self.proposer is not None:
                self.proposer.release(req)
            self.finished[req.rid] = req

    # ---- forward passes --------------------------------------------------------------------------------
    def forward(self, model, pool: KVPool, ids: list[list[int]], positions: list[list[int]],
                slices: list[SeqSlice], capture: tuple[int, ...] = ()):
        """One packed pass of `model` over the rows of several sequences (logits are left to the caller)."""
        dev = self.device
        flat_ids = torch.tensor([t for row in ids for t in row], device=dev)[None]
        flat_pos = torch.tensor([p for row in positions for p in row], device=dev)[None]
        cache = PagedCache(pool, PagedBatch(slices, dev))
        return model(flat_ids, flat_pos, cache=cache, logits="none", capture_layers=capture)

    def _prefill(self, reqs: list[Request]) -> None:
        feeds = [r.tokens if not r.output else r.tokens[:-1] for r in reqs]
        slices = [SeqSlice(r.table, 0, len(f)) for r, f in zip(reqs, feeds)]
        out = self.forward(self.target, self.pool, feeds, [list(range(len(f))) for f in feeds], slices, self.capture)
        rows, r0 = [], 0
        for f in feeds:
            rows.append((r0, r0 + len(f)))
            r0 += len(f)
        fresh = [i for i, r in enumerate(reqs) if not r.output]
        if fresh:
            logits = _logits(self.target, out.hidden[0, [rows[i][1] - 1 for i in fresh]])
            for j, i in enumerate(fresh):
                reqs[i].output.append(reqs[i].sampling.pick(logits[j])[0])
        for r, f in zip(reqs, feeds):
            r.cached, r.draft = len(f), None
        self.running.extend(reqs)
        if self.proposer is not None:
            self.proposer.prefill(reqs, out, rows)
        for r in list(reqs):
            self._finish_check(r)

    def _decode(self) -> None:
        reqs = list(self.running)
        out = self.forward(self.target, self.pool, [[r.tokens[-1]] for r in reqs], [[r.m] for r in reqs],
                           [SeqSlice(r.table, r.m, 1) for r in reqs])
        logits = _logits(self.target, out.hidden[0])
        for i, r in enumerate(reqs):
            r.cached = r.m + 1
            r.output.append(r.sampling.pick(logits[i])[0])
            r.stats.steps += 1
            r.stats.emitted += 1
            self.stats.steps += 1
            self.stats.emitted += 1
            self._finish_check(r)

    def _count(self, req: Request, a: int, emitted: int) -> None:
        for st in (req.stats, self.stats):
            for d in range(min(a + 1, self.k)):
                st.reached[d] += 1
                st.accepted[d] += int(d < a)
            st.steps += 1
            st.emitted += emitted

    def _chain_round(self) -> None:
        reqs, k = list(self.running), self.k
        drafts, qs = self.proposer.propose(reqs, k)
        ids = [[r.tokens[-1]] + d for r, d in zip(reqs, drafts)]
        vout = self.forward(self.target, self.pool, ids, [list(range(r.m, r.m + k + 1)) for r in reqs],
                            [SeqSlice(r.table, r.m, k + 1) for r in reqs], self.capture)
        logits = _logits(self.target, vout.hidden[0]).view(len(reqs), k + 1, -1)
        greedy = all(r.sampling.greedy for r in reqs)
        argmax = logits.argmax(-1)  # [B, k+1]
        accepted, emitted = [], []
        for i, r in enumerate(reqs):
            if r.sampling.greedy:
                a = accept_greedy(torch.tensor(drafts[i], device=argmax.device), argmax[i])
                last = int(argmax[i, a])
            else:
                a, last = accept_rejection(drafts[i], torch.stack(qs[i]), r.sampling.probs(logits[i]),
                                           r.sampling.generator)
            accepted.append(a)
            emitted.append(drafts[i][:a] + [last])
        rows = [(i * (k + 1), (i + 1) * (k + 1)) for i in range(len(reqs))]
        self.proposer.update(reqs, vout, rows, accepted, emitted, argmax if greedy else None)
        for r, a, e in zip(reqs, accepted, emitted):
            r.draft = None  # drafted here on the host; a later k = 1 round drafts from r.state again
            self._count(r, a, len(e))
            r.cached = r.m + a + 1
            r.output.extend(e)
            self._finish_check(r)

    def _k1_applies(self) -> bool:
        return (self.k1_schedule and self.k == 1 and getattr(self.proposer, "supports_k1", False)
                and all(r.sampling.greedy for r in self.running))

    def _k1_round(self) -> None:
        """The seed's MTP schedule for one draft token (greedy). Each of the D sequences verifies a fixed
        2 tokens — t_m and the head's draft d — so the target pass has 2·D rows whatever is accepted.
        On the device: the target's argmax g at both rows, acceptance a = [d == g_0], the head re-run
        on both positions with the target's states and tokens g (the row after a rejected draft is
        wasted, as in the seed), its state at row a, and from it the next round's draft — all queued
        without reading a value back. The host then reads g and a once, to extend the outputs and
        schedule the next batch. The positions, slots and attention metadata of the round are built
        beforehand from what the host already knows (each sequence's m)."""
        reqs, dev = list(self.running), self.device
        positions = torch.tensor([[r.m, r.m + 1] for r in reqs], device=dev).view(1, -1)  # [1, 2D]
        batch = PagedBatch([SeqSlice(r.table, r.m, 2) for r in reqs], dev)
        last = torch.tensor([r.tokens[-1] for r in reqs], device=dev)  # t_m, known on the host
        with forbid_host_reads() if self.guard_host_reads else nullcontext():
            g, a, state, nxt = self._k1_device(reqs, last, positions, batch)
        g_host, a_host = g.tolist(), a.tolist()  # the round's one read, after its device work is queued
        for i, r in enumerate(reqs):
            emitted = g_host[i][: a_host[i] + 1]  # an accepted draft equals g_0; then the target's bonus token
            self._count(r, a_host[i], len(emitted))
            r.cached = r.m + a_host[i] + 1
            r.output.extend(emitted)
            r.state, r.draft = state[i], nxt[i]
            self._finish_check(r)

    def _k1_device(self, reqs: list[Request], last: torch.Tensor, positions: torch.Tensor, batch: PagedBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device part of `_k1_round`: (g [D, 2], a [D], the head's new states [D, S], next drafts [D])."""
        prop = self.proposer
        fresh = [i for i, r in enumerate(reqs) if r.draft is None]  # after a prefill or a generic round
        drafted = prop.draft_k1(torch.stack([reqs[i].state for i in fresh])) if fresh else None
        draft = torch.stack([r.draft if r.draft is not None else drafted[fresh.index(i)] for i, r in enumerate(reqs)])
        ids = torch.stack([last, draft], dim=1).view(1, -1)  # [1, 2D]: t_m, d per sequence
        vout = self.target(ids, positions, cache=PagedCache(self.pool, batch), logits="none",
                           capture_layers=self.capture)
        g = _logits(self.target, vout.hidden[0]).argmax(-1).view(-1, 2)  # [D, 2]
        a = (g[:, 0] == draft).long()  # [D] 0/1
        h = prop.refresh_k1(_target_state(prop.head, vout.hidden, vout.aux), g.view(1, -1), positions, batch)
        state = h[torch.arange(len(reqs), device=self.device) * 2 + a]  # [D, S]: the state at row a
        return g, a, state, prop.draft_k1(state)

    def _tree_round(self) -> None:
        reqs = list(self.running)
        trees = self.proposer.propose_tree(reqs)
        ids = [[r.tokens[-1]] + t.tokens for r, t in zip(reqs, trees)]
        positions = [[r.m] + [r.m + d for d in t.depths] for r, t in zip(reqs, trees)]
        slices = [SeqSlice(r.table, r.m, len(t.tokens) + 1, mask=t.ancestry().to(self.device))
                  for r, t in zip(reqs, trees)]
        vout = self.forward(self.target, self.pool, ids, positions, slices, self.capture)
        argmax = _logits(self.target, vout.hidden[0]).argmax(-1).tolist()
        rows, r0, paths, emitted = [], 0, [], []
        for r, t in zip(reqs, trees):
            children: dict[int, dict[int, int]] = {}
            for i, (tok, p) in enumerate(zip(t.tokens, t.parents)):
                children.setdefault(p + 1, {}).setdefault(tok, i + 1)
            cur, path = 0, []
            while (nxt := children.get(cur, {}).get(argmax[r0 + cur])) is not None:
                path.append(nxt)
                cur = nxt
            paths.append(path)
            emitted.append([t.tokens[p - 1] for p in path] + [argmax[r0 + cur]])
            rows.append((r0, r0 + len(t.tokens) + 1))
            r0 += len(t.tokens) + 1
            if path != list(range(1, len(path) + 1)):  # move the accepted nodes' entries to m+1..m+a
                src = r.table.slots[[r.m + p for p in path]]
                dst = r.table.slots[r.m + 1: r.m + 1 + len(path)]
                self.pool.copy_slots(src, dst)
        self.proposer.update_tree(reqs, vout, rows, paths, emitted)
        for r, path, e in zip(reqs, paths, emitted):
            self._count(r, len(path), len(e))
            r.cached = r.m + len(path) + 1
            r.output.extend(e)
            self._finish_check(r)


# ---- proposers ---------------------------------------------------------------------------------------
class ChainProposer:
    """What chain proposers share: k drafts per round, k + 1 positions written, their own KV pool over
    the engine's block tables."""

    tree = False
    speculate_beside_prefill = True  # False: a step that admits (prefills) a request decodes plainly

    def check(self, k: int) -> None:
        return None

    def stats_depth(self, k: int) -> int:
        return k

    def lookahead(self, k: int) -> int:
        return k + 1

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def _pool(self, num_layers: int, args, dtype: torch.dtype) -> KVPool:
        e = self.engine
        return KVPool.for_args(args, num_layers, e.num_blocks, e.block_size, dtype, e.device)


class PagedHeadProposer(ChainProposer):
    """A head from heads/ in the engine. Chain heads keep their KV cache in a pool over the engine's
    block tables: the depth-1 entries of every committed position (computed from the target's states),
    then the current round's deeper draft steps (slot m+j-2 at depth j; with separate MTP modules, of
    module j's layer and of every deeper module's, from the same input). Medusa drafts from the target's
    state at the last committed position.

    Greedy rounds refresh the head over all k+1 verified positions with the target's argmax tokens —
    a fixed shape that does not wait for the acceptance length (for the positions up to the accepted
    one these are exactly the emitted tokens; entries beyond are overwritten before they are read) —
    and pick the state at the accepted position: the seed's k = 1 schedule (verify 2 tokens, re-run
    the draft on the same batch) is the k = 1 case."""

    def __init__(self, head, draft_vocab: torch.Tensor | None = None) -> None:
        self.head = head
        self.capture_layers = head.capture_layers
        self.vocab = self.vocab_weight = None
        if draft_vocab is not None:  # FR-Spec style: draft only among these (frequent) target ids
            if head.draft_ids is not None:
                raise ValueError(f"the {head.kind} head already drafts from its own sub-vocabulary (d2t)")
            self.vocab = draft_vocab.to(head.lm_head_weight.device)
            self.vocab_weight = head.lm_head_weight[self.vocab]

    def _logits(self, h: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """Draft logits over the target vocabulary (−inf outside a draft vocabulary)."""
        if self.vocab is None:
            return full_vocab_logits(self.head, h, depth)
        sub = self.head.tied.cap_logits(linear(self.head.features(h, depth), self.vocab_weight))
        out = sub.new_full((*sub.shape[:-1], self.head.args.vocab_size), float("-inf"))
        out[..., self.vocab] = sub
        return out

    def check(self, k: int) -> None:
        if self.head.max_depth is not None and k > self.head.max_depth:
            raise ValueError(f"k={k} draft tokens, but the {self.head.kind} head defines {self.head.max_depth} draft steps")

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = self._pool(self.head.num_cache_layers, self.head.args, self.head.dtype) if self.head.chain else None

    def release(self, req: Request) -> None:
        req.state = None

    def _head(self, states: torch.Tensor, tokens: list[list[int]], positions: list[list[int]],
              slices: list[SeqSlice], depth: int = 1) -> torch.Tensor:
        dev = self.engine.device
        flat_tok = torch.tensor([t for row in tokens for t in row], device=dev)[None]
        flat_pos = torch.tensor([p for row in positions for p in row], device=dev)[None]
        cache = PagedCache(self.pool, PagedBatch(slices, dev))
        return self.head(states, flat_tok, flat_pos, cache, 0, depth=depth)

    def _refresh(self, reqs: list[Request], states: torch.Tensor, tokens: list[list[int]], base: list[int]
                 ) -> torch.Tensor:
        """Depth-1 head pass over (target state, next token) rows at positions base.. (every module)."""
        dev = self.engine.device
        flat_tok = torch.tensor([t for row in tokens for t in row], device=dev)[None]
        flat_pos = torch.tensor([b + j for b, t in zip(base, tokens) for j in range(len(t))], device=dev)[None]
        batch = PagedBatch([SeqSlice(r.table, b, len(t)) for r, b, t in zip(reqs, base, tokens)], dev)
        return self.refresh_k1(states, flat_tok, flat_pos, batch)

    def prefill(self, reqs: list[Request], out, rows: list[tuple[int, int]]) -> None:
        if not self.head.chain:
            for r, (_, e) in zip(reqs, rows):
                r.state = out.hidden[0, e - 1]
            return
        states = _target_state(self.head, out.hidden, out.aux)
        h = self._refresh(reqs, states, [r.tokens[1: r.cached + 1] for r in reqs], [0] * len(reqs))
        for r, (_, e) in zip(reqs, rows):
            r.state = h[e - 1]

    def _pick(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list]:
        picks = [r.sampling.pick(logits[i]) for i, r in enumerate(reqs)]
        return [d for d, _ in picks], [q for _, q in picks]

    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]:
        head = self.head
        h = torch.stack([r.state for r in reqs])[None]  # [1, B, S]
        if not head.chain:
            cols = [self._pick(reqs, self._logits(head(h, depth=j), j)[0]) for j in range(1, k + 1)]
        else:
            cols = [self._pick(reqs, self._logits(h)[0])]
            for j in range(2, k + 1):
                pos = [[r.m + j - 2] for r in reqs]
                slices = [SeqSlice(r.table, r.m + j - 2, 1) for r in reqs]
                toks = [[d] for d in cols[-1][0]]
                for e in head.key_writers(j, k):  # separate modules: each deeper module's key of this step
                    self._head(h, toks, pos, slices, depth=e)
                h = self._head(h, toks, pos, slices, depth=j)
                cols.append(self._pick(reqs, self._logits(h, depth=j)[0]))
        drafts = [[c[0][i] for c in cols] for i in range(len(reqs))]
        qs = [[c[1][i] for c in cols] for i in range(len(reqs))]
        return drafts, qs

    def update(self, reqs: list[Request], vout, rows: list[tuple[int, int]], accepted: list[int],
               emitted: list[list[int]], argmax: torch.Tensor | None) -> None:
        if not self.head.chain:
            for r, (s, _), a in zip(reqs, rows, accepted):
                r.state = vout.hidden[0, s + a]
            return
        if argmax is not None:  # greedy: fixed shape, all k+1 positions
            states = _target_state(self.head, vout.hidden, vout.aux)  # [1, N, S]
            h = self._refresh(reqs, states, argmax.tolist(), [r.m for r in reqs])
            for r, (s, _), a in zip(reqs, rows, accepted):
                r.state = h[s + a]
            return
        self.update_tree(reqs, vout, rows, [list(range(1, a + 1)) for a in accepted], emitted)

    @property
    def supports_k1(self) -> bool:
        return self.head.chain and not self.tree

    def draft_k1(self, state: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [D] from head states [D, S], as a device tensor."""
        return self._logits(state[None])[0].argmax(-1)

    def refresh_k1(self, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                   batch: PagedBatch) -> torch.Tensor:
        """Depth-1 head pass (every module, one attention metadata for all of them) over rows whose
        tokens and positions are already on the device: [N, S]. The k = 1 round passes the metadata of
        the target's own pass (same slots)."""
        cache = PagedCache(self.pool, batch)
        out = self.head(states, tokens, positions, cache, 0)
        if self.head.separate_modules:
            for d in range(2, len(self.head.layers) + 1):
                self.head(states, tokens, positions, cache, 0, depth=d)
        return out[0]

    def update_tree(self, reqs: list[Request], vout, rows: list[tuple[int, int]], paths: list[list[int]],
                    emitted: list[list[int]]) -> None:
        """Refresh the head over each sequence's verified rows [0, *path] (the root t_m, then the
        accepted nodes) with the emitted tokens; its state is the one at the last accepted row. A chain
        round's path is rows 1..a."""
        states = _target_state(self.head, vout.hidden, vout.aux)
        idx = [s + p for (s, _), path in zip(rows, paths) for p in [0, *path]]
        h = self._refresh(reqs, states[:, idx], emitted, [r.m for r in reqs])
        end = 0
        for r, e in zip(reqs, emitted):
            end += len(e)
            r.state = h[end - 1]


class PagedTreeProposer(PagedHeadProposer):
    """EAGLE-2's dynamic draft tree from a chain head (greedy acceptance). Level 1 holds the head's
    top-`topk` tokens after t_m; each further level expands the `topk` nodes of the previous level
    with the highest cumulative log-probability (one head pass for all of them, each attending only its
    own ancestors through a tree mask) into their top-`topk` children, up to `depth` levels; the
    `total` nodes of highest cumulative log-probability (always closed under ancestors) are verified
    by the target in one pass with a tree mask, and the longest path matching the target's argmax is
    accepted; its cache entries are moved to the contiguous positions m+1..m+a."""

    tree = True

    def __init__(self, head, depth: int = 4, topk: int = 4, total: int = 16,
                 draft_vocab: torch.Tensor | None = None) -> None:
        if not head.chain:
            raise ValueError(f"a draft tree needs a chain head, not {head.kind}")
        super().__init__(head, draft_vocab)
        self.depth, self.topk, self.total = depth, topk, total
        if min(depth, topk, total) < 1:
            raise ValueError(f"tree depth/topk/total must be ≥ 1, got {depth}/{topk}/{total}")

    def check(self, k: int) -> None:
        super().check(self.depth)

    def stats_depth(self, k: int) -> int:
        return self.depth

    def lookahead(self, k: int) -> int:
        return max(self.total + 1, self.topk * (self.depth - 1) + 1)

    def propose_tree(self, reqs: list[Request]) -> list[Tree]:
        head, kk = self.head, self.topk
        b = len(reqs)
        logp = self._logits(torch.stack([r.state for r in reqs])[None])[0].float().log_softmax(-1)
        top = logp.topk(kk, dim=-1)
        # per sequence: node lists (token, parent, depth, score); node ids are list indices
        tok = [top.indices[i].tolist() for i in range(b)]
        par = [[-1] * kk for _ in range(b)]
        dep = [[1] * kk for _ in range(b)]
        score = [top.values[i].tolist() for i in range(b)]
        frontier = [list(range(kk)) for _ in range(b)]  # nodes to expand at this level
        entry: list[dict[int, int]] = [{} for _ in range(b)]  # node → head-cache entry (slot m + entry)
        parent_state = [torch.stack([reqs[i].state] * kk) for i in range(b)]  # [K, S] per sequence
        written = 0
        for level in range(1, self.depth):
            masks = []
            for i in range(b):
                m = torch.zeros(kk, written + kk, dtype=torch.bool)
                for row, node in enumerate(frontier[i]):
                    m[row, written + row] = True
                    entry[i][node] = written + row
                    p = par[i][node]
                    while p >= 0:
                        m[row, entry[i][p]] = True
                        p = par[i][p]
                masks.append(m.to(self.engine.device))
            args = (torch.cat(parent_state)[None], [[tok[i][n] for n in frontier[i]] for i in range(b)],
                    [[reqs[i].m + level - 1] * kk for i in range(b)],
                    [SeqSlice(reqs[i].table, reqs[i].m, kk, written, masks[i]) for i in range(b)])
            # separate modules: every module that answers a deeper level writes its entries of this level too
            # (the chain's rule, draft_chain), so its nodes attend their ancestors in their own cache
            for e in head.key_writers(level + 1, self.depth):
                self._head(*args, depth=e)
            h = self._head(*args, depth=level + 1)[0].view(b, kk, -1)
            written += kk
            child = self._logits(h, depth=level + 1).float().log_softmax(-1).topk(kk, dim=-1)
            for i in range(b):
                new, states = [], {}
                for row, node in enumerate(frontier[i]):
                    for c in range(kk):
                        tok[i].append(int(child.indices[i, row, c]))
                        par[i].append(node)
                        dep[i].append(level + 1)
                        score[i].append(score[i][node] + float(child.values[i, row, c]))
                        new.append(len(tok[i]) - 1)
                        states[len(tok[i]) - 1] = h[i, row]
                frontier[i] = sorted(new, key=lambda n, s=score[i]: (-s[n], n))[:kk]
                parent_state[i] = torch.stack([states[n] for n in frontier[i]])
        trees = []
        for i in range(b):
            keep = sorted(range(len(tok[i])), key=lambda n, s=score[i], d=dep[i]: (-s[n], d[n], n))[: self.total]
            keep.sort(key=lambda n: (dep[i][n], n))  # parents before children
            index = {n: j for j, n in enumerate(keep)}
            trees.append(Tree([tok[i][n] for n in keep],
                              [index[par[i][n]] if par[i][n] >= 0 else -1 for n in keep],
                              [dep[i][n] for n in keep]))
        return trees


class PagedDraftModelProposer(ChainProposer):
    """A small LM with the target's tokenizer as the drafter, its cache in a pool over the engine's
    block tables, on the seed's draft-model schedule:
    - speculation only in decode-only batches: a step that prefills a newcomer decodes plainly;
    - a round's first draft d_1 comes from the logits the draft computed at the end of the previous
      round (`carry`), so drafting takes k-1 passes (d_2..d_k);
    - after acceptance the draft runs once over the tokens it has not seen — the target's bonus token
      (and d_k when all k were accepted) — which fills its cache and gives the next round's d_1.
    So a speculative round costs k draft passes and one target pass. After a plain step, a prefill or
    a preemption, positions ≥ `fed` are fed first (varlen) in the next round, at one pass more.
    `passes` counts the draft's forward passes.

    Schedule: vLLM's `draft_model` (the default, `speculate_beside_prefill=True`; read in 0.32: the step that
    prefills a request drafts for it too — gpu_model_runner.py `propose_draft_token_ids` passes the prompt's
    tokens when the step verifies no drafts, and llm_base_proposer.py `set_inputs_first_pass` appends the
    token sampled from the prefill, so the draft's first pass covers t_0..t_m and gives d_1): the step that
    admits a request runs a speculative round for the whole batch, whose propose feeds the newcomer's prompt
    and first token (the `stale` feed). Every sequence drafts in every step, and the per-position acceptance
    counts and verification passes equal vLLM's (tests/test_vllm_serving.py, the `draft_lm` row).
    `speculate_beside_prefill=False` is the seed's schedule: the step that prefills a request decodes the
    whole batch plainly, so the token after the first is never drafted (one more pass per request)."""

    capture_layers = ()
    speculate_beside_prefill = True

    def __init__(self, draft, speculate_beside_prefill: bool = True) -> None:
        self.draft = draft
        self.speculate_beside_prefill = speculate_beside_prefill
        self.passes = 0

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = self._pool(self.draft.args.num_hidden_layers, self.draft.args, self.draft.dtype)

    def lookahead(self, k: int) -> int:
        return k + 2  # the fill after acceptance writes the bonus token at m+k+1 when all k were accepted

    def release(self, req: Request) -> None:
        req.fed, req.carry = 0, None

    def prefill(self, reqs: list[Request], out, rows) -> None:
        for r in reqs:
            r.fed, r.carry = 0, None

    def _feed(self, reqs: list[Request], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One packed pass of the draft over each sequence's `feeds` at positions start..; logits at
        each sequence's last row [B, V]."""
        eng = self.engine
        out = eng.forward(self.draft, self.pool, feeds, [list(range(s, s + len(f))) for s, f in zip(starts, feeds)],
                          [SeqSlice(r.table, s, len(f)) for r, s, f in zip(reqs, starts, feeds)])
        self.passes += 1
        ends = torch.tensor([len(f) for f in feeds], device=eng.device).cumsum(0) - 1
        return _logits(self.draft, out.hidden[0, ends])

    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]:
        stale = [i for i, r in enumerate(reqs) if r.carry is None or r.fed != r.m + 1]
        if stale:  # positions fed..m are not in the draft's cache yet: feed them (varlen)
            logits = self._feed([reqs[i] for i in stale], [reqs[i].tokens[reqs[i].fed: reqs[i].m + 1] for i in stale],
                                [reqs[i].fed for i in stale])
            for j, i in enumerate(stale):
                reqs[i].carry, reqs[i].fed = logits[j], reqs[i].m + 1
        picks = [r.sampling.pick(r.carry) for r in reqs]
        cols = [([d for d, _ in picks], [q for _, q in picks])]
        for j in range(2, k + 1):
            logits = self._feed(reqs, [[d] for d in cols[-1][0]], [r.m + j - 1 for r in reqs])
            picks = [r.sampling.pick(logits[i]) for i, r in enumerate(reqs)]
            cols.append(([d for d, _ in picks], [q for _, q in picks]))
        for r in reqs:  # the cache now holds t_m and d_1..d_{k-1} at positions m..m+k-1
            r.fed, r.carry = r.m + k, None
        return [[c[0][i] for c in cols] for i in range(len(reqs))], [[c[1][i] for c in cols] for i in range(len(reqs))]

    def update(self, reqs: list[Request], vout, rows, accepted: list[int], emitted, argmax) -> None:
        """After acceptance: feed the emitted tokens the cache lacks (the bonus token; d_k too when all k
        were accepted) at positions m+1+min(a, k-1).., one pass for the batch; its logits are the next
        round's d_1."""
        k = self.engine.k
        starts = [r.m + 1 + min(a, k - 1) for r, a in zip(reqs, accepted)]
        feeds = [e[min(a, k - 1):] for e, a in zip(emitted, accepted)]
        logits = self._feed(reqs, feeds, starts)
        for i, (r, s, f) in enumerate(zip(reqs, starts, feeds)):
            r.fed, r.carry = s + len(f), logits[i]  # = m' + 1 once the emitted tokens are committed


def frequent_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids of `counts` [V] (ties: lower id first), ascending — a draft
    vocabulary for `PagedHeadProposer(head, draft_vocab=...)`."""
    order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))[:n]
    return torch.tensor(sorted(order), dtype=torch.long)


def engine_proposer(x, tree: dict | None = None):
    """A proposer for the engine: as is, a draft LM (has `lm_head`) → draft model, a head → head (or
    a tree over it when `tree` gives depth/topk/total)."""
    if hasattr(x, "attach"):
        return x
    if isinstance(x, DraftModelProposer):  # a named draft LM
        x = x.draft
    if hasattr(x, "lm_head") and hasattr(x, "model"):
        return PagedDraftModelProposer(x)
    if tree:
        return PagedTreeProposer(x, **tree)
    return PagedHeadProposer(x)


def engine_run(target, prompts: list[list[int]], max_new_tokens: int, proposer=None, k: int = 1,
               stop_ids=frozenset(), sampling: Sampling | list[Sampling] = GREEDY,
               arrivals: list[int] | None = None, on_finish=None, seq_len: int | None = None,
               **engine_kw) -> tuple[list[Result], Engine]:
    """The one way to run the engine over prompts: `prompts` through one Engine, their results in prompt
    order, and the engine (stats, preemptions). `on_finish(n)`: called as requests finish (a progress bar).
    Pool size: `num_blocks` or `max_seq_len` if given; `seq_len` (the longest prompt + new tokens of a
    whole prompt set, so that engines over parts of it are sized alike): sequences of seq_len + room for
    two rounds' drafts; otherwise min(max_batch, #prompts) sequences of the longest prompt +
    max_new_tokens + room for a round's drafts."""
    proposer = engine_proposer(proposer) if proposer is not None else None
    room = proposer.lookahead(k) if proposer is not None else 1  # positions a round writes ahead
    if seq_len is not None:
        engine_kw["max_seq_len"] = seq_len + 2 * room
    elif "num_blocks" not in engine_kw and "max_seq_len" not in engine_kw:
        block = engine_kw.get("block_size", 16)
        per_seq = -(-(max(map(len, prompts)) + max_new_tokens + 2 * room + 2 * block) // block)
        engine_kw["num_blocks"] = per_seq * min(engine_kw.get("max_batch", 8), len(prompts))
    eng = Engine(target, proposer, k=k, **engine_kw)
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    rids = [eng.add_request(p, max_new_tokens, stop_ids, s, (arrivals or [0] * len(prompts))[i])
            for i, (p, s) in enumerate(zip(prompts, samplings))]
    results = eng.run(on_finish=on_finish)
    return [results[r] for r in rids], eng


def engine_generate(target, prompts: list[list[int]], max_new_tokens: int, proposer=None, k: int = 1,
                    stop_ids=frozenset(), sampling: Sampling | list[Sampling] = GREEDY,
                    arrivals: list[int] | None = None, **engine_kw) -> tuple[list[list[int]], Engine]:
    """`engine_run`'s outputs as token lists, in prompt order, and the engine."""
    results, eng = engine_run(target, prompts, max_new_tokens, proposer, k, stop_ids, sampling, arrivals, **engine_kw)
    return [r.tokens for r in results], eng


def round_cost(target, proposer, k: int, prompts: list[list[int]], max_new_tokens: int,
               stop_ids=frozenset(), **engine_kw) -> dict[str, float]:
    """The cost of a speculative round in plain decoding steps, and the speedup it predicts.

    For each prompt, one engine decodes plainly and one speculatively (batch 1, greedy), their steps
    interleaved — a plain step, a round, a plain step, … — each timed alone, the prefill steps left out.
    cost = median round / median plain step: the target's verify of k + 1 tokens and the drafts, in
    units of one plain decoding step, measured a few milliseconds apart so that a load on the machine
    slows both alike; medians over many steps shrug off a preempted one. predicted_speedup = τ / cost,
    τ of the same rounds (prefill and the host's scheduling outside the steps are not in it)."""
    proposer = engine_proposer(proposer)
    sync = torch.cuda.synchronize if target.model.embed_tokens.weight.device.type == "cuda" else (lambda: None)
    plain_s: list[float] = []
    round_s: list[float] = []
    stats = SpecStats(k=k)
    for prompt in prompts:
        room = -(-(len(prompt) + max_new_tokens + 2 * proposer.lookahead(k) + 32) // 16)
        plain = Engine(target, None, k=1, max_batch=1, num_blocks=room, **engine_kw)
        spec = Engine(target, proposer, k=k, max_batch=1, num_blocks=room, **engine_kw)
        for eng in (plain, spec):
            eng.add_request(prompt, max_new_tokens, stop_ids)
            eng.step()  # the prefill (and, speculatively, the first round): not timed
        stats_before = SpecStats(k=spec.k)
        stats_before.merge(spec.stats)
        while spec.has_work and plain.has_work:
            for eng, out in ((plain, plain_s), (spec, round_s)):
                sync()
                t0 = time.perf_counter()
                eng.step()
                sync()
                out.append(time.perf_counter() - t0)
        spec.run()
        stats.steps += spec.stats.steps - stats_before.steps
        stats.emitted += spec.stats.emitted - stats_before.emitted
    if not plain_s:
        raise ValueError("round_cost: no decoding steps to time (max_new_tokens too small?)")
    cost = statistics.median(round_s) / statistics.median(plain_s)
    return {"plain_step_s": statistics.median(plain_s), "round_s": statistics.median(round_s), "cost": cost,
            "tau": stats.tau, "predicted_speedup": stats.tau / cost, "rounds": len(round_s)}
