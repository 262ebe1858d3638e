"""Regeneration (self-distillation): replace every assistant turn by the target's own reply.

A head trained on the target's own outputs learns the distribution it will be asked to draft at
inference time, not the one of whoever wrote the dataset's answers. For each conversation of the
configured data source, the turns are rebuilt in order: system and user turns are kept, and each
assistant turn is replaced by what the target generates from the conversation so far (rendered with
its chat template, `data/conversations.py` `tokenize_prompt`), until a stop token (EOS / end of turn,
`evaluation/evaluate.py` `stop_token_ids`) or `max_new_tokens`.

Backend (`regenerate.backend`): `engine` — the project's engine (inference_eval/engine/: paged KV
cache, continuous batching, each request its own sampler), the default (`auto`) for Llama-family
targets; `hf` — HF transformers `generate`, batched with left padding and an attention mask, for any
other family; `vllm` — real vLLM in its own environment (`regenerate.vllm`: a worker process,
inference_eval/vllm_generate_worker.py, tensor parallel over `tensor_parallel_size` devices, each group's
prompts in one continuous batch, a seed per request when sampling), for targets larger than one device. The checkpoint's own `generation_config.json` is ignored: the settings are exactly the
`regenerate:` config. Both backends give the target's greedy replies; sampled replies differ between
backends (different random streams), so the backend is part of the settings a resumed file must match.

Batching and determinism: conversations are cut, in input order, into groups of `batch_size`; a
group advances in lockstep, one `generate` call per assistant-turn index for the conversations that
still have such a turn. Groups are a function of the full conversation list and `batch_size` only,
and sampling draws from a generator seeded per (seed, group, turn index), so a group computes the same
replies whenever it runs.

Output: JSONL, one ShareGPT record per conversation (`{"id", "conversations": [{"from", "value"}],
"regenerated": {settings + per-record counts}}`), read back by `data.source=jsonl data.path=<file>`.
A conversation stops early (`regenerated.stopped`) at an empty reply (`empty_reply`: an empty answer
would be dropped as blank on load and merge the surrounding user turns), at an assistant turn whose
prompt already has `max_prompt_tokens` tokens (`prompt_too_long`: precompute truncates at
`data.max_length`, so later turns would never be trained on) or where the chat template refuses the
conversation (`template_error`); the trailing user turn it keeps is dropped on load, and a record
with no reply at all is rejected there as `no_assistant_turn`.

Cache (`regenerate.out: auto`, the default): regeneration costs a target's worth of generation per
conversation, so its output is kept per machine, like the converted target checkpoint, under
`data/assets.py` `cache_dir()` ($SPECHEAD_CACHE, else ~/.cache/spechead):
`regenerated/<target name>-<key[:16]>.jsonl`, with the key's inputs beside it in `<same>.key.json`.
The key is the sha256 of the settings every record carries (`meta`): the prompt set
(`prompts_sha256`, a hash of the loaded conversations themselves — ids and messages, in order — so
whatever picks or changes them, `data.path`'s content, `max_samples`, `skip`, counts without listing
the data settings one by one), the target (`target_sha256` over its config, weights and tokenizer
fingerprint — the weights by their safetensors headers unless `target.fingerprint=full`, which a
target retrained in place with unchanged shapes needs — the dtype, the backend, a
`data.chat_template`'s sha256) and the sampling settings (temperature and, when sampling, top_p /
top_k / seed; max_new_tokens, batch_size, max_prompt_tokens). Same settings: the file is reused —
when it holds every conversation no model is even loaded — or resumed when it holds part of them. A
changed setting is another key, so another file, regenerated from scratch; the old one is left as it
was. An explicit `regenerate.out` path is written and resumed the same way, but never replaced: a
file written with other settings is refused. `plan_regeneration(...).out` says where the output goes
without loading the target.

Resume: every finished group's records are appended as lines, flushed and fsynced, under a lock beside
the file (a second run with the same settings — the cache is shared by every run on the machine —
waits, then skips what the first one wrote). A rerun skips the ids already in the file and
regenerates a group that was written only in part whole (writing only its missing records), so the
file comes out identical to an uninterrupted run's. A last line without its newline (killed
mid-write) is dropped by rewriting the file atomically without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.files import atomic_write_bytes
from core.jsonio import read_jsonl
from core.paths import cache_dir
from core.progress import DEFAULT_EVERY_S, Progress
from data.conversations import chat_template_sha256, load_tokenizer, tokenize_prompt
from data.prompts import stop_token_ids
from data.sources import DataConfig, load_conversations
from inference_eval.engine import engine_generate
from inference_eval.model import LlamaForCausalLM
from inference_eval.speculative import GREEDY, Sampling
from inference_eval.targets import TargetConfig, resolve_backend, resolve_target_device

if TYPE_CHECKING:
    from data.sources import Conversations

log = logging.getLogger(__name__)

FROM = {"system": "system", "user": "human", "assistant": "gpt"}  # normalised role -> ShareGPT speaker


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @classmethod
    def of(cls, section: Any) -> "GenerationSettings":
        """The `regenerate` section's decoding settings (top_p / top_k null: off)."""
        return cls(max_new_tokens=int(section.max_new_tokens), temperature=float(section.temperature),
                   top_p=float(section.get("top_p") or 1.0), top_k=int(section.get("top_k") or 0),
                   seed=int(section.seed))

    def as_meta(self) -> dict[str, Any]:
        """What decides the replies: greedy ignores top_p, top_k and the seed."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": 0.0} if self.greedy else asdict(self)

    def generation_config(self, stop_ids: set[int], pad_id: int):
        from transformers import GenerationConfig

        sampling = {} if self.greedy else {"temperature": float(self.temperature), "top_p": float(self.top_p),
                                           "top_k": int(self.top_k)}
        return GenerationConfig(max_new_tokens=int(self.max_new_tokens), do_sample=not self.greedy,
                                eos_token_id=sorted(stop_ids), pad_token_id=pad_id, **sampling)


@dataclass
class Reply:
    ids: list[int]  # the reply's tokens, without the stop token
    stopped: bool  # ended by a stop token (False: cut at max_new_tokens)

    @property
    def new_tokens(self) -> int:  # what the target generated, stop token included
        return len(self.ids) + int(self.stopped)


def derived_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for (seed, keys...), stable across runs and platforms."""
    digest = hashlib.sha256(":".join(map(str, (seed, *keys))).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def generate_replies(model, prompts: list[list[int]], settings: GenerationSettings, stop_ids: set[int],
                     pad_id: int, seed: int | None = None) -> list[Reply]:
    """The replies to `prompts` (token ids), batched: through the engine when `model` is the engine's
    target (each prompt sampling from its own generator, seeded from `seed` and its row), else one HF
    `generate`, left-padded with an attention mask, drawing from torch's RNG seeded with `seed` inside
    a forked RNG state (the caller's global RNG is left as it was)."""
    if isinstance(model, LlamaForCausalLM):
        return _engine_replies(model, prompts, settings, stop_ids, seed)
    if hasattr(model, "generate_ids"):  # the vllm backend (inference_eval/vllm_backend.py VLLMGenerator)
        seeds = None if settings.greedy else [derived_seed(seed or 0, row) for row in range(len(prompts))]
        outs = model.generate_ids(prompts, settings.max_new_tokens, stop_ids, settings.temperature, settings.top_p,
                                  settings.top_k, seeds)
        return [Reply(o[:-1], True) if o and o[-1] in stop_ids else Reply(o, False) for o in outs]
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        input_ids[row, width - len(p):] = torch.tensor(p)
        attention_mask[row, width - len(p):] = 1
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=settings.generation_config(stop_ids, pad_id))
    replies = []
    for row in out[:, width:].tolist():
        stop = next((j for j, t in enumerate(row) if t in stop_ids), None)
        replies.append(Reply(row[:stop], True) if stop is not None else Reply(row, False))
    return replies


