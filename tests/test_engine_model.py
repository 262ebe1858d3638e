"""The engine's target model against HF transformers (logits, captured states), and its KV cache."""

import pytest
import torch

from inference_eval.model import LlamaForCausalLM, load_frozen_parts
from tests.conftest import make_hf_model


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                              ("mistral", {}), ("qwen2", {"attention_bias": True}), ("qwen3", {}),
                                              ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                          "original_max_position_embeddings": 64}})])
def test_parity_with_hf(tmp_path, model_type, extra):
    hf = make_hf_model(model_type, **extra)
    hf.save_pretrained(tmp_path)
    ours = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = ours(ids, capture_layers=(0, 1))
    torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=1e-5)
    # "input of layer i" convention: HF hidden_states[i]
    torch.testing.assert_close(out.aux[0], ref.hidden_states[0])
    torch.testing.assert_close(out.aux[1], ref.hidden_states[1], atol=1e-6, rtol=1e-5)
    # H_i is pre-norm: HF's last entry is N_f(H_i)
    torch.testing.assert_close(ours.model.norm(out.hidden), ref.hidden_states[-1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.hidden, ref.hidden_states[-1], atol=1e-3)


def test_cached_decode_equals_full_forward(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = model.new_cache(1, 32)
    parts = [model(ids[:, :7], cache=cache, start=0)]  # prefill
    parts.append(model(ids[:, 7:10], cache=cache, start=7))  # a 3-token "verify" chunk
    parts += [model(ids[:, i:i + 1], cache=cache, start=i) for i in range(10, 20)]  # decode
    torch.testing.assert_close(torch.cat([p.logits for p in parts], 1), full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p.hidden for p in parts], 1), full.hidden, atol=1e-5, rtol=1e-5)


def test_rejects_checkpoint_of_other_shape(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    cfg = (tmp_path / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="missing"):
        LlamaForCausalLM.from_pretrained(tmp_path)


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


@pytest.mark.parametrize("shape,out_features,bias,fast", [((1, 64), 1 << 13, False, True), ((1, 1, 64), 1 << 13, True, True),
                                                          ((1, 64), 96, True, False), ((3, 2, 64), 96, True, True),
                                                          ((2, 150, 64), 96, False, False), ((0, 64), 96, True, False)])
def test_small_batch_linear_equals_f_linear(monkeypatch, shape, out_features, bias, fast):
    """heads.layers.linear (W·xᵀ for a few fp32 rows in inference, one row padded) takes the path the
    rule says, gives F.linear's values and shape, contiguous; with grad enabled it is F.linear and
    gradients flow."""
    import torch.nn.functional as F

    import heads.layers
    from heads.layers import FAST_LINEAR_ROWS, PAD_ONE_ROW_MIN_WEIGHT, linear

    calls = []
    f_linear = F.linear
    monkeypatch.setattr(heads.layers.F, "linear", lambda *a: calls.append(1) or f_linear(*a))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out_features, shape[-1], generator=g) / 8
    b = torch.randn(out_features, generator=g) if bias else None
    rows = x.numel() // shape[-1]
    assert fast == (1 < rows <= FAST_LINEAR_ROWS or (rows == 1 and w.numel() >= PAD_ONE_ROW_MIN_WEIGHT))
    with torch.inference_mode():
        got = linear(x, w, b)
        assert len(calls) == (0 if fast else 1)  # the fast path does not call F.linear
        want = f_linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wp = w.clone().requires_grad_(True)
    linear(x, wp, b).sum().backward()
    torch.testing.assert_close(wp.grad, x.reshape(-1, shape[-1]).sum(0).expand_as(w))


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
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
