"""Conversation normalisation and template-agnostic loss masks.

Normalisation turns a raw record (ShareGPT ``{"conversations": [{"from", "value"}]}`` or OpenAI
style ``{"messages": [{"role", "content"}]}``) into a list of ``{"role", "content"}`` messages that
every chat template accepts, or into a reason for dropping it (see :func:`normalize_turns`).

Loss masks. A draft head learns to predict what the target generates, i.e. the assistant turns as
the target's chat template renders them. Instead of a regex per template (SpecForge, EAGLE), the
mask is derived from the template itself by rendering incrementally: for assistant message ``j``

    prefix_j = render(messages[:j], add_generation_prompt=True)   # everything before the answer
    full_j   = render(messages[:j + 1])                            # ... through its end of turn

The assistant span is the characters ``[len(prefix_j), len(full_j.rstrip()))``: the answer plus
the end-of-turn token(s) the template emits (``<|im_end|>``, ``<|eot_id|>``), without the trailing
whitespace some templates append after them (ChatML's ``\\n``): generation stops at the
end-of-turn token, so the target never produces that whitespace. The whole conversation is
tokenized once with offsets, and a token is in the mask iff its characters lie inside a span.

This needs an incremental template: each ``prefix_j`` must be a prefix of ``full_j`` and each
``full_j`` a prefix of the final rendering. Templates that rewrite earlier text depending on later
messages (e.g. dropping the reasoning of earlier turns) raise :class:`TemplateMaskError` rather
than producing a wrong mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
DropReason = Literal["malformed", "empty", "unknown_role", "no_assistant_turn"]

# Speaker names seen in ShareGPT dumps and OpenAI-style records, lower-cased.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}


# --------------------------------------------------------------------------------- normalisation


def normalize_sharegpt(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Normalise a ShareGPT record ``{"conversations": [{"from", "value"}, ...]}``."""
    return _normalize_list(record, "conversations", "from", "value")


def normalize_messages(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Normalise an OpenAI-style record ``{"messages": [{"role", "content"}, ...]}``."""
    return _normalize_list(record, "messages", "role", "content")


def normalize_record(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Dispatch on the record's shape; anything else is ``"malformed"``."""
    if isinstance(record, dict) and "conversations" in record:
        return normalize_sharegpt(record)
    if isinstance(record, dict) and "messages" in record:
        return normalize_messages(record)
    return None, "malformed"


def _normalize_list(
    record: dict, key: str, role_key: str, content_key: str
) -> tuple[list[Message] | None, DropReason | None]:
    turns = record.get(key) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, "malformed"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed"
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "malformed"
        if role.lower() not in ROLE_MAP:
            return None, "unknown_role"
        messages.append({"role": ROLE_MAP[role.lower()], "content": content})
    return normalize_turns(messages)


def normalize_turns(messages: list[Message]) -> tuple[list[Message] | None, DropReason | None]:
    """Apply the conversation policy to already role-mapped messages.

    1. No turns, or only blank ones -> ``"empty"``. Blank (whitespace-only) turns are removed
       first: an empty answer would teach only the end-of-turn token.
    2. Consecutive turns of one role are merged with ``"\\n\\n"`` (templates expect alternation).
    3. Assistant turns before the first user turn are dropped: they continue a conversation split
       elsewhere and have no prompt here. Leading system turns are kept; system turns later in the
       conversation are kept where they are (the template decides how to render them).
    4. Trailing user/system turns are dropped: they have no answer to learn.
    5. Nothing left with an assistant turn -> ``"no_assistant_turn"``.
    Contents are kept verbatim otherwise.
    """
    turns = [m for m in messages if m["content"].strip()]
    if not turns:
        return None, "empty"
    merged: list[Message] = []
    for m in turns:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(dict(m))
    first_user = next((i for i, m in enumerate(merged) if m["role"] == "user"), len(merged))
    kept = [m for i, m in enumerate(merged) if i >= first_user or m["role"] == "system"]
    while kept and kept[-1]["role"] != "assistant":
        kept.pop()
    if not any(m["role"] == "assistant" for m in kept):
        return None, "no_assistant_turn"
    return kept, None


# ----------------------------------------------------------------------------------- loss masks


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the target produces the token: assistant answers + end of turn


class TemplateMaskError(ValueError):
    """The chat template cannot be split into assistant spans by incremental rendering."""


class TooLongError(ValueError):
    """Truncation to ``max_length`` left no assistant token to learn from; skip the conversation."""


def tokenize_conversation(
    tokenizer, messages: Sequence[Message], max_length: int | None = None
) -> TokenizedConversation:
    """Token ids of the rendered conversation and its assistant loss mask.

    Truncation keeps the first ``max_length`` tokens (the prompt context of later answers lives
    at the start); if no assistant token survives, :class:`TooLongError` is raised.
    """
    text, spans = _assistant_spans(tokenizer, list(messages))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    loss_mask = [int(_inside(start, end, spans)) for start, end in offsets]
    if not any(loss_mask):
        raise TemplateMaskError("no token falls inside an assistant span of the rendered template")
    if max_length is not None and len(input_ids) > max_length:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if not any(loss_mask):
            raise TooLongError(f"no assistant token within the first {max_length} tokens")
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def tokenize_prompt(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation followed by the assistant generation prompt."""
    text = _render(tokenizer, list(messages), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The final rendering and the character spans of its assistant turns."""
    text = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:j], add_generation_prompt=True)
        full = _render(tokenizer, messages[: j + 1], add_generation_prompt=False)
        if not full.startswith(prefix):
            raise TemplateMaskError(f"message {j}: rendering up to the answer is not a prefix of the rendering with it")
        if not text.startswith(full):
            raise TemplateMaskError(f"message {j}: later messages change how messages[:{j + 1}] render")
        start, end = len(prefix), len(full.rstrip())
        # Guards against templates that drop or rewrite assistant content (beyond trimming).
        if message["content"].strip() not in text[start:end]:
            raise TemplateMaskError(f"message {j}: assistant content not found in its rendered span")
        spans.append((start, end))
    return text, spans


def _inside(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    # A token straddling a span edge belongs to the header/glue: it is never generated as a whole.
    return end > start and any(lo <= start and end <= hi for lo, hi in spans)