def _engine_replies(model, prompts: list[list[int]], settings: GenerationSettings, stop_ids: set[int],
                    seed: int | None) -> list[Reply]:
    device = model.model.embed_tokens.weight.device
    samplings = [GREEDY if settings.greedy else
                 Sampling(settings.temperature, settings.top_p, settings.top_k,
                          generator=torch.Generator(device).manual_seed(derived_seed(seed or 0, row)))
                 for row in range(len(prompts))]
    outs, _ = engine_generate(model, prompts, settings.max_new_tokens, stop_ids=stop_ids, sampling=samplings,
                              max_batch=len(prompts), max_seq_len=max(map(len, prompts)) + settings.max_new_tokens + 2)
    return [Reply(o[:-1], True) if o and o[-1] in stop_ids else Reply(o, False) for o in outs]


@dataclass
class RegenerateStats:
    conversations: int = 0  # written by this run
    replies: int = 0  # assistant turns in the records written
    cut: int = 0  # ... of which cut at max_new_tokens
    tokens: int = 0  # generated (stop tokens included; empty replies and a resumed group's rewritten part too)
    skipped_done: int = 0  # already in the output file
    rejected: dict[str, int] = field(default_factory=dict)  # by the data source
    seconds: float = 0.0
    cached: bool = False  # the output file already held every conversation: reused, no model loaded

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def regenerate_group(model, tokenizer, group: list[tuple[str, list[dict]]], group_index: int,
                     settings: GenerationSettings, stop_ids: set[int], pad_id: int, max_prompt_tokens: int,
                     meta: dict[str, Any], on_generate=None) -> list[dict[str, Any]]:
    """The regenerated records of one group of conversations, in the group's order."""
    from jinja2 import TemplateError

    rebuilt: list[list[dict]] = [[] for _ in group]
    cursor = [0] * len(group)  # next source message of each conversation
    counts = [{"new_tokens": 0, "cut": 0, "stopped": None} for _ in group]
    live = list(range(len(group)))
    turn = 0
    while live:
        prompts, rows = [], []
        for c in live:
            source = group[c][1]
            while cursor[c] < len(source) and source[cursor[c]]["role"] != "assistant":
                rebuilt[c].append(dict(source[cursor[c]]))  # system / user turns are kept as they are
                cursor[c] += 1
            if cursor[c] == len(source):
                continue  # every assistant turn done
            try:
                prompt = tokenize_prompt(tokenizer, rebuilt[c])
            except TemplateError as e:  # e.g. a template that insists on strict user/assistant alternation
                log.warning("conversation %r: the chat template refuses it (%s); kept up to here", group[c][0], e)
                counts[c]["stopped"] = "template_error"
                continue
            if len(prompt) >= max_prompt_tokens:
                counts[c]["stopped"] = "prompt_too_long"
                continue
            prompts.append(prompt)
            rows.append(c)
        replies = generate_replies(model, prompts, settings, stop_ids, pad_id,
                                   seed=None if settings.greedy else derived_seed(settings.seed, group_index, turn)) \
            if prompts else []
        if on_generate is not None and replies:
            on_generate(replies)
        live = []
        for c, reply in zip(rows, replies):
            counts[c]["new_tokens"] += reply.new_tokens
            text = tokenizer.decode(reply.ids, skip_special_tokens=True)
            if not text.strip():
                counts[c]["stopped"] = "empty_reply"
                continue
            counts[c]["cut"] += int(not reply.stopped)
            rebuilt[c].append({"role": "assistant", "content": text})
            cursor[c] += 1  # past the source's assistant turn it replaces
            live.append(c)
        turn += 1
    return [{"id": sid, "conversations": [{"from": FROM[m["role"]], "value": m["content"]} for m in messages],
             "regenerated": {**meta, **count}}
            for (sid, _), messages, count in zip(group, rebuilt, counts)]


