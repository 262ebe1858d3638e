"""The training-time test's attention without [B, H, T, T] tensors (issue 29): heads/layers.py
`Attention.forward_unrolled` now makes one SDPA call over the concatenated keys of every depth under a
block mask (`unrolled_mask`). Its outputs and gradients must equal the dense formulation it replaced —
explicit scores, a masked fill, one fp32 softmax over [causal block | diagonal terms]
(`dense_unrolled_attention`, `Attention.unrolled_impl = "dense"`) — in float32 and float64, unpacked and
packed, with and without grouped-query attention."""

import pytest
import torch

from heads.layers import Attention, LlamaArgs, Rotary, unrolled_mask
from tests.numerics import assert_close_float32


pytestmark = pytest.mark.unit


def dense_unrolled(attn: Attention, *args):
    """The dense formulation (spechead until issue 29): [B, nH, T, T] scores kept for backward."""
    attn.unrolled_impl = "dense"
    try:
        return attn.forward_unrolled(*args)
    finally:
        del attn.unrolled_impl  # back to the class default


def _args(n_heads, n_kv):
    return LlamaArgs(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=16, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True)


def _run(fn, attn, xs, cos_sin, mask):
    """Depth 1 through len(xs): each depth's keys feed the next, as heads/unroll.py chains them."""
    base, extras, outs = None, [], []
    for d, x in enumerate(xs):
        cos, sin = cos_sin[d]
        if base is None:
            out, kv = attn.forward_unrolled(x, cos, sin, None, [], mask)
            base = kv
        else:
            out, kv = fn(attn, x, cos, sin, base, extras, mask)
            extras = [*extras, kv]
        outs.append(out)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_one_call_attention_equals_dense_values_and_gradients(dtype, packed, heads):
    torch.manual_seed(0)
    args = _args(*heads)
    attn = Attention(args).to(dtype)
    b, t, depth = 2, 11, 4
    xs0 = [torch.randn(b, t, args.hidden_size, dtype=dtype) for _ in range(depth)]
    pos = torch.arange(t).expand(b, t)
    rot = Rotary(args)
    cos_sin = [rot(pos + d, dtype) for d in range(depth)]
    mask = None
    if packed:  # two samples in row 0 (split at 5), one in row 1
        seg = torch.zeros(b, t, dtype=torch.long)
        seg[0, 5:] = 1
        mask = torch.ones(t, t, dtype=torch.bool).tril() & (seg[:, :, None] == seg[:, None, :])

    def grads(fn):
        attn.zero_grad()
        xs = [x.clone().requires_grad_() for x in xs0]
        outs = _run(fn, attn, xs, cos_sin, mask)
        weights = torch.randn(len(outs), generator=torch.Generator().manual_seed(1)).tolist()
        sum(w * (o ** 2).sum() for w, o in zip(weights, outs)).backward()
        return [o.detach() for o in outs], [x.grad for x in xs], {n: p.grad.clone() for n, p in attn.named_parameters()}

    new_out, new_gx, new_gp = grads(lambda a, *r: a.forward_unrolled(*r))
    ref_out, ref_gx, ref_gp = grads(dense_unrolled)
    for d in range(depth):
        if dtype == torch.float64:
            torch.testing.assert_close(new_out[d], ref_out[d], atol=1e-12, rtol=0)
            torch.testing.assert_close(new_gx[d], ref_gx[d], atol=1e-10, rtol=0)
        else:
            assert_close_float32(new_out[d], ref_out[d], terms=(d + 1) * t, layers=2)
            assert_close_float32(new_gx[d], ref_gx[d], terms=depth * (d + 1) * t * args.hidden_size, layers=4)
    for name, g in ref_gp.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(new_gp[name], g, atol=(1e-10 if dtype == torch.float64 else 2e-5) * max(scale, 1.0),
                                   rtol=0, msg=f"grad of {name}")
    # not vacuous: the deeper depths see earlier keys, so depth 3 differs from attending its own block only
    solo = attn.forward_unrolled(xs0[2], *cos_sin[2], None, [], mask)[0]
    assert (solo - new_out[2]).abs().max() > 1e-3


def test_unrolled_mask_blocks():
    m = unrolled_mask(4, 2, None, "cpu")
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))
    packed = torch.ones(2, 4, 4, dtype=torch.bool).tril()
    packed[0, 2:, :2] = False
    mp = unrolled_mask(4, 1, packed, "cpu")
    assert mp.shape == (2, 1, 4, 8) and torch.equal(mp[:, 0, :, :4], packed)
    assert torch.equal(mp[1, 0, :, 4:], torch.eye(4, dtype=torch.bool))
