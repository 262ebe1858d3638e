"""The block proposer (`PagedBlockProposer`): a parallel block drafter (heads/dflash.py: dflash, dspark) in the
engine — one draft forward per round drafts k tokens for every sequence, verified as a chain by the scheduler.

The draft's KV cache is a pool over the engine's block tables, one layer per draft layer:
- context: after every target pass (prefill, verification) the states of the positions it processed become the
  context entries c_p (the head's `target_input` of the captured layers) — each draft layer's k_proj / v_proj of
  c_p, k_norm, RoPE at p, written at p's slot. A verification writes all k + 1 of its rows, the rejected ones too:
  those lie at or past the next round's anchor and the next block overwrites them before anything reads them;
- block: a round's pass runs the rows [t_m, MASK, …] at positions m.. (`block_rows(k)` of them: vLLM shortens the
  block to the drafts served), each row seeing the context < m and every row of its block (non-causal); their
  keys are written at m.. and overwritten by the context once the target has verified those positions.

Draft i (1..k) predicts t_{m+i} from block row i - 1 + first_row: greedy (argmax) or sampled from the row's own
distribution for rejection sampling (a row's distribution depends on the context only, or — DSpark's Markov bias
— on the draft before it too, drawn left to right). This is vLLM's DFlash proposer (and its DSpark one at
`sample_from_anchor`), so the per-position acceptance counts of the two engines agree (tests/test_vllm_serving.py).
"""

from __future__ import annotations

import torch

from inference_eval.engine.base import ChainProposer, Engine, Request, target_state
from inference_eval.engine.static import LEAD, StaticBatch, batch_bucket
from inference_eval.paged import PagedBatch, PagedCache, SeqSlice


