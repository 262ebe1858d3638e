"""The engine's Llama model: checkpoints it refuses, the frozen parts it loads, parity with HF on the real
SmolLM2 and in decode-sized forwards, and the small-batch linear path with its native kernel. What every
model family does (parity with HF on tiny configs, the caches) is tests/test_family_conformance.py."""

import pytest
import torch

from inference_eval.model import LlamaForCausalLM, load_frozen_parts
from tests.conftest import make_hf_model
from tests.numerics import assert_matches_hf


@pytest.mark.unit
def test_rejects_checkpoint_of_other_shape(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="missing"):
        LlamaForCausalLM.from_pretrained(tmp_path)


@pytest.mark.unit
def test_frozen_parts_follow_tying(tmp_path):
    hf = make_hf_model("llama", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    parts = load_frozen_parts(tmp_path)
    assert torch.equal(parts.lm_head, hf.lm_head.weight)
    assert not torch.equal(parts.lm_head, parts.embed)
    assert torch.equal(parts.norm, hf.model.norm.weight)


def test_parity_on_real_smollm2():
    """Once on the real default target (converted once, cached): fp32 logits and final states."""
    from transformers import AutoModelForCausalLM

    from data.assets import ensure_smollm2_checkpoint

    path = ensure_smollm2_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = LlamaForCausalLM.from_pretrained(path)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]])
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = ours(ids, capture_layers=(15,))
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(out.aux[0], ref.hidden_states[15], atol=1e-4, rtol=1e-4)
    assert (out.logits.argmax(-1) == ref.logits.argmax(-1)).all()


@pytest.mark.unit
@pytest.mark.parametrize("shape,out_features,bias,use_native,path", [
    ((1, 64), 1 << 13, False, True, "native"), ((1, 1, 64), 96, True, True, "native"),
    ((3, 2, 64), 96, True, True, "native"), ((60, 37), 96, True, True, "mm"), ((40, 37), 96, False, True, "native"),
    ((2, 150, 64), 96, False, True, "F"), ((0, 64), 96, True, True, "F"),
    ((1, 64), 1 << 13, False, False, "mm"), ((1, 1, 64), 96, True, False, "F"), ((3, 2, 64), 96, True, False, "mm"),
    ((3, 2, 64), 96, True, "strided", "mm")])
@pytest.mark.parametrize("gemm", ["mm", "F"])
def test_small_batch_linear_equals_f_linear(monkeypatch, shape, out_features, bias, use_native, path, gemm):
    """heads.layers.linear takes the path its rule says for a few fp32 rows in inference — the native
    kernel up to NATIVE_ROWS rows, else the GEMM form core/gemm_choice.py measured faster for the rows
    (`gemm`: W·xᵀ, one row padded when the weight is large, or F.linear), F.linear above
    FAST_LINEAR_ROWS, and F.linear or that form when the kernel is unavailable — and gives F.linear's
    values and shape, contiguous; with grad enabled it is F.linear and gradients flow. ("strided": the
    kernel is available but the weight is a transposed view, which it cannot read.)"""
    import torch.nn.functional as F

    import heads.layers
    from core import gemm_choice, native
    from heads.layers import FAST_LINEAR_ROWS, NATIVE_ROWS, PAD_ONE_ROW_MIN_WEIGHT, linear

    if use_native:
        assert native.available(), native.error()  # the test machines have a C compiler
    else:
        monkeypatch.setattr(native, "load", lambda: None)
    calls = []
    f_linear, mm, native_call = F.linear, torch.mm, native.call
    monkeypatch.setattr(heads.layers.F, "linear", lambda *a: calls.append("F") or f_linear(*a))
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append("mm") or mm(*a))
    monkeypatch.setattr(native, "call", lambda *a: calls.append("native") or native_call(*a))
    monkeypatch.setattr(gemm_choice, "form", lambda rows: gemm)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out_features, shape[-1], generator=g) / 8
    if use_native == "strided":
        w = w.t().contiguous().t()
    b = torch.randn(out_features, generator=g) if bias else None
    rows = x.numel() // shape[-1]
    rule = ("F" if rows == 0 or rows > FAST_LINEAR_ROWS
            else "native" if use_native is True and rows <= NATIVE_ROWS
            else "F" if rows == 1 and w.numel() < PAD_ONE_ROW_MIN_WEIGHT else "mm")
    assert rule == path
    path = gemm if path == "mm" else path
    with torch.inference_mode():
        got = linear(x, w, b)
        assert calls == [path]
        want = f_linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wp = w.clone().requires_grad_(True)
    linear(x, wp, b).sum().backward()
    torch.testing.assert_close(wp.grad, x.reshape(-1, shape[-1]).sum(0).expand_as(w))


