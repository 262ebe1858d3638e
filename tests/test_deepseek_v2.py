"""The engine's DeepSeek-V2 family (inference_eval/families/deepseek_v2.py) against HF transformers'
DeepseekV2ForCausalLM on tiny random configs: MLA with small ranks (q_proj or the q LoRA, YaRN), an MoE
of 8 routed experts (top-2, greedy or group-limited) with 2 shared ones after a dense first layer.
Logits and captured states, the compressed latent cache (contiguous against HF's own cache, paged,
a draft tree), packed rows, the batched engine's plain and speculative decoding, and an mtp head."""

import dataclasses
import json
import math

import pytest
import torch

from inference_eval.engine import engine_generate
from inference_eval.families.deepseek_v2 import DeepseekV2Args, DeepseekV2ForCausalLM, MLARotary
from inference_eval.model import LlamaForCausalLM
from inference_eval.paged import PackedRows
from tests.helpers import generate_plain
from tests.helpers import (assert_cached_decode_equals_full_forward, assert_tree_verification_equals_branches,
                           paged_steps_per_sequence, pool_and_tables as _tables, random_hf_model)
from tests.numerics import assert_matches_hf, assert_same_function, float64_copy

pytestmark = pytest.mark.unit

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
RANK, ROPE = 16, 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_hf_deepseek(seed: int = 0, **overrides):
    """A tiny random HF DeepSeek-V2 (eager attention): 3 layers, the first dense; 4 heads with
    qk = 12 + 8 (nope + rope) and v = 12 dims, a latent of 16; 8 routed experts (top 2) of width 32 and 2
    shared ones. Norm weights are perturbed so that norm bugs show."""
    import transformers

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, kv_lora_rank=RANK, q_lora_rank=None, qk_nope_head_dim=12,
                  qk_rope_head_dim=ROPE, v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                  first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1,
                  attn_implementation="eager")
    kwargs.update(overrides)
    return random_hf_model(transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config(**kwargs), seed)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v2")
    hf = make_hf_deepseek()
    hf.save_pretrained(path)
    return hf, LlamaForCausalLM.from_pretrained(path), path


def _experts_chosen(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Expert ids [N, k] each MoE layer's router picked in a forward of `ids`."""
    chosen, hooks = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[1])))
    try:
        model(ids, logits="none")
    finally:
        for h in hooks:
            h.remove()
    return chosen


@pytest.mark.parametrize("variant", ["lite", "q_lora", "yarn", "group_limited", "hub_config"])
def test_parity_with_hf(tmp_path, variant):
    """Logits, captured layer inputs and the final state equal HF's over 40 tokens. `lite`: V2-Lite's
    form (plain q_proj, greedy top-k); `q_lora`: V2's low-rank query, routed weights scaled by 1.5; `yarn`: V2's YaRN (factor 4 over
    64 original positions, mscale) with bias on the projections, and a head built on it; `group_limited`: 4 groups, top 2 groups;
    `hub_config`: the Hub's config.json layout (`rope_theta`, `rope_scaling` with `type`, moe_layer_freq,
    scoring_func). Several experts are active in each MoE layer, and the YaRN tables matter."""
    overrides = {"q_lora": {"q_lora_rank": 24, "routed_scaling_factor": 1.5}, "yarn": {"rope_parameters": YARN, "attention_bias": True},
                 "group_limited": {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
                 "hub_config": {"rope_parameters": YARN}}.get(variant, {})
    hf = make_hf_deepseek(**overrides)
    hf.save_pretrained(tmp_path)
    if variant == "hub_config":
        cfg = json.loads((tmp_path / "config.json").read_text())
        rope = dict(cfg.pop("rope_parameters"))
        cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
                   moe_layer_freq=1, scoring_func="softmax")
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = LlamaForCausalLM.from_pretrained(tmp_path)
    assert isinstance(ours, DeepseekV2ForCausalLM)
    assert (ours.args.rope_yarn is not None) == (variant in ("yarn", "hub_config")) and ours.args.rope_scaling is None
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = ours(ids, capture_layers=(0, 1, 2))
    assert_matches_hf(out.logits, ref.logits, ours.args, ids.shape[1])
    assert ref.logits.std() > 0.1, ref.logits.std()
    for got, i in zip(out.aux, (0, 1, 2)):  # "input of layer i": HF hidden_states[i]
        assert_matches_hf(got, ref.hidden_states[i], ours.args, ids.shape[1])
    assert_matches_hf(ours.model.norm(out.hidden), ref.hidden_states[-1], ours.args, ids.shape[1])
    assert not torch.allclose(out.hidden, ref.hidden_states[-1], atol=1e-3)  # H_i is pre-norm
    chosen = _experts_chosen(ours, ids)
    assert len(chosen) == 2  # layers 1 and 2; each: most experts someone's choice, rows choosing differently
    for c in chosen:
        assert len(c.unique()) >= 6 and len({tuple(sorted(r)) for r in c.tolist()}) >= 8
    if variant == "yarn":  # a head builds on a YaRN target; its Llama layer has plain RoPE at rope_theta
        from heads.registry import build_head
        from heads.layers import Rotary
        from inference_eval.model import tied_target

        tied, args, _ = tied_target(tmp_path)
        head = build_head({"type": "mtp"}, args, tied)
        assert head.args.rope_scaling is None and head.args.rope_theta == 10000.0
        torch.testing.assert_close(head.rotary.inv_freq, Rotary(head.args).inv_freq, rtol=0, atol=0)
    if variant in ("yarn", "hub_config"):
        rope = ours.model.rotary_emb
        ours.model.rotary_emb = MLARotary(dataclasses.replace(ours.args, rope_yarn=None))
        try:
            assert (ours(ids).logits - ref.logits).abs().max() > 1e-3
        finally:
            ours.model.rotary_emb = rope


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


