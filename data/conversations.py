"""Conversation normalisation and template-agnostic loss masks.

Normalisation turns a raw record (ShareGPT ``{"conversations": [{"from", "value"}]}`` or OpenAI
style ``{"messages": [{"role", "content"}]}``) into a list of ``{"role", "content"}`` messages that
every chat template accepts, or into a reason for dropping it (see :func:`normalize_turns`;
:func:`explain_record` also names the offending field). Strings no tokenizer can encode (a lone
surrogate) or that mark binary data (NUL) drop the record here, before any template sees it. OpenAI content
given as a list of text parts is joined into one string; a conversation with tool calls or tool results is
dropped as ``tool_turn`` (counted like every drop).

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

The template is the tokenizer's own, or the file ``data.chat_template`` names (:func:`load_tokenizer`
sets it on the tokenizer for every stage that renders conversations: precompute, regeneration,
evaluation) — a base model has none. A tokenizer without any template stops the run with
:class:`MissingTemplateError` instead of rejecting every conversation one by one.

Plain text (``data.source=text``, for base models) needs no template: :func:`tokenize_text` tokenizes
a document as the base model reads one (with the tokenizer's own BOS) and masks in every token but
the first, which nothing before it predicts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.jsonio import LONE_SURROGATE

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
DropReason = Literal["malformed", "empty", "unknown_role", "tool_turn", "no_assistant_turn", "lone_surrogate",
                     "nul_char"]

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

# Roles of tool results (OpenAI `tool` / `function`, Llama 3 `ipython`, GLM `observation`): a conversation with
# tool calls or their results is counted as `tool_turn`, not trained on — how each chat template renders tool calls
# differs, and a draft learnt on a half-rendered call would not match what the target generates.
TOOL_ROLES = ("tool", "function", "ipython", "observation")

# A str from JSON keeps a "\ud800" escape as a lone surrogate (a pair becomes one character): no
# UTF-8 encoding exists for it, and a fast tokenizer refuses the string with a TypeError.


@dataclass(frozen=True)
class Drop:
    """Why a record is not a conversation: a reason (counted) and a detail naming the field."""

    reason: DropReason
    detail: str


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages about ill-typed fields."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def check_text(value: str, where: str) -> Drop | None:
    """A string field's characters: a lone surrogate or a NUL makes the record unusable.

    NUL never occurs in real conversation text (the packaged ShareGPT has none); it marks binary
    data or UTF-16 decoded as UTF-8. Other control characters (ANSI escapes, bells, form feeds in
    pasted terminal output: 32 turns of the packaged ShareGPT) are text the tokenizer encodes byte by
    byte, and are kept.
    """
    bad = LONE_SURROGATE.search(value)
    if bad:
        return Drop("lone_surrogate", f"{where}: lone surrogate {ascii(bad.group())} at character {bad.start()}")
    nul = value.find("\x00")
    if nul >= 0:
        return Drop("nul_char", f"{where}: NUL character at character {nul}")
    return None


# --------------------------------------------------------------------------------- normalisation


def normalize_sharegpt(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Normalise a ShareGPT record ``{"conversations": [{"from", "value"}, ...]}``."""
    return _reason(*_normalize_list(record, "conversations", "from", "value"))


