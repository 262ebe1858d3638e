"""What the scheduler asks of a proposer (`Proposer`, a typed protocol), what chain proposers share
(`ChainProposer`), a draft tree (`Tree`), and the two small functions every proposer applies to the
target's pass (its logits, the state a head reads)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from inference_eval.paged import POOLS, BlockTable, KVPool
from inference_eval.speculative import Sampling, SpecStats



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



class Engine(Protocol):
    """What a proposer uses of the engine it is attached to (inference_eval/engine/scheduler.py `Engine`, which
    imports the proposers, so they do not import it)."""

    device: torch.device
    num_blocks: int
    block_size: int
    k: int

    def forward(self, model, pool: KVPool, ids: list[list[int]], positions: list[list[int]], slices: list,
                capture: tuple[int, ...] = ()): ...


class Proposer(Protocol):
    """A drafter in the engine. The scheduler (inference_eval/engine/scheduler.py) calls only these; each
    proposer owns its per-request state (keyed by `Request.rid`) and drops it in `release`.

    Capabilities are declared attributes:
    - `capture_layers`: target layers whose inputs the verification pass must capture for `update`;
    - `tree`: drafts a tree (`propose_tree` / `update_tree`, greedy) instead of a chain (`propose` / `update`);
    - `supports_k1`: the fused k = 1 schedule applies (`k1_drafts`, `refresh_k1`, `draft_k1`, `k1_commit`);
    - `fused_round`: with the compiled step a greedy round is one graph (`round_drafts`, `next_meta`, `fused_rest`,
      `fused_commit`, `fused_name`: scheduler.py `_fused_round`);
    - `speculate_beside_prefill`: False when a step that prefills a newcomer must decode the batch plainly."""

    capture_layers: tuple[int, ...]
    tree: bool
    supports_k1: bool
    speculate_beside_prefill: bool

    def check(self, k: int) -> None: ...
    def stats_depth(self, k: int) -> int: ...
    def lookahead(self, k: int) -> int: ...
    def attach(self, engine: Engine) -> None: ...
    def prefill(self, reqs: list[Request], out, rows: list[tuple[int, int]]) -> None: ...
    def propose(self, reqs: list[Request], k: int) -> tuple[list[list[int]], list[list]]: ...
    def update(self, reqs: list[Request], vout, rows: list[tuple[int, int]], accepted: list[int],
               emitted: list[list[int]], argmax: torch.Tensor | None) -> None: ...
    def release(self, req: Request) -> None: ...


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



def target_state(head, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    return head.target_input(hidden, torch.cat(aux, dim=-1) if head.capture_layers else None)


def target_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))



class ChainProposer:
    """What chain proposers share: k drafts per round, k + 1 positions written, their own KV pool over
    the engine's block tables."""

    capture_layers: tuple[int, ...] = ()
    tree = False
    supports_k1 = False
    fused_round = False
    speculate_beside_prefill = True  # False: a step that admits (prefills) a request decodes plainly

    def check(self, k: int) -> None:
        return None

    def stats_depth(self, k: int) -> int:
        return k

    def lookahead(self, k: int) -> int:
        return k + 1

    @property
    def engine(self) -> Engine:
        """The engine attached last. Held weakly: the engine holds its proposer, and without a cycle between them a
        finished engine is freed at once, its KV pools back in paged.py's `PoolCache` for the next engine."""
        held = self.__dict__.get("_engine")
        return held() if isinstance(held, weakref.ref) else held

    @engine.setter
    def engine(self, engine: Engine) -> None:
        try:
            self._engine = weakref.ref(engine)
        except TypeError:  # a stand-in that cannot be referenced weakly (inference_eval/scoring.py's namespace)
            self._engine = engine

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def fuses(self) -> bool:
        """Whether the attached engine runs this proposer's greedy rounds as one graph (its compiled step and
        `k1_schedule` on, and `fused_round`: scheduler.py `_fused_round`) — its pages reach further (`lookahead`)."""
        e = self.engine
        return e is not None and e.static is not None and e.k1_schedule and self.fused_round

    def _pool(self, num_layers: int, args, dtype: torch.dtype) -> KVPool:
        e = self.engine
        if e.static is None:
            return KVPool.for_args(args, num_layers, e.num_blocks, e.block_size, dtype, e.device)
        # with the compiled step: its scratch block too (its padding rows write there), a pool lent for the engine's
        # life (paged.py `PoolCache`)
        pool = POOLS.lend(e, args, num_layers, e.num_blocks + 1, e.block_size, dtype, e.device)
        e.static.adopt(pool)
        return pool

    def release(self, req: Request) -> None:
        return None
