"""Tests for conversation normalisation and template-agnostic assistant loss masks."""

from __future__ import annotations

import collections

import pytest

from data.conversations import (
    TemplateMaskError,
    TokenizedConversation,
    TooLongError,
    explain_record,
    normalize_messages,
    normalize_record,
    normalize_sharegpt,
    tokenize_conversation,
    tokenize_prompt,
)
from tests.tiny_tokenizer import make_tiny_tokenizer

TEMPLATES = ["chatml", "llama3", "plain-default-system"]
# What each template renders around an answer: (text before the content inside the span, end of turn)
SPAN_FORM = {"chatml": ("", "<|im_end|>"), "llama3": ("", "<|eot_id|>"), "plain-default-system": (" ", "<|endoftext|>")}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def sharegpt(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def masked_runs(tokenizer, tokenized: TokenizedConversation) -> list[str]:
    """Decoded text of each contiguous run of loss-mask ones."""
    runs, current = [], []
    for token, bit in zip(tokenized.input_ids, tokenized.loss_mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(r) for r in runs]


# -------------------------------------------------------------------------------- normalisation


@pytest.mark.unit
def test_sharegpt_roles_are_mapped():
    messages, reason = normalize_sharegpt(
        sharegpt(("system", "S"), ("human", "a"), ("gpt", "b"), ("user", "c"), ("chatgpt", "d"),
                 ("Human", "e"), ("bard", "f"), ("human", "g"), ("bing", "h"), ("human", "i"), ("assistant", "j"))
    )
    assert reason is None
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 5
    assert [m["content"] for m in messages] == list("Sabcdefghij")


@pytest.mark.unit
@pytest.mark.parametrize(
    "record, reason",
    [
        ({"id": "x"}, "malformed"),
        ({"conversations": "hello"}, "malformed"),
        ({"conversations": ["hello"]}, "malformed"),
        (sharegpt(("human", "a"), ("gpt", None)), "malformed"),
        (sharegpt(("human", "a"), ("gpt", ["b"])), "malformed"),
        ({"conversations": [{"value": "a"}]}, "malformed"),
        (sharegpt(), "empty"),
        (sharegpt(("human", " "), ("gpt", "\n")), "empty"),
        (sharegpt(("human", "a"), ("robot", "b")), "unknown_role"),
        (sharegpt(("human", "a")), "no_assistant_turn"),
        (sharegpt(("system", "s"), ("human", "a")), "no_assistant_turn"),
        (sharegpt(("gpt", "continued"), ("human", "a")), "no_assistant_turn"),
        (sharegpt(("gpt", "only answers")), "no_assistant_turn"),
        (sharegpt(("human", "a"), ("gpt", "   ")), "no_assistant_turn"),
    ],
)
def test_sharegpt_drop_reasons(record, reason):
    assert normalize_sharegpt(record) == (None, reason)


@pytest.mark.unit
def test_leading_assistant_turns_are_dropped_but_system_kept():
    got, _ = normalize_sharegpt(sharegpt(("gpt", "tail of a split chat"), ("human", "q"), ("gpt", "a")))
    assert got == [user("q"), assistant("a")]
    got, _ = normalize_sharegpt(sharegpt(("system", "s"), ("gpt", "tail"), ("gpt", "more"), ("human", "q"), ("gpt", "a")))
    assert got == [system("s"), user("q"), assistant("a")]


@pytest.mark.unit
def test_same_role_turns_merge_blank_turns_vanish_trailing_user_dropped():
    got, reason = normalize_sharegpt(
        sharegpt(("human", "q1"), ("human", "q2"), ("gpt", ""), ("human", "q3"), ("gpt", "a1"), ("gpt", "a2 "),
                 ("human", "unanswered"), ("system", "late"))
    )
    assert reason is None
    assert got == [user("q1\n\nq2\n\nq3"), assistant("a1\n\na2 ")]


@pytest.mark.unit
def test_openai_messages_and_dispatch():
    record = {"messages": [system("s"), user("q"), assistant("a"), user("again")]}
    assert normalize_messages(record) == ([system("s"), user("q"), assistant("a")], None)
    assert normalize_record(record) == normalize_messages(record)
    assert normalize_record(sharegpt(("human", "q"), ("gpt", "a"))) == ([user("q"), assistant("a")], None)
    assert normalize_record({"text": "raw"}) == (None, "malformed")
    assert normalize_record({"messages": [{"role": "user", "content": [{"type": "text"}]}]}) == (None, "malformed")
    assert normalize_record({"messages": [{"role": "tool", "content": "x"}]}) == (None, "tool_turn")
    assert normalize_record({"messages": [{"role": "robot", "content": "x"}]}) == (None, "unknown_role")


@pytest.mark.unit
def test_tool_turns_and_text_parts():
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "function": {"name": "f"}}]}
    got, drop = explain_record({"messages": [user("q"), call, {"role": "tool", "content": "42"}, assistant("a")]})
    assert got is None and drop.reason == "tool_turn" and drop.detail.startswith("messages[1].tool_calls")
    got, drop = explain_record({"conversations": [{"from": "human", "value": "q"}, {"from": "function", "value": "r"}]})
    assert got is None and drop.reason == "tool_turn" and drop.detail.startswith("conversations[1].from: 'function'")
    # a null tool_calls (a parquet column other rows fill) is no tool call
    plain = {**assistant("a"), "tool_calls": None}
    assert normalize_record({"messages": [user("q"), plain]}) == ([user("q"), assistant("a")], None)
    parts = {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}
    assert normalize_record({"messages": [parts, assistant("a")]}) == ([user("two parts"), assistant("a")], None)
    image = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}]}
    got, drop = explain_record({"messages": [image, assistant("a")]})
    assert got is None and drop.reason == "malformed" and "messages[0].content" in drop.detail


