"""The native paged-attention kernel (core/native.py `paged_attention`) and the paged layer's use of it
(inference_eval/paged.py): its values against softmax attention over the gathered keys (grouped heads, a head
size that is not a multiple of 16, values that are a prefix of the keys, sliding windows), every row computed
alone — the same bits in any batch and at any thread count —, and the choice made per sequence, so a decode
row's output does not depend on what else shares its forward."""

import pytest
import torch

from core import native
from core.timing import thread_budget
from inference_eval.paged import NATIVE_ATTN_ROWS, BlockAllocator, BlockTable, KVPool, PagedBatch, PagedLayer, SeqSlice

pytestmark = pytest.mark.unit


def reference(q, k_pool, v_pool, value_dim, table, seq, lo, hi, scale):
    """Softmax attention of each row over its gathered keys, in float64."""
    nh, n, _ = q.shape
    g = nh // k_pool.shape[1]
    out = []
    for r in range(n):
        slots = table[seq[r], lo[r]: hi[r]]
        keys = k_pool[slots].double()  # [m, nKV, d]
        values = keys[..., :value_dim] if v_pool is None else v_pool[slots].double()
        heads = []
        for h in range(nh):
            w = torch.softmax(keys[:, h // g] @ q[h, r].double() * scale, 0)
            heads.append(w @ values[:, h // g])
        out.append(torch.stack(heads))
    return torch.stack(out)


def problem(seed, n_kv=3, g=3, d=64, dv=None, slots=97, seqs=3, keys=40):
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(slots, n_kv, d, generator=gen)
    v_pool = None if dv == 0 else torch.randn(slots, n_kv, dv or d, generator=gen)
    table = torch.stack([torch.randperm(slots, generator=gen)[:keys] for _ in range(seqs)])
    rows = [(s, lo, hi) for s in range(seqs) for lo, hi in ((0, 1), (0, keys), (5, 17), (keys - 3, keys))]
    seq, lo, hi = (torch.tensor(x) for x in zip(*rows))
    q = torch.randn(n_kv * g, len(rows), d, generator=gen)
    return q, k_pool, v_pool, table, seq, lo, hi


@pytest.mark.parametrize("shape", [dict(), dict(d=20), dict(n_kv=1, g=4, d=48, dv=0), dict(n_kv=2, g=1, dv=32)],
                         ids=["gqa3_d64", "d20_tail", "values_in_keys", "mha_dv32"])
def test_the_kernel_is_softmax_attention_over_the_rows_keys(shape):
    assert native.available(), native.error()  # the test machines have a C compiler
    q, k_pool, v_pool, table, seq, lo, hi = problem(0, **shape)
    value_dim = 24 if v_pool is None else 0
    scale = q.shape[-1] ** -0.5
    got = native.paged_attention(q, k_pool, v_pool, value_dim, table, seq, lo, hi, scale)
    want = reference(q, k_pool, v_pool, value_dim, table, seq, lo, hi, scale)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    # a row that sees one key gets that key's value exactly
    one = (hi - lo == 1).nonzero()[0, 0]
    v = k_pool[..., :value_dim] if v_pool is None else v_pool
    assert torch.equal(got[one, 0], v[table[seq[one], lo[one]], 0])


def test_every_row_is_computed_alone_whatever_the_batch_and_threads():
    """Each row's output is bit-identical computed with the others, alone, in another order and on 1 or 2
    threads (the property the greedy-equality contracts rest on: a plain step's row and the same row verified
    among others)."""
    q, k_pool, v_pool, table, seq, lo, hi = problem(1)
    args = (k_pool, v_pool, 0, table)
    with thread_budget(2):
        together = native.paged_attention(q, *args, seq, lo, hi, 0.125)
    with thread_budget(1):
        one = native.paged_attention(q, *args, seq, lo, hi, 0.125)
        flipped = native.paged_attention(q.flip(1).contiguous(), *args, seq.flip(0), lo.flip(0), hi.flip(0), 0.125)
        for r in (0, 5, q.shape[1] - 1):
            alone = native.paged_attention(q[:, r: r + 1].contiguous(), *args, seq[r: r + 1], lo[r: r + 1],
                                           hi[r: r + 1], 0.125)
            assert torch.equal(alone[0], together[r])
    assert torch.equal(one, together) and torch.equal(flipped.flip(0), together)


def paged_setup(lengths, n_kv=3, d=64, block_size=4, seed=0):
    pool = KVPool(1, 64, block_size, n_kv, d, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    alloc, tables = BlockAllocator(64), []
    for n in lengths:
        t = BlockTable(block_size)
        t.extend(alloc.allocate(-(-n // block_size)))
        tables.append(t)
    tables[0].blocks.reverse()  # scattered blocks
    tables[0].slots = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in tables[0].blocks])
    return pool, tables


def attend(pool, slices, q, k, v, window=None, native_on=True):
    batch = PagedBatch(slices)
    if not native_on:
        batch.native = [False] * len(slices)
    layer = PagedLayer(pool.k[0], pool.v[0], batch)
    with torch.inference_mode():
        return layer.attend(q, k, v, True, window=window)


@pytest.mark.parametrize("window", [None, 6])
def test_the_paged_layer_takes_the_kernel_per_sequence(window):
    """Decode and verification rows (causal, ≤ NATIVE_ATTN_ROWS per sequence) go through the kernel and match
    the SDPA path (same function, other summation order); a decode row gives the same bits whether it shares its
    forward with a prefill, with a tree-masked sequence or with nothing; a prefill longer than NATIVE_ATTN_ROWS
    and a masked sequence stay on SDPA."""
    pool, tables = paged_setup([30, 30, 40])
    gen = torch.Generator().manual_seed(3)
    nh, n_kv, d = 9, 3, 64

    def rows(n):
        return (torch.randn(1, nh, n, d, generator=gen), torch.randn(1, n_kv, n, d, generator=gen),
                torch.randn(1, n_kv, n, d, generator=gen))

    q0, k0, v0 = rows(1)  # sequence 0: one decode row at position 20
    q1, k1, v1 = rows(4)  # sequence 1: four verified rows at 12..15
    qp, kp, vp = rows(NATIVE_ATTN_ROWS + 4)  # sequence 2: a prefill of 20 rows
    decode, verify = SeqSlice(tables[0], 20, 1), SeqSlice(tables[1], 12, 4)
    prefill = SeqSlice(tables[2], 0, NATIVE_ATTN_ROWS + 4)
    assert PagedBatch([decode, verify]).native == [True, True]
    assert PagedBatch([decode, prefill]).native == [True, False]
    cat = lambda *ts: torch.cat(ts, dim=2)  # noqa: E731
    both = attend(pool, [decode, verify], cat(q0, q1), cat(k0, k1), cat(v0, v1), window)
    sdpa = attend(pool, [decode, verify], cat(q0, q1), cat(k0, k1), cat(v0, v1), window, native_on=False)
    torch.testing.assert_close(both, sdpa, rtol=0, atol=2e-6)
    assert not torch.equal(both, sdpa)  # the kernel ran: its summation order is not SDPA's
    alone = attend(pool, [decode], q0, k0, v0, window)
    with_prefill = attend(pool, [decode, prefill], cat(q0, qp), cat(k0, kp), cat(v0, vp), window)
    masked = SeqSlice(tables[1], 12, 4, mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]],
                                                           dtype=torch.bool))
    with_tree = attend(pool, [decode, masked], cat(q0, q1), cat(k0, k1), cat(v0, v1), window)
    for out in (both, with_prefill, with_tree):
        assert torch.equal(out[:, :, :1], alone)
    # the prefill's rows and the tree's rows: SDPA's values, as with the kernel off
    torch.testing.assert_close(with_prefill[:, :, 1:], attend(pool, [decode, prefill], cat(q0, qp), cat(k0, kp),
                                                              cat(v0, vp), window, native_on=False)[:, :, 1:],
                               rtol=0, atol=0)
    torch.testing.assert_close(with_tree[:, :, 1:], attend(pool, [decode, masked], cat(q0, q1), cat(k0, k1),
                                                           cat(v0, v1), window, native_on=False)[:, :, 1:],
                               rtol=0, atol=0)
