"""A small C kernel for the few-row fp32 linears of CPU decoding (`heads.layers.linear`).

Decode, verification and drafting multiply a handful of rows by every weight matrix of the model.
That is memory-bound work, and MKL's GEMM does it poorly: at SmolLM2's shapes it reads the weights at
10-15 GB/s where this machine streams 27-40. `skinny_linear` reads each weight row once, keeps it
in L1 while it meets every input row (register blocks of 2 weight rows × 8 input rows from 8 rows on, 4 × 4/2/1
below) and prefetches the rows ahead (into L1 below 8 input rows, into L2 from 8). SmolLM2 decode steps (2 threads)
take a third less time at batch 8 and an eighth less at batch 1 (docs/engine.md). Without AVX-512 the
16-lane sums run as two 8-lane halves (same values, bit for bit): GCC's own lowering of the 64-byte
vector spilled there and made the kernel 4-5x slower than torch at 4-48 rows on an AVX2 EPYC.

Every output is one dot product in a fixed order (16-lane partial sums over k, a fixed-order tree
over the lanes, then the tail), each multiply-add an explicit fused one (the compiler's own contraction
is off): row i of a batch is bit-identical to row i computed alone, whatever the other rows are, and
the AVX-512, AVX2 and no-FMA builds give the same bits. F.linear gives no such promise (MKL picks its
blocking by batch size).

`skinny_linear_bf16` reads bf16 weights (a float32 model whose weights are stored in bf16,
`LlamaForCausalLM.store_weights`), widening each 16-lane load exactly with a 16-bit shift: the same
loops, half the bytes streamed, the output bit-identical to the fp32 kernel's on the widened weight.

The source below is compiled once per CPU and compiler with the system C compiler (`$CC`, default
`cc`; `-O3 -march=native -fopenmp`) into `<SPECHEAD_CACHE>/native/`, written atomically. It links
the OpenMP runtime torch already loaded, and runs on torch's intra-op thread count. Without a
compiler (or with `SPECHEAD_NATIVE=0`) `available()` is False and the callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from core.paths import cache_dir

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t h16 __attribute__((vector_size(32)));
typedef uint32_t u16 __attribute__((vector_size(64)));
typedef uint16_t h8 __attribute__((vector_size(16)));
typedef uint32_t u8 __attribute__((vector_size(32)));

/* Every multiply-add is one explicit fused multiply-add (the build turns off the compiler's own contraction,
   -ffp-contract=off): whether a product is rounded before its add never depends on how the compiler scheduled
   a loop, so the fp32 and the bf16 weight paths, and the AVX-512 and AVX2 branches, give the same bits. */
#if defined(__FMA__)
static inline v8 fma8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 fma8(v8 a, v8 b, v8 c) {
    v8 r; for (int i = 0; i < 8; ++i) r[i] = fmaf(a[i], b[i], c[i]); return r;
}
#endif
#if defined(__AVX512F__)
static inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
static inline v16 fma16(v16 a, v16 b, v16 c) {  /* as two 8-lane halves: the same lanes, the same bits */
    v8 al, ah, bl, bh, cl, ch; memcpy(&al, &a, 32); memcpy(&ah, (char *)&a + 32, 32);
    memcpy(&bl, &b, 32); memcpy(&bh, (char *)&b + 32, 32); memcpy(&cl, &c, 32); memcpy(&ch, (char *)&c + 32, 32);
    v8 rl = fma8(al, bl, cl), rh = fma8(ah, bh, ch); v16 r; memcpy(&r, &rl, 32); memcpy((char *)&r + 32, &rh, 32);
    return r;
}
#endif

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
/* Weights are fp32 (bf = 0) or bf16 (bf = 1: the top half of an fp32, widened exactly by a 16-bit shift).
   Either way the products and sums are fp32, in the same order: a bf16 weight gives the values of the
   fp32 kernel on that weight widened to fp32, bit for bit. `bf` is a constant in each exported function,
   so the compiler keeps one loop per weight type. */
static inline v16 ldw(const void *w, int64_t i, const int bf) {
    if (!bf) return ld((const float *)w + i);
    h16 h; memcpy(&h, (const uint16_t *)w + i, sizeof h);
    u16 u = __builtin_convertvector(h, u16) << 16; v16 v; memcpy(&v, &u, sizeof v); return v;
}
static inline v8 ldw8(const void *w, int64_t i, const int bf) {
    if (!bf) return ld8((const float *)w + i);
    h8 h; memcpy(&h, (const uint16_t *)w + i, sizeof h);
    u8 u = __builtin_convertvector(h, u8) << 16; v8 v; memcpy(&v, &u, sizeof v); return v;
}
static inline float w1(const void *w, int64_t i, const int bf) {
    if (!bf) return ((const float *)w)[i];
    uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline const void *wrow(const void *w, int64_t n, int64_t k, const int bf) {
    return (const char *)w + n * k * (bf ? 2 : 4);
}

static inline float lanes(v16 a) {  /* fixed-order tree over the 16 lanes */
    v8 lo, hi; memcpy(&lo, &a, 32); memcpy(&hi, (const char *)&a + 32, 32);
    v8 s8 = lo + hi;
    v4 l4, h4; memcpy(&l4, &s8, 16); memcpy(&h4, (const char *)&s8 + 16, 16);
    v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float finish(v16 a, const void *w, const float *x, int64_t from, int64_t k, const float *bias, int64_t n,
                           const int bf) {
    float s = lanes(a);
    for (int64_t i = from; i < k; ++i) s = fmaf(w1(w, i, bf), x[i], s);
    return bias ? s + bias[n] : s;
}

/* Weight rows prefetched ahead, and where to: below 8 input rows a weight row meets few FMAs, so it is fetched
   into L1 8 rows ahead (1.12-1.16x faster at 1-4 rows than 32 rows ahead into L2, measured on an AVX-512 Xeon,
   one thread: faster than F.linear at one row); from 8 input rows into L2, 16 rows ahead. */
#define AHEAD_NARROW 8
#define AHEAD_WIDE 16

/* Q input rows from r (Q ≤ 8) against P weight rows ws (P ≤ 4): P·Q independent accumulators. */
static inline __attribute__((always_inline)) void rows_block(
        const void *const ws[4], const int P, const float *x, int64_t r, const int Q, int64_t k, int64_t kv,
        const void *pf, const int l1, const float *bias, float *out, int64_t n_out, int64_t n0, const int bf) {
    const float *xs[8];
    for (int q = 0; q < Q; ++q) xs[q] = x + (r + q) * k;
#ifdef __AVX512F__
    v16 a[4][8];
    for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) a[p][q] = (v16){0};
    for (int64_t i = 0; i < kv; i += 16) {
        if (pf)
            for (int p = 0; p < P; ++p) {
                const char *a = (const char *)wrow(pf, p, k, bf) + i * (bf ? 2 : 4);
                if (l1) __builtin_prefetch(a, 0, 3); else __builtin_prefetch(a, 0, 2);
            }
        v16 wv[4];
        for (int p = 0; p < P; ++p) wv[p] = ldw(ws[p], i, bf);
        for (int q = 0; q < Q; ++q) {
            v16 xv = ld(xs[q] + i);
            for (int p = 0; p < P; ++p) a[p][q] = fma16(wv[p], xv, a[p][q]);
        }
    }
#else
    /* Without AVX-512 a 16-lane vector is two 8-lane registers, and GCC's lowering of the 64-byte type
       spills (measured on an AVX2 EPYC: 4-5x slower than torch at 4-48 rows). The same 16 lanes, kept
       as explicit halves: every lane sums the same products in the same order, so the result is
       bit-identical to the branch above. */
    v8 lo[4][8], hi[4][8];
    for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) { lo[p][q] = (v8){0}; hi[p][q] = (v8){0}; }
    for (int64_t i = 0; i < kv; i += 16) {
        if (pf)
            for (int p = 0; p < P; ++p) {
                const char *a = (const char *)wrow(pf, p, k, bf) + i * (bf ? 2 : 4);
                if (l1) __builtin_prefetch(a, 0, 3); else __builtin_prefetch(a, 0, 2);
            }
        v8 wl[4], wh[4];
        for (int p = 0; p < P; ++p) { wl[p] = ldw8(ws[p], i, bf); wh[p] = ldw8(ws[p], i + 8, bf); }
        for (int q = 0; q < Q; ++q) {
            v8 xl = ld8(xs[q] + i), xh = ld8(xs[q] + i + 8);
            for (int p = 0; p < P; ++p) { lo[p][q] = fma8(wl[p], xl, lo[p][q]); hi[p][q] = fma8(wh[p], xh, hi[p][q]); }
        }
    }
    v16 a[4][8];
    for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) { memcpy(&a[p][q], &lo[p][q], 32); memcpy((char *)&a[p][q] + 32, &hi[p][q], 32); }
#endif
    for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q)
            out[(r + q) * n_out + n0 + p] = finish(a[p][q], ws[p], xs[q], kv, k, bias, n0 + p, bf);
}

/* out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]); x [rows, k], w [n_out, k], out [rows, n_out], all
   contiguous, x, bias and out fp32. Register blocks: 2 weight rows × 8 input rows from 8 rows on (then
   4, 2, 1 for the rest), else 4 weight rows × 4, 2, 1 input rows — measured best on both sides of 8. The
   blocking changes which rows share a pass, never the order of a dot product. */
static inline __attribute__((always_inline)) void linear_rows(
        const float *x, const void *w, const float *bias, float *out, int64_t rows, int64_t n_out, int64_t k,
        int32_t threads, const int bf) {
    const int wide = rows >= 8;
    const int64_t kv = k / 16 * 16, nb = wide ? 2 : 4, blocks = (n_out + nb - 1) / nb;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t n0 = blk * nb;
        if (n0 + nb > n_out) {  /* the last, partial block: one weight row at a time */
            for (int64_t n = n0; n < n_out; ++n) {
                const void *wn = wrow(w, n, k, bf);
                for (int64_t r = 0; r < rows; ++r) {
                    const float *xr = x + r * k;
                    v16 a = {0};
                    for (int64_t i = 0; i < kv; i += 16) a = fma16(ldw(wn, i, bf), ld(xr + i), a);
                    out[r * n_out + n] = finish(a, wn, xr, kv, k, bias, n, bf);
                }
            }
            continue;
        }
        const void *ws[4] = {wrow(w, n0, k, bf), wrow(w, n0 + 1, k, bf), 0, 0};
        if (!wide) { ws[2] = wrow(w, n0 + 2, k, bf); ws[3] = wrow(w, n0 + 3, k, bf); }
        /* the first pass over this block prefetches the rows `ahead` rows on */
        const int64_t ahead = wide ? AHEAD_WIDE : AHEAD_NARROW;
        const void *pf = n0 + ahead + nb <= n_out ? wrow(w, n0 + ahead, k, bf) : 0;
        int64_t r = 0;
        if (wide) {
            for (; r + 8 <= rows; r += 8, pf = 0) rows_block(ws, 2, x, r, 8, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf);
            if (rows - r >= 4) { rows_block(ws, 2, x, r, 4, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf); r += 4; }
            if (rows - r >= 2) { rows_block(ws, 2, x, r, 2, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf); r += 2; }
            if (rows - r == 1) rows_block(ws, 2, x, r, 1, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf);
        } else {
            if (rows - r >= 4) { rows_block(ws, 4, x, r, 4, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf); r += 4; pf = 0; }
            if (rows - r >= 2) { rows_block(ws, 4, x, r, 2, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf); r += 2; pf = 0; }
            if (rows - r == 1) rows_block(ws, 4, x, r, 1, k, kv, pf, !wide, bias, out, n_out, n0,
                                     bf);
        }
    }
}

void skinny_linear(const float *x, const float *w, const float *bias, float *out,
                   int64_t rows, int64_t n_out, int64_t k, int32_t threads) {
    linear_rows(x, w, bias, out, rows, n_out, k, threads, 0);
}

/* Attention of a few query rows over a paged KV pool, without gathering the keys: row r (of sequence seq[r])
   sees the key positions [lo[r], hi[r]) of its sequence, whose slots are table[seq[r] * tk + j]; q [nh, n, d]
   (row-major), the key and value of a pool slot at k + slot * ks + kvh * khs and v + slot * vs + kvh * vhs (kvh:
   the query head's key head, nh / nkv query heads per key head; d and dv floats), out [n, nh, dv]. Each (row,
   head) is computed alone in a fixed order — the scores (16-lane partial sums, the fixed lane tree, the tail),
   their maximum, exp(s − max) and its sum in key order, the values' weighted sum in key order, one division — so a row's
   output does not depend on the other rows, the thread count or the batch. `buf`: nthreads × tk floats. */
static void attend_rows(const float *q, int64_t q_rs, int64_t q_hs, const float *k, const float *v,
                        const int64_t *table, int64_t tk, const int64_t *seq, const int64_t *lo, const int64_t *hi,
                        float *out, float *buf, int64_t n, int64_t nh, int64_t nkv, int64_t d, int64_t dv, int64_t ks,
                        int64_t khs, int64_t vs, int64_t vhs, float scale, int32_t threads) {
    const int64_t g = nh / nkv, dq = d / 16 * 16, dv16 = dv / 16 * 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < n * nh; ++u) {
        const int64_t r = u / nh, h = u % nh, kvh = h / g;
        const float *qr = q + r * q_rs + h * q_hs;
        const int64_t *slots = table + seq[r] * tk;
        float *s = buf + (int64_t)omp_get_thread_num() * tk;
        float m = -INFINITY;
        for (int64_t j = lo[r]; j < hi[r]; ++j) {
            const float *kr = k + slots[j] * ks + kvh * khs;
            v16 a = {0};
            for (int64_t i = 0; i < dq; i += 16) a = fma16(ld(qr + i), ld(kr + i), a);
            float x = lanes(a);
            for (int64_t i = dq; i < d; ++i) x = fmaf(qr[i], kr[i], x);
            x *= scale;
            s[j] = x;
            if (x > m) m = x;
        }
        float sum = 0.f;
        for (int64_t j = lo[r]; j < hi[r]; ++j) { s[j] = expf(s[j] - m); sum += s[j]; }
        float *o = out + (r * nh + h) * dv;
        for (int64_t i = 0; i < dv; ++i) o[i] = 0.f;
        for (int64_t j = lo[r]; j < hi[r]; ++j) {
            const float *vr = v + slots[j] * vs + kvh * vhs;
            const v16 p = (v16){0} + s[j];
            int64_t i = 0;
            for (; i < dv16; i += 16) {
                v16 acc = fma16(p, ld(vr + i), ld(o + i));
                memcpy(o + i, &acc, sizeof acc);
            }
            for (; i < dv; ++i) o[i] = fmaf(s[j], vr[i], o[i]);
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < dv; ++i) o[i] *= inv;
    }
}

/* q [nh, n, d] (one head's rows together: what the torch path holds) */
void paged_attention(const float *q, const float *k, const float *v, const int64_t *table, int64_t tk,
                     const int64_t *seq, const int64_t *lo, const int64_t *hi, float *out, float *buf,
                     int64_t n, int64_t nh, int64_t nkv, int64_t d, int64_t dv, int64_t ks, int64_t khs,
                     int64_t vs, int64_t vhs, float scale, int32_t threads) {
    attend_rows(q, d, n * d, k, v, table, tk, seq, lo, hi, out, buf, n, nh, nkv, d, dv, ks, khs, vs, vhs, scale,
                threads);
}

/* RMSNorm of `rows` rows of `dim`: out = w · (x · 1/sqrt(mean(x²) + eps)), the sum of squares in the fixed order
   of the dot products above; each row alone (in place allowed: a row is read whole before it is written). */
static void rms_rows(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps,
                     int32_t threads) {
    const int64_t dq = dim / 16 * 16;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        v16 a = {0};
        for (int64_t i = 0; i < dq; i += 16) { v16 t = ld(xr + i); a = fma16(t, t, a); }
        float s = lanes(a);
        for (int64_t i = dq; i < dim; ++i) s = fmaf(xr[i], xr[i], s);
        const float inv = 1.f / sqrtf(s / (float)dim + eps);
        for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (xr[i] * inv);
    }
}

void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps, int32_t threads) {
    rms_rows(x, w, out, rows, dim, eps, threads);
}

/* out = silu(g) · u = g / (1 + exp(-g)) · u, element by element (in place allowed) */
void silu_mul(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* RoPE in place on rows × heads vectors of d (x [rows, heads, d]): with c, s the row's cos and sin (their two
   halves equal), (x1, x2) → (x1·c − x2·s, x2·c + x1·s), each product rounded before its sum (no contraction):
   torch's apply_rope, bit for bit. */
static void rope_rows(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + (r * heads + h) * d, *x2 = x1 + half;
            const float *c = cos + r * d, *s = sin + r * d;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
}

/* One Llama decoder layer's weights (heads/layers.py DecoderLayer): linear weights fp32 (bf = 0) or bf16 (bf = 1),
   the input norm, the q/k/v biases and the per-head q/k norms optional (NULL). Every field 8 bytes: the ctypes
   mirror has no padding to get wrong. */
typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm;
    const void *wq, *wk, *wv, *wo, *wg, *wu, *wd;
    const float *bq, *bk, *bv;
    int64_t bf, h, nh, nkv, d, inter;
    double eps;
} layer_t;

/* One forward's rows: x [n, h] (updated in place), their cos/sin [n, d], the pool slots they write, the paged
   attention plan (as paged_attention takes it), every layer's key and value pool ([S, nkv, d], strides ks, khs and
   vs, vhs), scratch of n·(h + 2·nh·d + 2·nkv·d + 2·inter) floats and the attention's threads × tk. */
typedef struct {
    float *x; int64_t n;
    const float *cos, *sin;
    const int64_t *slots, *table; int64_t tk; const int64_t *seq, *lo, *hi;
    float *const *kpool; float *const *vpool;
    int64_t ks, khs, vs, vhs;
    float *scratch, *buf;
    double scale; int64_t threads;
} step_t;

static void lin(const float *x, const void *w, const float *bias, float *out, int64_t rows, int64_t n_out,
                int64_t k, int32_t threads, int64_t bf) {
    if (bf) linear_rows(x, w, bias, out, rows, n_out, k, threads, 1);
    else linear_rows(x, w, bias, out, rows, n_out, k, threads, 0);
}

/* Layers [first, last) of the model on the step's rows: the same kernels, in the same order, as the layer's torch
   path with them (heads/layers.py: the native linear, rms_norm and silu_mul, the paged kernel's attention), so the
   output is bit-identical to it; one call instead of ~160 torch operators per layer. */
void decode_layers(const layer_t *layers, int64_t first, int64_t last, const step_t *S) {
    const int64_t n = S->n;
    const int32_t th = (int32_t)S->threads;
    float *x = S->x;
    for (int64_t li = first; li < last; ++li) {
        const layer_t *L = layers + li;
        const int64_t h = L->h, nh = L->nh, nkv = L->nkv, d = L->d, in = L->inter, qd = nh * d, kd = nkv * d;
        const float eps = (float)L->eps;
        float *hn = S->scratch, *q = hn + n * h, *k = q + n * qd, *v = k + n * kd, *att = v + n * kd;
        float *g = att + n * qd, *u = g + n * in;
        float *kp = S->kpool[li], *vp = S->vpool[li];
        if (L->in_norm) rms_rows(x, L->in_norm, hn, n, h, eps, th);
        else memcpy(hn, x, n * h * sizeof(float));  /* EAGLE-1's layer: no input norm */
        lin(hn, L->wq, L->bq, q, n, qd, h, th, L->bf);
        lin(hn, L->wk, L->bk, k, n, kd, h, th, L->bf);
        lin(hn, L->wv, L->bv, v, n, kd, h, th, L->bf);
        if (L->q_norm) {
            rms_rows(q, L->q_norm, q, n * nh, d, eps, th);
            rms_rows(k, L->k_norm, k, n * nkv, d, eps, th);
        }
        rope_rows(q, S->cos, S->sin, n, nh, d);
        rope_rows(k, S->cos, S->sin, n, nkv, d);
        for (int64_t r = 0; r < n; ++r)
            for (int64_t j = 0; j < nkv; ++j) {
                memcpy(kp + S->slots[r] * S->ks + j * S->khs, k + (r * nkv + j) * d, d * sizeof(float));
                memcpy(vp + S->slots[r] * S->vs + j * S->vhs, v + (r * nkv + j) * d, d * sizeof(float));
            }
        attend_rows(q, qd, d, kp, vp, S->table, S->tk, S->seq, S->lo, S->hi, att, S->buf, n, nh, nkv, d, d, S->ks,
                    S->khs, S->vs, S->vhs, (float)S->scale, th);
        lin(att, L->wo, 0, hn, n, h, qd, th, L->bf);
        for (int64_t i = 0; i < n * h; ++i) x[i] = x[i] + hn[i];
        rms_rows(x, L->post_norm, hn, n, h, eps, th);
        lin(hn, L->wg, 0, g, n, in, h, th, L->bf);
        lin(hn, L->wu, 0, u, n, in, h, th, L->bf);
        silu_mul(g, u, g, n * in);
        lin(g, L->wd, 0, hn, n, h, in, th, L->bf);
        for (int64_t i = 0; i < n * h; ++i) x[i] = x[i] + hn[i];
    }
}

/* The same with bf16 weights (w: uint16 bit patterns): half the bytes streamed per decode step. */
void skinny_linear_bf16(const float *x, const uint16_t *w, const float *bias, float *out,
                        int64_t rows, int64_t n_out, int64_t k, int32_t threads) {
    linear_rows(x, w, bias, out, rows, n_out, k, threads, 1);
}
"""

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_ready = False  # _lib is loaded (a plain bool: what a traced graph reads)
_tried = False
_error = ""