def test_real_sharegpt_policy_counts():
    from data.assets import load_sharegpt

    results = [normalize_sharegpt(r) for r in load_sharegpt()]
    assert collections.Counter(reason for _, reason in results) == {None: 17390, "no_assistant_turn": 155, "empty": 126}
    for messages, _ in results:
        if messages is not None:
            roles = [m["role"] for m in messages if m["role"] != "system"]
            assert roles[0] == "user" and roles[-1] == "assistant"
            assert all(a != b for a, b in zip(roles, roles[1:]))


# ----------------------------------------------------------------------------- masks, tiny


@pytest.mark.unit
@pytest.mark.parametrize("template", TEMPLATES)
def test_mask_is_exactly_the_assistant_turns(template):
    tokenizer = make_tiny_tokenizer(template)
    assert len(tokenizer) < 400
    messages = [user("What is é+1?"), assistant("It is é1."), user("Thanks USER"), assistant("You're welcome!")]
    tokenized = tokenize_conversation(tokenizer, messages)
    lead, end = SPAN_FORM[template]
    assert masked_runs(tokenizer, tokenized) == [lead + "It is é1." + end, lead + "You're welcome!" + end]
    masked_text = "".join(masked_runs(tokenizer, tokenized))
    for not_learned in ["What is", "Thanks", "helpful", "curious", "user", "assistant"]:
        assert not_learned not in masked_text
    assert len(tokenized.input_ids) == len(tokenized.loss_mask)
    assert tokenizer.decode(tokenized.input_ids) == tokenizer.apply_chat_template(messages, tokenize=False)


@pytest.mark.unit
@pytest.mark.parametrize("template", TEMPLATES)
def test_mask_with_explicit_system_prompt(template):
    tokenizer = make_tiny_tokenizer(template)
    messages = [system("Be terse."), user("Hi"), assistant("Hey.")]
    tokenized = tokenize_conversation(tokenizer, messages)
    lead, end = SPAN_FORM[template]
    assert masked_runs(tokenizer, tokenized) == [lead + "Hey." + end]
    rendered = tokenizer.decode(tokenized.input_ids)
    assert "Be terse." in rendered and "helpful" not in rendered and "curious" not in rendered


@pytest.mark.unit
def test_chatml_default_system_prompt_and_newline_after_end_of_turn():
    tokenizer = make_tiny_tokenizer("chatml")
    tokenized = tokenize_conversation(tokenizer, [user("Hi"), assistant("Hey.")])
    text = tokenizer.decode(tokenized.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert text.endswith("Hey.<|im_end|>\n")
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    assert tokenized.input_ids[-2:] == [tokenizer.eos_token_id, newline]
    assert tokenized.loss_mask[-2:] == [1, 0]  # the end of turn is learned, the glue after it is not


@pytest.mark.unit
def test_prompt_tokens_are_the_prefix_of_the_training_tokens():
    tokenizer = make_tiny_tokenizer("llama3")
    messages = [user("Hi"), assistant("Hey."), user("Again"), assistant("Sure.")]
    full = tokenize_conversation(tokenizer, messages)
    for j in (1, 3):
        prompt = tokenize_prompt(tokenizer, messages[:j])
        assert full.input_ids[: len(prompt)] == prompt
        assert full.loss_mask[len(prompt) - 1] == 0 and full.loss_mask[len(prompt)] == 1


@pytest.mark.unit
def test_truncation_keeps_prefix_or_raises():
    tokenizer = make_tiny_tokenizer("chatml")
    messages = [user("Hi"), assistant("Hey."), user("More"), assistant("Fine.")]
    full = tokenize_conversation(tokenizer, messages)
    first_one = full.loss_mask.index(1)
    cut = tokenize_conversation(tokenizer, messages, max_length=first_one + 2)
    assert cut.input_ids == full.input_ids[: first_one + 2] and sum(cut.loss_mask) == 2
    assert tokenize_conversation(tokenizer, messages, max_length=10_000) == full
    with pytest.raises(TooLongError):
        tokenize_conversation(tokenizer, messages, max_length=first_one)


@pytest.mark.unit
def test_non_incremental_template_raises():
    tokenizer = make_tiny_tokenizer("chatml")
    messages = [user("Hi"), assistant("Hey."), user("More"), assistant("Fine.")]
    # Earlier text depends on the number of messages: prefixes of the final text shift.
    tokenizer.chat_template = (
        "{{ 'turns=' ~ (messages | length) ~ '\n' }}{% for m in messages %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(TemplateMaskError, match="message 1"):
        tokenize_conversation(tokenizer, messages)
    # The last answer is rendered differently from earlier ones (reasoning-stripping style).
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ 'assistant: [hidden]<|im_end|>' }}"
        "{% else %}{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(TemplateMaskError, match="message 1: later messages change"):
        tokenize_conversation(tokenizer, messages)


