"""The MTP head: shapes, frozen shared tensors, cached decode == full forward, native round trip."""

import json

import pytest
import torch

from heads.registry import build_head
from artifacts.checkpoint import load_native
from artifacts.export import export_native, probe_logits
from inference_eval.model import tied_target
from tests.helpers import assert_cached_steps_equal_full_forward


pytestmark = pytest.mark.unit


@pytest.fixture
def head(tiny_target):
    tied, args, parts = tied_target(tiny_target)
    h = build_head({"type": "mtp", "num_modules": 1, "init": "copy"}, args, tied)
    h.reset_parameters(0, parts.first_input_norm)
    return h


def test_shapes_and_frozen_parts(head, tiny_target):
    args = head.args
    hidden = torch.randn(2, 9, args.hidden_size)
    tokens = torch.randint(0, args.vocab_size, (2, 9))
    out = head(hidden, tokens, torch.arange(9).expand(2, 9))
    assert out.shape == (2, 9, args.hidden_size)
    assert head.logits(out).shape == (2, 9, args.vocab_size)
    names = [n for n, _ in head.named_parameters()]
    assert not any("tied" in n or "embed" in n or "lm_head" in n for n in names)
    assert not any(k.startswith("tied") for k in head.state_dict())
    assert {"layers.0.enorm.weight", "layers.0.hnorm.weight", "layers.0.eh_proj.weight",
            "layers.0.layer.input_layernorm.weight", "layers.0.shared_head.norm.weight"} <= set(head.state_dict())
    # hnorm starts at 1 (`hnorm_init: ones`, the default), the final norm from the target's N_f; eh_proj's
    # hidden half is the identity
    assert torch.equal(head.layers[0].hnorm.weight, torch.ones_like(head.tied.norm_weight))
    assert torch.equal(head.layers[0].shared_head.norm.weight, head.tied.norm_weight)
    assert torch.equal(head.layers[0].eh_proj.weight[:, args.hidden_size:], torch.eye(args.hidden_size))
    loss = head.logits(out).logsumexp(-1).sum()
    loss.backward()
    assert head.tied.embed.grad is None and head.tied.lm_head.grad is None
    assert head.layers[0].eh_proj.weight.grad is not None


def test_cached_steps_equal_full_forward(head):
    assert_cached_steps_equal_full_forward(head)


def test_native_round_trip(head, tmp_path, tiny_target):
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = export_native(head, tmp_path / "native", {"name": "tiny"})
    assert sorted(p.name for p in out.iterdir()) == [".spechead-artifact.json", "checksums.json", "config.json",
                                                     "model.safetensors"]
    assert json.loads((out / ".spechead-artifact.json").read_text())["kind"] == "native-head"
    tied, args, _ = tied_target(tiny_target)
    again = load_native(out, tied, args)
    assert torch.equal(probe_logits(again), probe_logits(head))
    other = build_head({"type": "mtp"}, args, tied)
    other.reset_parameters(1)
    assert not torch.equal(probe_logits(other), probe_logits(head))


def test_unknown_head_type(tiny_target):
    tied, args, _ = tied_target(tiny_target)
    with pytest.raises(ValueError, match="unknown head type 'nope'"):
        build_head({"type": "nope"}, args, tied)