def test_cached_decode_equals_full_forward(deepseek):
    """Contiguous cache (absorbed attention over the latent): a prefill, a 3-token verification chunk,
    then single decode steps give the full forward's (expanded, HF's) logits and states."""
    hf, model, _ = deepseek
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    assert_cached_decode_equals_full_forward(hf, model, ids)


@pytest.mark.parametrize("prefill_per_sequence", [True, False])
def test_paged_equals_contiguous(deepseek, prefill_per_sequence):
    """Sequences of 12, 3 and 19 tokens over scattered blocks of the latent pool: prefill (per-sequence
    or padded path), a decode step and 3- and 2-row verification steps (padded path) give the
    contiguous cache's logits, sequence by sequence."""
    _, model, _ = deepseek
    model = float64_copy(model)  # the same function in other summation orders: compared in float64
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 3, 19)]
    steps = [[7], [8, 9, 10], [11, 12]]
    got = paged_steps_per_sequence(model, seqs, steps, prefill_per_sequence)
    for s, mine in zip(seqs, got):
        want = model(torch.tensor([s + [t for rows in steps for t in rows]])).logits[0]  # full forward
        assert_same_function(mine, want)


def test_paged_tree_verification(deepseek):
    """Two branches verified in one pass through a tree mask after a 12-token context give each
    branch's own full-forward logits."""
    _, model, _ = deepseek
    ctx = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    assert_tree_verification_equals_branches(model, ctx)


def test_packed_rows_equal_separate_forwards(deepseek):
    """Precompute's packed path: samples packed in one row give each sample's own states and captured
    layer inputs (the MoE routes the packed rows as it routes each sample's)."""
    _, model, _ = deepseek
    model = float64_copy(model)  # the same function in other summation orders: compared in float64
    g = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (15, 1, 5, 22)]
    rows = PackedRows([len(s) for s in seqs])
    got = model(torch.tensor([[t for s in seqs for t in s]]), rows.positions(), cache=rows,
                logits="none", capture_layers=(2,))
    for s, a, b in zip(seqs, rows.bounds, rows.bounds[1:]):
        want = model(torch.tensor([s]), logits="none", capture_layers=(2,))
        assert_same_function(got.hidden[0, a:b], want.hidden[0])
        assert_same_function(got.aux[0][0, a:b], want.aux[0][0])


def test_truncated_shares_layers(deepseek):
    """A layer-skip draft of a DeepSeek target: its last state is the full model's input of that layer,
    its layers (an MoE one included) are the target's."""
    _, model, _ = deepseek
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(10))
    draft = model.truncated(2)
    assert isinstance(draft, DeepseekV2ForCausalLM) and draft.model.layers[1] is model.model.layers[1]
    torch.testing.assert_close(draft(ids, logits="none").hidden, model(ids, capture_layers=(2,)).aux[0])


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


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """A DeepSeek target whose greedy continuations vary (weights at std 0.3), prompts of 4..25 tokens."""
    path = tmp_path_factory.mktemp("deepseek_varied")
    hf = make_hf_deepseek(initializer_range=0.3)
    hf.save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (4 + 3 * i,), generator=g).tolist() for i in range(8)]
    return target, prompts, path, [generate_plain(target, p, 16) for p in prompts], hf


