"""What only the engine's Gemma 3 family (inference_eval/families/gemma3.py) has, against HF transformers'
Gemma3ForCausalLM on tiny random configs whose sliding window (7) is shorter than the sequences: the window
and the local RoPE, bf16's embedding scale, its config layouts, the tied conventions a head follows (E·√H,
(1 + w) norms, the final logit cap) in training, drafting and export. What every family does (parity with
HF, the caches, packed rows, the engine's decoding) is tests/test_family_conformance.py."""

import pytest
import torch

from inference_eval.engine import engine_generate
from inference_eval.families.gemma3 import Gemma3Args
from inference_eval.model import LlamaForCausalLM
from tests.families import TYPES, WINDOW, make_hf_gemma3
from tests.helpers import engine_plain
from tests.numerics import assert_matches_hf, decoder_chain, float32_bound

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The default tiny config, saved; the engine's model loaded from it."""
    path = tmp_path_factory.mktemp("gemma3")
    hf = make_hf_gemma3()
    hf.save_pretrained(path)
    return hf, LlamaForCausalLM.from_pretrained(path), path


def test_sliding_window_and_local_rope_matter(gemma):
    """Without the window (or with the global RoPE on local layers) the logits past position 7 move:
    the parity with HF (tests/test_family_conformance.py) depends on both."""
    hf, ours, _ = gemma
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_matches_hf(ours(ids).logits, ref, ours.args, ids.shape[1])
    for layer in ours.model.layers:
        layer.self_attn.window = None
    try:
        got = ours(ids).logits
    finally:
        for layer, kind in zip(ours.model.layers, TYPES):
            layer.self_attn.window = WINDOW if kind == "sliding_attention" else None
    assert_matches_hf(got[:, :WINDOW], ref[:, :WINDOW], ours.args, ids.shape[1])
    # what the window changes is far outside the parity bound
    assert (got[:, WINDOW:] - ref[:, WINDOW:]).abs().max() > 10 * float32_bound(ref, 128, decoder_chain(4))
    local = ours.model.rotary_emb_local
    ours.model.rotary_emb_local = ours.model.rotary_emb
    try:
        assert (ours(ids).logits - ref).abs().max() > 1e-3
    finally:
        ours.model.rotary_emb_local = local


def test_bf16_embedding_scale_rounds_like_hf(gemma):
    """In bf16 the √H factor is rounded to bf16 before the multiply (√48 → 6.9375), as HF does."""
    hf, _, path = gemma
    ours = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf16 = make_hf_gemma3().to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf16(ids, output_hidden_states=True)
    out = ours(ids, capture_layers=(0,))
    assert torch.equal(out.aux[0], ref.hidden_states[0])
    exact = (ours.model.embed_tokens.weight[ids].float() * 48 ** 0.5).to(torch.bfloat16)
    assert not torch.equal(out.aux[0], exact)
    assert (out.logits.float().argmax(-1) == ref.logits.float().argmax(-1)).float().mean() > 0.9


