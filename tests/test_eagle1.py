"""The EAGLE-1 head: EAGLE's key set, frozen shared tensors, the exact EAGLE-1 function, cached decode
== full forward, greedy speculative == plain greedy through the engine loop, training through the real
loss, native round trip."""

import pytest
import torch
import torch.nn.functional as F

from data.store import FeatureStore
from heads.registry import build_head
from artifacts.checkpoint import load_native, read_config
from heads.eagle1 import Eagle1Head
from artifacts.export import export_native, probe_logits
from inference_eval.model import LlamaForCausalLM, tied_target
from experiments.stages import run_precompute
from tests.helpers import engine_plain, engine_speculative
from tests.conftest import compose_config
from tests.helpers import assert_cached_steps_equal_full_forward, train_on_batch
from tests.numerics import assert_close_float32, decoder_chain
from train.data import collate
from train.losses import hidden_regression
from train.module import DraftHeadModule

pytestmark = pytest.mark.unit

EAGLE_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
              *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
              *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def perturbed(head: Eagle1Head, seed: int = 1, scale: float = 0.05) -> Eagle1Head:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return head


@pytest.fixture
def head(tiny_target):
    tied, args, parts = tied_target(tiny_target)
    h = build_head({"type": "eagle1"}, args, tied)
    h.reset_parameters(0, parts.first_input_norm)
    return h


def test_keys_shapes_and_frozen_parts(head):
    args, h = head.args, head.args.hidden_size
    assert set(head.state_dict()) == EAGLE_KEYS and len(head.layers) == 1
    assert head.fc.weight.shape == (h, 2 * h) and head.fc.bias.shape == (h,)
    assert head.cfg.to_dict() == {"type": "eagle1", "bias": True, "init": "copy", "init_std": 0.02}
    assert not any(n.startswith("tied") for n, _ in head.named_parameters())
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    out = head(torch.randn(2, 9, h), tokens, torch.arange(9).expand(2, 9))
    assert out.shape == (2, 9, h) and head.logits(out).shape == (2, 9, args.vocab_size)
    head.logits(out).logsumexp(-1).sum().backward()
    assert head.tied.embed.grad is None and head.tied.lm_head.grad is None and head.fc.weight.grad is not None
    # fc's feature half starts as the identity, the bias at zero
    assert torch.equal(head.fc.weight[:, h:], torch.eye(h)) and not head.fc.bias.any()
    no_bias = build_head({"type": "eagle1", "bias": False}, args, head.tied)
    assert set(no_bias.state_dict()) == EAGLE_KEYS - {"fc.bias"}


def test_is_exactly_eagle1(head):
    """x = fc[E t; N_f(H)] → layer without input norm → no final norm; logits = W_lm Ĥ; target F_{i+1}."""
    perturbed(head)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 6, head.args.hidden_size, generator=g)
    tokens = torch.randint(0, head.args.vocab_size, (1, 6), generator=g)
    pos = torch.arange(6).expand(1, 6)
    tied, layer = head.tied, head.layers[0]
    feat = tied.norm_weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + tied.eps))
    x = F.linear(torch.cat([tied.embed[tokens], feat], -1), head.fc.weight, head.fc.bias)
    cos, sin = head.rotary(pos, x.dtype)
    x = x + layer.self_attn(x, cos, sin)
    ref = x + layer.mlp(layer.post_attention_layernorm(x))
    out = head(hidden, tokens, pos)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.logits(out), ref @ tied.lm_head.T, atol=1e-5, rtol=1e-5)
    assert not hasattr(layer, "input_layernorm")
    torch.testing.assert_close(head.regression_target(hidden), feat, atol=1e-6, rtol=1e-6)
    # depth > 1 feeds the head's own Ĥ back as the feature, without N_f
    torch.testing.assert_close(head.fuse(out, tied.embed[tokens], depth=2),
                               head.fc(torch.cat([tied.embed[tokens], out], -1)))


def test_cached_steps_equal_full_forward(head):
    perturbed(head)
    assert_cached_steps_equal_full_forward(head)


