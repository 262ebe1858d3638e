"""The proposer of a head from heads/ (`PagedHeadProposer`: chain heads mtp / eagle1 / eagle3, and medusa), and
`frequent_ids`, a draft vocabulary for it."""

from __future__ import annotations

import torch

from heads.layers import linear
from inference_eval.engine.base import ChainProposer, Engine, Request, target_state
from inference_eval.engine.static import StaticBatch
from inference_eval.paged import PagedBatch, PagedCache, SeqSlice
from inference_eval.speculative import full_vocab_logits


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
        # per request: the head's state at the last committed position, and (k = 1 schedule) its next draft
        # token left on the device; a round drafted on the host drops the latter
        self.states: dict[int, torch.Tensor] = {}
        self.drafts: dict[int, torch.Tensor] = {}
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
        self.states.pop(req.rid, None)
        self.drafts.pop(req.rid, None)

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
        return self.refresh_k1(states, flat_tok, flat_pos, PagedCache(self.pool, batch))

    def prefill(self, reqs: list[Request], out, rows: list[tuple[int, int]]) -> None:
        for r in reqs:
            self.drafts.pop(r.rid, None)
        if not self.head.chain:
            for r, (_, e) in zip(reqs, rows):
                self.states[r.rid] = out.hidden[0, e - 1]
            return
        states = target_state(self.head, out.hidden, out.aux)
        h = self._refresh(reqs, states, [r.tokens[1: r.cached + 1] for r in reqs], [0] * len(reqs))
        for r, (_, e) in zip(reqs, rows):
            self.states[r.rid] = h[e - 1]

    def _pick(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list]:
        picks = [r.sampling.pick(logits[i]) for i, r in enumerate(reqs)]
        return [d for d, _ in picks], [q for _, q in picks]

    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]:
        head = self.head
        h = torch.stack([self.states[r.rid] for r in reqs])[None]  # [1, B, S]
        if not head.chain:
            cols = [self._pick(reqs, self._logits(head(h, depth=j), j)[0]) for j in range(1, k + 1)]
        else:
            cols = []

            def pick(j: int, state: torch.Tensor) -> list[int]:
                cols.append(self._pick(reqs, self._logits(state, depth=j)[0]))
                return cols[-1][0]

            self.chain(reqs, h, k, pick)
        drafts = [[c[0][i] for c in cols] for i in range(len(reqs))]
        qs = [[c[1][i] for c in cols] for i in range(len(reqs))]
        return drafts, qs

    def chain(self, reqs: list, h: torch.Tensor, k: int, after) -> list[torch.Tensor]:
        """The head's states [1, B, S] at depths 1..k of each sequence's chain, from its depth-1 state `h` [1, B, S].
        Depth j ≥ 2 reads depth j − 1's state and the tokens `after(j − 1, that state)` returns (one per sequence:
        the drafts picked from it, or forced ones for teacher-forced scoring) at position m + j − 2, writing that
        slot (with separate modules, of module j and of every deeper module that answers this step)."""
        states = [h]
        toks = after(1, h)
        for j in range(2, k + 1):
            pos = [[r.m + j - 2] for r in reqs]
            slices = [SeqSlice(r.table, r.m + j - 2, 1) for r in reqs]
            toks = [[t] for t in toks]
            for e in self.head.key_writers(j, k):
                self._head(h, toks, pos, slices, depth=e)
            h = self._head(h, toks, pos, slices, depth=j)
            states.append(h)
            toks = after(j, h)
        return states

    def update(self, reqs: list[Request], vout, rows: list[tuple[int, int]], accepted: list[int],
               emitted: list[list[int]], argmax: torch.Tensor | None) -> None:
        for r in reqs:  # drafted on the host this round: a later k = 1 round drafts from the state again
            self.drafts.pop(r.rid, None)
        if not self.head.chain:
            for r, (s, _), a in zip(reqs, rows, accepted):
                self.states[r.rid] = vout.hidden[0, s + a]
            return
        if argmax is not None:  # greedy: fixed shape, all k+1 positions
            states = target_state(self.head, vout.hidden, vout.aux)  # [1, N, S]
            h = self._refresh(reqs, states, argmax.tolist(), [r.m for r in reqs])
            for r, (s, _), a in zip(reqs, rows, accepted):
                self.states[r.rid] = h[s + a]
            return
        self.update_tree(reqs, vout, rows, [list(range(1, a + 1)) for a in accepted], emitted)

    @property
    def supports_k1(self) -> bool:
        return self.head.chain and not self.tree

    def draft_k1(self, state: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [D] from head states [D, S], as a device tensor."""
        return self._logits(state[None])[0].argmax(-1)

    def k1_drafts(self, reqs: list[Request]) -> torch.Tensor:
        """The k = 1 round's draft token per sequence [D], on the device: the one the previous k = 1 round left,
        else (after a prefill or a round drafted on the host) drafted now from the head's state."""
        fresh = [i for i, r in enumerate(reqs) if r.rid not in self.drafts]
        drafted = self.draft_k1(torch.stack([self.states[reqs[i].rid] for i in fresh])) if fresh else None
        return torch.stack([self.drafts[r.rid] if r.rid in self.drafts else drafted[fresh.index(i)]
                            for i, r in enumerate(reqs)])

    def round_drafts(self, reqs: list[Request], k: int) -> torch.Tensor:
        """The fused round's drafts [D, k] on the device (scheduler.py `_fused_round`): those the previous round left,
        else (after a prefill or a round drafted on the host) drafted now, greedily, by `propose`."""
        fresh = [r for r in reqs if r.rid not in self.drafts or tuple(self.drafts[r.rid].shape) != (k,)]
        if fresh:
            drafted, _ = self.propose(fresh, k)
            for r, d in zip(fresh, drafted):
                self.drafts[r.rid] = torch.tensor(d, device=self.engine.device)
        return torch.stack([self.drafts[r.rid] for r in reqs])

    def chain_drafts(self, state: torch.Tensor, k: int, steps: torch.Tensor) -> torch.Tensor:
        """`chain`'s greedy drafts [D, k] with nothing read back (in the fused round's graph): from depth-1 states
        [D, S], draft step j ≥ 2 at the rows `steps[:, j − 2]` — compiled-step metadata (static.py) over this
        proposer's pool, each sequence's position and slots for that step."""
        h = state[None]
        tok = self._logits(h)[0].argmax(-1)
        out = [tok]
        for j in range(2, k + 1):
            batch = StaticBatch(steps[:, j - 2], self.pool)
            pos = batch.positions[None]
            for e in self.head.key_writers(j, k):
                self.head(h, tok[None], pos, batch, 0, depth=e)
            h = self.head(h, tok[None], pos, batch, 0, depth=j)
            tok = self._logits(h, j)[0].argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)

    def lookahead(self, k: int) -> int:
        """Positions a round writes past m: the verification's k + 1, and with the fused round the next round's draft
        steps too (up to m + 2k − 1; at k = 1 the same k + 1)."""
        return 2 * k if self.fuses else k + 1

    @property
    def fused_round(self) -> bool:
        """The compiled greedy round as one graph applies (scheduler.py `_fused_round`; k = 1 is `_k1_round`)."""
        return self.supports_k1

    def fused_name(self, k: int) -> str:
        return f"k={k} round"

    def next_meta(self, reqs: list[Request], k: int, rows: int) -> torch.Tensor:
        """The rows of the next round's draft steps 2..k after each acceptance a ∈ 0..k (step j at position
        m + a + j − 1), as compiled-step metadata [rows · (k + 1)(k − 1), …] — `rows` sequences, padding ones in the
        scratch slot."""
        deep = (k + 1) * (k - 1)
        return self.engine.static.pack(None, [r.m + a + j - 1 for r in reqs for a in range(k + 1)
                                              for j in range(2, k + 1)],
                                       [r.table.blocks for r in reqs for _ in range(deep)], rows=rows * deep)

    def fused_rest(self, hidden: torch.Tensor, aux: tuple, g: torch.Tensor, a: torch.Tensor, vmeta: torch.Tensor,
                   nmeta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In the fused round's graph, after the target's pass over the k + 1 rows of D' sequences (its last hidden
        [N, H] and captured layers, its argmax g [D', k + 1], the acceptance a [D']): the head refreshed over every
        verified position with the tokens g (every module, the verification's metadata over the head's pool), its
        state at row a [D', S] and the next round's k greedy drafts from it [D', k]."""
        dp, k = g.shape[0], g.shape[1] - 1
        cache = StaticBatch(vmeta, self.pool)
        h = self.refresh_k1(target_state(self.head, hidden[None], [x[None] for x in aux]), g.view(1, -1),
                            cache.positions[None], cache)
        rows = torch.arange(dp, device=g.device)
        state = h[rows * (k + 1) + a]
        steps = nmeta.view(dp, k + 1, k - 1, nmeta.shape[-1])[rows, a]  # [D', k − 1, C]: the rows of each a
        return state, self.chain_drafts(state, k, steps)

    def fused_commit(self, reqs: list[Request], state: torch.Tensor, nxt: torch.Tensor) -> None:
        self.k1_commit(reqs, state, nxt)

    def k1_commit(self, reqs: list[Request], state: torch.Tensor, nxt: torch.Tensor) -> None:
        """After a k = 1 round: each sequence's new head state [D, S] and next draft token [D] (device tensors);
        after a fused round at k ≥ 2, its next drafts [D, k]."""
        for i, r in enumerate(reqs):
            self.states[r.rid], self.drafts[r.rid] = state[i], nxt[i]

    def refresh_k1(self, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Depth-1 head pass (every module, one attention metadata for all of them) over rows whose
        tokens and positions are already on the device: [N, S]. `cache`: the head pool under a batch's metadata
        (a `PagedCache`, or the compiled step's `StaticBatch` over `self.pool`); the k = 1 round passes the
        metadata of the target's own pass (same slots)."""
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
        states = target_state(self.head, vout.hidden, vout.aux)
        idx = [s + p for (s, _), path in zip(rows, paths) for p in [0, *path]]
        h = self._refresh(reqs, states[:, idx], emitted, [r.m for r in reqs])
        end = 0
        for r, e in zip(reqs, emitted):
            end += len(e)
            self.states[r.rid] = h[end - 1]


def frequent_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """The n most frequent token ids of `counts` [V] (ties: lower id first), ascending — a draft
    vocabulary for `PagedHeadProposer(head, draft_vocab=...)`."""
    order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))[:n]
    return torch.tensor(sorted(order), dtype=torch.long)
