"""Evaluation on stub drafts with a known acceptance pattern: figures, per-category τ and the report files."""

import json

import pytest

from inference_eval.evaluate import evaluate_head, write_report
from inference_eval.model import LlamaForCausalLM
from tests.helpers import StubHead
from tests.test_speculative import OracleHead


class SequentialOracle(StubHead):
    """An OracleHead per prompt: evaluate_head runs prompts in order, and each starts with a
    prefill call at position 0 (later calls start at the accepted length ≥ 1)."""


    def __init__(self, target, prompts, wrong):
        self.target, self.prompts, self.wrong, self.n, self.head = target, prompts, wrong, 0, None

    def new_cache(self, batch, max_len):
        return None

    def __call__(self, hidden, tokens, positions, cache=None, start=0, depth=1):
        if int(positions[0, 0]) == 0:
            self.head = OracleHead(self.target, self.prompts[self.n]["ids"][0], self.wrong)
            self.n += 1
        return self.head(hidden, tokens, positions, cache, start, depth)

    def logits(self, h, depth=1):
        return self.head.logits(h, depth)


@pytest.fixture(scope="module")
def target(tiny_target):
    return LlamaForCausalLM.from_pretrained(tiny_target)


PROMPTS = [{"ids": [5, 6, 7, 8], "category": "a"}, {"ids": [9, 10, 11], "category": "b"},
           {"ids": [30, 31], "category": "b"}]


def test_known_acceptance_patterns_and_report(target, tmp_path):
    perfect = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: False), PROMPTS, k=3,
                            max_new_tokens=13, stop_ids=set(), label="perfect", progress=False)
    # 13 new tokens per prompt: 1 from prefill + 3 verification passes × 4 tokens
    assert perfect.tau == 4.0 and perfect.alpha == [1.0, 1.0, 1.0]
    assert perfect.target_passes == 9 and perfect.new_tokens == 39 and perfect.prompts == 3
    assert perfect.per_category_tau == {"a": 4.0, "b": 4.0}
    never = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: True), PROMPTS, k=3,
                          max_new_tokens=13, stop_ids=set(), label="never", progress=False)
    assert never.tau == 1.0 and never.alpha == [0.0, 0.0, 0.0] and never.target_passes == 36
    # k = 1 with a perfect draft: every pass emits 2 tokens
    half = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: False), PROMPTS,
                         k=1, max_new_tokens=9, stop_ids=set(), label="k1", progress=False)
    assert half.tau == 2.0 and half.alpha == [1.0]

    report = {"target": "tiny", "target_dtype": "float32", "dataset": "stub", "turn": 1, "prompts": 3, "k": 3,
              "max_new_tokens": 13, "batch_size": 1, "results": {"perfect": vars(perfect), "never": vars(never)}}
    files = write_report(report, tmp_path / "eval.json")
    assert all(f.exists() for f in files) and len(files) == 4
    assert json.loads(files[0].read_text())["results"]["perfect"]["tau"] == 4.0
    md = files[1].read_text()
    assert "| perfect | 4.000 | 1.000 | 1.000 | 1.000 |" in md and "| never | 1.000 | 0.000 | 0.000 | 0.000 |" in md
    assert "| perfect | 4.000 | 4.000 |" in md  # per-category row
    assert files[2].read_bytes()[:4] == b"\x89PNG" and files[3].read_bytes()[:4] == b"\x89PNG"


def test_mtbench_turn2_uses_the_models_own_answer(target, tiny_target):
    from transformers import AutoTokenizer

    from data.assets import load_mtbench
    from inference_eval.evaluate import mtbench_prompts
    from inference_eval.speculative import generate_plain

    tok = AutoTokenizer.from_pretrained(tiny_target)
    first = mtbench_prompts(tok, 2, turn=1)
    second = mtbench_prompts(tok, 2, turn=2, target=target, max_new_tokens=6)
    questions = {q["question_id"]: q for q in load_mtbench()}
    for p1, p2 in zip(first, second):
        q = questions[p2["id"]]
        answer = tok.decode(generate_plain(target, p1["ids"], 6), skip_special_tokens=True).strip()
        text = tok.decode(p2["ids"])
        assert p2["ids"][: len(p1["ids"]) - 3] == p1["ids"][: len(p1["ids"]) - 3]  # same turn-1 question
        assert answer in text and q["turns"][1] in text and text.index(answer) < text.index(q["turns"][1])
    assert [p["category"] for p in first] == [p["category"] for p in second] and len({p["category"] for p in first}) == 2