@torch.no_grad()
def test_training_unroll_equals_engine_draft_chain(head):
    """Depth d > 1 feeds Ĥ back without N_f in both the training unroll and the engine's chain."""
    from heads.unroll import unroll

    perturbed(head)
    g = torch.Generator().manual_seed(4)
    t, depth = 10, 3
    hidden = torch.randn(1, t, head.args.hidden_size, generator=g)
    ids = torch.randint(0, head.args.vocab_size, (1, t), generator=g)
    outs = unroll(head, hidden, ids, depth)
    for i in range(t - depth):
        cache = head.new_cache(1, t + depth)
        h = head(hidden[:, : i + 1], ids[:, 1 : i + 2], torch.arange(i + 1).expand(1, i + 1), cache, 0)[:, -1:]
        assert_close_float32(outs[0][:, i], h[:, 0], terms=max(head.args.intermediate_size, t),
                             layers=depth * (decoder_chain(1) + 1))
        for d in range(2, depth + 1):
            pos = i + d - 1
            h = head(h, ids[:, i + d : i + d + 1], torch.tensor([[pos]]), cache, pos, depth=d)
            assert_close_float32(outs[d - 1][:, i], h[:, 0], terms=max(head.args.intermediate_size, t),
                                 layers=depth * (decoder_chain(1) + 1))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain(head, tiny_target, k):
    perturbed(head, scale=0.1)  # an imperfect draft: both accepts and rejects happen
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    accepted = rejected = 0
    for prompt in ([1, 17, 33, 250, 9], list(range(40, 77))):
        spec, st = engine_speculative(target, head, prompt, k, 24)
        assert spec == engine_plain(target, prompt, 24)
        assert st.emitted == sum(st.accepted) + st.steps and 1.0 <= st.tau <= k + 1
        accepted, rejected = accepted + sum(st.accepted), rejected + sum(st.reached) - sum(st.accepted)
    assert accepted > 0 and rejected > 0


def test_training_steps_reduce_the_loss(head, tiny_overrides):
    """A few optimizer steps through DraftHeadModule.compute_loss on a collated batch of the real store,
    with EAGLE-1's weights; the regression target is F_{i+1}, the KL teacher W_lm F_{i+1}."""
    store_dir, _ = run_precompute(compose_config(tiny_overrides))
    store = FeatureStore(store_dir)
    batch = collate([store[i] for i in range(4)])
    module = DraftHeadModule(head, w_hidden=1.0, w_kl=0.1, normed_regression=False, kl_chunk_size=256)
    with torch.no_grad():  # the regression part is SmoothL1(Ĥ, N_f(H_{i+1})), not against H_{i+1}
        out = module.compute_loss(batch)
        hidden, ids = batch["hidden"], batch["input_ids"]
        t = hidden.shape[1]
        pred = head(hidden[:, :-1], ids[:, 1:], torch.arange(t - 1).expand(hidden.shape[0], t - 1))
        mask = torch.zeros(pred.shape[:2], dtype=torch.bool)
        mask[:, :-1] = batch["loss_mask"][:, 2:] & batch["valid"][:, 2:]
        ref = hidden_regression(pred[mask], head.tied.final_norm(hidden[:, 1:][mask]), False) / mask.sum()
        torch.testing.assert_close(out["reg_d1"], ref)
    losses = train_on_batch(module, batch, 12)
    assert losses[-1] < 0.6 * losses[0], losses
    assert head.fc.bias.abs().max() > 0  # the bias trains


def test_native_round_trip(head, tmp_path, tiny_target):
    perturbed(head)
    out = export_native(head, tmp_path / "native", {"name": "tiny"})
    assert read_config(out)["head"] == {"type": "eagle1", "bias": True, "init": "copy", "init_std": 0.02}
    tied, args, _ = tied_target(tiny_target)
    again = load_native(out, tied, args)
    assert isinstance(again, Eagle1Head) and torch.equal(probe_logits(again), probe_logits(head))
    fresh = build_head({"type": "eagle1"}, args, tied)
    fresh.reset_parameters(0)
    assert not torch.equal(probe_logits(fresh), probe_logits(head))
