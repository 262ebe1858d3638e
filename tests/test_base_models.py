"""Base models: a chat template from a file (`data.chat_template`), plain text with a loss on every token
(`data.source=text`), and the missing-template error before any work (docs/pipeline.md "Base models and
chat templates")."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import pytest
import torch

from scripts.checks import ConfigError, check_before_work
from data.conversations import MissingTemplateError, normalize_record
from data.precompute import tokenize_all
from data.store import FeatureStore, StoreError
from experiments.stages import run_precompute
from tests.conftest import CONVERSATIONS, compose_config
from tests.test_first_hour import foreign_target, no_work, run_stage  # noqa: F401  (no_work: a fixture)

# "### User:" / "### Assistant:" headers and ChatML's end of turn: nothing like the target's own template
HASH_TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] | capitalize + ':\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '### Assistant:\n' }}{% endif %}")


def base_target(tiny_target, tmp_path):
    """The tiny target without any chat template (a base model)."""
    path = foreign_target(tiny_target, tmp_path)
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    tcfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def base_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert not tokenizer.chat_template
    return tokenizer


def masked_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


@pytest.mark.unit
def test_a_template_file_renders_a_base_models_conversations(tiny_target, tiny_overrides, tmp_path):
    base = base_target(tiny_target, tmp_path)
    template = tmp_path / "hash.jinja"
    template.write_text(HASH_TEMPLATE)
    overrides = [*tiny_overrides, f"target.path={base}", f"data.chat_template={template}", "data.max_samples=3"]
    store_dir, stats = run_precompute(compose_config(overrides))
    assert stats.samples == 3 and stats.rejected == {}  # the bad records come after the first 3
    store = FeatureStore(store_dir)
    tokenizer = base_tokenizer(base)
    for i in range(3):
        sample = store[i]
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].int().tolist()
        text = tokenizer.decode(ids)
        turns = CONVERSATIONS[i]["conversations"]
        assert text == "".join(f"### {'User' if t['from'] == 'human' else 'Assistant'}:\n{t['value']}<|im_end|>\n"
                               for t in turns)
        # the answers and their end of turn, not the headers nor the newline after <|im_end|>
        assert masked_text(tokenizer, ids, mask) == f"{turns[1]['value']}<|im_end|>{turns[3]['value']}<|im_end|>"
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert manifest["source"]["chat_template_sha256"] == hashlib.sha256(HASH_TEMPLATE.encode()).hexdigest()


@pytest.mark.unit
def test_another_template_file_is_another_store(tiny_overrides, tmp_path):
    """The template file's content is part of the store's `source`: a store precomputed with one template is
    never resumed with another (same file name, new content), and the same template resumes it."""
    template = tmp_path / "t.jinja"
    template.write_text(HASH_TEMPLATE)
    cfg = compose_config([*tiny_overrides, f"data.chat_template={template}", "data.max_samples=2"])
    store_dir, first = run_precompute(cfg)
    assert first.samples == 2
    _, again = run_precompute(cfg)
    assert again.samples == 0 and again.skipped_done == 2
    template.write_text(HASH_TEMPLATE.replace("### ", "## "))
    with pytest.raises(StoreError, match="differs in source"):
        run_precompute(cfg)
    # the target's own template (no data.chat_template) is another identity too
    with pytest.raises(StoreError, match="differs in source"):
        run_precompute(compose_config([*tiny_overrides, "data.max_samples=2", f"store_dir={store_dir}"]))


def write_texts(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


TEXTS = ["Once upon a time there was a tiny model.", "The quick brown fox jumps over the lazy dog. " * 3,
         "x" * 600]  # longer than data.max_length=512: truncated


def test_plain_text_end_to_end_on_a_base_model(tiny_target, tiny_overrides, tmp_path):
    """data.source=text on a target without a template: precompute (loss on every token but the first, bad
    records counted with file:line), training with engine validation, and evaluation on raw `prompt` records."""
    from artifacts.checkpoint import load_native
    from inference_eval.model import tied_target
    from artifacts.export import probe_logits
    from experiments.stages import run_evaluation, run_training

    base = base_target(tiny_target, tmp_path)
    data = tmp_path / "texts.jsonl"
    write_texts(data, [json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(TEXTS)] + [
        json.dumps({"text": 5}),  # 4: malformed
        json.dumps({"txt": "no text field"}),  # 5: malformed
        json.dumps({"text": "   \n "}),  # 6: empty
        "{not json",  # 7
        json.dumps({"text": "a\u0000b"}),  # 8: nul_char
        json.dumps({"id": "t0", "text": "same id again"}),  # 9: duplicate_id
        json.dumps({"text": "ends a turn <|im_end|> inside"}),  # 10: special_token (tokenize_all)
        json.dumps({"text": "a"}),  # 11: one token, nothing to learn
    ] + [json.dumps({"text": f"Document {i}: " + "counting words one two three. " * (1 + i % 4)})
         for i in range(8)])
    prompts = tmp_path / "prompts.jsonl"
    write_texts(prompts, [json.dumps({"prompt": "Once upon a time"}), json.dumps({"prompt": "The quick brown"})])
    cfg = compose_config([*tiny_overrides, f"target.path={base}", "data.source=text", f"data.path={data}",
                          "trainer.max_epochs=1",
                          "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}",
                          "evaluate.heads.untrained=null", "evaluate.simulated_tau=false"])
    store_dir, stats = run_precompute(cfg)
    assert stats.samples == 3 + 8
    assert stats.rejected == {"malformed": 2, "empty": 1, "not_json": 1, "nul_char": 1, "duplicate_id": 1,
                              "special_token": 1, "no_loss_tokens": 1}
    examples = json.loads((store_dir / "manifest.json").read_text())["rejected"]["examples"]
    assert {(e["reason"], e["where"]) for e in examples} == {
        ("malformed", f"{data}:4"), ("malformed", f"{data}:5"), ("empty", f"{data}:6"), ("not_json", f"{data}:7"),
        ("nul_char", f"{data}:8"), ("duplicate_id", f"{data}:9"), ("special_token", f"{data}:10"),
        ("no_loss_tokens", f"{data}:11")}
    tokenizer = base_tokenizer(base)
    store = FeatureStore(store_dir)
    for i, text in enumerate(TEXTS):  # the store keeps the source's order: t0, t1, t2 first
        sample = store[i]
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].int().tolist()
        assert ids == tokenizer(text)["input_ids"][:512]
        assert mask == [0] + [1] * (len(ids) - 1)  # every token but the first: nothing predicts it
    assert len(store[2]["input_ids"]) == 512
    assert sum(int(store[i]["loss_mask"].sum()) for i in range(len(store))) == stats.loss_tokens

    head_dir, metrics = run_training(cfg)
    assert metrics["train/loss"] > 0 and metrics["train/loss"] == metrics["train/loss"]
    # in-loop engine validation runs on texts too: its prompt is a text's first token (loss_mask's first 1)
    assert "engine_val/failed" not in metrics and metrics["engine_val/tau"] >= 1.0
    tied, args, _ = tied_target(base)
    trained, untrained = load_native(head_dir, tied, args), load_native(cfg.train.untrained_dir, tied, args)
    assert not torch.equal(probe_logits(trained), probe_logits(untrained))

    report = run_evaluation(cfg)
    assert report["prompts"] == 2 and set(report["results"]) == {"trained"}
    assert report["results"]["trained"]["tau"] >= 1.0


@pytest.mark.unit
def test_raw_prompts_without_a_template_and_templated_ones_with_it(tiny_target, tmp_path):
    from data.conversations import load_tokenizer
    from data.prompts import jsonl_prompts

    base = base_target(tiny_target, tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    write_texts(prompts, [json.dumps({"prompt": "Once upon a time", "id": "p"})])
    tokenizer = base_tokenizer(base)
    assert jsonl_prompts(tokenizer, prompts, None)[0]["ids"] == tokenizer("Once upon a time")["input_ids"]
    template = tmp_path / "hash.jinja"
    template.write_text(HASH_TEMPLATE)
    templated = load_tokenizer(base, template)
    assert templated.decode(jsonl_prompts(templated, prompts, None)[0]["ids"]) == \
        "### User:\nOnce upon a time<|im_end|>\n### Assistant:\n"
    chat = tmp_path / "chat.jsonl"
    write_texts(chat, [json.dumps({"messages": [{"role": "user", "content": "hi"}]})])
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: no `prompt` string; the target has no chat template"):
        jsonl_prompts(tokenizer, chat, None)


@pytest.mark.unit
def test_a_template_less_tokenizer_stops_tokenizing_with_the_cause(tiny_target, tmp_path):
    """The issue's symptom: every conversation rejected one by one ({'ValueError': 50}) hid the cause."""
    tokenizer = base_tokenizer(base_target(tiny_target, tmp_path))
    conversations = [(c["id"], normalize_record(c)[0]) for c in CONVERSATIONS[:3]]
    rejected = Counter()
    with pytest.raises(MissingTemplateError, match="no chat template.*data.chat_template=.*data.source=text"):
        tokenize_all(tokenizer, conversations, 512, rejected)
    assert rejected == Counter()
    assert [s[0] for s in tokenize_all(tokenizer, [("t", "plain text needs no template")], 512, rejected)] == ["t"]


