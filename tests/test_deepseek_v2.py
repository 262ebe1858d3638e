"""What only the engine's DeepSeek-V2 family (inference_eval/families/deepseek_v2.py) has, against HF
transformers' DeepseekV2ForCausalLM on tiny random configs (tests/families.py `make_hf_deepseek`: MLA with
small ranks, an MoE of 8 routed experts with 2 shared ones after a dense first layer): the MoE's parts and
router, bf16 with the router in fp32, the compressed latent cache against HF's own cache, V2-Lite's shapes
and config errors. What every family does (parity with HF over the q_proj / q LoRA / YaRN / group-limited
variants, the caches, packed rows, the engine's decoding, an mtp head) is tests/test_family_conformance.py."""

import math

import pytest
import torch

from inference_eval.families.deepseek_v2 import DeepseekV2Args, DeepseekV2ForCausalLM
from inference_eval.model import LlamaForCausalLM
from tests.families import RANK, ROPE, make_hf_deepseek
from tests.helpers import pool_and_tables as _tables
from tests.numerics import assert_matches_hf

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v2")
    hf = make_hf_deepseek()
    hf.save_pretrained(path)
    return hf, LlamaForCausalLM.from_pretrained(path), path


def test_moe_parts_matter(deepseek):
    """The routed experts, their weights and the shared experts each change the output: dropping the
    shared experts, or routing every row to its second choice only, moves the logits."""
    hf, model, _ = deepseek
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_matches_hf(model(ids).logits, ref, model.args, ids.shape[1])
    moe = model.model.layers[1].mlp
    shared = moe.shared_experts
    del moe.shared_experts
    try:
        assert (model(ids).logits - ref).abs().max() > 1e-3
    finally:
        moe.shared_experts = shared
    top_k = moe.gate.top_k
    moe.gate.top_k = 1
    try:
        assert (model(ids).logits - ref).abs().max() > 1e-3
    finally:
        moe.gate.top_k = top_k


def test_bf16_router_in_fp32(deepseek):
    """In bf16 the router's weight stays fp32 (HF's `_keep_in_fp32_modules_strict`), the embedding is
    HF's bit for bit, and the logits (full and cached) stay close to HF's bf16 ones."""
    from transformers import AutoModelForCausalLM

    _, _, path = deepseek
    ours = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32 == hf16.model.layers[1].mlp.gate.weight.dtype
    assert ours.model.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = hf16(ids, output_hidden_states=True)
    out = ours(ids, capture_layers=(0,))
    assert torch.equal(out.aux[0], ref.hidden_states[0])
    cache = ours.new_cache(2, 24)
    parts = [ours(ids[:, :6], cache=cache)] + [ours(ids[:, i:i + 1], cache=cache, start=i) for i in range(6, 24)]
    want = ref.logits.float()
    for got in (out.logits.float(), torch.cat([o.logits for o in parts], 1).float()):  # bf16 roundings: 0.06 of 3
        assert (got - want).abs().max() < 0.05 * want.abs().max() and want.abs().max() > 1.0
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_router_normalised_weights():
    """`norm_topk_prob` (DeepSeek's own code; HF's router ignores it): the top-k weights sum to 1;
    without it they are the softmax probabilities times routed_scaling_factor."""
    from inference_eval.families.deepseek_v2 import TopkRouter

    a = DeepseekV2Args.from_hf_config({"model_type": "deepseek_v2", "hidden_size": 16, "num_attention_heads": 2,
                                       "n_routed_experts": 8, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5})
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    router = TopkRouter(a)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(4))
    w, ids = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    torch.testing.assert_close(w, 2.5 * probs.gather(1, ids))
    assert torch.equal(ids.sort(-1).values, probs.topk(3, -1).indices.sort(-1).values)
    router.renormalise = True
    w, _ = router(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))


def test_cache_holds_the_latent_as_hf_does(deepseek):
    """The contiguous cache holds per token and layer [c ; k_pe] (kv_lora_rank + rope dims, one head,
    no values): after a prefill it equals what HF's DynamicCache stores (the normed latent and the
    rotated rope key), and the engine's pool has the same layout."""
    from transformers import DynamicCache

    hf, model, _ = deepseek
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))
    cache = model.new_cache(2, 16)
    model(ids, cache=cache)
    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids, cache=hf_cache, use_cache=True)
    for i in range(3):
        assert cache.k[i].shape == (2, 1, 16, RANK + ROPE) and cache.v[i].numel() == 0
        torch.testing.assert_close(cache.k[i][:, :, :11, :RANK], hf_cache.layers[i].keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.k[i][:, :, :11, RANK:], hf_cache.layers[i].values, atol=1e-5, rtol=1e-5)
    pool, _ = _tables(model, [8])
    assert pool.k[0].shape == (256, 1, RANK + ROPE) and pool.v[0].numel() == 0
    full = 2 * model.args.num_attention_heads * (12 + 8)  # what full per-head K and V would take (v ≤ qk)
    assert pool.k[0].shape[-1] * 4 < full


# DeepSeek-V2-Lite's config.json on the Hub (deepseek-ai/DeepSeek-V2-Lite), the fields the engine reads
V2_LITE = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False,
           "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944,
           "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
           "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
           "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
           "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_group": 1,
           "topk_method": "greedy", "tie_word_embeddings": False, "v_head_dim": 128, "vocab_size": 102400}


def test_v2_lite_shapes_and_config_errors():
    """V2-Lite's config: family dispatch, a dense first layer then 26 MoE layers, a latent cache of
    512 + 64 per token and layer (vs 16 × (192 + 128) for full K and V), YaRN's softmax scale, the
    head's Llama layer sizes; built on the meta device it has V2-Lite's 15.7B parameters under the
    Hub's tensor names. Unsupported routers and RoPE scalings are refused by name."""
    from inference_eval.families import args_from_hf_config
    from heads.layers import LlamaArgs

    a = args_from_hf_config(V2_LITE)
    assert isinstance(a, DeepseekV2Args)
    assert [a.is_moe_layer(i) for i in (0, 1, 26)] == [False, True, True]
    assert a.kv_layout() == (1, 576, 0) and a.rope_yarn["factor"] == 40
    assert math.isclose(a.softmax_scale(), 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    head_args = a.layer_args()
    assert type(head_args) is LlamaArgs and head_args.rope_scaling is None
    assert (head_args.head_dim, head_args.num_key_value_heads, head_args.intermediate_size) == (128, 16, 10944)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(a)
    names = set(model.state_dict())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.26.mlp.experts.63.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.5.self_attn.kv_a_proj_with_mqa.weight", "model.layers.5.self_attn.q_proj.weight"} <= names
    assert not any("q_a_proj" in n for n in names)
    assert 15.6e9 < sum(p.numel() for p in model.parameters()) < 15.8e9
    for bad, match in (({"scoring_func": "sigmoid"}, "scoring_func"), ({"topk_method": "noaux_tc"}, "noaux_tc"),
                       ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic")):
        with pytest.raises(NotImplementedError, match=match):
            args_from_hf_config({**V2_LITE, **bad})


