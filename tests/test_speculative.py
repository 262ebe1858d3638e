"""Greedy speculative decoding: exact accept rule, output identical to plain greedy, exact τ/α on
stub drafts with a known acceptance pattern. Stub heads run through the reference batch-1 loop
(tests/reference_decoding.py); real heads and draft models through the product's decoder, the paged
engine with one slot (`engine_speculative`), against the reference loop's plain output."""

import pytest
import torch

from heads.registry import build_head
from inference_eval.model import LlamaForCausalLM, tied_target
from inference_eval.speculative import accept_greedy
from tests.helpers import engine_speculative
from tests.reference_decoding import reference_plain, reference_speculative
from tests.helpers import StubHead


pytestmark = pytest.mark.unit


def test_accept_greedy_cases():
    g = torch.tensor([5, 6, 9, 1])
    assert accept_greedy(torch.tensor([5, 6, 7]), g) == 2
    assert accept_greedy(torch.tensor([4, 6, 9]), g) == 0
    assert accept_greedy(torch.tensor([5, 6, 9]), g) == 3
    assert accept_greedy(torch.tensor([5]), g) == 1


class OracleHead(StubHead):
    """Drafts the target's own greedy continuation through the head interface, wrong on purpose at
    state positions p where `wrong(p)`. The 'hidden state' it returns just carries p."""


    def __init__(self, target, first_token: int, wrong=lambda p: False):
        self.target, self.seq, self.wrong = target, {0: first_token}, wrong

    def new_cache(self, batch, max_len):
        return None

    def __call__(self, hidden, tokens, positions, cache=None, start=0, depth=1):
        for p, t in zip(positions[0].tolist(), tokens[0].tolist()):
            self.seq[p + 1] = t  # the input at position p is t_{p+1}
        return positions[..., None].float()

    def logits(self, h, depth=1):
        p = int(h[0, -1, 0])
        ids = torch.tensor([[self.seq[i] for i in range(p + 2)]])
        pred = int(self.target(ids, logits="last").logits[0, -1].argmax())
        if self.wrong(p):
            pred = (pred + 1) % self.target.args.vocab_size
        out = torch.full((1, 1, self.target.args.vocab_size), -1e9)
        out[0, 0, pred] = 0.0
        return out


@pytest.fixture(scope="module")
def target(tiny_target):
    return LlamaForCausalLM.from_pretrained(tiny_target)


PROMPTS = [[1, 17, 33, 250, 9], [3], list(range(40, 77))]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_perfect_draft_gives_tau_k_plus_1(target, k):
    for prompt in PROMPTS:
        plain = reference_plain(target, prompt, 20)
        spec, st = reference_speculative(target, OracleHead(target, prompt[0]), prompt, k, 20)
        assert spec == plain
        assert st.alpha == [1.0] * k
        assert st.tau == k + 1
        assert st.steps == -(-(20 - 1) // (k + 1))  # the first token comes from prefill


@pytest.mark.parametrize("k", [1, 3])
def test_wrong_draft_gives_tau_1(target, k):
    prompt = PROMPTS[0]
    spec, st = reference_speculative(target, OracleHead(target, prompt[0], wrong=lambda p: True), prompt, k, 12)
    assert spec == reference_plain(target, prompt, 12)
    assert st.tau == 1.0 and st.alpha[0] == 0.0 and st.reached == [st.steps] + [0] * (k - 1)


def test_mixed_acceptance_pattern(target):
    prompt = PROMPTS[2]
    spec, st = reference_speculative(target, OracleHead(target, prompt[0], wrong=lambda p: p % 3 == 0), prompt, 3, 30)
    assert spec == reference_plain(target, prompt, 30)
    assert 1.0 < st.tau < 4.0 and 0 < st.alpha[0] < 1
    assert st.emitted == sum(st.accepted) + st.steps


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_real_head_speculative_equals_plain(target, tiny_target, k):
    tied, args, parts = tied_target(tiny_target)
    head = build_head({"type": "mtp"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    for prompt in PROMPTS:
        plain = reference_plain(target, prompt, 24)
        spec, st = engine_speculative(target, head, prompt, k, 24)
        ref, ref_st = reference_speculative(target, head, prompt, k, 24)
        assert spec == plain == ref
        # the engine's τ and per-position acceptance == the former batch-1 loop's on the same prompt
        assert (st.steps, st.emitted, st.reached, st.accepted) == (ref_st.steps, ref_st.emitted, ref_st.reached,
                                                                   ref_st.accepted)
        assert st.steps >= 1 and st.emitted >= st.steps


def test_stop_token_truncates_both(target):
    prompt = PROMPTS[0]
    full = reference_plain(target, prompt, 20)
    stop = {full[5]}
    first = full.index(full[5])
    assert reference_plain(target, prompt, 20, stop) == full[:first + 1]
    spec, _ = reference_speculative(target, OracleHead(target, prompt[0]), prompt, 3, 20, stop)
    assert spec == full[:first + 1]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_model_proposer_is_lossless(target, k):
    from inference_eval.speculative import DraftModelProposer

    draft = DraftModelProposer(target.truncated(1))
    for prompt in PROMPTS:
        plain = reference_plain(target, prompt, 20)
        spec, st = engine_speculative(target, draft, prompt, k, 20)
        ref, _ = reference_speculative(target, draft, prompt, k, 20)  # the reference loop: the same output
        # (not the same rounds: the engine's draft-model schedule, vLLM's, drafts in the prefill's step too)
        assert spec == plain == ref
        assert 1 <= st.steps <= len(plain) - 1  # each verification pass emits at least one token
    # the whole target as its own draft: every draft accepted. On vLLM's draft-model schedule (the default) the
    # prefill gives the first token and the draft drafts beside it: 4 verification passes of k + 1 tokens each
    # follow, none plain (the seed's schedule, speculate_beside_prefill=False: one plain pass more, 5 in all)
    full = DraftModelProposer(target.truncated(target.args.num_hidden_layers))
    spec, st = engine_speculative(target, full, PROMPTS[0], k, 4 * (k + 1) + 1)
    assert spec == reference_plain(target, PROMPTS[0], 4 * (k + 1) + 1)
    assert st.accepted == st.reached == [4] * k and st.steps == 4 and st.emitted == 4 * (k + 1)


def test_truncated_model_shares_weights(target):
    draft = target.truncated(1)
    assert draft.model.layers[0] is target.model.layers[0] and len(draft.model.layers) == 1
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([[3, 5, 7]])
    ref = target.lm_head(target.model.norm(target.model.layers[0](
        target.model.embed_tokens(ids), *target.model.rotary_emb(torch.arange(3)[None], torch.float32))))
    torch.testing.assert_close(draft(ids).logits, ref)
    with pytest.raises(ValueError, match="truncate"):
        target.truncated(0)
