"""What every model family of the engine (tests/families.py `FAMILIES`: Llama and its relatives, Gemma 3,
DeepSeek-V2) must do, on tiny random configs, each case named after its family (`pytest -k gemma3`): logits
and captured states equal HF transformers', the contiguous cache equals the full forward, the paged cache
(prefill, decode, verification, a draft tree) the contiguous one, packed rows separate forwards, a layer-skip
draft shares the target's layers, and the batched engine's plain, draft-model, eagle3 and mtp-head decoding
equal plain decoding. What only one family has (Gemma's sliding window and caps, DeepSeek's router and
latent cache) is tested in its own file (tests/test_gemma3.py, tests/test_deepseek_v2.py)."""

import dataclasses

import pytest
import torch

from inference_eval.engine import engine_generate
from inference_eval.model import LlamaForCausalLM
from inference_eval.paged import PackedRows
from tests.families import FAMILIES, TYPES, WINDOW
from tests.helpers import (assert_cached_decode_equals_full_forward, assert_tree_verification_equals_branches,
                           engine_plain, paged_steps_per_sequence)
from tests.numerics import (assert_close_float32, assert_matches_hf, assert_same_function, decoder_chain,
                            float64_copy)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: on 2 shared cores the engine's skinny-matmul kernel spins its threads against
    other processes' and decoding runs many times slower. No value tested depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The family's default tiny config, saved: (Family, the HF model, the engine's model loaded from it)."""
    fam = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(fam.name)
    hf = fam.build()
    hf.save_pretrained(path)
    return fam, hf, LlamaForCausalLM.from_pretrained(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def varied(request, tmp_path_factory):
    """A target of the family whose greedy continuations vary (weights at std 0.3), prompts of 4..25 tokens,
    and their 16-token greedy continuations by the engine with one slot: (Family, target, prompts, its
    checkpoint, continuations, the HF model)."""
    fam = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"{fam.name}_varied")
    hf = fam.build(**fam.varied)
    hf.save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, fam.vocab_size, (4 + 3 * i,), generator=g).tolist() for i in range(8)]
    return fam, target, prompts, path, [engine_plain(target, p, 16) for p in prompts], hf


def _aux_within_layers(got, want, i, args, seq_len):
    """Llama: the input of layer i within the float32 bound of i decoder layers (no final norm nor lm_head);
    the embedding (layer 0's input) exactly: no arithmetic."""
    if i == 0:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:
        assert_close_float32(got, want, terms=max(args.intermediate_size, seq_len), layers=decoder_chain(i) - 2)


def _aux_within_decoder(got, want, i, args, seq_len):
    """Gemma 3 (four norms a layer, the embedding scaled by √H) and DeepSeek-V2 (MLA's low-rank projections,
    the router and experts) chain more reductions per layer than `decoder_chain`'s Llama layer: every
    captured input within the whole decoder's bound."""
    assert_matches_hf(got, want, args, seq_len)


AUX_WITHIN = {"llama": _aux_within_layers, "gemma3": _aux_within_decoder, "deepseek_v2": _aux_within_decoder}


def _gemma3_parity(variant, hf, ours, ids, ref, path):
    """The config read as HF reads it (also the Hub's older layout: layer 2 global); with `softcaps` the final
    cap shapes the logits: without it they differ."""
    assert list(ours.args.layer_types) == hf.config.layer_types
    assert (ours.args.rope_theta, ours.args.rope_local_theta, ours.args.sliding_window) == (10000.0, 100.0, WINDOW)
    if variant == "hub_config":
        assert hf.config.layer_types == [TYPES[0], TYPES[0], TYPES[1], TYPES[0]]
    if variant == "softcaps":
        assert ref.logits.abs().max() > 2.0
        ours.lm_head.cap = None
        assert (ours(ids).logits - ref.logits).abs().max() > 0.1


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


def _deepseek_v2_parity(variant, hf, ours, ids, ref, path):
    """Several experts are active in each MoE layer; with YaRN (`yarn`, `hub_config`) its tables matter, and a
    head built on a YaRN target has a Llama layer with plain RoPE at rope_theta."""
    from inference_eval.families.deepseek_v2 import MLARotary

    assert (ours.args.rope_yarn is not None) == (variant in ("yarn", "hub_config")) and ours.args.rope_scaling is None
    assert ref.logits.std() > 0.1, ref.logits.std()
    chosen = _experts_chosen(ours, ids)
    assert len(chosen) == 2  # layers 1 and 2; each: most experts someone's choice, rows choosing differently
    for c in chosen:
        assert len(c.unique()) >= 6 and len({tuple(sorted(r)) for r in c.tolist()}) >= 8
    if variant == "yarn":
        from heads.layers import Rotary
        from heads.registry import build_head
        from inference_eval.model import tied_target

        tied, args, _ = tied_target(path)
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