def normalize_messages(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Normalise an OpenAI-style record ``{"messages": [{"role", "content"}, ...]}``."""
    return _reason(*_normalize_list(record, "messages", "role", "content"))


def normalize_record(record: dict) -> tuple[list[Message] | None, DropReason | None]:
    """Dispatch on the record's shape; anything else is ``"malformed"``."""
    return _reason(*explain_record(record))


def explain_record(record: object) -> tuple[list[Message] | None, Drop | None]:
    """Like :func:`normalize_record`, with the drop's detail: which field is wrong and how."""
    if not isinstance(record, dict):
        return None, Drop("malformed", f"record: expected an object, got {json_type(record)}")
    if "conversations" in record:
        return _normalize_list(record, "conversations", "from", "value")
    if "messages" in record:
        return _normalize_list(record, "messages", "role", "content")
    return None, Drop("malformed", "record: no 'conversations' (ShareGPT) or 'messages' (OpenAI) field")


def _reason(messages: list[Message] | None, drop: Drop | None) -> tuple[list[Message] | None, DropReason | None]:
    return messages, drop.reason if drop else None


def _normalize_list(record: object, key: str, role_key: str, content_key: str
                    ) -> tuple[list[Message] | None, Drop | None]:
    turns = record.get(key) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, Drop("malformed", f"{key}: expected an array of turns, got {json_type(turns)}")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            return None, Drop("malformed", f"{where}: expected an object with {role_key!r} and {content_key!r}, "
                                           f"got {json_type(turn)}")
        tool = _tool_turn(turn, where, role_key)
        if tool:
            return None, tool
        turn = _text_parts(turn, content_key)
        for name in (role_key, content_key):
            if name not in turn:
                return None, Drop("malformed", f"{where}: no {name!r}")
            if not isinstance(turn[name], str):
                return None, Drop("malformed", f"{where}.{name}: expected a string, got {json_type(turn[name])}")
            bad = check_text(turn[name], f"{where}.{name}")
            if bad:
                return None, bad
        role, content = turn[role_key], turn[content_key]
        if role.lower() not in ROLE_MAP:
            return None, Drop("unknown_role", f"{where}.{role_key}: {ascii(role[:40])} (known: {', '.join(ROLE_MAP)})")
        messages.append({"role": ROLE_MAP[role.lower()], "content": content})
    return _policy(messages)


def _tool_turn(turn: dict, where: str, role_key: str) -> Drop | None:
    """A turn that is a tool result (a `TOOL_ROLES` role) or an assistant's tool call (`tool_calls` /
    `function_call` set), as the `tool_turn` drop naming it."""
    role = turn.get(role_key)
    if isinstance(role, str) and role.lower() in TOOL_ROLES:
        return Drop("tool_turn", f"{where}.{role_key}: {role!r} (a tool result; tool conversations are not trained on)")
    for key in ("tool_calls", "function_call"):
        if turn.get(key):
            return Drop("tool_turn", f"{where}.{key}: set (a tool call; tool conversations are not trained on)")
    return None


def _text_parts(turn: dict, content_key: str) -> dict:
    """OpenAI's content as a list of parts, `[{"type": "text", "text": ...}, ...]`, as the one string of its text
    parts joined; a list with another part (an image) or a part without its text stays a list: `malformed`."""
    parts = turn.get(content_key)
    if not isinstance(parts, list) or not parts:
        return turn
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return {**turn, content_key: "".join(p["text"] for p in parts)}
    return turn


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
    return _reason(*_policy(messages))


def _policy(messages: list[Message]) -> tuple[list[Message] | None, Drop | None]:
    turns = [m for m in messages if m["content"].strip()]
    if not turns:
        return None, Drop("empty", f"{len(messages)} turns, none with non-blank content")
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
        roles = ", ".join(m["role"] for m in turns[:8]) + (", ..." if len(turns) > 8 else "")
        return None, Drop("no_assistant_turn", f"no assistant turn after a user turn (non-blank roles: {roles})")
    return kept, None


# ----------------------------------------------------------------------------------- loss masks


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the target produces the token: assistant answers + end of turn


class TemplateMaskError(ValueError):
    """The chat template cannot be split into assistant spans by incremental rendering."""

    reason = "template_mask"


class TooLongError(ValueError):
    """Truncation to ``max_length`` left no assistant token to learn from; skip the conversation."""

    reason = "too_long"


class TemplateRenderError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``, e.g. "roles must
    alternate", or any other error while rendering it)."""

    reason = "template_error"


class TokenizerError(ValueError):
    """The tokenizer could not encode the rendered text."""

    reason = "tokenizer_error"


class SpecialTokenError(ValueError):
    """A message's content holds one of the tokenizer's special tokens verbatim: rendered and
    tokenized, it would become that control token (an end of turn mid-answer, a fake header), not
    text; tiktoken refuses such text for the same reason."""

    reason = "special_token"


class NoLossTokensError(ValueError):
    """A plain text of one token (after the tokenizer's BOS and truncation): nothing to learn."""

    reason = "no_loss_tokens"


class MissingTemplateError(RuntimeError):
    """The tokenizer has no chat template at all. Not one conversation's fault (a ValueError would reject
    each of them in turn and hide the cause), so it stops the caller."""


class TemplateFileError(ValueError):
    """`data.chat_template` names a file that is missing, unreadable or not a Jinja template."""


def read_chat_template(path: str | Path) -> str:
    """The text of a chat-template file (`data.chat_template`), checked to compile as the Jinja template
    transformers renders (its sandbox and extensions)."""
    path = Path(str(path)).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TemplateFileError(f"data.chat_template={path}: no such file (a Jinja chat template, e.g. the "
                                "chat_template.jinja of the chat model to mimic)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TemplateFileError(f"data.chat_template={path}: cannot be read as UTF-8 text ({e})") from e
    if not text.strip():
        raise TemplateFileError(f"data.chat_template={path}: an empty file")
    from jinja2 import TemplateError

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # older transformers: the same sandbox, without its custom {% generation %} tag
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def _compile_jinja_template(source):
            return ImmutableSandboxedEnvironment(extensions=[loopcontrols]).from_string(source)
    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise TemplateFileError(f"data.chat_template={path}:{line} not a valid Jinja template "
                                f"({type(e).__name__}: {e})") from e
    return text


def chat_template_sha256(path: str | Path | None) -> str | None:
    """The sha256 of the `data.chat_template` file's text (None when unset): part of a store's `source`
    and of regenerated records' settings, so that nothing made with another template is resumed."""
    return hashlib.sha256(read_chat_template(path).encode()).hexdigest() if path else None


def load_tokenizer(target_dir: str | Path, chat_template: str | Path | None = None):
    """The target's tokenizer, with its chat template replaced by the `data.chat_template` file when set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _require_template(tokenizer) -> None:
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        raise MissingTemplateError(
            "the target's tokenizer has no chat template, so no conversation can be rendered (a base model?): "
            "set data.chat_template=<a Jinja template file>, put one into the target directory as "
            "chat_template.jinja, or train on plain text with data.source=text")


def tokenize_sample(tokenizer, content: Sequence[Message] | str, max_length: int | None = None
                    ) -> TokenizedConversation:
    """A source item (data/sources.py `load_conversations`): messages, or a plain text (data.source=text)."""
    if isinstance(content, str):
        return tokenize_text(tokenizer, content, max_length)
    return tokenize_conversation(tokenizer, content, max_length)


def tokenize_text(tokenizer, text: str, max_length: int | None = None) -> TokenizedConversation:
    """Token ids of a plain text as a base model reads a document (the tokenizer's own special tokens
    added: BOS for Llama or Gemma tokenizers, none for SmolLM2's), truncated to `max_length`; the loss
    mask is 1 on every token but the first, which nothing before it predicts (a BOS is never generated).
    A special token written verbatim in the text is refused as in a conversation (SpecialTokenError)."""
    _check_special_tokens(tokenizer, [{"role": "text", "content": text}])
    input_ids = list(_encode(tokenizer, text, add_special_tokens=True)["input_ids"])
    if max_length is not None:
        input_ids = input_ids[:max_length]
    if len(input_ids) < 2:
        raise NoLossTokensError(f"the text is {len(input_ids)} token(s) (max_length {max_length}): nothing follows "
                                "the first token to learn")
    return TokenizedConversation(input_ids=input_ids, loss_mask=[0] + [1] * (len(input_ids) - 1))


def tokenize_conversation(
    tokenizer, messages: Sequence[Message], max_length: int | None = None
) -> TokenizedConversation:
    """Token ids of the rendered conversation and its assistant loss mask.

    Truncation keeps the first ``max_length`` tokens (the prompt context of later answers lives
    at the start); if no assistant token survives, :class:`TooLongError` is raised. Every way a
    conversation can fail is a ``ValueError`` subclass with a ``reason`` (TemplateMaskError,
    TooLongError, TemplateRenderError, TokenizerError, SpecialTokenError): errors raised inside the
    template or the tokenizer are converted here, so that a caller can reject one conversation and
    go on with the others. A tokenizer with no template at all raises :class:`MissingTemplateError`.
    """
    _require_template(tokenizer)
    _check_special_tokens(tokenizer, messages)
    text, spans = _assistant_spans(tokenizer, list(messages))
    encoding = _encode(tokenizer, text, return_offsets_mapping=True)
    input_ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    loss_mask = [int(_inside(start, end, spans)) for start, end in offsets]
    if not any(loss_mask):
        raise TemplateMaskError("no token falls inside an assistant span of the rendered template")
    if max_length is not None and len(input_ids) > max_length:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if not any(loss_mask):
            raise TooLongError(f"no assistant token within the first {max_length} tokens "
                               f"(the conversation has {len(offsets)})")
    return TokenizedConversation(input_ids=input_ids, loss_mask=loss_mask)


def tokenize_prompt(tokenizer, messages: Sequence[Message]) -> list[int]:
    """Token ids of the conversation followed by the assistant generation prompt.

    The template's and the tokenizer's own exceptions pass through unchanged (regeneration stops a
    conversation at jinja's ``TemplateError``); a tokenizer with no template raises
    :class:`MissingTemplateError`."""
    _require_template(tokenizer)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_special_tokens(tokenizer, messages: Sequence[Message]) -> None:
    specials = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            specials.add(str(token))
    for j, message in enumerate(messages):
        hits = [(message["content"].find(special), special) for special in specials if special]
        hits = [hit for hit in hits if hit[0] >= 0]
        if hits:
            at, special = min(hits)  # the first one in the text: the same report whatever the set's order
            raise SpecialTokenError(f"message {j} ({message['role']}) holds the special token {special!r} "
                                    f"verbatim at character {at}")


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except MemoryError:
        raise
    except Exception as e:  # jinja's TemplateError (raise_exception), TypeError, ...: this conversation only
        raise TemplateRenderError(f"the chat template refused messages[:{len(messages)}]: "
                                  f"{type(e).__name__}: {e}") from e


def _encode(tokenizer, text: str, add_special_tokens: bool = False, **kwargs):
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)
    except MemoryError:
        raise
    except Exception as e:  # e.g. TypeError "TextEncodeInput must be Union[...]" for a lone surrogate
        raise TokenizerError(f"the tokenizer refused the rendered text ({len(text)} characters): "
                             f"{type(e).__name__}: {e}") from e


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
