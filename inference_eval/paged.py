"""Paged KV cache (docs/design.md §5): a pool of fixed-size blocks per layer, per-sequence block tables,
slot mapping, and the attention metadata of one packed (varlen) forward.

A slot is `block * block_size + offset`; position p of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size`. The target, the draft head and a draft model
each own a `KVPool` (their own layers) over the *same* block ids: one allocation per sequence serves
all of them, so the draft advances in lock-step with the target.

A forward runs the rows of several sequences packed into one `[1, N]` batch (no padding in the
linear layers). `SeqSlice` says, for one sequence, where its rows go and what they see:

- keys at positions `< base` (the committed context) are all visible;
- the `n` new rows are written at positions `base + offset .. base + offset + n - 1`;
- keys at positions `base .. base + offset + n - 1` are visible through `mask` `[n, offset + n]`
  (None: every earlier one and causal among the new rows) — the tree attention of a draft tree,
  or a draft step that must see only its own ancestors.

Sliding-window layers (Gemma 3) pass their `window` to `attend`: the batch then also hides the keys
more than `window - 1` positions behind each query (every block is kept; out-of-window keys are only
masked). A query's position is `base` plus the number of new-region keys it sees, minus one — its
slot position for a chain, its depth for a draft tree whose root is the first new row; keys are at
their slot positions, exact for every key of the committed context.

On a float32 CPU pool, the rows of a sequence with at most `NATIVE_ATTN_ROWS` new rows and no mask (decode,
a chain's verification) are attended by the native kernel (core/native.py `paged_attention`): each row reads
its visible keys where they lie in the pool — no gather, no padding — and is computed alone in a fixed order,
so its output does not depend on the batch it is in (a plain step's row equals the same row verified among k
others, bit for bit). Every other row is attended in torch: when padding the query rows of all sequences to the
longest would more than double them (prefills of different lengths), or there is one sequence with several rows,
each sequence is one SDPA call over exactly its own keys (causal fast path for a fresh prefill); otherwise the
queries and each sequence's keys are gathered into one padded `[B, ...]` SDPA call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core import native
from heads.layers import causal_mask
from inference_eval import fused

# a sequence's rows in a forward up to this many (decode, verification) are attended by the native kernel on a
# float32 CPU pool, when they see a causal prefix of their sequence (module docstring)
NATIVE_ATTN_ROWS = 16


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """A free list of block ids (lowest id first)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks requested, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        if len(set(self._free)) != len(self._free):
            raise RuntimeError("a block was released twice")


class KVPool:
    """Keys and values of `num_layers` layers in `num_blocks × block_size` slots: `[slots, n_kv, d]`
    (values `[slots, n_kv, value_dim]` when given: 0 for DeepSeek-V2's latent, whose values are a
    prefix of its keys)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", value_dim: int | None = None) -> None:
        shape = (num_blocks * block_size, n_kv, head_dim)
        v_shape = shape if value_dim is None else (*shape[:2], value_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    @classmethod
    def for_args(cls, args, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "KVPool":
        """A pool in the cache layout a model's args give (`LlamaArgs.kv_layout`: per-head K and V, or
        a family's own, e.g. DeepSeek-V2's compressed latent)."""
        n_kv, key_dim, value_dim = args.kv_layout()
        return cls(num_layers, num_blocks, block_size, n_kv, key_dim, dtype, device, value_dim)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move the entries of slots `src` to slots `dst` in every layer (tree compaction)."""
        for pool in (*self.k, *self.v):
            pool.index_copy_(0, dst, pool.index_select(0, src))


