"""Sampling and lossless rejection sampling (inference_eval/speculative.py): top-k / top-p applied
alike to draft and target, χ² goodness-of-fit of the emitted tokens against the target's exact
distribution (single positions, and the first generated tokens of a tiny model with a head and a
draft model), and top_k = 1 reproducing greedy decoding."""

import zlib
from collections import Counter

import pytest
import torch

from inference_eval.model import LlamaForCausalLM
from inference_eval.engine import engine_generate
from inference_eval.speculative import DraftModelProposer, Sampling, accept_rejection
from tests.helpers import engine_speculative
from tests.reference_decoding import reference_plain
from tests.test_heads_family import make


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """χ² quantile at 1 − 0.001 (z = Φ⁻¹(0.999)) by the Wilson–Hilferty approximation (within ~1% for df ≥ 3)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3


def chi2(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson χ² of observed counts against expected n·p, cells with expected < 5 pooled into one."""
    big = [c for c, p in probs.items() if n * p >= 5]
    stat = sum((counts.get(c, 0) - n * probs[c]) ** 2 / (n * probs[c]) for c in big)
    rest_p = 1 - sum(probs[c] for c in big)
    rest_obs = n - sum(counts.get(c, 0) for c in big)
    cells = len(big)
    if n * rest_p >= 5:
        stat += (rest_obs - n * rest_p) ** 2 / (n * rest_p)
        cells += 1
    elif rest_obs > 0 and rest_p <= 0:
        return float("inf"), cells - 1
    return stat, cells - 1


@pytest.mark.unit
def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    torch.testing.assert_close(Sampling(1.0, top_k=2).probs(logits), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(Sampling(1.0, top_p=0.65).probs(logits), torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(Sampling(1.0, top_p=0.4).probs(logits), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(Sampling(1.0, top_p=0.75).probs(logits), torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    hot = Sampling(0.5).probs(logits)
    torch.testing.assert_close(hot, torch.tensor([0.16, 0.09, 0.04, 0.01]) / 0.30)


def uniform_simplex(v: int, g: torch.Generator) -> torch.Tensor:
    """A Dirichlet(1, …, 1) draw from `g` (normalised Exp(1) variables): Dirichlet.sample() would draw
    from the global generator, whose state depends on the tests that ran before."""
    e = -torch.rand(v, generator=g, dtype=torch.float64).log()
    return (e / e.sum()).float()


@pytest.mark.unit
@pytest.mark.parametrize("case", ["random", "q_misses_tokens", "q_equals_p", "q_one_hot"])
def test_rejection_sampling_preserves_the_target_distribution(case):
    # a seed fixed per case: str hashes change between interpreters (PYTHONHASHSEED), crc32 does not
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    v, n = 6, 20000
    p = uniform_simplex(v, g)
    q = {"random": uniform_simplex(v, g),
         "q_misses_tokens": torch.tensor([0.5, 0.5, 0, 0, 0, 0]),
         "q_equals_p": p.clone(),
         "q_one_hot": torch.tensor([0, 0, 1.0, 0, 0, 0])}[case]
    first, drafted = Counter(), Counter()
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        a, tok = accept_rejection([d], q[None], torch.stack([p, p]), g)
        first[d if a == 1 else tok] += 1
        drafted[d] += 1
    probs = {i: float(p[i]) for i in range(v)}
    stat, df = chi2(first, probs, n)
    assert stat < chi2_critical(df), (case, stat, df)
    if case != "q_equals_p":  # the test has power: the drafts themselves are far from p
        assert chi2(drafted, probs, n)[0] > chi2_critical(df)


@pytest.fixture(scope="module")
def target(tiny_target):
    return LlamaForCausalLM.from_pretrained(tiny_target)


@torch.no_grad()
def _exact(target, prompt, sampling):
    """P(t1) and P(t2 | t1) of the target under `sampling`, as {(t1, t2): p}."""
    p1 = sampling.probs(target(torch.tensor([prompt])).logits[0, -1])
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = sampling.probs(target(torch.tensor([prompt + [t1]])).logits[0, -1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("proposer", ["mtp", "draft_model"])
def test_speculative_sampling_matches_the_targets_joint_distribution(target, tiny_target, proposer):
    sampling = Sampling(temperature=0.8, top_k=6, generator=torch.Generator().manual_seed(0))
    prompt = [5, 17, 42, 9]
    exact = _exact(target, prompt, Sampling(temperature=0.8, top_k=6))
    draft = make(tiny_target, "mtp3") if proposer == "mtp" else DraftModelProposer(target.truncated(1))
    n = 1000
    # the engine: n independent requests of the same prompt, 16 decoded together
    outs, eng = engine_generate(target, [prompt] * n, 3, draft, 2, sampling=sampling, max_batch=16)
    counts = Counter(tuple(out[:2]) for out in outs)
    rejected = sum(eng.stats.reached) - sum(eng.stats.accepted)
    stat, df = chi2(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df)
    assert rejected > n // 4  # the drafts really were rejected often: the residual path was exercised
    plain = Counter(tuple(reference_plain(target, prompt, 2, sampling=sampling)) for _ in range(n))
    assert chi2(plain, exact, n)[0] < chi2_critical(df)  # the reference sampler passes the same test


@pytest.mark.unit
def test_top_k_1_sampling_is_greedy(target, tiny_target):
    one = Sampling(temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(1))
    for prompt in ([1, 17, 33, 250, 9], list(range(40, 60))):
        greedy = reference_plain(target, prompt, 16)
        assert reference_plain(target, prompt, 16, sampling=one) == greedy
        for head in (make(tiny_target, "mtp3"), make(tiny_target, "medusa"), make(tiny_target, "eagle3")):
            assert engine_speculative(target, head, prompt, 3, 16, sampling=one)[0] == greedy