@pytest.mark.unit
@pytest.mark.parametrize("k,n", [(64, 96), (37, 10), (5, 3), (576, 1539)])
def test_native_kernel_is_batch_invariant(k, n):
    """The C kernel: F.linear's values for 1..40 rows (both register blockings; k with and without a
    16-lane tail, n with and without a partial block, bias or not), each row bit-identical to that
    row computed alone."""
    from core import native

    assert native.available(), native.error()
    g = torch.Generator().manual_seed(k + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    for bias in (None, b):
        alone = [native.skinny_linear(x[i:i + 1], w, bias) for i in range(40)]
        for rows in (1, 2, 3, 4, 5, 7, 8, 11, 15, 16, 40):
            got = native.skinny_linear(x[:rows], w, bias)
            torch.testing.assert_close(got, torch.nn.functional.linear(x[:rows], w, bias), atol=1e-4, rtol=1e-5)
            assert all(torch.equal(got[i], alone[i][0]) for i in range(rows))
    with pytest.raises(ValueError, match="weight"):
        native.skinny_linear(x, w.t())  # not contiguous (and the wrong shape)
    with pytest.raises(ValueError, match="contiguous fp32"):
        native.skinny_linear(x[:, :k], w.double())


@pytest.mark.unit
def test_native_kernel_build_is_cached_and_fails_cleanly(tmp_path, monkeypatch, caplog):
    """The kernel is built once per cache into <SPECHEAD_CACHE>/native; a failing compiler or
    SPECHEAD_NATIVE=0 leaves it unavailable with the reason logged, nothing half-written, and
    heads.layers.linear still computes F.linear's values."""
    from core import native
    from heads.layers import linear

    def fresh():
        monkeypatch.setattr(native, "_tried", False)
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_error", "")

    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    fresh()
    assert native.available()
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    fresh()
    assert native.available() and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt

    x, w = torch.randn(3, 40), torch.randn(20, 40)
    for env, reason in (({"CC": "false", "SPECHEAD_CACHE": str(tmp_path / "other")}, "false failed"),
                        ({"CC": "no-such-compiler-xyz"}, "no C compiler"), ({"SPECHEAD_NATIVE": "0"}, "disabled")):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        fresh()
        with caplog.at_level("WARNING", logger="core.native"):
            assert not native.available()
        assert reason in native.error() and reason in caplog.text
        with torch.inference_mode():
            torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match="unavailable"):
            native.skinny_linear(x, w)
        for key in env:
            monkeypatch.delenv(key)
    failed = tmp_path / "other" / "native"
    # the failed build's scratch files are gone (the GEMM form measured for linear's fallback is kept there)
    assert failed.is_dir() and all(p.name.startswith("gemm-") and p.suffix == ".json" for p in failed.iterdir())