def finished_ids(path: Path, meta: dict[str, Any], repair: bool = True) -> set[str]:
    """Ids of the records already in `path`. A last line without its newline (a write killed midway)
    is dropped by rewriting the file atomically without it — only with `repair`, under the writer's lock:
    without it, the line may be another process's write in progress, and is just not counted. A record
    written with other settings, or a complete line that is not a JSON record, is an error naming the
    file and line."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]
    if repair and len(keep) < len(data):
        log.warning("%s: dropping a truncated last line (%d bytes, an interrupted write)", path, len(data) - len(keep))
        atomic_write_bytes(path, keep)
    done = set()
    try:
        records = list(read_jsonl(path, ValueError, data=keep))
    except ValueError as e:
        raise ValueError(f"{e}; not a file this stage wrote — choose another regenerate.out or delete it") from e
    for record, where in records:
        if not (isinstance(record, dict) and "id" in record and isinstance(record.get("regenerated"), dict)):
            raise ValueError(f"{where}: not a regenerated record (an object with `id` and a `regenerated` object); "
                             "not a file this stage wrote — choose another regenerate.out or delete it")
        sid, stored = record["id"], record["regenerated"]
        diffs = {k: (stored.get(k), v) for k, v in meta.items() if stored.get(k) != v}
        if diffs:
            detail = ", ".join(f"{k}: stored {a!r}, now {b!r}" for k, (a, b) in diffs.items())
            raise ValueError(f"{where}: record {sid!r} was regenerated with other settings ({detail}); resuming "
                             "would mix them in one file: choose another regenerate.out or delete it")
        done.add(str(sid))
    return done


@contextmanager
def writing(out: Path):
    """Hold `out`'s lock (`.<name>.lock` beside it) while appending to it: a second regeneration into
    the same file — a run with the same settings elsewhere on the machine, the cache being shared —
    waits, then finds what the first one wrote and skips it, instead of appending it a second time."""
    import fcntl

    from core.lock import process_identity

    with open(out.with_name(f".{out.name}.lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read(4096).strip()  # who holds it, as that writer recorded below
            log.info("%s: another regeneration is writing it%s; waiting for it to finish", out,
                     f" ({holder})" if holder else "")
            fcntl.flock(lock, fcntl.LOCK_EX)
        me = process_identity()
        lock.truncate(0)  # "a+": every write appends, so the file holds this holder's line alone
        lock.write(f"pid {me['pid']} on {me['host']} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        lock.flush()
        yield  # closing the file releases the lock


def regenerate_conversations(model, tokenizer, conversations: list[tuple[str, list[dict]]], out: Path,
                             settings: GenerationSettings, batch_size: int, max_prompt_tokens: int,
                             meta: dict[str, Any], progress: bool = True,
                             progress_log_s: float | None = None) -> RegenerateStats:
    """Regenerate `conversations` (sample id, normalised messages) into the JSONL file `out`,
    resuming from the records it already holds (read under the writer's lock)."""
    stop_ids = stop_token_ids(tokenizer)
    if not stop_ids:
        raise ValueError("the tokenizer has no EOS / end-of-turn token: replies could only stop at max_new_tokens")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    with writing(out):
        done = finished_ids(out, meta)
        groups = [conversations[i:i + batch_size] for i in range(0, len(conversations), batch_size)]
        todo = [(g, group) for g, group in enumerate(groups) if any(sid not in done for sid, _ in group)]
        stats = RegenerateStats(skipped_done=sum(sid in done for sid, _ in conversations))
        bar = Progress(len(conversations) - stats.skipped_done, "regenerate", "conv", bar=progress,
                       every_s=progress_log_s)
        t0 = time.perf_counter()

        def on_generate(replies: list[Reply]) -> None:
            stats.tokens += sum(r.new_tokens for r in replies)
            bar.set(tok_s=round(stats.tokens / max(time.perf_counter() - t0, 1e-9), 1))

        try:
            with open(out, "ab") as f:
                for g, group in todo:
                    records = regenerate_group(model, tokenizer, group, g, settings, stop_ids, pad_id,
                                               max_prompt_tokens, meta, on_generate)
                    new = [r for r in records if r["id"] not in done]  # a partly written group: only its missing ones
                    f.write(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in new))
                    f.flush()
                    os.fsync(f.fileno())
                    stats.conversations += len(new)
                    stats.replies += sum(m["from"] == "gpt" for r in new for m in r["conversations"])
                    stats.cut += sum(r["regenerated"]["cut"] for r in new)
                    bar.update(len(new))
        finally:
            bar.close(failed=sys.exc_info()[0] is not None)
        stats.seconds = time.perf_counter() - t0
    return stats


