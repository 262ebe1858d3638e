"""A static-shape target step for the engine's plain decoding and its speculative verification, compiled with
`torch.compile` (`Engine(compile=...)`).

The eager target pass (scheduler.py `forward`) builds its attention metadata with the batch's own shapes — a
key index as long as the longest sequence, a mask as wide — so every step has new shapes and a compiler would
trace again each time. Here every shape is fixed by a bucket:

- the rows (one per sequence in a plain step, k + 1 per sequence in a verification) are padded to a power of two
  (`batch_bucket`); a padding row feeds token 0 at position 0, writes its
  key and value to a scratch slot that no sequence owns (the pool's extra block, `Engine` allocates it) and reads
  only that slot;
- the keys a row may see are its sequence's first K slots, K its block table's length rounded up to a power of
  two of blocks (`key_bucket`) — position i of a sequence is column i, so the mask is `column ≤ limit` (and
  inside the window of a sliding-window layer), computed in the graph; a row's limit is its own position (causal)
  or, for a block drafter's rows, the block's last position (non-causal within the block);
- the host builds the metadata once per step — tokens, positions, limits, write slots, the [B, K] key slots — and
  hands it over as one int64 tensor (one transfer on an accelerator); nothing inside the step depends on a value.

`StaticStep.run` compiles any pass over such metadata, one graph per key: the target step here, the whole k = 1 MTP
round (scheduler.py `_k1_graph`: the target's pass and the head's refresh over the head's pool under the same
metadata), every other greedy round (scheduler.py `_fused_graph`: with the next round's drafts, their rows picked
by the acceptance) and a block drafter's pass (block.py).

One compiled graph per (row bucket, key bucket, captured layers), compiled on first use (the seconds logged once per
bucket and summed in `compile_s`), the target's final norm and lm_head in it: the step returns the last hidden state,
the captured layers' inputs and the logits. The engine's
few-row fp32 linears stay the native kernel, as one operator of the graph (core/native.py `skinny_linear_op`).
On CUDA the compiled graph is captured as a CUDA graph (`mode="reduce-overhead"`, the pool's tensors marked static):
one launch per step instead of one per kernel — the engine's decode there is bound by launches (bench/gpu_check.py
measures both steps). Greedy and sampled tokens equal the eager step's in fp32 (tests/test_engine_compile.py,
tests/test_engine_compile_spec.py). On a CPU the compiled step is about 1.2x faster per step but takes minutes to
compile its buckets (docs/engine.md "Compiled target step"), so `compile: auto` compiles on CUDA only; `on` compiles
anywhere."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from inference_eval.engine.base import target_logits
from inference_eval.model import TargetOutput
from inference_eval.paged import KVPool

log = logging.getLogger(__name__)

COMPILE = ("auto", "on", "off")
LEAD = 4  # a metadata row's columns before its key slots: token, position, last position seen, write slot


def compile_enabled(setting: str, device: torch.device) -> bool:
    """`compile`: on, off, or auto (on CUDA, whose per-kernel launch cost a graph removes; off on a CPU, where a
    step's 1.2x gain repays minutes of compiling only on long jobs — docs/engine.md)."""
    if setting not in COMPILE:
        raise ValueError(f"engine compile={setting!r}: expected one of {', '.join(COMPILE)}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def batch_bucket(n: int) -> int:
    """The padded batch of `n` rows: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def key_bucket(blocks: int, block_size: int) -> int:
    """Key columns for sequences of at most `blocks` blocks: the next power of two of blocks, in slots."""
    return batch_bucket(max(blocks, 1)) * block_size


class StaticLayer:
    """Layer i's attention over the step's fixed metadata (a model's `cache.layer(i)`): writes the rows' keys and
    values to their slots, then attends over each row's K key columns."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, step: "StaticBatch") -> None:
        self.k_pool, self.v_pool, self.step = k_pool, v_pool, step

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, gqa: bool, window: int | None = None,
               scale: float | None = None, value_dim: int | None = None) -> torch.Tensor:
        """q [1, nH, B, d], k/v [1, nKV, B, d] (one row per sequence) → [1, nH, B, dv]."""
        st = self.step
        self.k_pool.index_copy_(0, st.write_slots, k[0].transpose(0, 1))
        if v is not None:
            self.v_pool.index_copy_(0, st.write_slots, v[0].transpose(0, 1))
        b, n_heads, d = st.key_slots.shape[0], q.shape[1], q.shape[3]
        kb = _gather(self.k_pool, st.key_slots)  # [B, nKV, K, d]
        vb = kb[..., :value_dim] if v is None else _gather(self.v_pool, st.key_slots)
        g = n_heads // kb.shape[1]
        visible = st.columns <= st.limits[:, None]  # [B, K]
        if window is not None:
            visible = visible & (st.positions[:, None] - st.columns < window)
        qb = q[0].transpose(0, 1).reshape(b, kb.shape[1], g, d)  # the g query heads of a key head as its rows
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible[:, None, None, :], scale=scale)
        return out.reshape(b, n_heads, out.shape[-1]).transpose(0, 1)[None]


def describe(key: tuple) -> str:
    """A bucket key in words: (rows, key slots, captured layers) of the target step, or (name, rows, key slots,
    captured layers) of another compiled pass."""
    name, (rows, keys, capture) = ("target step", key) if isinstance(key[0], int) else (key[0], key[1:])
    return f"{name} for {rows} rows × {keys} key slots" + (f", capturing layers {list(capture)}" if capture else "")


def _gather(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Slots `idx` [B, K] of a pool [S, nKV, d] → [B, nKV, K, d]."""
    return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, *pool.shape[1:]).transpose(1, 2)


class StaticBatch:
    """A step's metadata, unpacked in the graph from the one host tensor (`StaticStep.pack`): the rows' positions,
    the last position each row sees, write slots, each row's key slots, and the key columns."""

    def __init__(self, meta: torch.Tensor, pool: KVPool) -> None:
        self.positions, self.limits, self.write_slots = meta[:, 1], meta[:, 2], meta[:, 3]
        self.key_slots = meta[:, LEAD:]
        self.columns = torch.arange(self.key_slots.shape[1], device=meta.device)
        self.pool = pool

    def layer(self, i: int) -> StaticLayer:
        return StaticLayer(self.pool.k[i], self.pool.v[i], self)


class StaticStep:
    """The compiled target pass of `target` over `pool`, whose last block (`scratch_block`) no sequence owns: any
    number of rows, each a token at a position of a sequence (a plain step's one row per sequence; a verification's
    t_m and its drafts, k + 1 rows), every row attending to its sequence's keys up to its own position — the rows of
    one sequence written in the same step included, since every row's key and value is written before any row
    attends. A drafter's pool must hold the scratch block too (base.py `ChainProposer._pool`)."""

    def __init__(self, target, pool: KVPool, block_size: int, scratch_block: int) -> None:
        self.target, self.pool, self.block_size = target, pool, block_size
        self.scratch = scratch_block * block_size
        self.device = target.model.embed_tokens.weight.device
        self.compiled: dict[tuple, object] = {}  # key (static.py `describe`) → its compiled pass
        self.compile_s = 0.0
        self.steps = 0
        # on CUDA the graph is also captured as a CUDA graph (one launch a step); the pool it writes must then keep
        # its address, which marking it static promises the capture
        self.mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.adopt(pool)
        # one graph per bucket: dynamo keeps them all (its default of 8 per function would start evicting)
        import torch._dynamo.config as dynamo_config

        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)

    def adopt(self, pool: KVPool) -> None:
        """A pool the compiled passes write (the target's, a drafter's): on CUDA its tensors are marked static, so
        the CUDA graphs that write them keep their addresses instead of copying them in."""
        if self.device.type == "cuda":
            for t in (*pool.k, *pool.v):
                torch._dynamo.mark_static_address(t)

    def pack(self, ids: list[int] | None, positions: list[int], blocks: list[list[int]],
             limits: list[int] | None = None, rows: int | None = None) -> torch.Tensor:
        """The step's metadata as one int64 tensor [N', 4 + K] (N' = `rows`, by default the row bucket; K the key
        bucket of the longest block table): per row its token (0 where the tokens are on the device already),
        position, the last position it sees (`limits`; by default its own: causal), write slot and key slots —
        built on the host from the block tables' ids and put on the device in one copy."""
        n, bs = len(positions), self.block_size
        width = key_bucket(max(len(b) for b in blocks), bs)
        meta = torch.full((rows or batch_bucket(n), LEAD + width), self.scratch, dtype=torch.long)
        meta[:, :3] = 0  # padding rows: token 0 at position 0, keys and values in the scratch slot
        if ids is not None:
            meta[:n, 0] = torch.tensor(ids, dtype=torch.long)
        meta[:n, 1] = torch.tensor(positions, dtype=torch.long)
        meta[:n, 2] = meta[:n, 1] if limits is None else torch.tensor(limits, dtype=torch.long)
        offsets = torch.arange(bs)
        tables: dict[int, torch.Tensor] = {}
        for i, (p, table) in enumerate(zip(positions, blocks)):
            meta[i, 3] = table[p // bs] * bs + p % bs
            slots = tables.get(id(table))
            if slots is None:  # the rows of one sequence share its table
                slots = tables[id(table)] = (torch.tensor(table, dtype=torch.long)[:, None] * bs + offsets).flatten()
            meta[i, LEAD:LEAD + len(slots)] = slots
        return meta.to(self.device, non_blocking=True)

    def _step(self, ids: torch.Tensor, meta: torch.Tensor, capture: tuple[int, ...] = ()):
        batch = StaticBatch(meta, self.pool)
        out = self.target(ids[None], batch.positions[None], cache=batch, logits="none", capture_layers=capture)
        hidden = out.hidden[0]
        return hidden, tuple(a[0] for a in out.aux), target_logits(self.target, hidden)

    def forward(self, ids: list[int] | torch.Tensor, positions: list[int], blocks: list[list[int]],
                capture: tuple[int, ...] = ()) -> TargetOutput:
        """The target's pass over the rows (row i: token ids[i] at positions[i] of the sequence whose block table is
        `blocks[i]`), as the eager packed pass returns it — hidden [1, N, H], the captured layers' inputs — with the
        logits [N, V] too. `ids` may be on the device already (a draft the host has not read): then nothing of it
        is read back."""
        n = len(positions)
        meta = self.pack(ids if isinstance(ids, list) else None, positions, blocks)
        if isinstance(ids, list):
            row_ids = meta[:, 0]
        else:
            row_ids = torch.cat([ids.reshape(-1), ids.new_zeros(meta.shape[0] - n)])
        key = (meta.shape[0], meta.shape[1] - LEAD, tuple(capture))
        hidden, aux, logits = self.run(key, StaticStep._step, self, row_ids, meta, key[2])
        self.steps += 1
        return TargetOutput(hidden=hidden[:n][None], logits=logits[:n], aux=[a[:n][None] for a in aux])

    def run(self, key: tuple, fn, *args):
        """`fn(*args)` through its compiled graph for `key` (a shape bucket: one graph per key, fn's inputs of the
        bucket's shapes). A new key is compiled by a first run (after an eager one), timed apart (`compile_s`: a
        timed pass subtracts it); fn then runs again for its output, so fn must write the same values to the same
        slots on a rerun. With CUDA graphs the outputs are copies (a replay overwrites the graph's own)."""
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False, fullgraph=True, mode=self.mode)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            # eagerly once first: the GEMM form of each linear's rows is measured there, outside the graph, so the
            # graph computes them as the eager engine does (core/gemm_choice.py)
            fn(*args)
            compiled(*args)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
            self.compile_s += seconds
            self.compiled[key] = compiled
            log.info("engine: %s compiled in %.1f s", describe(key), seconds)
        out = compiled(*args)
        if self.mode:
            out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return out

    def logits(self, ids: list[int], positions: list[int], blocks: list[list[int]]) -> torch.Tensor:
        """[len(ids), V]: the target's logits for each row (a plain decode step: one row per sequence)."""
        return self.forward(ids, positions, blocks).logits