class PagedBlockProposer(ChainProposer):
    """`stop_below` (a head with a confidence head, DSpark's): a sequence's drafts end after the first draft at
    which the predicted probability that every draft so far is accepted, Π_j σ(c_j), falls below it (at least one
    draft each round) — an adaptive draft length per request and round; the target verifies fewer rows. None: k."""

    def __init__(self, head, stop_below: float | None = None) -> None:
        if not getattr(head, "block", False):
            raise ValueError(f"PagedBlockProposer drafts with a block head (dflash, dspark), not {head.kind}")
        if stop_below is not None and not hasattr(head, "confidence_head"):
            raise ValueError(f"stop_below={stop_below}: the {head.kind} head has no confidence head to stop by "
                             "(head=dspark with head.confidence=true has)")
        if stop_below is not None and not 0.0 < stop_below < 1.0:
            raise ValueError(f"stop_below={stop_below!r}: expected a probability in (0, 1)")
        self.head, self.stop_below = head, stop_below
        self.capture_layers = head.capture_layers
        self.passes = 0  # draft forward passes
        self.drafts: dict[int, torch.Tensor] = {}  # per request: the next round's drafts [k] a fused round left

    def check(self, k: int) -> None:
        if k > self.head.max_depth:
            raise ValueError(f"k={k} draft tokens, but the {self.head.kind} head's block of {self.head.block_size} "
                             f"drafts at most {self.head.max_depth}")

    def lookahead(self, k: int) -> int:
        """Positions a round writes past m: the verification's k + 1 or the block's rows; with the fused round the
        next round's block too (at m + a + 1, a ≤ k)."""
        n = self.head.block_rows(k)
        return k + 1 + n if self.fuses else max(k + 1, n)

    @property
    def fused_round(self) -> bool:
        """The compiled greedy round as one graph applies (scheduler.py `_fused_round`): not with the confidence
        stop, whose draft count per sequence the host decides."""
        return self.stop_below is None

    def fused_name(self, k: int) -> str:
        return f"{self.head.kind} round, k={k}"

    def release(self, req: Request) -> None:
        self.drafts.pop(req.rid, None)

    def round_drafts(self, reqs: list[Request], k: int) -> torch.Tensor:
        """The fused round's drafts [D, k] on the device: those the last fused round left, else (after a prefill or an
        eager round) drafted now by a block pass at each sequence's m."""
        fresh = [r for r in reqs if r.rid not in self.drafts]
        if fresh:
            _, drafted = self.block_hidden(fresh, k, greedy=True)
            for r, d in zip(fresh, drafted):
                self.drafts[r.rid] = d
        return torch.stack([self.drafts[r.rid] for r in reqs])

    def next_meta(self, reqs: list[Request], k: int, rows: int) -> torch.Tensor:
        """The rows of the next round's block after each acceptance a ∈ 0..k — n rows at m + a + 1.., each seeing the
        whole block — as compiled-step metadata [rows · (k + 1) · n, …], padding sequences in the scratch slot."""
        n = self.head.block_rows(k)
        per = (k + 1) * n
        return self.engine.static.pack(
            None, [r.m + a + 1 + j for r in reqs for a in range(k + 1) for j in range(n)],
            [r.table.blocks for r in reqs for _ in range(per)],
            limits=[r.m + a + n for r in reqs for a in range(k + 1) for _ in range(n)], rows=rows * per)

    def fused_rest(self, hidden: torch.Tensor, aux: tuple, g: torch.Tensor, a: torch.Tensor, vmeta: torch.Tensor,
                   nmeta: torch.Tensor) -> tuple[torch.Tensor]:
        """In the fused round's graph, after the target's pass over the k + 1 rows of D' sequences (its argmax g
        [D', k + 1], the acceptance a [D']): the context entries of every verified row, written at the
        verification's slots (as `update`), then the next block pass at m' = m + a + 1 from the anchor g[a] — the
        rows of its a — and its k greedy drafts [D', k]."""
        dp, k = g.shape[0], g.shape[1] - 1
        n = self.head.block_rows(k)
        verified = StaticBatch(vmeta, self.pool)
        self._write(target_state(self.head, hidden[None], [x[None] for x in aux]), verified.positions,
                    verified.write_slots)
        rows = torch.arange(dp, device=g.device)
        meta = nmeta.view(dp, k + 1, n, nmeta.shape[-1])[rows, a].reshape(dp * n, nmeta.shape[-1])
        _, drafts = self._block_graph(g[rows, a], meta, k, True)
        return (drafts,)

    def fused_commit(self, reqs: list[Request], drafts: torch.Tensor) -> None:
        for i, r in enumerate(reqs):
            self.drafts[r.rid] = drafts[i]

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = self._pool(self.head.num_cache_layers, self.head.layer_args, self.head.dtype)

    def write_context(self, reqs: list[Request], states: torch.Tensor, rows: list[tuple[int, int]],
                       starts: list[int]) -> None:
        """Context entries for each sequence's rows [s, e) of a target pass (`states` [1, N, K·H] or its aux list),
        at positions start.. of that sequence."""
        dev = self.engine.device
        idx = torch.cat([torch.arange(s, e, device=dev) for s, e in rows])
        slots = torch.cat([r.table.slots[p: p + (e - s)] for r, p, (s, e) in zip(reqs, starts, rows)])
        positions = torch.cat([torch.arange(p, p + (e - s), device=dev) for p, (s, e) in zip(starts, rows)])
        self._write(states[:, idx], positions, slots)

    def _write(self, ctx: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Context entries of states `ctx` [1, N, K·H] at `positions` [N], written at `slots` [N] of every draft layer."""
        for i, (k, v) in enumerate(self.head.context_kv(ctx, positions[None])):
            self.pool.k[i].index_copy_(0, slots, k[0].transpose(0, 1).to(self.pool.k[i].dtype))
            self.pool.v[i].index_copy_(0, slots, v[0].transpose(0, 1).to(self.pool.v[i].dtype))

    def prefill(self, reqs: list[Request], out, rows: list[tuple[int, int]]) -> None:
        for r in reqs:
            self.drafts.pop(r.rid, None)
        self.write_context(reqs, target_state(self.head, out.hidden, out.aux), rows, [0] * len(reqs))

    def update(self, reqs: list[Request], vout, rows: list[tuple[int, int]], accepted: list[int],
               emitted: list[list[int]], argmax: torch.Tensor | None) -> None:
        for r in reqs:  # an eager round: the next drafts are drafted from the block at the new m
            self.drafts.pop(r.rid, None)
        self.write_context(reqs, target_state(self.head, vout.hidden, vout.aux), rows, [r.m for r in reqs])

    def block_hidden(self, reqs: list[Request], k: int, greedy: bool = False):
        """One draft pass over every sequence's block at its m: the last layer's rows [B, block_rows(k), H]. With
        the engine's compiled step (static.py) the pass is one graph per bucket of sequences and key slots, and
        `greedy` (every sequence greedy, drafting all k) adds the k left-to-right picks to it: then (rows, drafts
        [B, k] on the device)."""
        dev, n = self.engine.device, self.head.block_rows(k)
        anchors = torch.tensor([r.tokens[-1] for r in reqs], device=dev)
        static = self.engine.static
        if static is not None:
            d = len(reqs)
            meta = static.pack(None, [r.m + j for r in reqs for j in range(n)],
                               [r.table.blocks for r in reqs for _ in range(n)],
                               limits=[r.m + n - 1 for r in reqs for _ in range(n)],  # the whole block: non-causal
                               rows=batch_bucket(d) * n)  # padding sequences of n rows each, in the scratch slot
            anchors = torch.cat([anchors, anchors.new_zeros(meta.shape[0] // n - d)])
            name = f"{self.head.kind} block pass, blocks of {n} rows" + (f", {k} greedy drafts" if greedy else "")
            out = static.run((name, meta.shape[0], meta.shape[1] - LEAD, ()), self._block_graph, anchors, meta, k,
                             greedy)
            self.passes += 1
            return tuple(t[:d] for t in out) if greedy else out[:d]
        ids = self.head.block_inputs(anchors, n).view(1, -1)
        positions = torch.tensor([[r.m + j for j in range(n)] for r in reqs], device=dev).view(1, -1)
        full = torch.ones(n, n, dtype=torch.bool, device=dev)  # non-causal within the block
        batch = PagedBatch([SeqSlice(r.table, r.m, n, 0, full) for r in reqs], dev)
        self.passes += 1
        h = self.head(ids, positions, PagedCache(self.pool, batch)).view(len(reqs), n, -1)
        return (h, self.greedy_drafts(h, anchors, k)) if greedy else h

    def _block_graph(self, anchors: torch.Tensor, meta: torch.Tensor, k: int, greedy: bool):
        """The compiled block pass (static.py): the rows of `meta`, n per sequence of `anchors`."""
        d = anchors.shape[0]
        n = meta.shape[0] // d
        cache = StaticBatch(meta, self.pool)
        h = self.head(self.head.block_inputs(anchors, n).view(1, -1), cache.positions[None], cache).view(d, n, -1)
        return (h, self.greedy_drafts(h, anchors, k)) if greedy else h

    def greedy_drafts(self, h: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """The k greedy drafts [B, k] of block rows `h` [B, n, H] after `anchors` [B], left to right (DSpark's
        Markov bias reads the draft before)."""
        prev, drafts = anchors, []
        for i in range(k):
            prev = self.draft_logits(h[:, self.head.first_row + i], prev).argmax(-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1)

    def draft_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits over the target vocabulary [B, V] of block rows `h` [B, H] after tokens `prev` [B] (−inf outside
        a reduced draft vocabulary)."""
        logits = self.head.row_logits(h, prev)
        ids = self.head.draft_ids
        if ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.head.args.vocab_size), float("-inf"))
        out[..., ids] = logits
        return out

    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]:
        if self.stop_below is None and all(r.sampling.greedy for r in reqs):  # the drafts' one read
            _, drafts = self.block_hidden(reqs, k, greedy=True)
            return drafts.tolist(), [[None] * k for _ in reqs]
        h = self.block_hidden(reqs, k)
        first = self.head.first_row
        prev = torch.tensor([r.tokens[-1] for r in reqs], device=self.engine.device)
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list] = [[] for _ in reqs]
        live = list(range(len(reqs)))  # the sequences still drafting this round
        survive = torch.ones(len(reqs), device=h.device)
        for i in range(k):  # left to right: a row's Markov bias (DSpark) reads the draft before it
            logits = self.draft_logits(h[:, first + i], prev)
            picks = [reqs[j].sampling.pick(logits[j]) if j in live else (0, None) for j in range(len(reqs))]
            for j in live:
                drafts[j].append(picks[j][0])
                qs[j].append(picks[j][1])
            if self.stop_below is not None:  # Π σ(c): the chance that every draft so far is accepted
                survive = survive * torch.sigmoid(self.head.confidence(h[:, first + i], prev).float())
                live = [j for j in live if float(survive[j]) >= self.stop_below]
            prev = torch.tensor([d for d, _ in picks], device=self.engine.device)
        return drafts, qs
