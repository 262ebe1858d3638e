"""A draft model with its own KV cache (`PagedDraftModelProposer`: any LM with the target's tokenizer)."""

from __future__ import annotations

import torch

from inference_eval.engine.base import ChainProposer, Engine, Request, target_logits
from inference_eval.paged import SeqSlice


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
        # per request: positions < fed[rid] are in the draft's cache; carry[rid]: its logits at fed-1 (the next d_1)
        self.fed: dict[int, int] = {}
        self.carry: dict[int, torch.Tensor | None] = {}

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.pool = self._pool(self.draft.args.num_hidden_layers, self.draft.args, self.draft.dtype)

    def lookahead(self, k: int) -> int:
        return k + 2  # the fill after acceptance writes the bonus token at m+k+1 when all k were accepted

    def release(self, req: Request) -> None:
        self.fed.pop(req.rid, None)
        self.carry.pop(req.rid, None)

    def prefill(self, reqs: list[Request], out, rows) -> None:
        for r in reqs:
            self.release(r)

    def _feed(self, reqs: list[Request], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One packed pass of the draft over each sequence's `feeds` at positions start..; logits at
        each sequence's last row [B, V]."""
        eng = self.engine
        out = eng.forward(self.draft, self.pool, feeds, [list(range(s, s + len(f))) for s, f in zip(starts, feeds)],
                          [SeqSlice(r.table, s, len(f)) for r, s, f in zip(reqs, starts, feeds)])
        self.passes += 1
        ends = torch.tensor([len(f) for f in feeds], device=eng.device).cumsum(0) - 1
        return target_logits(self.draft, out.hidden[0, ends])

    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]:
        fed, carry = self.fed, self.carry
        stale = [i for i, r in enumerate(reqs) if carry.get(r.rid) is None or fed.get(r.rid, 0) != r.m + 1]
        if stale:  # positions fed..m are not in the draft's cache yet: feed them (varlen)
            logits = self._feed([reqs[i] for i in stale], [reqs[i].tokens[fed.get(reqs[i].rid, 0): reqs[i].m + 1] for i in stale],
                                [fed.get(reqs[i].rid, 0) for i in stale])
            for j, i in enumerate(stale):
                carry[reqs[i].rid], fed[reqs[i].rid] = logits[j], reqs[i].m + 1
        picks = [r.sampling.pick(carry[r.rid]) for r in reqs]
        cols = [([d for d, _ in picks], [q for _, q in picks])]
        for j in range(2, k + 1):
            logits = self._feed(reqs, [[d] for d in cols[-1][0]], [r.m + j - 1 for r in reqs])
            picks = [r.sampling.pick(logits[i]) for i, r in enumerate(reqs)]
            cols.append(([d for d, _ in picks], [q for _, q in picks]))
        for r in reqs:  # the cache now holds t_m and d_1..d_{k-1} at positions m..m+k-1
            fed[r.rid], carry[r.rid] = r.m + k, None
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
            self.fed[r.rid], self.carry[r.rid] = s + len(f), logits[i]  # = m' + 1 once the emitted tokens are committed