def canonical_json(value: Any) -> bytes:
    """One byte string per value (sorted keys, no spaces, ASCII): what a hash of settings is taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def prompts_sha256(conversations: list[tuple[str, Any]]) -> str:
    """The prompt set's hash: the loaded conversations themselves (ids and messages, in order), so that
    whatever decides them — the file's content, `max_samples`, `skip`, what the source rejects — is
    covered without listing the data settings one by one."""
    return hashlib.sha256(canonical_json([[sid, messages] for sid, messages in conversations])).hexdigest()


def settings_key(meta: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(meta)).hexdigest()


def cache_path(meta: dict[str, Any]) -> Path:
    """The cache's file for these settings: `<cache_dir()>/regenerated/<target name>-<key[:16]>.jsonl`,
    the name made of letters, digits, `.`, `_` and `-` only (target names hold spaces, `/`, parentheses)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(meta["target"])).strip("._")[:64] or "target"
    return cache_dir() / "regenerated" / f"{name}-{settings_key(meta)[:16]}.jsonl"


def key_file(path: Path) -> Path:
    """The sidecar of a cached file: its key and the settings it was computed from, for whoever
    wonders which of several cached files is which."""
    return path.with_suffix(".key.json")


@dataclass(frozen=True)
class RegenerateConfig:
    """The `regenerate` section and what else a regeneration reads (the conversations of `data`, progress), built
    once at the stage's entry (experiments/stages.py `regenerate_config`)."""

    settings: GenerationSettings
    data: DataConfig
    batch_size: int = 8
    max_prompt_tokens: int = 1024
    backend: str | None = "auto"
    out: Path | None = None  # None: the cache's file for these settings (regenerate.out=auto)
    device: str | None = None  # None: target.device
    vllm: Any = None  # VllmSettings of regenerate.vllm (backend=vllm)
    progress: bool = True
    every_s: float | None = DEFAULT_EVERY_S

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.settings.max_new_tokens < 1:
            raise ValueError(f"regenerate.batch_size ({self.batch_size}) and max_new_tokens "
                             f"({self.settings.max_new_tokens}) must be at least 1")