def _cpu_id() -> str:
    """The CPU model and feature flags (the build is -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


def _build(cc: str, cache: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), version, platform.machine(), _cpu_id()]).encode())
    lib = cache / f"skinny_linear-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "skinny_linear.c", Path(tmp) / "skinny_linear.so"
        src.write_text(SOURCE)
        res = subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None when it is disabled or cannot be built
    (the reason is logged once and kept in `error()`)."""
    global _lib, _ready, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("SPECHEAD_NATIVE", "1") == "0":
                raise RuntimeError("disabled by SPECHEAD_NATIVE=0")
            cc = os.environ.get("CC", "cc")
            if shutil.which(cc) is None:
                raise RuntimeError(f"no C compiler {cc!r} on PATH")
            lib = ctypes.CDLL(str(_build(cc, cache_dir() / "native")))
            for fn in (lib.skinny_linear, lib.skinny_linear_bf16):
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
                fn.restype = None
            lib.paged_attention.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 5
                                            + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int32])
            lib.paged_attention.restype = None
            lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int32]
            lib.silu_mul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
            lib.decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            for fn in (lib.rms_norm, lib.silu_mul, lib.decode_layers):
                fn.restype = None
            _lib, _ready = lib, True
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            log.warning("native few-row linear kernel unavailable, using torch's GEMM: %s", e)
        _tried = True
        return _lib


