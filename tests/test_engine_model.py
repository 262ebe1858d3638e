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