class PoolCache:
    """The KV pools of engines with a compiled step, lent again once their engine is gone. A compiled pass's CUDA
    graph is recorded against the addresses of the pools it writes: an engine on a pool an earlier engine used
    replays the graphs recorded then, where a new pool would record every graph again (with its memory) — and an
    evaluation builds an engine per timed pass. Two live engines never share a pool. An engine is freed as soon as it
    is dropped (nothing it owns refers back to it: its proposer holds it weakly, its compiled passes are functions
    of it, not methods bound to it), except one whose steps compiled a new graph, which dynamo's tracing state holds
    in a cycle until the collector runs; no collection is forced here (a full one takes a large part of a second
    with torch loaded)."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[KVPool]] = {}
        self.made = 0

    def lend(self, owner, args, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> KVPool:
        """A pool of this layout for `owner` (an engine), back in the cache when the owner is collected."""
        key = (args.kv_layout(), num_layers, num_blocks, block_size, dtype, str(device))
        free = self.free.setdefault(key, [])
        if free:
            pool = free.pop()
        else:
            pool = KVPool.for_args(args, num_layers, num_blocks, block_size, dtype, device)
            self.made += 1
        weakref.finalize(owner, free.append, pool)
        return pool


POOLS = PoolCache()


class BlockTable:
    """The blocks of one sequence, and its position → slot map."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.slots = torch.empty(0, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def extend(self, blocks: list[int]) -> None:
        self.blocks.extend(blocks)
        new = torch.tensor(blocks, dtype=torch.long, device=self.slots.device)[:, None] * self.block_size
        self.slots = torch.cat([self.slots, (new + torch.arange(self.block_size, device=new.device)).flatten()])

    def clear(self) -> list[int]:
        blocks, self.blocks = self.blocks, []
        self.slots = self.slots[:0]
        return blocks


@dataclass
class SeqSlice:
    """One sequence's rows in a packed forward; see the module docstring."""

    table: BlockTable
    base: int
    n: int
    offset: int = 0
    mask: torch.Tensor | None = None  # [n, offset + n] bool

    @property
    def end(self) -> int:
        return self.base + self.offset + self.n