PARITY_CHECKS = {"gemma3": _gemma3_parity, "deepseek_v2": _deepseek_v2_parity}


@pytest.mark.parametrize("name,variant", [pytest.param(name, variant, id=f"{name}-{variant}")
                                          for name, fam in FAMILIES.items() for variant in fam.parity_variants])
def test_parity_with_hf(tmp_path, name, variant):
    """Logits, every layer's captured input and the final state equal HF's over 100 tokens (past Gemma's
    window, past the 64 original positions of YaRN and Llama 3's RoPE), for each family's variants
    (tests/families.py `parity_variants`; `hub_config`: the Hub's config.json layout); H_i is pre-norm."""
    fam = FAMILIES[name]
    hf = fam.parity_checkpoint(variant, tmp_path)
    ours = LlamaForCausalLM.from_pretrained(tmp_path)
    assert type(ours) is fam.model_cls
    ids = torch.randint(0, fam.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    layers = tuple(range(ours.args.num_hidden_layers))
    out = ours(ids, capture_layers=layers)
    assert_matches_hf(out.logits, ref.logits, ours.args, ids.shape[1])
    for got, i in zip(out.aux, layers, strict=True):  # "input of layer i": HF hidden_states[i]
        AUX_WITHIN[name](got, ref.hidden_states[i], i, ours.args, ids.shape[1])
    # H_i is pre-norm: HF's last entry is N_f(H_i)
    assert_matches_hf(ours.model.norm(out.hidden), ref.hidden_states[-1], ours.args, ids.shape[1])
    assert not torch.allclose(out.hidden, ref.hidden_states[-1], atol=1e-3)
    if name in PARITY_CHECKS:
        PARITY_CHECKS[name](variant, hf, ours, ids, ref, tmp_path)


def test_cached_decode_equals_full_forward(family):
    """Contiguous cache: a prefill, a 3-token verification chunk, then single decode steps (past Gemma's
    window; DeepSeek's absorbed attention over the latent) give the full forward's logits and states (which
    equal HF's)."""
    _, hf, model = family
    ids = torch.randint(0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    assert_cached_decode_equals_full_forward(hf, model, ids)


@pytest.mark.parametrize("prefill_per_sequence", [True, False])
def test_paged_equals_contiguous(family, prefill_per_sequence):
    """Sequences of 12, 3 and 19 tokens (shorter and longer than Gemma's window) over scattered blocks:
    prefill (per-sequence or padded path), a decode step and 3- and 2-row verification steps (padded path)
    give the contiguous cache's logits and the full forward's, sequence by sequence."""
    _, _, model = family
    model = float64_copy(model)  # the same function in other summation orders: compared in float64
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in (12, 3, 19)]
    steps = [[7], [8, 9, 10], [11, 12]]
    got = paged_steps_per_sequence(model, seqs, steps, prefill_per_sequence)
    for s, mine in zip(seqs, got):
        cache = model.new_cache(1, 64)
        want = [model(torch.tensor([s]), cache=cache).logits[0]]
        m = len(s)
        for rows in steps:
            want.append(model(torch.tensor([rows]), cache=cache, start=m).logits[0])
            m += len(rows)
        assert_same_function(mine, torch.cat(want))
        assert_same_function(mine, model(torch.tensor([s + [t for rows in steps for t in rows]])).logits[0])


def test_paged_tree_verification(family):
    """Two branches verified in one pass through a tree mask after a 12-token context give each branch's
    own full-forward logits (Gemma's window counts a tree row's position by its depth)."""
    _, _, model = family
    ctx = torch.randint(0, model.args.vocab_size, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    assert_tree_verification_equals_branches(model, ctx)


def test_packed_rows_equal_separate_forwards(family):
    """Precompute's packed path (varlen prefill without a cache): samples packed in one row, a 1-token one
    among them and ones longer and shorter than Gemma's window, give each sample's own states and captured
    layer inputs (DeepSeek's MoE routes the packed rows as it routes each sample's); a length mismatch is
    refused."""
    _, _, model = family
    model = float64_copy(model)  # the same function in other summation orders: compared in float64
    layer = min(2, model.args.num_hidden_layers - 1)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist() for n in (15, 1, 5, 22)]
    rows = PackedRows([len(s) for s in seqs])
    assert rows.positions().tolist() == [[p for s in seqs for p in range(len(s))]]
    with torch.no_grad():
        got = model(torch.tensor([[t for s in seqs for t in s]]), rows.positions(), cache=rows,
                    logits="none", capture_layers=(layer,))
        for s, a, b in zip(seqs, rows.bounds, rows.bounds[1:]):
            want = model(torch.tensor([s]), logits="none", capture_layers=(layer,))
            assert_same_function(got.hidden[0, a:b], want.hidden[0])
            assert_same_function(got.aux[0][0, a:b], want.aux[0][0])
        with pytest.raises(ValueError, match="packed forward of"):
            model(torch.tensor([seqs[0]]), logits="none", cache=rows)


def test_truncated_shares_layers(family):
    """A layer-skip draft of the target: of the family's class, its layers (DeepSeek's MoE one included) are
    the target's, its last state is the full model's input of that layer."""
    fam, _, model = family
    n = min(2, model.args.num_hidden_layers - 1)
    ids = torch.randint(0, model.args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(8))
    draft = model.truncated(n)
    assert isinstance(draft, fam.model_cls) and draft.model.layers[n - 1] is model.model.layers[n - 1]
    torch.testing.assert_close(draft(ids, logits="none").hidden, model(ids, capture_layers=(n,)).aux[0])


def test_engine_plain_and_draft_model_equal_reference(varied):
    """The batched engine on the family's target (its pool in the family's layout: DeepSeek's holds
    latents): the engine with one slot equals HF's own greedy loop; plain greedy decoding with requests
    arriving at different steps, a layer-skip draft model's speculation and an (untrained) eagle3 head's,
    fed captured layer inputs, equal it."""
    from heads.registry import build_head
    from inference_eval.model import tied_target

    fam, target, prompts, path, reference, hf = varied
    assert len({tuple(r) for r in reference}) == len(reference) and len(set(reference[0])) > 4
    for p, r in zip(prompts[:2], reference[:2]):
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(16):
                ids = torch.cat([ids, hf(ids).logits[:, -1:].argmax(-1)], dim=1)
        assert ids[0, len(p):].tolist() == r
    out, eng = engine_generate(target, prompts, 16, arrivals=[0, 0, 1, 2, 3, 5, 8, 13], block_size=4)
    assert out == reference and eng.pool.k[0].shape[1:] == fam.kv_slot
    draft = target.truncated(target.args.num_hidden_layers - 1)
    out, eng = engine_generate(target, prompts, 16, proposer=draft, k=2, block_size=4)
    assert out == reference and 0 < eng.stats.alpha[0] < 1
    tied, args, parts = tied_target(path)  # an untrained eagle3 head: the target captures its layers' inputs
    eagle3 = build_head({"type": "eagle3"}, args, tied).eval().requires_grad_(False)
    assert eagle3.capture_layers == fam.eagle3_layers
    out, _ = engine_generate(target, prompts[:4], 16, proposer=eagle3, k=2, block_size=4)
    assert out == reference[:4]


def test_mtp_head_speculative_equals_plain(varied, tmp_path):
    """An mtp head on the family's target (a Llama layer of 16-dim heads; the tied tensors follow the
    family's conventions and give the target's logits) trained briefly on the target's own continuations
    drafts for it in the batched engine (k = 1 and 3) and with one slot: greedy output equal to plain
    decoding, drafts both accepted and rejected. It exports by default to the family's formats (no engine
    format is checked against a Gemma or DeepSeek target yet: native only); its native export is validated
    against the target and reloads to the same logits."""
    from artifacts.checkpoint import load_native, save_native
    from artifacts.export import default_formats, export_head
    from heads.layers import LlamaArgs
    from heads.registry import build_head
    from inference_eval.model import tied_target
    from tests.helpers import engine_speculative, train_on_batch
    from train.module import DraftHeadModule

    fam, target, prompts, path, reference, _ = varied
    ids = torch.tensor([p[:4] + r for p, r in zip(prompts, reference)])  # [8, 20]
    with torch.no_grad():
        out = target(ids)
    ones = torch.ones_like(ids, dtype=torch.bool)
    tied, args, parts = tied_target(path)
    torch.testing.assert_close(tied.teacher_logits(out.hidden), out.logits, atol=1e-5, rtol=1e-5)
    head = build_head({"type": "mtp"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    assert type(head.args) is LlamaArgs and head.args.model_type == fam.model_type and head.args.head_dim == 16
    torch.manual_seed(0)
    losses = train_on_batch(DraftHeadModule(head, kl_chunk_size=64, depth=2),
                            {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": out.hidden}, 20, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    head = head.eval().requires_grad_(False)
    for k in (1, 3):
        got, eng = engine_generate(target, prompts, 16, proposer=head, k=k, block_size=4)
        assert got == reference and 0 < eng.stats.alpha[0] < 1
    assert [engine_speculative(target, head, p, 2, 16)[0] for p in prompts[:3]] == reference[:3]
    assert default_formats(head) == list(fam.mtp_formats)
    written = export_head(head, {"native": tmp_path / "export"}, path)  # validated against the target, read back
    assert (written["native"] / "model.safetensors").is_file()
    save_native(head, tmp_path / "head")
    again = load_native(tmp_path / "head", tied, args)
    pos = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(again.logits(again(out.hidden, ids, pos)), head.logits(head(out.hidden, ids, pos)))