def test_args_from_configs():
    """Family dispatch and the config layouts: defaults of Gemma3TextConfig, every 6th layer global,
    the image-text `gemma3` config and unknown families refused with the reason."""
    from inference_eval.families import args_from_hf_config

    a = args_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 64,
                             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100})
    assert isinstance(a, Gemma3Args)
    assert [i for i, t in enumerate(a.layer_types) if t == "full_attention"] == [5, 11]
    assert (a.head_dim, a.sliding_window, a.rope_theta, a.rope_local_theta) == (256, 4096, 1e6, 1e4)
    assert a.tie_word_embeddings and a.final_logit_softcapping is None
    # google/gemma-3-1b-it's config.json (transformers 4.50 layout), and the 4B's linear RoPE scaling
    hub = {"model_type": "gemma3_text", "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
           "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
           "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
           "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
           "sliding_window_pattern": 6, "vocab_size": 262144, "final_logit_softcapping": None}
    a = args_from_hf_config(hub)
    assert [i for i, t in enumerate(a.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert (a.sliding_window, a.rope_theta, a.rope_local_theta, a.rope_scaling) == (512, 1e6, 1e4, None)
    a = args_from_hf_config({**hub, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}})
    assert a.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert a.tied_conventions().embed_scale == 1152 ** 0.5 and a.layer_args().num_key_value_heads == 1
    with pytest.raises(ValueError, match="image-text"):
        args_from_hf_config({"model_type": "gemma3", "text_config": {}})
    with pytest.raises(ValueError, match="families: .*gemma3_text"):
        args_from_hf_config({"model_type": "gpt2"})


@pytest.mark.parametrize("cap", [None, 3.0])
def test_tied_target_follows_gemma(tmp_path, cap):
    """What a head shares with a Gemma target follows Gemma's conventions: E t·√H, N_f = x̂·(1 + w)
    and the final cap give the target's own embedding, final norm and logits (loaded from disk or
    taken from the loaded model); the head's norms start as (1 + w); its checkpoint records plain
    LlamaArgs and reloads; the store fingerprint records the conventions (a Llama target's none)."""
    from heads.registry import build_head
    from artifacts.checkpoint import load_native, save_native
    from heads.layers import LlamaArgs
    from inference_eval.model import tied_from_model, tied_target
    from inference_eval.model import target_fingerprint
    from tests.conftest import make_hf_model

    make_hf_gemma3(initializer_range=0.3, final_logit_softcapping=cap).save_pretrained(tmp_path / "g")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "g")
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(9))
    out = model(ids)
    for tied in (tied_target(tmp_path / "g")[0], tied_from_model(model)):
        assert torch.equal(tied.embed_tokens(ids), model.model.embed_tokens(ids))
        assert torch.equal(tied.final_norm(out.hidden), model.model.norm(out.hidden))
        torch.testing.assert_close(tied.teacher_logits(out.hidden), out.logits, atol=1e-5, rtol=1e-5)
    if cap is not None:
        assert out.logits.abs().max() > 2.0 and tied.conventions.logit_softcap == cap
    tied, args, parts = tied_target(tmp_path / "g")
    torch.testing.assert_close(parts.first_input_norm, 1 + model.model.layers[0].input_layernorm.weight)
    head = build_head({"type": "mtp", "hnorm_init": "target"}, args, tied)  # hnorm from N_f: Gemma's (1 + w)
    head.reset_parameters(0, parts.first_input_norm)
    torch.testing.assert_close(head.layers[0].hnorm.weight, 1 + model.model.norm.weight)
    h = out.hidden[:, :-1]
    torch.testing.assert_close(head.layers[0].hnorm(h), model.model.norm(h), atol=1e-5, rtol=1e-5)
    assert type(head.args) is LlamaArgs and head.args.model_type == "gemma3_text"
    with torch.no_grad():
        want = head.logits(head(out.hidden, ids, torch.arange(20)[None]))
    if cap is not None:
        assert want.abs().max() <= cap
    from artifacts.export import default_formats

    assert default_formats(head) == ["native"]  # no engine format applies Gemma's conventions (yet)
    save_native(head, tmp_path / "head")
    again = load_native(tmp_path / "head", tied, args)
    with torch.no_grad():
        assert torch.equal(again.logits(again(out.hidden, ids, torch.arange(20)[None])), want)

    fp = target_fingerprint(tmp_path / "g", "gemma", "float32")
    assert fp["tied_conventions"] == {"embed_scale": 48 ** 0.5, "norm_offset": 1.0, "logit_softcap": cap}
    make_hf_model("llama").save_pretrained(tmp_path / "l")
    assert "tied_conventions" not in target_fingerprint(tmp_path / "l", "llama", "float32")