def available() -> bool:
    return load() is not None


def loaded() -> bool:
    """Whether the kernel was loaded already (no build, no lock: what a compiled graph may ask while tracing)."""
    return _ready


def error() -> str:
    return _error


def accepts(t: torch.Tensor) -> bool:
    """Whether the kernel can read `t` as it is (an input, a bias): contiguous fp32 on the CPU."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def accepts_weight(t: torch.Tensor) -> bool:
    """Whether the kernel can read `t` as a weight: contiguous fp32 or bf16 on the CPU."""
    return t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" and t.is_contiguous()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] @ weight[n, k]ᵀ (+ bias) with the kernel: fp32 CPU tensors (the weight fp32 or bf16,
    widened exactly, products and sums in fp32); weight and bias contiguous. Raises if the kernel is
    unavailable (check `available()` first)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"native kernel unavailable: {_error}")
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not match")
    for name, t in (("x", x), ("bias", bias)):
        if t is not None and not accepts(t):
            raise ValueError(f"{name}: a contiguous fp32 CPU tensor is required, got {t.dtype} on {t.device}")
    if not accepts_weight(weight):
        raise ValueError(f"weight: a contiguous fp32 or bf16 CPU tensor is required, got {weight.dtype} on "
                         f"{weight.device}{'' if weight.is_contiguous() else ' (not contiguous)'}")
    return call(lib, x, weight, bias)


@torch.library.custom_op("spechead::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel as one opaque torch operator, for a `torch.compile`d graph (a ctypes call would break the graph
    there): x [rows, k] contiguous fp32 on the CPU, as `call` takes it; the kernel must be loaded (`available()`)."""
    return call(load(), x, weight, bias)