class PagedBatch:
    """Attention metadata of one packed forward, built once and shared by every layer."""

    # a forward whose padded query block would be this much larger than its rows runs per sequence
    PAD_LIMIT = 2.0

    def __init__(self, seqs: list[SeqSlice], device: torch.device | str = "cpu",
                 per_sequence: bool | None = None) -> None:
        self.seqs = seqs
        self._window_masks: dict[int, list[torch.Tensor | None]] = {}
        for s in seqs:
            if s.end > s.table.capacity:
                raise OutOfBlocks(f"a sequence needs slots up to position {s.end}, its blocks hold {s.table.capacity}")
            if s.mask is not None and tuple(s.mask.shape) != (s.n, s.offset + s.n):
                raise ValueError(f"mask shape {tuple(s.mask.shape)}, expected {(s.n, s.offset + s.n)}")
        self.num_rows = sum(s.n for s in seqs)
        self.write_slots = torch.cat([s.table.slots[s.base + s.offset: s.end] for s in seqs])
        # the sequences whose rows the native kernel attends (decided per sequence: a row's path never depends on
        # the other sequences of its batch)
        self.native = [s.mask is None and s.n <= NATIVE_ATTN_ROWS and s.table.slots.device.type == "cpu"
                       for s in seqs]
        self._native_plans: dict[int | None, tuple[torch.Tensor, ...]] = {}
        self._native_table: torch.Tensor | None = None
        b, t_max = len(seqs), max(s.n for s in seqs)
        if per_sequence is None:
            per_sequence = (b == 1 and t_max > 1) or b * t_max > self.PAD_LIMIT * self.num_rows
        self.per_sequence = per_sequence
        self._device = device
        self._masks: list[torch.Tensor | None] | None = None
        if self.per_sequence:
            self.row_start = [0]
            for s in seqs:
                self.row_start.append(self.row_start[-1] + s.n)
            self.key_slots = [s.table.slots[: s.end] for s in seqs]
            return
        # every sequence with the same number of rows (decode, verification): queries reshape in place
        self.uniform = all(s.n == t_max for s in seqs)
        self.t_max = t_max
        self._padded_meta: tuple[torch.Tensor, ...] | None = None
        self._grouped: dict[tuple[int, int | None], torch.Tensor] = {}

    @property
    def masks(self) -> list[torch.Tensor | None]:
        """Per sequence, the [n, end] mask of the keys its rows see; None for a fresh causal prefill on the
        per-sequence path (SDPA's is_causal, no mask built). Built on first use: a forward whose rows all go to the
        native kernel needs none."""
        if self._masks is None:
            self._masks = [None if self.per_sequence and s.base == 0 and s.offset == 0 and s.mask is None
                           else self._mask(s, s.end, self._device) for s in self.seqs]
        return self._masks

    def padded_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded path's (kv_idx [B, K], q_idx [B, T], mask [B, 1, T, K], unpad [N]), built on first use."""
        if self._padded_meta is None:
            self._padded_meta = self._build_padded()
            self._grouped[(1, None)] = self._padded_meta[2]
        return self._padded_meta

    def _build_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, device, t_max = self.seqs, self._device, self.t_max
        b, k_max = len(seqs), max(s.end for s in seqs)
        kv_idx = torch.zeros(b, k_max, dtype=torch.long, device=device)
        q_idx = torch.full((b, t_max), self.num_rows, dtype=torch.long, device=device)  # row N: a zero row
        mask = torch.zeros(b, 1, t_max, k_max, dtype=torch.bool, device=device)
        mask[:, 0, :, 0] = True  # padded query rows see one key (no NaN); their output is dropped
        unpad, row = [], 0
        for i, s in enumerate(seqs):
            kv_idx[i, : s.end] = s.table.slots[: s.end]
            q_idx[i, : s.n] = torch.arange(row, row + s.n, device=device)
            mask[i, 0, : s.n] = False
            mask[i, 0, : s.n, : s.end] = self.masks[i]
            unpad.append(torch.arange(i * t_max, i * t_max + s.n, device=device))
            row += s.n
        return kv_idx, q_idx, mask, torch.cat(unpad)

    def grouped_mask(self, g: int, window: int | None = None) -> torch.Tensor:
        """The padded path's mask for `grouped_attention` with g query heads per key head (and a sliding
        `window`), built once per batch (every such layer of the target and the drafter shares it)."""
        if window is not None and max(s.end for s in self.seqs) <= window:
            window = None  # no key can be out of the window
        mask = self.padded_meta()[2]
        if (g, window) not in self._grouped:
            if window is None:
                self._grouped[(g, None)] = mask.repeat(1, 1, g, 1)
            else:
                q_pos = torch.zeros(len(self.seqs), self.t_max, dtype=torch.long, device=mask.device)
                for i, s in enumerate(self.seqs):  # padded rows stay at 0: they keep seeing key 0
                    q_pos[i, : s.n] = self._query_positions(s, mask.device)
                keys = torch.arange(mask.shape[-1], device=mask.device)
                near = (q_pos[:, None, :, None] - keys) < window  # [B, 1, T, K]
                self._grouped[(g, window)] = (mask & near).repeat(1, 1, g, 1)
        return self._grouped[(g, window)]

    def window_masks(self, window: int | None) -> list[torch.Tensor | None]:
        """The per-sequence path's masks (`masks`), with a sliding `window` applied."""
        if window is None:
            return self.masks
        if window not in self._window_masks:
            out = []
            for s, m in zip(self.seqs, self.masks):
                if s.end <= window:  # every visible key is inside the window
                    out.append(m)
                    continue
                device = s.table.slots.device if m is None else m.device
                m = causal_mask(s.n, s.end, device=device) if m is None else m
                near = (self._query_positions(s, device)[:, None] - torch.arange(s.end, device=device)) < window
                out.append(m & near)
            self._window_masks[window] = out
        return self._window_masks[window]

    def native_plan(self, window: int | None) -> tuple[torch.Tensor, ...]:
        """The native kernel's metadata for the rows it attends (`native`), built once per batch and window:
        (their indices among the packed rows, every sequence's slots [B, K], per row its sequence and the key
        positions it sees, [lo, hi) — a sliding `window` hides the keys `window` or more behind the row)."""
        if window not in self._native_plans:
            rows, seq, lo, hi = [], [], [], []
            row = 0
            for i, s in enumerate(self.seqs):
                if self.native[i]:
                    first = s.base + s.offset
                    rows.extend(range(row, row + s.n))
                    seq.extend([i] * s.n)
                    hi.extend(range(first + 1, first + s.n + 1))
                    lo.extend(0 if window is None else max(0, p - window) for p in range(first + 1, first + s.n + 1))
                row += s.n
            if self._native_table is None:  # the slots do not depend on the window: one table per batch
                self._native_table = torch.zeros(len(self.seqs), max(s.end for s in self.seqs), dtype=torch.long)
                for i, s in enumerate(self.seqs):
                    if self.native[i]:
                        self._native_table[i, : s.end] = s.table.slots[: s.end]
            self._native_plans[window] = tuple(torch.tensor(x, dtype=torch.long) for x in (rows, seq, lo, hi)) + (
                self._native_table,)
        return self._native_plans[window]

    @staticmethod
    def _query_positions(s: SeqSlice, device) -> torch.Tensor:
        """[n] positions of a sequence's new rows, as the sliding window counts them (module docstring)."""
        if s.mask is None:
            return torch.arange(s.base + s.offset, s.end, device=device)
        return s.base + s.mask.to(device).sum(-1) - 1

    @staticmethod
    def _mask(s: SeqSlice, end: int, device) -> torch.Tensor:
        m = torch.zeros(s.n, end, dtype=torch.bool, device=device)
        m[:, : s.base] = True
        if s.mask is None:
            m[:, s.base:] = torch.ones(s.n, s.offset + s.n, dtype=torch.bool, device=device).tril(s.offset)
        else:
            m[:, s.base:] = s.mask.to(device)
        return m