def test_training_kl_and_draft_vocab_follow_the_cap(tmp_path):
    """With `final_logit_softcapping` the training loss (train/module.py → fused KL with the cap) equals
    the naive KL between the head's capped logits and the target's capped logits recomputed from the
    stored states, in value and gradient; the engine's draft-vocabulary logits are capped too."""
    import torch.nn.functional as F

    from heads.registry import build_head
    from inference_eval.engine import PagedHeadProposer
    from inference_eval.model import tied_target
    from train.module import DraftHeadModule

    cap = 1.5
    make_hf_gemma3(initializer_range=0.3, final_logit_softcapping=cap).save_pretrained(tmp_path / "g")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "g")
    tied, args, parts = tied_target(tmp_path / "g")
    head = build_head({"type": "mtp"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = model(ids).hidden
    ones = torch.ones_like(ids, dtype=torch.bool)
    module = DraftHeadModule(head, w_hidden=0.0, depth=1, kl_chunk_size=5)
    loss = module.compute_loss({"hidden": hidden, "input_ids": ids, "valid": ones, "loss_mask": ones})["loss"]
    grads = torch.autograd.grad(loss, list(head.parameters()))

    pred = head(hidden[:, :-1], ids[:, 1:], torch.arange(15).expand(2, 15))[:, :14]  # Ĥ_{i+1}, i < 14
    s, t = head.logits(pred), tied.teacher_logits(hidden[:, 1:15])
    assert float(s.abs().max()) <= cap and float(t.abs().max()) > 0.5 * cap  # capped, and the cap bites
    ref = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="sum") / (2 * 14)
    ref_grads = torch.autograd.grad(ref, list(head.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)

    vocab = torch.arange(0, 512, 3)
    prop = PagedHeadProposer(head, draft_vocab=vocab)
    with torch.no_grad():
        sub = prop._logits(pred[0])
        full = head.logits(pred[0])
    torch.testing.assert_close(sub[:, vocab], full[:, vocab])
    assert torch.isinf(sub[:, 1]).all()


def test_draft_lm_on_a_capped_gemma_target(tmp_path):
    """The `draft_lm` family on a Gemma target with a logit cap: Llama layers (random init; the target's
    own layers are refused as another architecture), the target's scaled embedding, a final norm that
    starts as N_f (1 + w), capped logits; trained briefly, it drafts in the engine with greedy output
    equal to plain decoding. Engine formats refuse its heads by name (native only)."""
    from heads.registry import build_head
    from artifacts.draft_hf import read_target_layers
    from artifacts.export import export_head
    from inference_eval.model import tied_target
    from tests.helpers import train_on_batch
    from train.module import DraftHeadModule

    cap = 3.0
    path = tmp_path / "g"
    make_hf_gemma3(initializer_range=0.3, tie_word_embeddings=False, final_logit_softcapping=cap).save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (4 + 3 * i,), generator=g).tolist() for i in range(8)]
    reference = [engine_plain(target, p, 16) for p in prompts]
    tied, args, parts = tied_target(path)
    head = build_head({"type": "draft_lm", "num_layers": 1, "init": "random"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    torch.testing.assert_close(head.model.norm.weight, 1 + target.model.norm.weight)
    with pytest.raises(ValueError, match="gemma3_text.*init=random"):
        head.copy_target_layers(read_target_layers(path, 1))
    ids = torch.tensor([p[:4] + r for p, r in zip(prompts, reference)])
    with torch.no_grad():
        hidden = target(ids, logits="none").hidden
        assert torch.equal(head.embed(ids), target.model.embed_tokens(ids))
    ones = torch.ones_like(ids, dtype=torch.bool)
    torch.manual_seed(0)
    losses = train_on_batch(DraftHeadModule(head, kl_chunk_size=64),
                            {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": hidden}, 30, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    head = head.eval().requires_grad_(False)
    with torch.no_grad():
        out = head(ids)
        engine_logits = head.lm_head(head.model.norm(out.hidden))  # what the engine's draft-model path calls
    torch.testing.assert_close(engine_logits, out.logits)
    assert float(out.logits.abs().max()) <= cap and float(out.logits.abs().max()) > 0.5 * cap
    out, eng = engine_generate(target, prompts, 16, proposer=head, k=2, block_size=4)
    assert out == reference and 0 < eng.stats.alpha[0] < 1
    for fmt in ("draft-hf", "native"):
        if fmt == "native":
            assert export_head(head, {fmt: tmp_path / fmt}, path) == {fmt: tmp_path / fmt}
        else:
            with pytest.raises(ValueError, match="draft-hf.*conventions.*native"):
                export_head(head, {fmt: tmp_path / fmt}, path)
            assert not (tmp_path / fmt).exists()


def test_mtp_hnorm_init_ones_starts_at_the_targets_logits(tmp_path):
    """`head.hnorm_init=ones`: at step 0 (init=copy) the mtp head projects ≈ N_f(H_i), the target's own
    logits at i, whatever N_f's multipliers; the default (`target`) applies N_f twice, which on a target
    whose final-norm multipliers are far from 1 (Gemma-3-270M's span 0.19..301) starts far off."""
    import torch.nn.functional as F

    from heads.registry import build_head
    from inference_eval.model import tied_target

    hf = make_hf_gemma3(initializer_range=0.3)
    with torch.no_grad():
        hf.model.norm.weight.copy_(torch.rand(48, generator=torch.Generator().manual_seed(1)) * 8 - 0.8)
    hf.save_pretrained(tmp_path / "g")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "g")
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model(ids, logits="none").hidden
    tied, args, parts = tied_target(tmp_path / "g")
    kl = {}
    for init in ("target", "ones"):
        head = build_head({"type": "mtp", "hnorm_init": init}, args, tied)
        head.reset_parameters(0, parts.first_input_norm)
        assert torch.equal(head.layers[0].shared_head.norm.weight, tied.norm_scale)
        with torch.no_grad():
            s = head.logits(head(hidden[:, :-1], ids[:, 1:], torch.arange(23)[None]))
            t = tied.teacher_logits(hidden[:, :-1])  # the target's own logits at the same positions
            kl[init] = float(F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean"))
            if init == "ones":
                assert torch.equal(head.layers[0].hnorm.weight, torch.ones(48))
                cos = F.cosine_similarity(head.features(head(hidden[:, :-1], ids[:, 1:], torch.arange(23)[None])),
                                          tied.final_norm(hidden[:, :-1]), dim=-1)
                assert float(cos.min()) > 0.95
    assert kl["ones"] < 0.25 * kl["target"], kl
    auto = build_head({"type": "mtp", "hnorm_init": "auto"}, args, tied)  # a Gemma target: ones
    auto.reset_parameters(0, parts.first_input_norm)
    assert torch.equal(auto.layers[0].hnorm.weight, torch.ones(48))
    from tests.conftest import make_hf_model

    make_hf_model("llama", seed=0).save_pretrained(tmp_path / "l")
    l_tied, l_args, l_parts = tied_target(tmp_path / "l")
    auto = build_head({"type": "mtp", "hnorm_init": "auto"}, l_args, l_tied)  # a Llama target: N_f's multiplier
    auto.reset_parameters(0, l_parts.first_input_norm)
    assert torch.equal(auto.layers[0].hnorm.weight, l_tied.norm_scale)
    with pytest.raises(ValueError, match="hnorm_init"):
        build_head({"type": "mtp", "hnorm_init": "zeros"}, args, tied)