@pytest.mark.unit
def test_template_without_assistant_content_raises():
    tokenizer = make_tiny_tokenizer("chatml")
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(TemplateMaskError):
        tokenize_conversation(tokenizer, [user("Hi"), assistant("Hey.")])


@pytest.mark.unit
def test_refusals_raise_a_value_error_with_a_reason_but_prompts_keep_jinjas_error():
    """tokenize_conversation turns what the template or tokenizer raises into a ValueError with a
    `reason` (precompute rejects that one conversation); tokenize_prompt lets jinja's TemplateError
    through, which regeneration catches to stop a conversation at the turn the template refuses."""
    from jinja2.exceptions import TemplateError

    from data.conversations import SpecialTokenError, TemplateRenderError, TokenizerError

    tokenizer = make_tiny_tokenizer("chatml")
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                               "{{ raise_exception('no late system') }}{% endif %}{% endfor %}"
                               + tokenizer.chat_template)
    late_system = [user("Hi"), assistant("Hey."), {"role": "system", "content": "s"}, user("q"), assistant("a")]
    with pytest.raises(TemplateRenderError, match="refused messages\\[:5\\]: TemplateError: no late system") as err:
        tokenize_conversation(tokenizer, late_system)
    assert err.value.reason == "template_error"
    with pytest.raises(TemplateError, match="no late system"):
        tokenize_prompt(tokenizer, late_system[:4])
    with pytest.raises(TokenizerError, match="TextEncodeInput") as err:
        tokenize_conversation(tokenizer, [user("a\ud800"), assistant("b")])
    assert err.value.reason == "tokenizer_error"
    with pytest.raises(SpecialTokenError, match="message 0 \\(user\\) holds the special token '<\\|endoftext\\|>' "
                                                "verbatim at character 3") as err:
        tokenize_conversation(tokenizer, [user("hi <|endoftext|> <|im_end|>"), assistant("b")])
    assert err.value.reason == "special_token"
    assert TooLongError("x").reason == "too_long" and TemplateMaskError("x").reason == "template_mask"


@pytest.mark.unit
def test_explain_record_names_the_field():
    from data.conversations import Drop, explain_record

    assert explain_record([]) == (None, Drop("malformed", "record: expected an object, got array"))
    assert explain_record({"messages": [{"role": "user", "content": 1.5}]}) == (
        None, Drop("malformed", "messages[0].content: expected a string, got number"))
    assert explain_record({"conversations": [{"from": "human", "value": "a\x00"}]}) == (
        None, Drop("nul_char", "conversations[0].value: NUL character at character 1"))
    assert explain_record({"conversations": [{"from": "human", "value": "\udfff"}]})[1].reason == "lone_surrogate"
    assert explain_record({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) == (
        [user("q"), assistant("a")], None)
    assert normalize_record({"conversations": [{"from": "human", "value": "\ud800"}]}) == (None, "lone_surrogate")


# --------------------------------------------------------------------------- masks, SmolLM2


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from data.assets import ensure_smollm2_checkpoint

    return AutoTokenizer.from_pretrained(ensure_smollm2_checkpoint())


def test_smollm2_golden(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    messages = [user("What is 2+2?"), assistant("2+2 equals 4."), user("And 3+3?"), assistant("6.")]
    tokenized = tokenize_conversation(tokenizer, messages)
    system_ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198]
    turn1 = [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]
    answer1 = [34, 27, 34, 16473, 216, 36, 30, 2]
    turn2 = [198, 1, 4093, 198, 3528, 216, 35, 27, 35, 47, 2, 198, 1, 520, 9531, 198]
    answer2 = [38, 30, 2]
    assert tokenized.input_ids == system_ids + turn1 + answer1 + turn2 + answer2 + [198]
    assert tokenized.loss_mask == [0] * 37 + [1] * 8 + [0] * 16 + [1] * 3 + [0]
    assert masked_runs(tokenizer, tokenized) == ["2+2 equals 4.<|im_end|>", "6.<|im_end|>"]
    assert tokenize_prompt(tokenizer, messages[:1]) == system_ids + turn1
    assert tokenizer.eos_token_id == 2


def test_smollm2_masks_on_real_sharegpt(smollm2_tokenizer):
    from data.assets import load_sharegpt

    tokenizer = smollm2_tokenizer
    conversations = [m for m, _ in map(normalize_sharegpt, load_sharegpt(limit=120)) if m is not None]
    assert len(conversations) > 100
    for messages in conversations:
        tokenized = tokenize_conversation(tokenizer, messages)
        runs = masked_runs(tokenizer, tokenized)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert runs == [a + "<|im_end|>" for a in answers]