class PagedLayer:
    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: PagedBatch) -> None:
        self.k_pool, self.v_pool, self.batch = k_pool, v_pool, batch

    def run_layer(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """A whole decoder layer on this batch's rows in one native call (inference_eval/fused.py `run_layer`), or
        None where that does not apply (the layer then runs its torch path, which gives the same bits)."""
        return fused.run_layer(layer, x, cos, sin, self)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, gqa: bool, window: int | None = None,
               scale: float | None = None, value_dim: int | None = None) -> torch.Tensor:
        """q [1, nH, N, d], k/v [1, nKV, N, d] of the packed rows → attention output [1, nH, N, d];
        the rows' keys and values are written to their slots first. `window`: a sliding-window layer's;
        `scale`: the scores' scale (None: d^-0.5). `v=None`: the values are the keys' first `value_dim`
        channels (DeepSeek-V2's absorbed MLA: one pool holds the latent), output [1, nH, N, value_dim]."""
        meta = self.batch
        self.k_pool.index_copy_(0, meta.write_slots, k[0].transpose(0, 1))
        if v is not None:
            self.v_pool.index_copy_(0, meta.write_slots, v[0].transpose(0, 1))
        own = self._native(q, v is None, window, scale, value_dim) if any(meta.native) else None  # [rows, nH, dv]
        if own is not None and all(meta.native):
            return own.permute(1, 0, 2)[None]
        if own is not None:
            if meta.per_sequence:  # the kernel's sequences taken from its output, the others attended below
                starts = [0]
                for i, s in enumerate(meta.seqs):
                    starts.append(starts[-1] + (s.n if meta.native[i] else 0))
            else:  # the padded call attends every row; the kernel's rows then take the kernel's values
                rows = meta.native_plan(window)[0]
                return self._padded(q, v is None, window, scale, value_dim).index_copy(2, rows,
                                                                                      own.permute(1, 0, 2)[None])
        if meta.per_sequence:
            outs = []
            masks = meta.window_masks(window)
            for i, s in enumerate(meta.seqs):
                if own is not None and meta.native[i]:
                    outs.append(own[starts[i]: starts[i + 1]].permute(1, 0, 2)[None])
                    continue
                qs = q[:, :, meta.row_start[i]: meta.row_start[i + 1]]
                ks = self._gather(self.k_pool, meta.key_slots[i][None])
                vs = ks[..., :value_dim] if v is None else self._gather(self.v_pool, meta.key_slots[i][None])
                outs.append(F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=masks[i], is_causal=masks[i] is None, scale=scale, enable_gqa=gqa))
            return torch.cat(outs, dim=2)
        return self._padded(q, v is None, window, scale, value_dim)

    def _native(self, q: torch.Tensor, v_none: bool, window: int | None, scale: float | None,
                value_dim: int | None) -> torch.Tensor | None:
        """The kernel's rows attended by it ([rows, nH, dv]), or None where it does not apply: a pool or query
        that is not float32 on the CPU, a traced graph, autograd, the kernel not built."""
        if (q.dtype != torch.float32 or self.k_pool.dtype != torch.float32 or q.device.type != "cpu"
                or torch.compiler.is_compiling() or torch.is_grad_enabled() or not native.available()
                or self.k_pool.stride(2) != 1 or self.v_pool.stride(2) != 1):
            return None
        rows, seq, lo, hi, table = self.batch.native_plan(window)
        qn = q[0] if len(rows) == q.shape[2] else q[0].index_select(1, rows)
        return native.paged_attention(qn.contiguous(), self.k_pool, None if v_none else self.v_pool,
                                      value_dim or 0, table, seq, lo, hi,
                                      q.shape[-1] ** -0.5 if scale is None else scale)

    def _padded(self, q: torch.Tensor, v_none: bool, window: int | None, scale: float | None,
                value_dim: int | None) -> torch.Tensor:
        """Every row through one padded SDPA call over each sequence's gathered keys."""
        meta = self.batch
        kv_idx, q_idx, _, unpad = meta.padded_meta()
        n_heads, d = q.shape[1], q.shape[3]
        b = len(meta.seqs)
        if meta.uniform:
            qb = q[0].view(n_heads, b, meta.t_max, d).transpose(0, 1)  # [B, nH, T, d]
        else:
            rows = torch.cat([q[0].transpose(0, 1), q.new_zeros(1, n_heads, d)])  # [N+1, nH, d]
            qb = rows[q_idx].transpose(1, 2)
        kb = self._gather(self.k_pool, kv_idx)  # [B, nKV, K, d]
        vb = kb[..., :value_dim] if v_none else self._gather(self.v_pool, kv_idx)
        out = grouped_attention(qb, kb, vb, meta.grouped_mask(n_heads // kb.shape[1], window), scale)  # [B, nH, T, dv]
        dv = out.shape[-1]
        if meta.uniform:
            return out.transpose(0, 1).reshape(n_heads, b * meta.t_max, dv)[None]
        out = out.transpose(1, 2).reshape(-1, n_heads, dv)[unpad]  # [N, nH, dv]
        return out.transpose(0, 1)[None]

    @staticmethod
    def _gather(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Slots `idx` [B, K] of a pool [S, nKV, d] → [B, nKV, K, d] (index_select: several times
        faster than advanced indexing on CPU)."""
        return pool.index_select(0, idx.reshape(-1)).view(*idx.shape, *pool.shape[1:]).transpose(1, 2)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """SDPA with a boolean mask, q [B, nH, T, d], k/v [B, nKV, K, d]. The g = nH/nKV query heads that
    share a key head are folded into its query rows ([B, nKV, g·T, d]), so each key head is one SDPA
    problem with g·T queries: the same result as `enable_gqa`, and on CPU several times faster for the
    few query rows of decode and verification (bf16 single-query SDPA is slow). `mask` is
    [B, 1, g·T, K]: the [B, 1, T, K] mask repeated g times along the rows (`PagedBatch.grouped_mask`)."""
    b, n_heads, t, d = q.shape
    g = n_heads // k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, k.shape[1], g * t, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, n_heads, t, v.shape[-1])  # CUDA's SDPA may return a non-contiguous layout: view fails there


class PagedCache:
    """What a model's forward takes as `cache`: `layer(i)` gives layer i's paged view of this batch."""

    def __init__(self, pool: KVPool, batch: PagedBatch) -> None:
        self.pool, self.batch = pool, batch

    def layer(self, i: int) -> PagedLayer:
        return PagedLayer(self.pool.k[i], self.pool.v[i], self.batch)


class PackedRows:
    """Varlen prefill without a KV cache (precompute): several samples packed back to back in one
    row, each attending causally to itself only, so no token is padding. Passed to a model's forward
    as `cache`, with each sample's positions restarting at 0 (`positions()`)."""

    def __init__(self, lengths: list[int]) -> None:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sample lengths must be ≥ 1, got {lengths}")
        self.lengths = [int(n) for n in lengths]
        self.bounds = [0]
        for n in self.lengths:
            self.bounds.append(self.bounds[-1] + n)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, N] positions, 0..n-1 for each sample."""
        return torch.cat([torch.arange(n, device=device) for n in self.lengths])[None]

    def layer(self, i: int) -> "PackedRows":
        return self

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, window: int | None = None,
               scale: float | None = None) -> torch.Tensor:
        """q [1, nH, N, d], k/v [1, nKV, N, d] → [1, nH, N, d], causal within each sample (and within
        a sliding `window`; `scale` as in PagedLayer.attend)."""
        if q.shape[2] != self.bounds[-1]:
            raise ValueError(f"packed forward of {q.shape[2]} rows, the samples hold {self.bounds[-1]}")

        def one(a: int, b: int) -> torch.Tensor:
            mask = None if window is None or b - a <= window else causal_mask(b - a, b - a, window, q.device)
            return F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask,
                                                  is_causal=mask is None, scale=scale, enable_gqa=gqa)

        if len(self.lengths) == 1:
            return one(0, self.bounds[-1])
        return torch.cat([one(a, b) for a, b in zip(self.bounds, self.bounds[1:])], dim=2)
