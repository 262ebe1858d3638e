"""The decoder layers as one native call per forward (inference_eval/fused.py, core/native.py `decode_layers`): the
hidden states bit-identical to the torch path with the same kernels (plain Llama, q/k/v biases, Qwen3's q/k norms,
bf16-stored weights; decode and verification rows of several sequences; captured layer inputs; 1 and 2 threads),
the fused path taken exactly where it applies (and not for prefills, masked rows, grad or other layouts), and the
native elementwise kernels (`rms_norm`, `silu_mul`) against torch's functions."""

import pytest
import torch
import torch.nn.functional as F

from core import native
from core.timing import thread_budget
from heads.layers import LlamaArgs
from inference_eval import fused
from inference_eval.model import LlamaForCausalLM
from inference_eval.paged import PagedBatch, PagedCache, SeqSlice
from tests.helpers import pool_and_tables

pytestmark = pytest.mark.unit


def tiny(seed=0, **kw):
    args = LlamaArgs(**{**dict(vocab_size=97, hidden_size=80, intermediate_size=136, num_hidden_layers=3,
                               num_attention_heads=6, num_key_value_heads=2, head_dim=20, rms_norm_eps=1e-5),
                        **kw})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    return model


def run_steps(model, use_fused: bool, monkeypatch, steps=((1,), (3,), (1,)), capture=(0, 2)):
    """Prefill three sequences (lengths 9, 5, 20; the first's blocks scattered), then feed each the rows of every
    step (decode: 1, verification: 3); returns per forward (hidden, aux) and how many forwards went fused."""
    monkeypatch.setenv("SPECHEAD_FUSED", "1" if use_fused else "0")
    calls = {"n": 0}
    lib = native.load()

    class Counting:  # the library's calls of decode_layers counted, everything else passed through
        def __getattr__(self, name):
            return getattr(lib, name)

        def decode_layers(self, *a):
            calls["n"] += 1
            return lib.decode_layers(*a)

    monkeypatch.setattr(native, "load", lambda c=Counting(): c)
    lens = [9, 5, 20]  # 20 > NATIVE_ATTN_ROWS: the prefill takes the torch path
    gen = torch.Generator().manual_seed(5)
    pool, tables = pool_and_tables(model, [n + 8 for n in lens], block_size=4)
    tables[0].blocks.reverse()
    tables[0].slots = torch.cat([torch.arange(b * 4, b * 4 + 4) for b in tables[0].blocks])
    out = []
    with torch.inference_mode():
        ids = torch.randint(0, 97, (1, sum(lens)), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        pre = model(ids, pos, cache=PagedCache(pool, PagedBatch([SeqSlice(t, 0, n) for t, n in zip(tables, lens)])),
                    logits="none", capture_layers=capture)
        out.append((pre.hidden, pre.aux))
        for (n,) in steps:
            ids = torch.randint(0, 97, (1, n * len(lens)), generator=gen)
            pos = torch.cat([torch.arange(m, m + n) for m in lens])[None]
            batch = PagedBatch([SeqSlice(t, m, n) for t, m in zip(tables, lens)])
            o = model(ids, pos, cache=PagedCache(pool, batch), logits="none", capture_layers=capture)
            out.append((o.hidden, o.aux))
            lens = [m + n for m in lens]
    return out, calls["n"]


@pytest.mark.parametrize("kind", ["llama", "bias", "qk_norm", "bf16_weights"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layers_give_the_torch_paths_bits(kind, threads, monkeypatch):
    assert native.available(), native.error()  # the test machines have a C compiler
    kw = {"bias": dict(attention_bias=True), "qk_norm": dict(qk_norm=True)}.get(kind, {})
    model = tiny(1, **kw)
    if kind == "bf16_weights":
        model.store_weights(torch.bfloat16)
    assert fused.layers_for(model) is not None
    with thread_budget(threads):
        want, n_torch = run_steps(model, False, monkeypatch)
        got, n_fused = run_steps(model, True, monkeypatch)
    assert n_torch == 0
    # the prefill takes the torch path; each decode / verification forward one call per segment between captures
    assert n_fused == 3 * 2
    for (h, aux), (h0, aux0) in zip(got, want):
        assert torch.equal(h, h0)
        assert len(aux) == len(aux0) == 2 and all(torch.equal(a, b) for a, b in zip(aux, aux0))
    assert not torch.equal(got[1][1][0], got[1][1][1])  # the captured inputs are copies, not the updated rows


def test_fused_rows_match_an_independent_float64_reference(monkeypatch):
    """The fused decode row against the layers written out in float64 from the weights (the torch path is not
    the reference here: both would share a wrong kernel)."""
    model = tiny(2, qk_norm=True, attention_bias=True)
    a = model.args
    pool, tables = pool_and_tables(model, [30], block_size=4)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 97, (1, 6), generator=gen)

    def ref(ids):
        d = model.state_dict()
        x = d["model.embed_tokens.weight"].double()[ids[0]]
        t = x.shape[0]
        pos = torch.arange(t, dtype=torch.float64)
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
        ang = pos[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

        def norm(v, w):
            return w.double() * v / torch.sqrt((v * v).mean(-1, keepdim=True) + a.rms_norm_eps)

        def rope(v):  # [t, heads, d]
            h = a.head_dim // 2
            rot = torch.cat([-v[..., h:], v[..., :h]], -1)
            return v * cos[:, None] + rot * sin[:, None]

        for i in range(a.num_hidden_layers):
            p = f"model.layers.{i}."
            w = {k[len(p):]: v.double() for k, v in d.items() if k.startswith(p)}
            hn = norm(x, w["input_layernorm.weight"])
            q = (hn @ w["self_attn.q_proj.weight"].T + w["self_attn.q_proj.bias"]).view(t, 6, 20)
            k = (hn @ w["self_attn.k_proj.weight"].T + w["self_attn.k_proj.bias"]).view(t, 2, 20)
            v = (hn @ w["self_attn.v_proj.weight"].T + w["self_attn.v_proj.bias"]).view(t, 2, 20)
            q, k = rope(norm(q, w["self_attn.q_norm.weight"])), rope(norm(k, w["self_attn.k_norm.weight"]))
            k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) / 20 ** 0.5
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
            att = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1)
            x = x + att @ w["self_attn.o_proj.weight"].T
            hn = norm(x, w["post_attention_layernorm.weight"])
            g, u = hn @ w["mlp.gate_proj.weight"].T, hn @ w["mlp.up_proj.weight"].T
            x = x + (F.silu(g) * u) @ w["mlp.down_proj.weight"].T
        return x

    with torch.inference_mode():
        model(ids[:, :5], torch.arange(5)[None], cache=PagedCache(pool, PagedBatch([SeqSlice(tables[0], 0, 5)])),
              logits="none")
        calls = []
        real_run = fused.run
        monkeypatch.setattr(fused, "run", lambda *a: calls.append(1) or real_run(*a))
        last = model(ids[:, 5:], torch.tensor([[5]]), cache=PagedCache(pool, PagedBatch([SeqSlice(tables[0], 5, 1)])),
                     logits="none").hidden[0, 0]
    assert fused.layers_for(model) is not None and calls
    torch.testing.assert_close(last.double(), ref(ids)[5], rtol=1e-4, atol=1e-4)


def test_the_fused_path_is_taken_only_where_it_applies(monkeypatch):
    model = tiny(3)
    pool, tables = pool_and_tables(model, [40, 40])
    ran = []
    real = fused.run
    monkeypatch.setattr(fused, "run", lambda *a: (lambda r: ran.append(r is not None) or r)(real(*a)))

    def forward(slices, grad=False):
        ids = torch.zeros(1, sum(s.n for s in slices), dtype=torch.long)
        pos = torch.cat([torch.arange(s.base + s.offset, s.end) for s in slices])[None]
        with torch.set_grad_enabled(grad):
            model(ids, pos, cache=PagedCache(pool, PagedBatch(slices)), logits="none")
        return ran.pop()

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with torch.inference_mode():
        assert not forward([SeqSlice(tables[0], 0, 18), SeqSlice(tables[1], 0, 17)])  # prefills past 16 rows
        assert forward([SeqSlice(tables[0], 0, 3), SeqSlice(tables[1], 0, 2)])  # short prefills: the kernel's rows
        assert forward([SeqSlice(tables[0], 18, 1), SeqSlice(tables[1], 17, 1)])  # decode
        assert forward([SeqSlice(tables[0], 19, 4)])  # verification
        assert not forward([SeqSlice(tables[0], 19, 3, mask=tree)])  # a masked (tree) sequence
        assert not forward([SeqSlice(tables[0], 19, 1), SeqSlice(tables[1], 18, 3, mask=tree)])  # beside one
        assert not forward([SeqSlice(tables[0], 0, 16), SeqSlice(tables[1], 0, 16), SeqSlice(tables[1], 0, 17)])
        monkeypatch.setenv("SPECHEAD_FUSED", "0")
        assert not forward([SeqSlice(tables[0], 19, 1)])
        monkeypatch.delenv("SPECHEAD_FUSED")
    assert not forward([SeqSlice(tables[0], 19, 1)], grad=True)
    # a weight replaced after the mirror was built is picked up (the mirror is rebuilt, not read stale)
    before = fused.layers_for(model)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = torch.nn.Parameter(torch.zeros_like(mlp.up_proj.weight))
    after = fused.layers_for(model)
    assert after is not before and after.array[0].wu == mlp.up_proj.weight.data_ptr()
    from heads.layers import DecoderLayer  # a layer module replaced: its weights are read, not the old layer's
    model.model.layers[2] = DecoderLayer(model.args).eval()
    again = fused.layers_for(model)
    assert again is not after and again.array[2].wq == model.model.layers[2].self_attn.q_proj.weight.data_ptr()
    # a layout the kernel does not compute: a model with one layer of another kind
    model.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(80))
    assert fused.layers_for(model) is None
    with torch.inference_mode():
        assert not forward([SeqSlice(tables[0], 19, 1)])
    del model.model.layers[1].self_attn.o_proj.bias
    model.model.layers[1].self_attn.o_proj.bias = None
    assert fused.layers_for(model) is not None