def test_engine_plain_and_draft_model_equal_reference(varied):
    """The batched engine on a DeepSeek target (its pool holding latents): the batch-1 reference equals
    HF's own greedy loop; plain greedy decoding with requests arriving at different steps, a layer-skip
    draft model's speculation and an (untrained) eagle3 head's, fed captured layer inputs, equal it."""
    target, prompts, path, reference, hf = varied
    assert len({tuple(r) for r in reference}) == len(reference) and len(set(reference[0])) > 4
    for p, r in zip(prompts[:2], reference[:2]):
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(16):
                ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert ids[0, len(p):].tolist() == r
    out, eng = engine_generate(target, prompts, 16, arrivals=[0, 0, 1, 2, 3, 5, 8, 13], block_size=4)
    assert out == reference and eng.pool.k[0].shape[1:] == (1, RANK + ROPE)
    out, eng = engine_generate(target, prompts, 16, proposer=target.truncated(2), k=2, block_size=4)
    assert out == reference and 0 < eng.stats.alpha[0] < 1
    from heads.registry import build_head
    from inference_eval.model import tied_target

    tied, args, parts = tied_target(path)  # an untrained eagle3 head: the target captures layers 1 and 2's inputs
    eagle3 = build_head({"type": "eagle3"}, args, tied).eval().requires_grad_(False)
    assert eagle3.capture_layers == (1, 2)
    out, _ = engine_generate(target, prompts[:4], 16, proposer=eagle3, k=2, block_size=4)
    assert out == reference[:4]


def test_mtp_head_speculative_equals_plain(varied, tmp_path):
    """An mtp head on a DeepSeek target (Llama's tied conventions: plain E, w·x̂ final norm) trained
    briefly on the target's own continuations drafts for it in the batched engine (k = 1 and 3) and in
    the batch-1 loop: greedy output equal to plain decoding, drafts both accepted and rejected; it
    exports as native only by default (no engine format is checked against a DeepSeek target yet), and the
    export is validated against the target and reloads to the same logits."""
    from heads.registry import build_head
    from artifacts.checkpoint import load_native, save_native
    from artifacts.export import default_formats
    from heads.layers import LlamaArgs
    from inference_eval.model import tied_target
    from tests.helpers import generate_speculative
    from tests.helpers import train_on_batch
    from train.module import DraftHeadModule

    target, prompts, path, reference, _ = varied
    ids = torch.tensor([p[:4] + r for p, r in zip(prompts, reference)])  # [8, 20]
    with torch.no_grad():
        out = target(ids)
    ones = torch.ones_like(ids, dtype=torch.bool)
    tied, args, parts = tied_target(path)
    torch.testing.assert_close(tied.teacher_logits(out.hidden), out.logits, atol=1e-5, rtol=1e-5)
    head = build_head({"type": "mtp"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    assert type(head.args) is LlamaArgs and head.args.model_type == "deepseek_v2" and head.args.head_dim == 16
    torch.manual_seed(0)
    losses = train_on_batch(DraftHeadModule(head, kl_chunk_size=64, depth=2),
                            {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": out.hidden}, 20, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    head = head.eval().requires_grad_(False)
    for k in (1, 3):
        got, eng = engine_generate(target, prompts, 16, proposer=head, k=k, block_size=4)
        assert got == reference and 0 < eng.stats.alpha[0] < 1
    assert [generate_speculative(target, head, p, 2, 16)[0] for p in prompts[:3]] == reference[:3]
    assert default_formats(head) == ["native"]
    from artifacts.export import export_head

    written = export_head(head, {"native": tmp_path / "export"}, path)  # validated against the target, read back
    assert (written["native"] / "model.safetensors").is_file()
    save_native(head, tmp_path / "head")
    again = load_native(tmp_path / "head", tied, args)
    pos = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(again.logits(again(out.hidden, ids, pos)), head.logits(head(out.hidden, ids, pos)))