@skinny_linear_op.register_fake
def _skinny_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor | None, value_dim: int,
                    table: torch.Tensor, seq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of n query rows over a paged pool, the keys read where they lie (the kernel above): q [nH, n, d]
    contiguous, k_pool [S, nKV, d] and v_pool [S, nKV, dv] (None: the values are the keys' first `value_dim`
    channels) fp32 CPU with contiguous rows; `table` [B, K] int64 the slots of each sequence's positions, and per
    row its sequence `seq`, and the positions it sees, [lo, hi) (int64, [n] each; hi > lo). Returns [n, nH, dv].
    Every row is computed alone in a fixed order: the same bits whatever the other rows and the thread count. The
    caller checks the shapes (inference_eval/paged.py); the kernel must be loaded (`available()`)."""
    lib = load()
    nh, n, d = q.shape
    nkv = k_pool.shape[1]
    v = k_pool if v_pool is None else v_pool
    dv = value_dim if v_pool is None else v_pool.shape[2]
    out = torch.empty(n, nh, dv, dtype=torch.float32)
    threads = torch.get_num_threads()
    buf = torch.empty(threads, table.shape[1], dtype=torch.float32)
    lib.paged_attention(q.data_ptr(), k_pool.data_ptr(), v.data_ptr(), table.data_ptr(), table.shape[1],
                        seq.data_ptr(), lo.data_ptr(), hi.data_ptr(), out.data_ptr(), buf.data_ptr(), n, nh, nkv, d,
                        dv, k_pool.stride(0), k_pool.stride(1), v.stride(0), v.stride(1), float(scale), threads)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dimension, each row alone in a fixed order (the kernel above):
    x and weight contiguous fp32 CPU tensors; the kernel must be loaded (`available()`)."""
    out = torch.empty_like(x)
    dim = x.shape[-1]
    load().rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                    torch.get_num_threads())
    return out


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) · u element by element, g / (1 + exp(−g)) · u: contiguous fp32 CPU tensors of one shape."""
    out = torch.empty_like(g)
    load().silu_mul(g.data_ptr(), u.data_ptr(), out.data_ptr(), g.numel())
    return out


class Layer(ctypes.Structure):
    """The C `layer_t`: one decoder layer's tensors (data pointers: the caller keeps the tensors alive)."""

    _fields_ = ([(f, ctypes.c_void_p) for f in ("in_norm", "post_norm", "q_norm", "k_norm", "wq", "wk", "wv", "wo",
                                                "wg", "wu", "wd", "bq", "bk", "bv")]
                + [(f, ctypes.c_int64) for f in ("bf", "h", "nh", "nkv", "d", "inter")] + [("eps", ctypes.c_double)])


class Step(ctypes.Structure):
    """The C `step_t`: one forward's rows, their attention plan and pools, and scratch."""

    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("table", ctypes.c_void_p), ("tk", ctypes.c_int64),
                ("seq", ctypes.c_void_p), ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p),
                ("kpool", ctypes.c_void_p), ("vpool", ctypes.c_void_p), ("ks", ctypes.c_int64),
                ("khs", ctypes.c_int64), ("vs", ctypes.c_int64), ("vhs", ctypes.c_int64),
                ("scratch", ctypes.c_void_p), ("buf", ctypes.c_void_p), ("scale", ctypes.c_double),
                ("threads", ctypes.c_int64)]


def call(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`skinny_linear` without the checks, for a caller that made them (`heads.layers.linear`)."""
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    fn = lib.skinny_linear_bf16 if weight.dtype == torch.bfloat16 else lib.skinny_linear
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                      rows, n, x.shape[1], torch.get_num_threads())
    return out
