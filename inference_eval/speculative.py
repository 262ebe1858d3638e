"""Greedy decoding, plain and speculative with a chain of k draft tokens from a head (DESIGN.md §5).

KV-cached on both sides, batch 1. After each verification the head re-runs over the newly accepted
positions with the *target's* hidden states, so its cache only ever holds step-1 entries computed
from target states plus the current round's deeper draft steps — the layout the training unroll
reproduces.

Indexing (t_0..t_m committed, t_m not yet seen by the target; both caches valid for slots < m):
  draft 1:  head(H_{m-1}, t_m) at position m-1 was already run → d_1 = argmax logits
  draft j:  head(Ĥ^{j-1}, d_{j-1}) at position m+j-2            → d_j
  verify :  target([t_m, d_1..d_k]) at positions m..m+k          → g_0..g_k
  accept :  a = longest prefix with d_j == g_{j-1}; emit d_1..d_a, g_a
  refresh:  head(H_{m+j}, t_{m+j+1}) for j = 0..a at positions m..m+a
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SpecStats:
    k: int
    steps: int = 0  # verification passes of the target
    emitted: int = 0  # tokens emitted by those passes (accepted drafts + bonus)
    reached: list[int] = field(default_factory=list)  # [k] times draft position d was reached
    accepted: list[int] = field(default_factory=list)  # [k] times it was accepted
    seconds: float = 0.0
    new_tokens: int = 0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verification pass."""
        return self.emitted / max(self.steps, 1)

    @property
    def alpha(self) -> list[float]:
        """α_d: acceptance of draft position d given positions < d were accepted."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def merge(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.emitted += other.emitted
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]
        self.seconds += other.seconds
        self.new_tokens += other.new_tokens


def accept_greedy(drafts: torch.Tensor, target_argmax: torch.Tensor) -> int:
    """Length of the longest prefix of `drafts` [k] that equals the target's argmax at the
    preceding positions `target_argmax[:k]` (target_argmax has k+1 entries; entry a is the bonus)."""
    match = (drafts == target_argmax[: drafts.shape[0]]).int()
    return int(match.cumprod(0).sum())


def _finish(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], bool]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens, len(tokens) >= max_new_tokens


@torch.inference_mode()
def generate_plain(target, prompt: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    cache = target.new_cache(1, len(prompt) + max_new_tokens + 1)
    out = target(torch.tensor([prompt]), cache=cache, logits="last")
    new = [int(out.logits[0, -1].argmax())]
    pos = len(prompt)
    while not _finish(new, max_new_tokens, stop_ids)[1]:
        out = target(torch.tensor([[new[-1]]]), cache=cache, start=pos, logits="last")
        new.append(int(out.logits[0, -1].argmax()))
        pos += 1
    return _finish(new, max_new_tokens, stop_ids)[0]


@torch.inference_mode()
def generate_speculative(target, head, prompt: list[int], k: int, max_new_tokens: int,
                         stop_ids: set[int] = frozenset()) -> tuple[list[int], SpecStats]:
    if len(getattr(head, "layers", [])) > 1:
        raise NotImplementedError("the chain loop drives single-module heads; num_modules > 1 is not wired yet")
    stats = SpecStats(k=k)
    t0 = time.perf_counter()
    m = len(prompt)
    max_len = m + max_new_tokens + k + 2
    tcache, hcache = target.new_cache(1, max_len), head.new_cache(1, max_len)
    out = target(torch.tensor([prompt]), cache=tcache, logits="last")
    new = [int(out.logits[0, -1].argmax())]
    # Head prefill over (H_i, t_{i+1}), i = 0..m-1.
    nxt = torch.tensor([prompt[1:] + new])
    state = head(out.hidden, nxt, torch.arange(m).expand(1, m), hcache, 0)[:, -1:]  # [1, 1, H]
    while not _finish(new, max_new_tokens, stop_ids)[1]:
        drafts = [int(head.logits(state)[0, -1].argmax())]
        h = state
        for j in range(2, k + 1):
            pos = m + j - 2
            h = head(h, torch.tensor([[drafts[-1]]]), torch.tensor([[pos]]), hcache, pos, depth=j)
            drafts.append(int(head.logits(h, depth=j)[0, -1].argmax()))
        verify_in = torch.tensor([[new[-1]] + drafts])  # [1, k+1]
        vout = target(verify_in, cache=tcache, start=m, logits="all")
        g = vout.logits[0].argmax(-1)  # [k+1]
        a = accept_greedy(torch.tensor(drafts), g)
        for d in range(min(a + 1, k)):
            stats.reached[d] += 1
            stats.accepted[d] += int(d < a)
        emitted = drafts[:a] + [int(g[a])]
        stats.steps += 1
        stats.emitted += len(emitted)
        new.extend(emitted)
        # Refresh the head with the target's states of the accepted positions m..m+a.
        toks = torch.tensor([emitted])  # t_{m+1}..t_{m+a+1}
        state = head(vout.hidden[:, : a + 1], toks, torch.arange(m, m + a + 1).expand(1, a + 1), hcache, m)[:, -1:]
        m += a + 1
    result = _finish(new, max_new_tokens, stop_ids)[0]
    stats.seconds = time.perf_counter() - t0
    stats.new_tokens = len(result)
    return result, stats