@pytest.mark.unit
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_decode_sized_forward_matches_hf(tmp_path, rows):
    """The few-row forwards of decode and verification (the fast fp32 linear path) against HF."""
    hf = make_hf_model("llama", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    ours = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = ours.new_cache(1, 64)
        ours(ids[:, :-rows], cache=cache)
        got = ours(ids[:, -rows:], cache=cache, start=40 - rows).logits
        ref = hf(ids).logits[:, -rows:]
    assert_matches_hf(got, ref, ours.args, ids.shape[1])


@pytest.mark.unit
@pytest.mark.parametrize("k,n", [(64, 96), (37, 10), (576, 1539)])
def test_native_kernel_widens_bf16_weights_exactly(k, n):
    """bf16 weights (W16A32): the kernel's output is, bit for bit, its output on the weight widened to fp32, for
    1..40 rows (both register blockings, a 16-lane tail or not, a partial block or not, bias or not), each row as
    computed alone; and F.linear's values on the widened weight."""
    from core import native

    assert native.available(), native.error()
    g = torch.Generator().manual_seed(k * n)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    x = torch.randn(40, k, generator=g)
    for bias in (None, b):
        alone = [native.skinny_linear(x[i:i + 1], w, bias) for i in range(40)]
        for rows in (1, 2, 3, 4, 5, 8, 11, 40):
            got = native.skinny_linear(x[:rows], w, bias)
            assert torch.equal(got, native.skinny_linear(x[:rows], w.float(), bias))
            torch.testing.assert_close(got, torch.nn.functional.linear(x[:rows], w.float(), bias), atol=1e-4, rtol=1e-5)
            assert all(torch.equal(got[i], alone[i][0]) for i in range(rows))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        native.skinny_linear(x, w.half())


@pytest.mark.unit
@pytest.mark.parametrize("rows", [1, 3, 100, 300])
def test_linear_with_bf16_weights_is_linear_on_the_widened_weight(rows):
    """heads.layers.linear with a bf16 weight and fp32 input gives exactly what it gives on the weight widened to
    fp32, on each of its paths (1 row: F.linear below the padding's size; 3: the native kernel; 100: W·xᵀ; 300:
    F.linear), in a compiled graph (the kernel's operator) too; with grad enabled, F.linear on the widened weight."""
    from heads.layers import linear

    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 64, generator=g), torch.randn(96, generator=g)
    w = torch.randn(96, 64, generator=g).bfloat16()
    with torch.inference_mode():
        for bias in (None, b):
            got = linear(x, w, bias)
            assert got.dtype == torch.float32 and torch.equal(got, linear(x, w.float(), bias))
    if rows == 3:
        with torch.inference_mode():
            compiled = torch.compile(lambda x: linear(x, w, b), fullgraph=True)
            assert torch.equal(compiled(x), linear(x, w.float(), b))
    xg = x.clone().requires_grad_(True)
    linear(xg, w, b).sum().backward()
    torch.testing.assert_close(xg.grad, w.float().sum(0).expand_as(x))


@pytest.mark.unit
@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set flags")
def test_native_kernel_branches_give_the_same_bits(tmp_path):
    """The kernel's source built three ways — this CPU's own (AVX-512 where it has it), without AVX-512 (the branch of
    explicit 8-lane halves an AVX2 CPU runs) and without FMA instructions (a scalar fused multiply-add) — gives the
    same bits for fp32 and bf16 weights, 1 to 11 rows: a user's CPU computes what the test machine computed."""
    import ctypes
    import subprocess

    from core import native

    (tmp_path / "k.c").write_text(native.SOURCE)
    libs = []
    for extra in ([], ["-mno-avx512f"], ["-mno-avx512f", "-mno-fma"]):
        out = tmp_path / f"k{len(libs)}.so"
        subprocess.run(["cc", *native.FLAGS, *extra, str(tmp_path / "k.c"), "-o", str(out)], check=True, timeout=300)
        lib = ctypes.CDLL(str(out))
        for fn in (lib.skinny_linear, lib.skinny_linear_bf16):
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
            fn.restype = None
        libs.append(lib)
    g = torch.Generator().manual_seed(0)
    for k, n in ((37, 10), (576, 1539)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, k, generator=g)
            for weight in (w, w.bfloat16()):
                outs = [native.call(lib, x, weight, b) for lib in libs]
                assert all(torch.equal(o, outs[0]) for o in outs[1:]), (k, n, rows, weight.dtype)
