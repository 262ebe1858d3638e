"""The batch-1 speculative decoding loop over a contiguous KV cache that every stage ran before the
paged engine served them all — kept here, in the tests only, as an independent reference: the engine's
outputs and acceptance statistics must equal this loop's on the same prompts (tests/test_engine.py,
tests/test_speculative.py), and stub heads with a known acceptance pattern run through it."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from evaluation.evaluate import EvalResult
from inference_eval.engine.base import target_state
from inference_eval.speculative import (GREEDY, DraftModelProposer, Sampling, SpecStats, _finish, accept_greedy,
                                        accept_rejection, full_vocab_logits)


# The head's draft path along one sequence over a contiguous cache: the reference the engine's paged proposer
# (inference_eval/engine/head.py) must equal.
def refresh(head, states: torch.Tensor, tokens: torch.Tensor, start: int, cache, last_only: bool = True
            ) -> torch.Tensor:
    """Run the head over target states (H_j, t_{j+1}) at positions start.. and return its depth-1
    state at the last one (or at every one). Separate modules (mtp num_modules > 1) each refresh their
    own cache."""
    n = tokens.shape[1]
    positions = torch.arange(start, start + n, device=tokens.device).expand(1, n)
    state = head(states, tokens, positions, cache, start)
    if head.separate_modules:
        for d in range(2, len(head.layers) + 1):
            head(states, tokens, positions, cache, start, depth=d)
    return state[:, -1:] if last_only else state


def draft_chain(head, state: torch.Tensor, k: int, m: int, cache, forced: list[int] | None = None,
                sampling: Sampling = GREEDY) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """d_1 from the state at position m-1, then Ĥ^j = head(Ĥ^{j-1}, d_{j-1}) at RoPE position m+j-2
    and d_j picked from its logits (argmax, or sampled). Depth j writes slot m+j-2 (after the depth-1
    entries ≤ m-1 and depths 2..j-1): of the one shared cache, or with separate modules of module j's
    cache and, from the same input, of every module that answers a deeper step of this draft (what
    vLLM's draft loop reads: docs/export.md `mtp-vllm`). `forced` feeds those tokens instead of the
    drafts (teacher forcing). Returns the drafts, the states and (sampling) the draft
    distributions q_j over the target vocabulary."""
    d, q = sampling.pick(full_vocab_logits(head, state)[0, -1])
    drafts, qs, h, states = [d], [q], state, [state]
    for j in range(2, k + 1):
        pos = m + j - 2
        tok = forced[j - 2] if forced is not None else drafts[-1]
        tok_t, pos_t = torch.tensor([[tok]], device=h.device), torch.tensor([[pos]], device=h.device)
        for e in head.key_writers(j, k):  # separate modules: the deeper modules' keys of this step
            head(h, tok_t, pos_t, cache, pos, depth=e)
        h = head(h, tok_t, pos_t, cache, pos, depth=j)
        states.append(h)
        d, q = sampling.pick(full_vocab_logits(head, h, depth=j)[0, -1])
        drafts.append(d)
        qs.append(q)
    return drafts, states, qs


@torch.inference_mode()
def reference_plain(target, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset(),
                    sampling: Sampling = GREEDY) -> list[int]:
    cache = target.new_cache(1, len(prompt) + max_new_tokens + 1)
    dev = target.device
    out = target(torch.tensor([prompt], device=dev), cache=cache, logits="last")
    new = [sampling.pick(out.logits[0, -1])[0]]
    pos = len(prompt)
    while not _finish(new, max_new_tokens, stop_ids)[1]:
        out = target(torch.tensor([[new[-1]]], device=dev), cache=cache, start=pos, logits="last")
        new.append(sampling.pick(out.logits[0, -1])[0])
        pos += 1
    return _finish(new, max_new_tokens, stop_ids)[0]




class HeadProposer:
    """Drafts with a head from heads/: a chain (mtp, eagle1, eagle3) or all at once (medusa)."""

    def __init__(self, head) -> None:
        self.head = head
        self.capture_layers = head.capture_layers
        self.state = self.cache = None

    @property
    def label(self) -> str:
        return getattr(self.head, "kind", "head")

    def check(self, k: int) -> None:
        if self.head.max_depth is not None and k > self.head.max_depth:
            raise ValueError(f"k={k} draft tokens, but the {self.head.kind} head defines {self.head.max_depth} draft steps")

    def start(self, out, prompt: list[int], first: int, max_len: int) -> None:
        head = self.head
        if head.chain:  # head prefill over (H_i, t_{i+1}), i = 0..m-1
            self.cache = head.new_cache(1, max_len)
            self.state = refresh(head, target_state(head, out.hidden, out.aux), torch.tensor([prompt[1:] + [first]], device=out.hidden.device),
                                 0, self.cache)
        else:  # a parallel head drafts from the target state of the last committed position
            self.state = out.hidden[:, -1:]

    def propose(self, k: int, m: int, committed: list[int], sampling: Sampling = GREEDY
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        if self.head.chain:
            drafts, _, qs = draft_chain(self.head, self.state, k, m, self.cache, sampling=sampling)
            return drafts, qs
        picks = [sampling.pick(full_vocab_logits(self.head, self.head(self.state, depth=j), j)[0, -1])
                 for j in range(1, k + 1)]
        return [d for d, _ in picks], [q for _, q in picks]

    def update(self, vout, emitted: list[int], a: int, m: int) -> None:
        """After verification of positions m..m+k: a drafts accepted, `emitted` = t_{m+1}..t_{m+a+1}."""
        if self.head.chain:  # refresh the head with the target's states of the accepted positions m..m+a
            vstate = target_state(self.head, vout.hidden, vout.aux)[:, : a + 1]
            self.state = refresh(self.head, vstate, torch.tensor([emitted], device=vstate.device), m, self.cache)
        else:
            self.state = vout.hidden[:, a: a + 1]


class RefDraftModelProposer:
    """Drafts k tokens greedily with a small LM that shares the target's tokenizer (a checkpoint, or
    `LlamaForCausalLM.truncated`), keeping its own KV cache. The cache holds the tokens in `fed`;
    before each proposal the longest prefix of `fed` that is still committed is kept and the rest of
    the committed tokens is fed, so rejected drafts are simply overwritten."""

    capture_layers = ()

    def __init__(self, draft, label: str = "draft_model") -> None:
        self.draft, self.label = draft, label
        self.cache, self.fed = None, []

    def check(self, k: int) -> None:
        return None

    def start(self, out, prompt: list[int], first: int, max_len: int) -> None:
        self.cache, self.fed = self.draft.new_cache(1, max_len), []

    def propose(self, k: int, m: int, committed: list[int], sampling: Sampling = GREEDY
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        keep = 0
        for a, b in zip(self.fed, committed):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(committed) - 1)  # the last committed token is always fed: its logits draft d_1
        feed = committed[keep:]
        dev = self.draft.device
        out = self.draft(torch.tensor([feed], device=dev), cache=self.cache, start=keep, logits="last")
        self.fed = committed[:]
        d, q = sampling.pick(out.logits[0, -1])
        drafts, qs = [d], [q]
        for _ in range(k - 1):
            out = self.draft(torch.tensor([[drafts[-1]]], device=dev), cache=self.cache, start=len(self.fed),
                             logits="last")
            self.fed.append(drafts[-1])
            d, q = sampling.pick(out.logits[0, -1])
            drafts.append(d)
            qs.append(q)
        return drafts, qs

    def update(self, vout, emitted: list[int], a: int, m: int) -> None:
        return None


def as_proposer(x):
    """A proposer as is, or a head wrapped in HeadProposer."""
    if isinstance(x, DraftModelProposer):  # the product's named draft LM → this loop's draft proposer
        return RefDraftModelProposer(x.draft, x.label)
    return x if hasattr(x, "propose") else HeadProposer(x)


@torch.inference_mode()
def reference_speculative(target, head, prompt: list[int], k: int, max_new_tokens: int,
                          stop_ids: set[int] = frozenset(), sampling: Sampling = GREEDY
                          ) -> tuple[list[int], SpecStats]:
    """Speculative decoding of `prompt` with `head` (a head from heads/, or a proposer:
    HeadProposer / DraftModelProposer), plus acceptance stats. Greedy: output equal to
    `reference_plain`'s token for token; sampling: distributed as `reference_plain`'s (rejection sampling)."""
    proposer = as_proposer(head)
    proposer.check(k)
    stats = SpecStats(k=k)
    t0 = time.perf_counter()
    m = len(prompt)
    max_len = m + max_new_tokens + k + 2
    capture = proposer.capture_layers
    tcache = target.new_cache(1, max_len)
    dev = target.device
    out = target(torch.tensor([prompt], device=dev), cache=tcache, logits="last", capture_layers=capture)
    new = [sampling.pick(out.logits[0, -1])[0]]
    proposer.start(out, prompt, new[0], max_len)
    while not _finish(new, max_new_tokens, stop_ids)[1]:
        drafts, qs = proposer.propose(k, m, prompt + new, sampling)
        verify_in = torch.tensor([[new[-1]] + drafts], device=dev)  # [1, k+1]
        vout = target(verify_in, cache=tcache, start=m, logits="all", capture_layers=capture)
        if sampling.greedy:
            g = vout.logits[0].argmax(-1)  # [k+1]
            a = accept_greedy(torch.tensor(drafts, device=g.device), g)
            last = int(g[a])
        else:
            a, last = accept_rejection(drafts, torch.stack(qs), sampling.probs(vout.logits[0]), sampling.generator)
        for d in range(min(a + 1, k)):
            stats.reached[d] += 1
            stats.accepted[d] += int(d < a)
        emitted = drafts[:a] + [last]
        stats.steps += 1
        stats.emitted += len(emitted)
        new.extend(emitted)
        proposer.update(vout, emitted, a, m)
        m += a + 1
    result = _finish(new, max_new_tokens, stop_ids)[0]
    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(result)
    return result, stats


def evaluate_head(target, head, prompts: list[dict[str, Any]], k: int, max_new_tokens: int,
                  stop_ids: set[int], label: str = "head", progress: bool = True, warmup: int = 0,
                  repeats: int = 1, sampling: Sampling = GREEDY, outputs: list | None = None) -> EvalResult:
    """prompts: dicts with `ids` (token ids) and `category`. `head`: a head or a proposer
    (below). Acceptance comes from the first pass over the prompts (greedy:
    every repeat is identical); tokens/s is the median over `repeats` passes after `warmup` prompts."""
    total = SpecStats(k=k)
    by_cat: dict[str, SpecStats] = {}
    for p in prompts[:warmup]:
        reference_speculative(target, head, p["ids"], k, max_new_tokens, stop_ids, sampling)
    speeds = []
    for r in range(max(repeats, 1)):
        seconds = new_tokens = 0
        for p in prompts:
            out, st = reference_speculative(target, head, p["ids"], k, max_new_tokens, stop_ids, sampling)
            seconds, new_tokens = seconds + st.seconds, new_tokens + st.new_tokens
            if r == 0:
                if outputs is not None:
                    outputs.append(out)
                total.merge(st)
                by_cat.setdefault(p.get("category", "all"), SpecStats(k=k)).merge(st)
        speeds.append(new_tokens / max(seconds, 1e-9))
    return EvalResult(label=label, k=k, tau=total.tau, alpha=total.alpha, target_passes=total.steps,
                      new_tokens=total.new_tokens, tokens_per_s=statistics.median(speeds),
                      per_category_tau={c: s.tau for c, s in sorted(by_cat.items())}, prompts=len(prompts))
