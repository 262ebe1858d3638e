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
   (`lookahead`: k + 1 for a chain — more when the compiled round drafts the next round's k too — the tree's size
   for a tree) before anything runs; when the pool
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

The proposers live beside this module, one each (inference_eval/engine/base.py `Proposer` is what the
scheduler calls); `engine_proposer(x)` (proposers.py) wraps a head or a model.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import contextmanager, nullcontext

import torch

from inference_eval.engine.base import Proposer, Request, Result, target_logits, target_state
from inference_eval.engine.proposers import engine_proposer
from inference_eval.engine.static import LEAD, StaticBatch, StaticStep, batch_bucket, compile_enabled
from inference_eval.paged import (POOLS, BlockAllocator, BlockTable, KVPool, OutOfBlocks, PagedBatch, PagedCache,
                                  SeqSlice)
from inference_eval.speculative import GREEDY, Sampling, SpecStats, _finish, accept_greedy, accept_rejection


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
                 k1_schedule: bool = True, compile: str = "off") -> None:
        self.target = target
        # the seed's k = 1 MTP schedule (`_k1_round`) for chain heads at k = 1, and with the compiled step the greedy
        # round as one graph for chain heads at k ≥ 2 and block heads (`_fused_round`); False: the generic chain round
        self.k1_schedule = k1_schedule
        self.guard_host_reads = False  # tests: run the k = 1 round's device part under `forbid_host_reads`
        a = target.args
        self.device = target.model.embed_tokens.weight.device
        self.block_size, self.max_batch, self.prefill_tokens = block_size, max_batch, prefill_tokens
        if num_blocks is None:  # max_batch sequences of max_seq_len (default: the context, at most 4,096)
            num_blocks = max_batch * math.ceil((max_seq_len or min(a.max_position_embeddings, 4096)) / block_size)
        self.num_blocks = num_blocks
        self.alloc = BlockAllocator(num_blocks)
        # the target's decode and verification passes through the compiled static step (static.py): the pool gets one
        # more block, its scratch
        self.static = None
        if compile_enabled(compile, self.device) and not target.static_step:
            if compile == "on":
                raise ValueError(f"engine compile=on: {type(target).__name__}'s decode step reads values on the host "
                                 "(its MoE routing) and cannot be one graph; set compile=auto or off")
            compile = "off"
        if compile_enabled(compile, self.device):
            self.pool = POOLS.lend(self, a, a.num_hidden_layers, num_blocks + 1, block_size, target.dtype, self.device)
            self.static = StaticStep(target, self.pool, block_size, scratch_block=num_blocks)
        else:
            self.pool = KVPool.for_args(a, a.num_hidden_layers, num_blocks, block_size, target.dtype, self.device)
        self.proposer: Proposer | None = engine_proposer(proposer) if proposer is not None else None
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
    def compile_s(self) -> float:
        """Seconds spent compiling the static step's new shape buckets (0 when it is off): a timed run subtracts
        them."""
        return self.static.compile_s if self.static is not None else 0.0

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
            if self.proposer is None or (admitted and not self.proposer.speculate_beside_prefill):
                self._decode()  # the seed's draft-model schedule: a batch with a prefill decodes plainly
            elif self.proposer.tree:
                self._tree_round()
            elif self._k1_applies():
                self._k1_round()
            elif self._fused_applies():
                self._fused_round()
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
        req.cached = 0
        if self.proposer is not None:
            self.proposer.release(req)
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
            logits = target_logits(self.target, out.hidden[0, [rows[i][1] - 1 for i in fresh]])
            for j, i in enumerate(fresh):
                reqs[i].output.append(reqs[i].sampling.pick(logits[j])[0])
        for r, f in zip(reqs, feeds):
            r.cached = len(f)
        self.running.extend(reqs)
        if self.proposer is not None:
            self.proposer.prefill(reqs, out, rows)
        for r in list(reqs):
            self._finish_check(r)

    def _decode(self) -> None:
        reqs = list(self.running)
        if self.static is not None:
            logits = self.static.logits([r.tokens[-1] for r in reqs], [r.m for r in reqs], [r.table.blocks for r in reqs])
        else:
            out = self.forward(self.target, self.pool, [[r.tokens[-1]] for r in reqs], [[r.m] for r in reqs],
                               [SeqSlice(r.table, r.m, 1) for r in reqs])
            logits = target_logits(self.target, out.hidden[0])
        for i, r in enumerate(reqs):
            r.cached = r.m + 1
            r.output.append(r.sampling.pick(logits[i])[0])
            r.stats.steps += 1
            r.stats.emitted += 1
            self.stats.steps += 1
            self.stats.emitted += 1
            self._finish_check(r)

    def _count(self, req: Request, a: int, emitted: int, drafted: int | None = None) -> None:
        """A round's statistics: draft positions reached (up to the first rejection, at most the `drafted` ones —
        k unless the proposer ended this sequence's drafts early), accepted, and the tokens emitted."""
        for st in (req.stats, self.stats):
            for d in range(min(a + 1, self.k if drafted is None else drafted)):
                st.reached[d] += 1
                st.accepted[d] += int(d < a)
            st.steps += 1
            st.emitted += emitted

    def _chain_round(self) -> None:
        """Draft (up to k tokens per sequence: a proposer may end a sequence's drafts early), verify every
        sequence's t_m and drafts in one packed pass, accept, and let the proposer update."""
        reqs, k = list(self.running), self.k
        drafts, qs = self.proposer.propose(reqs, k)
        n = [len(d) for d in drafts]
        ids = [[r.tokens[-1]] + d for r, d in zip(reqs, drafts)]
        if self.static is not None:  # one row per token, each with its sequence's block table
            vout = self.static.forward([t for row in ids for t in row],
                                       [r.m + i for r, j in zip(reqs, n) for i in range(j + 1)],
                                       [r.table.blocks for r, j in zip(reqs, n) for _ in range(j + 1)], self.capture)
            flat = vout.logits
        else:
            vout = self.forward(self.target, self.pool, ids,
                                [list(range(r.m, r.m + j + 1)) for r, j in zip(reqs, n)],
                                [SeqSlice(r.table, r.m, j + 1) for r, j in zip(reqs, n)], self.capture)
            flat = target_logits(self.target, vout.hidden[0])
        rows, r0 = [], 0
        for j in n:
            rows.append((r0, r0 + j + 1))
            r0 += j + 1
        uniform = all(j == k for j in n)
        logits = flat.view(len(reqs), k + 1, -1) if uniform else [flat[a:b] for a, b in rows]
        greedy = all(r.sampling.greedy for r in reqs)
        argmax = logits.argmax(-1) if uniform else [x.argmax(-1) for x in logits]  # [B, k+1] when uniform
        accepted, emitted = [], []
        for i, r in enumerate(reqs):
            if r.sampling.greedy:
                a = accept_greedy(torch.tensor(drafts[i], device=argmax[i].device), argmax[i])
                last = int(argmax[i][a])
            else:
                a, last = accept_rejection(drafts[i], torch.stack(qs[i]), r.sampling.probs(logits[i]),
                                           r.sampling.generator)
            accepted.append(a)
            emitted.append(drafts[i][:a] + [last])
        # the target's argmax [B, k+1] for a greedy batch that drafted k everywhere (a chain head's fixed-shape refresh)
        self.proposer.update(reqs, vout, rows, accepted, emitted, argmax if greedy and uniform else None)
        for r, a, e, j in zip(reqs, accepted, emitted, n):
            self._count(r, a, len(e), j)
            r.cached = r.m + a + 1
            r.output.extend(e)
            self._finish_check(r)

    def _k1_applies(self) -> bool:
        return (self.k1_schedule and self.k == 1 and self.proposer.supports_k1
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
        self.proposer.k1_commit(reqs, state, nxt)
        g_host, a_host = g.tolist(), a.tolist()  # the round's one read, after its device work is queued
        for i, r in enumerate(reqs):
            emitted = g_host[i][: a_host[i] + 1]  # an accepted draft equals g_0; then the target's bonus token
            self._count(r, a_host[i], len(emitted))
            r.cached = r.m + a_host[i] + 1
            r.output.extend(emitted)
            self._finish_check(r)

    def _k1_device(self, reqs: list[Request], last: torch.Tensor, positions: torch.Tensor, batch: PagedBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device part of `_k1_round`: (g [D, 2], a [D], the head's new states [D, S], next drafts [D])."""
        prop = self.proposer
        draft = prop.k1_drafts(reqs)
        if self.static is not None:  # the whole round one graph; the positions and tables are the host's
            d = len(reqs)
            meta = self.static.pack(None, [r.m + i for r in reqs for i in (0, 1)],
                                    [r.table.blocks for r in reqs for _ in (0, 1)])
            pad = meta.shape[0] // 2 - d  # padding pairs: token 0 at position 0, in the scratch slot
            last, draft = (torch.cat([t, t.new_zeros(pad)]) for t in (last, draft))
            key = ("k=1 round", meta.shape[0], meta.shape[1] - LEAD, tuple(self.capture))
            out = self.static.run(key, type(self)._k1_graph, self, last, draft, meta, key[3])  # not bound: no cycle
            self.static.steps += 1
            return tuple(t[:d] for t in out)
        ids = torch.stack([last, draft], dim=1).view(1, -1)  # [1, 2D]: t_m, d per sequence
        vout = self.target(ids, positions, cache=PagedCache(self.pool, batch), logits="none",
                           capture_layers=self.capture)
        return self._k1_rest(draft, vout.hidden, vout.aux, target_logits(self.target, vout.hidden[0]), positions,
                             PagedCache(prop.pool, batch))

    def _k1_graph(self, last: torch.Tensor, draft: torch.Tensor, meta: torch.Tensor, capture: tuple[int, ...]):
        """The k = 1 round compiled as one graph (static.py): the target's pass over the 2·D' rows of `meta`, then
        `_k1_rest` with the head pool under the same metadata."""
        ids = torch.stack([last, draft], dim=1).view(-1)
        hidden, aux, logits = self.static._step(ids, meta, capture)
        head_cache = StaticBatch(meta, self.proposer.pool)
        return self._k1_rest(draft, hidden[None], [a[None] for a in aux], logits, head_cache.positions[None],
                             head_cache)

    def _k1_rest(self, draft: torch.Tensor, hidden: torch.Tensor, aux: list[torch.Tensor], logits: torch.Tensor,
                 positions: torch.Tensor, head_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the target's pass over the rows (t_m, d) of each sequence: its argmax g at both rows, acceptance
        a = [d == g_0], the head re-run on both positions with the target's states and tokens g, its state at row
        a and the next draft from it."""
        prop = self.proposer
        g = logits.argmax(-1).view(-1, 2)  # [D, 2]
        a = (g[:, 0] == draft).long()  # [D] 0/1
        h = prop.refresh_k1(target_state(prop.head, hidden, aux), g.view(1, -1), positions, head_cache)
        state = h[torch.arange(draft.shape[0], device=self.device) * 2 + a]  # [D, S]: the state at row a
        return g, a, state, prop.draft_k1(state)

    def _fused_applies(self) -> bool:
        return (self.static is not None and self.k1_schedule and self.proposer.fused_round
                and all(r.sampling.greedy for r in self.running))

    def _fused_round(self) -> None:
        """A greedy round with the compiled step as one graph (`_fused_graph`), as the k = 1 round: the target's pass
        over t_m and the k drafts of every sequence, the acceptance, the proposer's update from the target's states
        and its next round's k drafts from there — the drafts stay on the device. A chain head at k ≥ 2 refreshes
        over the k + 1 positions and drafts its chain from the state at the accepted row; a block head writes its
        context entries and runs its next block pass. The next round's draft rows sit at positions that depend on
        this round's acceptance a, which the host does not know yet: the proposer packs the rows of every
        a ∈ 0..k (`next_meta`; the pages are reserved for them, its `lookahead`) and the graph takes those of its a.
        The host reads g and a once, after."""
        reqs, k, prop = list(self.running), self.k, self.proposer
        drafts = prop.round_drafts(reqs, k)  # [D, k]: left by the last round, or drafted now after a prefill
        d, dp = len(reqs), batch_bucket(len(reqs))
        vmeta = self.static.pack(None, [r.m + i for r in reqs for i in range(k + 1)],
                                 [r.table.blocks for r in reqs for _ in range(k + 1)], rows=dp * (k + 1))
        nmeta = prop.next_meta(reqs, k, dp)
        last = torch.tensor([r.tokens[-1] for r in reqs] + [0] * (dp - d), device=self.device)
        with forbid_host_reads() if self.guard_host_reads else nullcontext():
            drafts = torch.cat([drafts, drafts.new_zeros(dp - d, k)])  # padding sequences: token 0, scratch slots
            key = (prop.fused_name(k), vmeta.shape[0], vmeta.shape[1] - LEAD, tuple(self.capture))
            out = self.static.run(key, type(self)._fused_graph, self, last, drafts, vmeta, nmeta, key[3])
            self.static.steps += 1
            g, a, *kept = (t[:d] for t in out)
            prop.fused_commit(reqs, *kept)
        g_host, a_host = g.tolist(), a.tolist()  # the round's one read, after its device work is queued
        for i, r in enumerate(reqs):
            emitted = g_host[i][: a_host[i] + 1]  # the accepted drafts equal g's; then the target's bonus token
            self._count(r, a_host[i], len(emitted))
            r.cached = r.m + a_host[i] + 1
            r.output.extend(emitted)
            self._finish_check(r)

    def _fused_graph(self, last: torch.Tensor, drafts: torch.Tensor, vmeta: torch.Tensor, nmeta: torch.Tensor,
                     capture: tuple[int, ...]):
        """`_fused_round` as one graph over D' sequences: (g [D', k + 1], a [D'], what the proposer keeps — its
        `fused_rest`)."""
        dp, k = drafts.shape
        ids = torch.cat([last[:, None], drafts], dim=1).view(-1)
        hidden, aux, logits = self.static._step(ids, vmeta, capture)
        g = logits.argmax(-1).view(dp, k + 1)
        a = (drafts == g[:, :k]).long().cumprod(1).sum(1)  # [D']: drafts accepted up to the first mismatch
        return (g, a, *self.proposer.fused_rest(hidden, aux, g, a, vmeta, nmeta))

    def _tree_round(self) -> None:
        reqs = list(self.running)
        trees = self.proposer.propose_tree(reqs)
        ids = [[r.tokens[-1]] + t.tokens for r, t in zip(reqs, trees)]
        positions = [[r.m] + [r.m + d for d in t.depths] for r, t in zip(reqs, trees)]
        slices = [SeqSlice(r.table, r.m, len(t.tokens) + 1, mask=t.ancestry().to(self.device))
                  for r, t in zip(reqs, trees)]
        vout = self.forward(self.target, self.pool, ids, positions, slices, self.capture)
        argmax = target_logits(self.target, vout.hidden[0]).argmax(-1).tolist()
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