@pytest.mark.unit
def test_template_problems_are_refused_before_any_work(tiny_target, tiny_overrides, tmp_path, no_work):
    base = base_target(tiny_target, tmp_path)
    at_base = [*tiny_overrides, f"target.path={base}"]
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    chat_prompts = tmp_path / "chat_prompts.jsonl"
    write_texts(chat_prompts, [json.dumps({"prompt": "raw"}), json.dumps({"messages": [{"role": "user",
                                                                                         "content": "hi"}]})])
    texts = tmp_path / "texts.jsonl"
    write_texts(texts, [json.dumps({"text": "plain"})])
    plain_txt = tmp_path / "book.txt"
    plain_txt.write_text("Chapter one.\n")
    cases = [
        ("precompute", [], r"no chat template .* the conversations of data\.source=jsonl cannot be rendered for "
                           r"precompute .* data\.chat_template=<file> .* data\.source=text"),
        ("regenerate", [], r"no chat template .* data\.chat_template=<file>"),
        ("evaluate", [], r"no chat template .* evaluate\.dataset=mtbench .* evaluate\.dataset=jsonl"),
        ("evaluate", ["evaluate.dataset=jsonl", f"evaluate.prompts_path={chat_prompts}"],
         rf"the record at {chat_prompts}:2 \(no `prompt` string"),
        ("pipeline", ["data.source=text", f"data.path={texts}"], r"evaluate\.dataset=mtbench"),
        ("precompute", [f"data.chat_template={tmp_path / 'missing.jinja'}"], "missing.jinja: no such file"),
        ("precompute", [f"data.chat_template={bad}"], r"bad\.jinja: line 1 not a valid Jinja template"),
        ("regenerate", ["data.source=text", f"data.path={texts}"], "no assistant turns to regenerate"),
        ("evaluate", ["data.source=text", f"data.path={texts}", "evaluate.dataset=sharegpt"],
         "data.source=text holds plain texts"),
        ("precompute", ["data.source=text", f"data.path={plain_txt}"], r"jq -Rs '\{text: \.\}'"),
    ]
    for stage, override, words in cases:
        with pytest.raises((ConfigError, ValueError), match=words):
            run_stage(stage, compose_config([*at_base, *override]))
    # what needs no template passes the checks: plain text, raw prompts, a template file
    good = tmp_path / "good.jinja"
    good.write_text(HASH_TEMPLATE)
    for stage, override in [("precompute", ["data.source=text", f"data.path={texts}"]),
                            ("precompute", [f"data.chat_template={good}"]),
                            ("regenerate", [f"data.chat_template={good}"])]:
        check_before_work(compose_config([*at_base, *override]), stage)


@pytest.mark.unit
def test_plain_text_keeps_the_tokenizers_bos_out_of_the_loss():
    """A tokenizer that adds BOS (Llama 3, Gemma): the ids are BOS + the text's, the BOS is masked out and
    the text's first token, which the target generates after BOS, is learned."""
    from tokenizers.processors import TemplateProcessing

    from data.conversations import tokenize_text
    from tests.tiny_tokenizer import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer("llama3")
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    plain = tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    tokenized = tokenize_text(tokenizer, "Hi there", max_length=5)
    assert tokenized.input_ids == [bos, *plain[:4]]
    assert tokenized.loss_mask == [0, 1, 1, 1, 1]
    assert tokenize_text(tokenizer, "H").input_ids == [bos, plain[0]]  # BOS + one token: one to learn
    with pytest.raises(ValueError, match=re.escape("holds the special token '<|eot_id|>' verbatim at character 4")) \
            as err:
        tokenize_text(tokenizer, "done<|eot_id|>")
    assert err.value.reason == "special_token"