def test_native_elementwise_kernels_against_torch():
    gen = torch.Generator().manual_seed(0)
    for dim in (576, 20, 33):
        x, w = torch.randn(7, dim, generator=gen), torch.randn(dim, generator=gen)
        got = native.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(got, w * F.rms_norm(x, (dim,), eps=1e-5), rtol=2e-6, atol=1e-6)
        for r in range(7):  # each row alone
            assert torch.equal(native.rms_norm(x[r:r + 1].contiguous(), w, 1e-5)[0], got[r])
    g, u = torch.randn(1000, generator=gen) * 6, torch.randn(1000, generator=gen)
    torch.testing.assert_close(native.silu_mul(g, u), F.silu(g) * u, rtol=1e-6, atol=1e-6)


def test_a_draft_heads_layer_runs_fused_with_the_torch_paths_bits(monkeypatch):
    """A head's decoder layer over its paged pool (an mtp module: the engine's k = 1 refresh and draft rows) goes
    through `run_layer`, bit-identical to its torch path; the engine's speculative tokens and acceptance are the
    same with the fused layers on and off."""
    from heads.mtp import MTPConfig, MTPHead
    from inference_eval.engine import engine_generate
    from inference_eval.model import tied_from_model
    from inference_eval.paged import KVPool

    target = tiny(4)
    head = MTPHead(target.args, MTPConfig(), tied_from_model(target)).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("tied"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    gen = torch.Generator().manual_seed(0)
    _, tables = pool_and_tables(target, [24, 24])
    ran = []
    real = fused.run_layer
    monkeypatch.setattr(fused, "run_layer", lambda *a: (lambda r: ran.append(r is not None) or r)(real(*a)))

    def head_rows(on: bool):
        monkeypatch.setenv("SPECHEAD_FUSED", "1" if on else "0")
        pool = KVPool.for_args(target.args, 1, 64, 4, torch.float32)
        outs = []
        g = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            for slices in ([SeqSlice(tables[0], 0, 6), SeqSlice(tables[1], 0, 3)],  # short prefills
                           [SeqSlice(tables[0], 6, 2), SeqSlice(tables[1], 3, 2)],  # a k = 1 refresh
                           [SeqSlice(tables[0], 8, 1), SeqSlice(tables[1], 5, 1)]):  # a draft step
                n = sum(s.n for s in slices)
                states = torch.randn(1, n, 80, generator=g)
                tokens = torch.randint(0, 97, (1, n), generator=g)
                pos = torch.cat([torch.arange(s.base, s.end) for s in slices])[None]
                outs.append(head(states, tokens, pos, PagedCache(pool, PagedBatch(slices)), 0))
        return outs

    torch_path, fused_path = head_rows(False), head_rows(True)
    assert ran == [False] * 3 + [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(torch_path, fused_path))
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    got = {}
    for on in ("0", "1"):
        monkeypatch.setenv("SPECHEAD_FUSED", on)
        outs, eng = engine_generate(target, prompts, 12, proposer=head, k=1)
        got[on] = (outs, eng.stats.accepted, eng.stats.steps)
    assert got["0"] == got["1"]
    assert ran.count(True) > 3  # the engine's rounds took the fused head layer


@pytest.mark.parametrize("input_norm", [False, True], ids=["eagle1_layer", "llama_layer"])
def test_one_layer_over_a_paged_pool(input_norm, monkeypatch):
    """`run_layer` on a lone DecoderLayer (EAGLE-1's has no input norm) over decode and verification rows of two
    sequences: the torch path's bits, the pool's written keys and values too; the input is left as it was."""
    from heads.layers import DecoderLayer, Rotary
    from inference_eval.paged import KVPool, PagedLayer

    args = tiny().args
    torch.manual_seed(6)
    layer = DecoderLayer(args, input_norm=input_norm).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    _, tables = pool_and_tables(tiny(), [24, 24])
    ran = []
    real = fused.run_layer
    monkeypatch.setattr(fused, "run_layer", lambda *a: (lambda r: ran.append(r is not None) or r)(real(*a)))
    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv("SPECHEAD_FUSED", on)
        pool = KVPool.for_args(args, 1, 64, 4, torch.float32)
        g = torch.Generator().manual_seed(2)
        pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
        slices = [SeqSlice(tables[0], 10, 1), SeqSlice(tables[1], 7, 3)]
        x = torch.randn(1, 4, 80, generator=g)
        cos, sin = Rotary(args)(torch.tensor([[10, 7, 8, 9]]), torch.float32)
        before = x.clone()
        with torch.inference_mode():
            out = layer(x, cos, sin, PagedLayer(pool.k[0], pool.v[0], PagedBatch(slices)))
        assert torch.equal(x, before)
        results[on] = (out, pool.k[0].clone(), pool.v[0].clone())
    assert ran == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(results["0"], results["1"]))
