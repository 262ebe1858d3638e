"""Prompt sets that stages decode — MT-Bench first or second turns, held-out ShareGPT conversations, a
JSONL file — tokenized for the target's chat template, and the target's stop tokens. Evaluation,
in-loop validation and regeneration take their prompts and stops from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.jsonio import read_jsonl
from data.assets import load_mtbench
from data.conversations import normalize_record, tokenize_prompt
from data.sources import DataConfig, load_conversations


def sharegpt_prompts(tokenizer, data: DataConfig, num_prompts: int | None) -> list[dict[str, Any]]:
    """Held-out ShareGPT prompts: the conversations right after the training data's range
    [skip, skip + max_samples), each up to its first assistant turn."""
    out = []
    for sid, messages in load_conversations(data.held_out(num_prompts)).items:
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out.append({"ids": tokenize_prompt(tokenizer, messages[:first]), "category": "sharegpt", "id": sid})
    return out


def jsonl_prompts(tokenizer, path: str | Path, num_prompts: int | None) -> list[dict[str, Any]]:
    """Prompts from a JSONL file: one object per line with `prompt` (a user message),
    `messages` / `conversations` (the prompt is everything before the first assistant turn) or
    `input_ids` (token ids, taken as they are: engine validation's `engine_val/prompts.jsonl`);
    optional `category` and `id`. A tokenizer without a chat template (a base model) takes `prompt`
    records as the raw text it continues (with its BOS, as data.source=text tokenizes), nothing else."""
    raw = not getattr(tokenizer, "chat_template", None)
    out = []
    path = Path(path)
    for rec, where in read_jsonl(path):
        n = int(where.rpartition(":")[2])
        if isinstance(rec, dict) and "input_ids" in rec:  # already tokenized: taken as it is
            ids = rec["input_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t
                                                          for t in ids)):
                raise ValueError(f"{where}: `input_ids` must be a non-empty list of token ids (non-negative integers)")
            out.append({"ids": list(ids), "category": str(rec.get("category", "jsonl")), "id": str(rec.get("id", n))})
            if num_prompts and len(out) >= num_prompts:
                break
            continue
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            messages = [{"role": "user", "content": rec["prompt"]}]
        elif raw:
            raise ValueError(f"{where}: no `prompt` string; the target has no chat template, so only "
                             "`prompt` records (raw text) can be used — or set data.chat_template=<file>")
        else:
            # a prompt need not have an answer: normalise the turns with a placeholder reply appended,
            # then keep everything before the first assistant turn
            padded = dict(rec) if isinstance(rec, dict) else {}
            for key, role, content, reply in (("conversations", "from", "value", "gpt"),
                                              ("messages", "role", "content", "assistant")):
                if isinstance(padded.get(key), list):
                    padded[key] = [*padded[key], {role: reply, content: "…"}]
            messages, reason = normalize_record(padded)
            if messages is None:
                raise ValueError(f"{where}: no `prompt` string and no usable `messages`/`conversations` ({reason})")
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            messages = messages[:first]
        if not messages:
            raise ValueError(f"{where}: the prompt is empty (the record starts with an assistant turn)")
        ids = list(tokenizer(rec["prompt"])["input_ids"]) if raw else tokenize_prompt(tokenizer, messages)
        out.append({"ids": ids, "category": str(rec.get("category", "jsonl")),
                    "id": str(rec.get("id", n))})
        if num_prompts and len(out) >= num_prompts:
            break
    return out


def mtbench_prompts(tokenizer, num_prompts: int | None, turn: int = 1, target=None, max_new_tokens: int = 64,
                    stop_ids: set[int] = frozenset()) -> list[dict[str, Any]]:
    """MT-Bench prompts, taken round-robin over the 8 categories so a subset stays balanced.
    Turn 2 follows MT-Bench: the model's own (greedy) turn-1 answer, then the second question."""
    cats: dict[str, list[dict]] = {}
    for q in load_mtbench():
        cats.setdefault(q["category"], []).append(q)
    ordered = [q for group in zip(*cats.values()) for q in group]
    ordered = ordered[:num_prompts] if num_prompts else ordered
    conversations = [[{"role": "user", "content": q["turns"][0]}] for q in ordered]
    if turn == 2:
        if target is None:
            raise ValueError("MT-Bench turn 2 needs the target to answer turn 1")
        from inference_eval.engine import engine_generate

        # the target's greedy turn-1 answers, all questions in one batch of the engine
        answers, _ = engine_generate(target, [tokenize_prompt(tokenizer, m) for m in conversations], max_new_tokens,
                                     stop_ids=stop_ids, max_batch=8)
        for messages, answer, q in zip(conversations, answers, ordered):
            messages += [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True).strip()},
                         {"role": "user", "content": q["turns"][1]}]
    return [{"ids": tokenize_prompt(tokenizer, messages), "category": q["category"], "id": q["question_id"],
             "turn": turn} for messages, q in zip(conversations, ordered)]


def stop_token_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):  # ChatML, Llama 3, Qwen, Gemma
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids


DATASETS = ("mtbench", "sharegpt", "jsonl")


@dataclass(frozen=True)
class PromptSet:
    """The prompts an evaluation decodes (`evaluate.dataset`, `num_prompts`, `turns`, `prompts_path`): MT-Bench's
    first turns (turn 2 after the target's own greedy turn-1 answer of `max_new_tokens` tokens), the held-out
    conversations right after `data`'s training range, or a JSONL file of prompts."""

    dataset: str = "mtbench"
    num_prompts: int | None = None  # None: every prompt of the set
    turns: tuple[int, ...] = (1,)
    prompts_path: Path | None = None
    max_new_tokens: int = 64
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"evaluate.dataset={self.dataset!r}: expected one of {', '.join(DATASETS)} "
                             "(other prompt sets: evaluate.dataset=jsonl evaluate.prompts_path=<file>)")
        if self.dataset == "jsonl" and self.prompts_path is None:
            raise ValueError("evaluate.dataset=jsonl needs evaluate.prompts_path=<file> (one {\"prompt\": ...} per "
                             "line)")


def load_prompts(prompt_set: PromptSet, tokenizer, target, stops: set[int]) -> list[dict[str, Any]]:
    n = prompt_set.num_prompts
    if prompt_set.dataset == "mtbench":
        return [p for t in prompt_set.turns
                for p in mtbench_prompts(tokenizer, n, t, target, prompt_set.max_new_tokens, stops)]
    if prompt_set.dataset == "sharegpt":
        return sharegpt_prompts(tokenizer, prompt_set.data, n)
    return jsonl_prompts(tokenizer, prompt_set.prompts_path, n)