@dataclass(frozen=True)
class Plan:
    """What a regeneration will do, known without loading the target."""
    target: TargetConfig
    conversations: Conversations
    settings: GenerationSettings
    batch_size: int
    max_prompt_tokens: int
    meta: dict[str, Any]  # what every record carries and must match to be resumed or reused
    out: Path
    keyed: bool  # `out` is the cache's file for `meta` (regenerate.out=auto), not a path the user named


def plan_regeneration(rc: RegenerateConfig, target: TargetConfig) -> Plan:
    """The settings, the conversations (loading them is cheap) and the output file of a regeneration."""
    settings, batch_size, max_prompt_tokens = rc.settings, rc.batch_size, rc.max_prompt_tokens
    target_dir, fp = target.dir, target.fingerprint
    identity = ("config_sha256", "weights_sha256", "tokenizer_sha256", "weights_content_sha256")
    meta = {"target": target.name,
            "target_sha256": hashlib.sha256("".join(fp[k] for k in identity if k in fp).encode()).hexdigest(),
            "dtype": target.dtype, **settings.as_meta(), "batch_size": batch_size,
            "max_prompt_tokens": max_prompt_tokens,
            "backend": resolve_backend(rc.backend, target_dir, "regenerate")}
    data = rc.data
    if data.chat_template:  # replies to prompts rendered otherwise: not resumed into one file
        meta["chat_template_sha256"] = chat_template_sha256(data.chat_template)
    convs = load_conversations(data)
    if not convs.items:
        raise RuntimeError(f"regenerate: no usable conversation in the data source (rejected: {dict(convs.rejected)})")
    meta["prompts_sha256"] = prompts_sha256(convs.items)
    keyed = rc.out is None
    return Plan(target, convs, settings, batch_size, max_prompt_tokens, meta,
                cache_path(meta) if keyed else rc.out, keyed)


def regenerate_stage(rc: RegenerateConfig, target: TargetConfig) -> tuple[Path, RegenerateStats]:
    """The regenerate stage: the target + `rc` (its data, `regenerate:`) → the JSONL at `rc.out` (None: the
    cache's file for these settings). A file that already holds every conversation is returned as it is, before
    the target is loaded."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    plan = plan_regeneration(rc, target)
    convs, meta, out = plan.conversations, plan.meta, plan.out
    done = finished_ids(out, meta, repair=False)  # no lock taken yet: read only
    if all(sid in done for sid, _ in convs.items):
        log.info("regenerate: reused %s: it holds all %d conversations, regenerated with these settings; "
                 "no model loaded", out, len(convs.items))
        return out, RegenerateStats(skipped_done=len(convs.items), rejected=dict(convs.rejected), cached=True)
    target = plan.target
    device = resolve_target_device(rc.device or target.device)
    tokenizer = load_tokenizer(target.dir, rc.data.chat_template)
    if meta["backend"] == "engine":
        model = LlamaForCausalLM.from_pretrained(target.dir, dtype=target.torch_dtype, device=device)
    elif meta["backend"] == "vllm":  # the target in a vLLM worker process (tensor parallel: regenerate.vllm)
        from inference_eval.vllm_backend import VLLMGenerator

        model = VLLMGenerator.for_target(rc.vllm, target.dir, target.torch_dtype,
                                         plan.max_prompt_tokens + plan.settings.max_new_tokens + 2)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            target.dir, dtype=target.torch_dtype, trust_remote_code=target.trust_remote_code).to(device).eval()
        model.generation_config = GenerationConfig()  # the checkpoint's defaults (penalties, sampling) do not apply
    if plan.keyed:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(key_file(out), json.dumps({"key": settings_key(meta), "settings": meta}, indent=2,
                                                     sort_keys=True).encode() + b"\n")
    try:
        stats = regenerate_conversations(model, tokenizer, convs.items, out, plan.settings, plan.batch_size,
                                         plan.max_prompt_tokens, meta, progress=rc.progress,
                                         progress_log_s=rc.every_s)
    finally:
        if hasattr(model, "close"):  # the vllm backend's worker process
            model.close()
    stats.rejected = dict(convs.rejected)
    log.info("regenerate: %d conversations (%d already in the file), %d replies (%d cut at max_new_tokens), "
             "%d tokens in %.1fs (%.1f tok/s); rejected by the source %s; out %s", stats.conversations,
             stats.skipped_done, stats.replies, stats.cut, stats.tokens, stats.seconds, stats.tokens_per_s,
             stats.rejected, out)
    return out, stats
