"""Speculative decoding's shared pieces (docs/design.md §5): acceptance statistics, τ from per-depth acceptance
(`chain_tau`), the greedy and the rejection-sampling accept rules (`Sampling`, `accept_rejection`) and a head's logits
over the target vocabulary. The decoder itself, and the only draft path, is the paged engine
(inference_eval/engine/, `engine_generate`; teacher-forced scoring runs its proposers too, inference_eval/scoring.py),
which imports this module, never the other way round. (The earlier batch-1 loop over a contiguous cache survives only
as the tests' independent reference, tests/reference_decoding.py.)

After each verification the head re-runs over the newly accepted positions with the *target's* hidden
states, so its cache only ever holds step-1 entries computed from target states plus the current
round's deeper draft steps — the layout the training unroll reproduces.

Indexing (t_0..t_m committed, t_m not yet seen by the target; both caches valid for slots < m):
  draft 1:  head(H_{m-1}, t_m) at position m-1 was already run → d_1 = argmax logits
  draft j:  head(Ĥ^{j-1}, d_{j-1}) at position m+j-2            → d_j
  verify :  target([t_m, d_1..d_k]) at positions m..m+k          → g_0..g_k
  accept :  a = longest prefix with d_j == g_{j-1}; emit d_1..d_a, g_a
            (sampling: d_j ~ q_j; accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
            rejection emit a sample of norm(max(0, p_j − q_j)); if all k pass, a sample of p_k)
  refresh:  head(H_{m+j}, t_{m+j+1}) for j = 0..a at positions m..m+a

EAGLE-3 heads read the captured aux layers instead of H and map draft ids to target ids (d2t);
separate MTP modules keep one cache each (heads/unroll.py); Medusa drafts all k tokens at once from
the target state of the last committed position and keeps no cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def chain_tau(accs):
    """τ if acceptance at each draft depth were independent: 1 + Σ_d Π_{j≤d} α_j, from per-depth acceptance rates
    `accs` (floats, or tensors: the sum keeps their autograd graph)."""
    tau, survive = 1.0, 1.0
    for acc in accs:
        survive = survive * acc
        tau = tau + survive
    return tau


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


@dataclass
class Sampling:
    """Token selection, applied identically to draft and target distributions: temperature 0 is
    greedy (argmax); otherwise softmax(logits / temperature) restricted to the top_k tokens (0: all)
    and to the smallest set whose mass reaches top_p (1.0: all), renormalised."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits → [..., V] float32 probabilities after temperature, top-k and top-p."""
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        p = x.softmax(-1)
        if self.top_p < 1.0:
            sorted_p, order = p.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
            drop = (before >= self.top_p).scatter(-1, order, before >= self.top_p)
            p = p.masked_fill(drop, 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A token from [V] logits, and its distribution (None when greedy)."""
        if self.greedy:
            return int(logits.argmax()), None
        p = self.probs(logits)
        return draw(p, self.generator), p


GREEDY = Sampling()


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id sampled from the probabilities `p` [V], on the generator's device (a CPU generator
    can drive sampling for a model on an accelerator)."""
    if generator is not None and p.device != generator.device:
        p = p.to(generator.device)
    return int(torch.multinomial(p, 1, generator=generator))


def accept_rejection(drafts: list[int], q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): drafts d_j ~ q_j [k, V] are
    checked against the target's p [k+1, V]. Returns (a, token): a drafts accepted, then `token`,
    sampled from norm(max(0, p_a − q_a)) after a rejection or from p_k when all k were accepted. The
    emitted tokens are distributed exactly as sampling from p, whatever q is."""
    for j, d in enumerate(drafts):
        u = torch.rand((), generator=generator, device=generator.device if generator is not None else "cpu")
        if float(u) * float(q[j, d]) < float(p[j, d]):  # accept with probability min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp(min=0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p[j]
        return j, draw(residual, generator)
    k = len(drafts)
    return k, draw(p[k], generator)


def full_vocab_logits(head, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """A head's logits over the target vocabulary: −inf outside a sub-vocabulary (EAGLE-3's d2t)."""
    logits = head.logits(hidden, depth)
    ids = head.draft_ids
    if ids is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], head.args.vocab_size), float("-inf"))
    out[..., ids] = logits
    return out


@dataclass
class DraftModelProposer:
    """A draft LM sharing the target's tokenizer (a checkpoint, or `LlamaForCausalLM.truncated`), named for
    reports. Not a decoder of its own: the engine drafts with it through `PagedDraftModelProposer`
    (`engine_proposer` unwraps it)."""

    draft: Any
    label: str = "draft_model"
