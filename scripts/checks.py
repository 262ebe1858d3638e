"""Configuration checks that run before any model or data work (docs/pipeline.md "Checks before work").

Each entry point runs `check_before_work(cfg, stage)` before its stage (scripts/runtime.py `stage_main`;
`run_pipeline` for the demo): what the config and a few bytes on disk can
tell is refused at once — a numeric or path setting of the wrong type or out of its range (`RULES`, one row per
setting), an unknown data source, a missing file, a source/path mismatch, a target
directory without config.json, a target family the engine cannot run (training, validation, evaluation
and export all run the target or its embedding and lm_head through spechead's engine, so a store
precomputed for such a target could never be used), a conversation source with a target that has no
chat template (or a `data.chat_template` file that is missing or not Jinja), plain text
(`data.source=text`) where conversations are needed, an unknown head type, an evaluation dataset or
prompts file that is not there — with the setting that fixes it, instead of after minutes of loading or
precomputing.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.jsonio import Record, jsonl_records

log = logging.getLogger(__name__)

# what each stage needs from the config
STAGES = {
    "precompute": ("target", "engine_family", "template", "data", "head"),
    "regenerate": ("target", "engine_family", "template", "data"),
    "train": ("target", "engine_family", "head", "validation", "strategy"),
    "evaluate": ("target", "engine_family", "template", "evaluate"),
    "export": ("target", "engine_family"),
    "pipeline": ("target", "engine_family", "template", "data", "head", "evaluate_settings", "validation", "strategy"),
}
LATER = {"precompute": "training, evaluation and export", "regenerate": "precompute, training and evaluation",
         "train": "training", "evaluate": "evaluation", "export": "export", "pipeline": "the demo's stages"}


class ConfigError(ValueError):
    """A configuration refused before any work; the message says which setting fixes it."""


def check_before_work(cfg: Any, stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"check_before_work: unknown stage {stage!r}")
    check_settings(cfg, stage)  # every numeric and path setting's type and range first: nothing below reads a bad one
    needs = STAGES[stage]
    if trains_online(cfg, stage):  # training tokenizes the conversations itself, as precompute does: its checks too
        needs = (*needs, "template", "data")
    target = cfg.get("target") or {}
    target_dir = check_target(target) if "target" in needs else None
    if target_dir is not None and "engine_family" in needs:
        # precompute / regeneration through HF transformers asked for by name: the user wants the store or the
        # text for something else than spechead's later stages; say what fails, do not refuse
        backend = (cfg.get(stage) or {}).get("backend") if stage in ("precompute", "regenerate") else None
        check_engine_family(target_dir, stage, warn_only=backend == "hf")
    if "template" in needs:
        check_plain_text_use(cfg, stage)
        check_chat_template(target_dir, stage, cfg)
    if "data" in needs:
        from data.sources import DataConfig, check_source

        check_source(DataConfig.of(cfg.data))
        if target_dir is not None:
            check_context(cfg, target_dir)
    if "head" in needs and cfg.get("head") is not None:
        check_head(cfg.head)
    if "validation" in needs:
        check_engine_validation(cfg)
    if "strategy" in needs:
        check_training_strategy(cfg)
    if "evaluate" in needs or "evaluate_settings" in needs:
        from evaluation.evaluate import check_evaluation_config
        from experiments.stages import eval_config

        try:
            check_evaluation_config(eval_config(cfg), heads_must_exist="evaluate" in needs)
        except ValueError as e:  # a setting: refused in one line like the others
            raise ConfigError(str(e)) from e


def check_training_strategy(cfg: Any) -> None:
    """The training module's settings, refused before the target loads: each `train.module` setting as the module
    checks it (train/settings.py `ModuleSettings`, the same message), then what the trainer's strategy cannot run —
    under DeepSpeed (trainer=8xh100, 8xh100_zero3, or a strategy named so) an explicit Muon, per-module clipping or
    a `deep_from_step` (their `auto` forms adapt there)."""
    from train.settings import ModuleSettings, deepspeed_conflicts

    try:
        settings = ModuleSettings.from_config((cfg.get("train") or {}).get("module"))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    strategy = (cfg.get("trainer") or {}).get("strategy")
    name = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy or "")
    if "deepspeed" not in name.lower():
        return
    if problems := deepspeed_conflicts(settings):
        raise ConfigError(f"trainer.strategy={name}: " + "; ".join(problems))


def check_engine_validation(cfg: Any) -> None:
    """train.engine_validation.engine: spechead or vllm; vllm needs its environment and decodes greedily."""
    ev = (cfg.get("train") or {}).get("engine_validation") or {}
    if not ev.get("enabled"):
        return
    from train.validation import check_engine

    engine = ev.get("engine", "spechead")
    try:
        check_engine(engine, float(ev.get("temperature", 0.0)))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if engine == "vllm":
        from inference_eval.vllm_backend import vllm_python

        try:
            vllm_python(((cfg.get("evaluate") or {}).get("vllm") or {}).get("python"), "evaluate.vllm.python",
                        "train.engine_validation.engine=vllm")
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from e


def trains_online(cfg: Any, stage: str) -> bool:
    """The train stage with `train.data.source=online`: it reads conversations, not a store."""
    return stage == "train" and ((cfg.get("train") or {}).get("data") or {}).get("source") == "online"


# what transformers' AutoTokenizer reads a tokenizer from: the fast tokenizer's file, SentencePiece's model, or a
# BPE vocabulary (with merges.txt)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def check_target(target_cfg: Any) -> Path | None:
    """target.path's directory — a Hugging Face Hub id's snapshot, resolved here as the stage will (data/hub.py, once
    per process) — (None for a packaged source, converted on first use)."""
    from data.hub import HubTargetError, hub_snapshot

    try:
        hub = hub_snapshot(target_cfg.get("path"), target_cfg.get("revision"))
    except HubTargetError as e:
        raise ConfigError(str(e)) from e
    if target_cfg.get("path"):
        path = hub.dir if hub else Path(str(target_cfg["path"])).expanduser()
        # a Hub target is named by its id (and revision) with the snapshot its files are in
        shown = (f"{hub.repo_id}{'' if hub.revision is None else ' target.revision=' + hub.revision} (the Hub "
                 f"snapshot {path})" if hub else str(path))
        if not path.is_dir():
            raise ConfigError(f"target.path={path}: no such directory (an HF checkpoint directory with config.json "
                              "and *.safetensors, or a Hugging Face Hub id org/name)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"target.path={shown}: no config.json (expected an HF checkpoint directory)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            fix = ("the Hub repository has none: set target.path to a local directory with the checkpoint and its "
                   "tokenizer" if hub else "copy the model's tokenizer into the directory")
            raise ConfigError(f"target.path={shown}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                              f"{fix} (AutoTokenizer.save_pretrained writes them)")
        warn_remote_code(path, bool(target_cfg.get("trust_remote_code", False)))
        return path
    from data.assets import TARGET_SOURCES

    if target_cfg.get("source") in TARGET_SOURCES:
        return None
    raise ConfigError("target: set target.path=<HF checkpoint directory> or target.source="
                      + " | ".join(TARGET_SOURCES))


def warn_remote_code(target_dir: Path, trust_remote_code: bool) -> bool:
    """A checkpoint whose config.json names code of its own (`auto_map`) while target.trust_remote_code is off: that
    code is not run — the target runs as its `model_type`'s implementation (the engine's or transformers') — and the
    user is told so, with the setting that runs it. True when warned. A config.json that is not JSON is left to the
    loader's own error."""
    try:
        auto_map = json.loads((target_dir / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return False
    if not auto_map or trust_remote_code:
        return False
    names = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
    log.warning("target.path=%s: config.json's auto_map names code of the checkpoint's own (%s), which is not run "
                "while target.trust_remote_code=false: the target runs as its model_type's implementation. If it needs "
                "its own code, set target.trust_remote_code=true (that runs the checkpoint's Python files)",
                target_dir, names)
    return True


def check_engine_family(target_dir: Path, stage: str, warn_only: bool = False) -> None:
    from inference_eval.families import args_from_hf_config

    try:
        config = json.loads((target_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{target_dir}/config.json: not readable JSON ({e})") from e
    try:
        args_from_hf_config(config)
    except (ValueError, KeyError, TypeError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        msg = (f"target.path={target_dir}: {what}. spechead's engine runs the target in training (its embedding "
               f"and lm_head), validation, evaluation and export, so {LATER[stage]} would fail on this target")
        if warn_only:
            log.warning("%s; %s.backend=hf goes on as asked", msg, stage)
            return
        raise ConfigError(f"{msg}: refused before any work ({stage}; {stage}.backend=hf runs it anyway). "
                          "docs/engine.md lists the families the engine implements.") from e


def has_chat_template(target_dir: Path) -> bool:
    if (target_dir / "chat_template.jinja").is_file() or (target_dir / "chat_template.json").is_file():
        return True
    try:
        tcfg = json.loads((target_dir / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(tcfg.get("chat_template"))


def check_chat_template(target_dir: Path | None, stage: str, cfg: Any = None) -> None:
    """A template for what `stage` renders: the `data.chat_template` file (which must exist and compile
    as Jinja) or the target's own. Plain text (`data.source=text`) needs none, and neither do raw
    `{"prompt": ...}` records of `evaluate.dataset=jsonl` (a base model continues them as they are)."""
    data = (cfg or {}).get("data") or {}
    if data.get("chat_template"):
        from data.conversations import TemplateFileError, read_chat_template

        try:
            read_chat_template(data["chat_template"])
        except TemplateFileError as e:
            raise ConfigError(str(e)) from e
        return
    if target_dir is None or has_chat_template(target_dir):
        return
    needs = _template_needs(stage, cfg or {})
    if needs:
        what, fix = needs
        raise ConfigError(
            f"target.path={target_dir}: the tokenizer has no chat template (no chat_template in "
            f"tokenizer_config.json, no chat_template.jinja), so {what} cannot be rendered for {stage} — a base "
            "model? Set data.chat_template=<file> to the template of the chat model you want to mimic (or put it "
            f"into the directory as chat_template.jinja); {fix}")


def _template_needs(stage: str, cfg: Any) -> tuple[str, str] | None:
    """(what needs a template in this stage, the template-free alternative), or None."""
    data = cfg.get("data") or {}
    reads_conversations = stage in ("precompute", "regenerate", "pipeline") or trains_online(cfg, stage)
    if reads_conversations and data.get("source", "sharegpt") != "text":
        return (f"the conversations of data.source={data.get('source', 'sharegpt')}",
                "or train on plain text: data.source=text (one {\"text\": ...} per line)")
    ecfg = cfg.get("evaluate") or {}
    if stage not in ("evaluate", "pipeline") or not ecfg:
        return None
    fix = "or evaluate on raw text: evaluate.dataset=jsonl with {\"prompt\": ...} records"
    if ecfg.get("dataset") in ("mtbench", "sharegpt"):
        return f"the prompts of evaluate.dataset={ecfg.get('dataset')}", fix
    path = Path(str(ecfg.get("prompts_path") or ""))
    if ecfg.get("dataset") == "jsonl" and path.is_file():
        for r in jsonl_records(path):
            if isinstance(r, Record) and not (isinstance(r.value, dict) and (isinstance(r.value.get("prompt"), str)
                                                                              or "input_ids" in r.value)):
                return f"the record at {r.where} (no `prompt` string: a conversation)", fix  # bad lines: when read
    return None


def check_plain_text_use(cfg: Any, stage: str) -> None:
    """Plain texts (`data.source=text`) have no assistant turns to regenerate and no held-out prompts."""
    if ((cfg.get("data") or {}).get("source")) != "text":
        return
    if stage == "regenerate":
        raise ConfigError("data.source=text: plain texts have no assistant turns to regenerate (regeneration "
                          "replaces a conversation's answers by the target's); precompute them as they are")
    if stage in ("evaluate", "pipeline") and ((cfg.get("evaluate") or {}).get("dataset")) == "sharegpt":
        raise ConfigError("evaluate.dataset=sharegpt takes held-out conversations of the data source, and "
                          "data.source=text holds plain texts: use evaluate.dataset=jsonl "
                          "evaluate.prompts_path=<file> ({\"prompt\": ...} per line; raw text for a base model)")


def check_context(cfg: Any, target_dir: Path) -> None:
    """data.max_length within the target's context (config.json's max_position_embeddings)."""
    try:
        limit = json.loads((target_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError):
        return  # check_engine_family names an unreadable config
    max_length = (cfg.get("data") or {}).get("max_length")
    if limit is not None and max_length is not None and int(max_length) > int(limit):
        raise ConfigError(f"data.max_length={max_length} exceeds the target's context (max_position_embeddings="
                          f"{limit} in {target_dir}/config.json): set data.max_length ≤ {limit}")


def check_head(head_cfg: Any) -> None:
    """A known head type, and its settings as its config class takes them (heads/registry.py `build_head`): an
    unknown key or a value the class refuses, before the target loads."""
    from heads.registry import HEAD_TYPES
    from train.settings import plain_mapping

    kind = head_cfg.get("type", "mtp")
    if kind not in HEAD_TYPES:
        raise ConfigError(f"head.type={kind!r}: unknown head type; known: {', '.join(sorted(HEAD_TYPES))} "
                          "(head=<name> picks conf/head/<name>.yaml)")
    settings = {k: v for k, v in plain_mapping(head_cfg, "head").items() if k not in ("type", "_target_")}
    try:
        HEAD_TYPES[kind][0](**settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"head (head.type={kind}): {e}") from e


# ---- the type and range of every numeric and path setting -------------------------------------------------------
# One row per setting a stage reads (`RULES`), applied by `check_settings` for the stages that read it: a value the
# code would take silently — a negative data.max_length slices the last tokens off every sample,
# evaluate.num_prompts=0 runs every prompt, a run_name with `../` writes outside runs/ — or fail on after the model
# loaded (precompute.batch_tokens=0) is refused at once, naming the setting and what it accepts. A new setting is a
# new row.
# Settings that a typed config checks are built there instead of repeated here: train.module.* (train/settings.py
# ModuleSettings, `check_training_strategy`), target.dtype and target.fingerprint (inference_eval/targets.py
# TargetConfig, `check_target_settings`), data.* (data/sources.py DataConfig: the source, the range of records, the
# tokens per sample, the bounds on a record); so are evaluate.k (experiments/stages.py `eval_config`, which builds
# evaluation/settings.py `EvalConfig`) and the files that must exist (data.path, target.path, evaluate.prompts_path,
# the heads).

PRECOMPUTE, REGENERATE, TRAIN, EVALUATE, EXPORT = "precompute", "regenerate", "train", "evaluate", "export"
ONLINE = "online"  # training with train.data.source=online: it reads data.* and writes a store as precompute does
PIPELINE = "pipeline"  # the demo: every stage, and its own settings
EVERY = (PRECOMPUTE, REGENERATE, TRAIN, EVALUATE, EXPORT)
DATA = (PRECOMPUTE, REGENERATE, ONLINE)
SEED_MAX = 2**32 - 1  # Lightning's seed_everything (and numpy) take seeds in [0, 2**32 - 1]
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Accept:
    """What a setting accepts: `ok(value)` (the value resolved, lists as lists), and the same in words for the
    refusal."""

    ok: Callable[[Any], bool]
    text: str


@dataclass(frozen=True)
class Rule:
    """One setting of `RULES`: what it accepts, checked for the stages that read it."""

    key: str  # the dotted setting
    stages: tuple[str, ...]  # the stages that read it (ONLINE: training with train.data.source=online)
    accept: Accept


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def either(accept: Accept, null: str | None = None, words: tuple[Any, ...] = ()) -> Accept:
    """`accept`, or null where `null` says what null means, or one of the `words` (values such as `auto` or -1)."""
    def ok(v: Any) -> bool:
        return ((null is not None and v is None) or any(type(v) is type(w) and v == w for w in words)
                or accept.ok(v))

    parts = ([f"null ({null})"] if null is not None else []) + [str(w) for w in words] + [accept.text]
    return Accept(ok, parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1])


def whole(at_least: int | None = None, of: str = "", at_most: int | None = None, null: str | None = None,
          words: tuple[Any, ...] = (), note: str = "") -> Accept:
    """A whole number (`of`: its unit) ≥ at_least (and ≤ at_most); `note` says what a special value means."""
    def ok(v: Any) -> bool:
        return _whole(v) and (at_least is None or v >= at_least) and (at_most is None or v <= at_most)

    text = "a whole number" + (f" of {of}" if of else "")
    if at_least is not None:
        text += f" in [{at_least}, {at_most}]" if at_most is not None else f" ≥ {at_least}"
    return either(Accept(ok, text + (f" ({note})" if note else "")), null, words)


def number(low: float, high: float | None = None, what: str = "a number", above: bool = False, below: bool = False,
           null: str | None = None, words: tuple[Any, ...] = (), note: str = "") -> Accept:
    """A finite number ≥ low (> low: `above`), ≤ high (< high: `below`); `note` as for `whole`."""
    def ok(v: Any) -> bool:
        return (_number(v) and (v > low if above else v >= low)
                and (high is None or (v < high if below else v <= high)))

    if high is None:
        text = f"{what} {'>' if above else '≥'} {low}"
    else:
        text = f"{what} in {'(' if above else '['}{low}, {high}{')' if below else ']'}"
    return either(Accept(ok, text + (f" ({note})" if note else "")), null, words)


def one_of(*choices: str) -> Accept:
    return Accept(lambda v: isinstance(v, str) and v in choices, "one of " + ", ".join(choices))


def path(kind: str, null: str | None = None, words: tuple[str, ...] = ()) -> Accept:
    """Where a stage writes a `kind` ("directory" or "file"): a non-empty path that is not the other kind."""
    other = "file" if kind == "directory" else "directory"

    def ok(v: Any) -> bool:
        if not isinstance(v, str) or not v.strip() or "\x00" in v:
            return False
        p = Path(v).expanduser()
        return not (p.is_file() if kind == "directory" else p.is_dir())

    return either(Accept(ok, f"a {kind} path (not empty, not an existing {other})"), null, words)


def list_of(item: Accept, what: str, null: str | None = None, words: tuple[str, ...] = ()) -> Accept:
    """A non-empty list of `item`s, each once."""
    def ok(v: Any) -> bool:
        return (isinstance(v, list) and bool(v) and all(item.ok(x) for x in v)
                and len({repr(x) for x in v}) == len(v))

    return either(Accept(ok, f"a non-empty list of {what}, each once, each {item.text}"), null, words)


def _device(v: Any) -> bool:
    import torch

    try:
        return isinstance(v, str) and (v == "auto" or torch.device(v) is not None)
    except (RuntimeError, TypeError, ValueError):
        return False


def _devices(v: Any) -> bool:
    """Lightning's `devices`: auto, -1 (all), a count, a list of indices, or indices as "0,1"."""
    if v in ("auto", -1) or (_whole(v) and v >= 1):
        return True
    if isinstance(v, str):
        v = [p.strip() for p in v.split(",") if p.strip()]
        return bool(v) and all(p.isdigit() for p in v)
    return isinstance(v, list) and bool(v) and all(_whole(i) and i >= 0 for i in v)


def _plain_name(v: Any) -> bool:
    return (isinstance(v, str) or _whole(v)) and PLAIN_NAME.fullmatch(str(v)) is not None


def _threads(v: Any) -> bool:
    """A count as scripts/runtime.py `resolve_threads` takes it: a whole number, or its digits."""
    return v is None or v == "auto" or (_whole(v) and v >= 1) or (isinstance(v, str) and v.isdigit() and int(v) >= 1)


def _revision(v: Any) -> bool:
    """A Hub revision as huggingface_hub takes it: a non-empty string (an unquoted number, which hydra reads as a
    number and would lose a commit's leading zeros, is refused)."""
    return isinstance(v, str) and bool(v.strip()) and v == v.strip() and "\x00" not in v


def _storage_dtype(v: Any) -> bool:
    from data.store import STORAGE_ALIASES, STORAGE_DTYPES

    return isinstance(v, str) and STORAGE_ALIASES.get(v, v) in STORAGE_DTYPES


def _checkpoint_file(v: Any) -> bool:
    return isinstance(v, str) and "\x00" not in v and Path(v).expanduser().is_file()


SEED = whole(0, at_most=SEED_MAX)
FLAG = Accept(lambda v: isinstance(v, bool), "true or false")  # a string such as `no` would read as true
TOKENS = whole(1, "tokens")
VLLM = {"tensor_parallel_size": whole(1, "devices"), "data_parallel_size": whole(1, "replicas"),
        "gpu_memory_utilization": number(0, 1, "a fraction of each GPU", above=True),
        "cpu_kvcache_space_gb": whole(1, "GB"), "startup_timeout_s": number(0, what="seconds", above=True)}
VLLM_AUTO = {**VLLM, "gpu_memory_utilization": either(VLLM["gpu_memory_utilization"], words=("auto",))}
SAMPLING = {"temperature": number(0, what="a temperature", note="0: greedy"),
            "top_p": number(0, 1, above=True, note="1: off"), "top_k": whole(0, "tokens", note="0: off")}
RULES: tuple[Rule, ...] = (
    # the run and its directories
    Rule("run_name", EVERY, Accept(_plain_name, "a plain name of letters, digits, '.', '_' and '-' that starts with a "
                                                "letter or digit (no '/', no '..': the run's directory is "
                                                "runs/<run_name>)")),
    Rule("run_dir", EVERY, path("directory")),
    Rule("store_dir", (PRECOMPUTE, TRAIN), path("directory")),
    Rule("head_dir", (TRAIN, EVALUATE, EXPORT), path("directory")),
    Rule("seed", (REGENERATE, TRAIN, EVALUATE), SEED),
    Rule("progress_log_s", EVERY, number(0, what="seconds", null="no progress lines")),
    Rule("threads", EVERY, Accept(_threads, "null (every core), auto (the cores other work leaves free) or a positive "
                                            "number of threads")),
    Rule("progress", EVERY, FLAG),
    Rule("target.device", EVERY, Accept(_device, "auto or a torch device (cpu, cuda, cuda:N)")),
    Rule("target.revision", EVERY, either(Accept(_revision, "a branch, tag or commit of the Hugging Face Hub id "
                                                            "target.path names (a string; quote one of digits only)"),
                                          "the repository's default branch")),
    Rule("pipeline.regenerate", (PIPELINE,), FLAG),
    Rule("pipeline.head_modules", (PIPELINE,), whole(1, "modules", at_most=1, words=("auto", "all"),
                                                     note="module 1 alone")),
    # the head's shapes (the head's config class checks its choices: check_head); the rows of keys a head type does
    # not have are skipped
    Rule("head.num_modules", (PRECOMPUTE, TRAIN), whole(1, "modules")),
    Rule("head.num_layers", (PRECOMPUTE, TRAIN), whole(1, "layers")),
    Rule("head.num_heads", (PRECOMPUTE, TRAIN), whole(1, "heads")),
    Rule("head.init_std", (PRECOMPUTE, TRAIN), number(0, what="a standard deviation")),
    Rule("head.draft_vocab_size", (PRECOMPUTE, TRAIN), whole(1, "tokens", null="the whole vocabulary")),
    Rule("head.mask_token_id", (PRECOMPUTE, TRAIN), whole(0, null="the target's last token id")),
    # precompute
    Rule("precompute.batch_tokens", (PRECOMPUTE,), TOKENS),
    Rule("precompute.shard_tokens", (PRECOMPUTE, ONLINE), TOKENS),
    Rule("precompute.workers", (PRECOMPUTE,), whole(1, "batches in flight", null="1 on an accelerator, one per CPU "
                                                                              "thread on CPU")),
    Rule("precompute.rank", (PRECOMPUTE,), whole(0, null="$RANK, else 0")),
    Rule("precompute.world_size", (PRECOMPUTE,), whole(1, "ranks", null="$WORLD_SIZE, else 1")),
    Rule("precompute.store_dtype", (PRECOMPUTE, ONLINE),
         Accept(_storage_dtype, "bfloat16, float16, float32 or fp8 (or bf16, fp16, fp32, fp8_e4m3, float8_e4m3fn)")),
    Rule("precompute.aux_layers", (PRECOMPUTE,), list_of(whole(0), "target layer ids", words=("auto", "none"),
                                                         null="none")),
    Rule("precompute.on_changed", (PRECOMPUTE,), one_of("recompute", "refuse")),
    Rule("precompute.vllm.in_flight", (PRECOMPUTE,), whole(1, "batches")),
    Rule("precompute.vllm.keep_worker", (PRECOMPUTE,), FLAG),
    *(Rule(f"precompute.vllm.{k}", (PRECOMPUTE,), a) for k, a in VLLM_AUTO.items() if k != "data_parallel_size"),
    # regeneration
    Rule("regenerate.out", (REGENERATE,), path("file", words=("auto",))),
    Rule("regenerate.batch_size", (REGENERATE,), whole(1, "conversations")),
    Rule("regenerate.max_new_tokens", (REGENERATE,), TOKENS),
    Rule("regenerate.max_prompt_tokens", (REGENERATE,), TOKENS),
    Rule("regenerate.seed", (REGENERATE,), SEED),
    *(Rule(f"regenerate.{k}", (REGENERATE,), a) for k, a in SAMPLING.items()),
    *(Rule(f"regenerate.vllm.{k}", (REGENERATE,), a) for k, a in VLLM_AUTO.items()),
    # training
    Rule("train.resume", (TRAIN,), either(Accept(_checkpoint_file, "an existing checkpoint file"), "a fresh run",
                                          ("last",))),
    Rule("train.checkpoint_dir", (TRAIN,), path("directory")),
    Rule("train.untrained_dir", (TRAIN,), path("directory", null="not saved")),
    Rule("train.checkpoint_every_n_steps", (TRAIN,), whole(1, "optimizer steps", null="at epoch ends")),
    Rule("train.data.source", (TRAIN,), one_of("store", "online")),
    Rule("train.data.online.write_store", (TRAIN,), path("directory", null="no store")),
    Rule("train.data.batch_tokens", (TRAIN,), TOKENS),
    Rule("train.data.val_fraction", (TRAIN,), number(0, 1, "a fraction", below=True)),
    Rule("train.data.split_seed", (TRAIN,), whole()),
    Rule("train.data.train_samples", (TRAIN,), whole(1, "conversations", null="the whole training split")),
    Rule("train.data.seed", (TRAIN,), whole()),
    Rule("train.data.num_workers", (TRAIN,), whole(0, "workers", words=("auto",))),
    Rule("train.data.verify_store", (TRAIN,), one_of("full", "header")),
    Rule("train.data.packing", (TRAIN,), FLAG),
    Rule("train.data.online.prefetch", (TRAIN,), either(FLAG, words=("auto",))),
    Rule("train.engine_validation.enabled", (TRAIN,), FLAG),
    Rule("train.engine_validation.strict", (TRAIN,), either(FLAG, "true for a float32 target")),
    Rule("train.engine_validation.every_n_steps", (TRAIN,), whole(1, "optimizer steps", null="when training ends")),
    Rule("train.engine_validation.conversations", (TRAIN,), whole(1, "conversations")),
    Rule("train.engine_validation.max_rows", (TRAIN,), whole(1, "rows", null="every row")),
    Rule("train.engine_validation.depth", (TRAIN,), whole(1, "draft depths")),
    Rule("train.engine_validation.prompts", (TRAIN,), whole(0, "prompts", note="0: none decoded")),
    Rule("train.engine_validation.k", (TRAIN,), whole(1, "draft tokens")),
    Rule("train.engine_validation.max_new_tokens", (TRAIN,), TOKENS),
    Rule("train.engine_validation.tolerance", (TRAIN,), number(0, 1, "a top-1 gap")),
    Rule("train.engine_validation.wait_timeout_s", (TRAIN,), number(0, what="seconds", above=True)),
    *(Rule(f"train.engine_validation.{k}", (TRAIN,), a) for k, a in SAMPLING.items()),
    Rule("trainer.max_epochs", (TRAIN,), whole(1, "epochs", null="Lightning's default", words=(-1,),
                                               note="-1: no limit")),
    Rule("trainer.max_steps", (TRAIN,), whole(1, "optimizer steps", words=(-1,), note="-1: no limit")),
    Rule("trainer.gradient_clip_val", (TRAIN,), number(0, what="a gradient norm", null="no clipping")),
    Rule("trainer.log_every_n_steps", (TRAIN,), whole(1, "steps")),
    Rule("trainer.num_nodes", (TRAIN,), whole(1, "nodes")),
    Rule("trainer.num_sanity_val_steps", (TRAIN,), whole(-1, "batches", note="-1: all")),
    Rule("trainer.devices", (TRAIN,), Accept(_devices, "auto, -1 (every device), a whole number of devices ≥ 1, or "
                                                       "a list of device indices (or \"0,1\")")),
    # evaluation
    Rule("evaluate.num_prompts", (EVALUATE,), whole(1, "prompts", null="every prompt")),
    Rule("evaluate.max_new_tokens", (EVALUATE,), TOKENS),
    *(Rule(f"evaluate.{k}", (EVALUATE,), a) for k, a in SAMPLING.items()),
    Rule("evaluate.batch_size", (EVALUATE,), whole(1, "sequences")),
    Rule("evaluate.turns", (EVALUATE,), list_of(Accept(lambda t: _whole(t) and t in (1, 2), "1 or 2"),
                                                "MT-Bench turns")),
    Rule("evaluate.auto_max_k", (EVALUATE,), whole(1, "draft tokens")),
    Rule("evaluate.auto_prompts", (EVALUATE,), whole(1, "prompts")),
    Rule("evaluate.auto_pairs", (EVALUATE,), whole(1, "pairs")),
    Rule("evaluate.auto_draft_vocab", (EVALUATE,),
         list_of(whole(1, "tokens", null="the whole vocabulary"), "draft vocabulary sizes",
                 null="the whole vocabulary")),
    Rule("evaluate.tree.depth", (EVALUATE,), whole(1, "levels")),
    Rule("evaluate.tree.topk", (EVALUATE,), whole(1, "children")),
    Rule("evaluate.tree.total", (EVALUATE,), whole(1, "nodes")),
    Rule("evaluate.head_dtype", (EVALUATE,), either(one_of("bfloat16", "float16", "float32"), "the target's dtype")),
    Rule("evaluate.weight_dtype", (EVALUATE,), either(one_of("bfloat16", "float32"), "the target's dtype")),
    Rule("evaluate.stop_below", (EVALUATE,), number(0, 1, what="a probability", above=True, below=True,
                                                    null="every block head drafts k")),
    Rule("evaluate.speed_pairs", (EVALUATE,), whole(1, "groups")),
    Rule("evaluate.predict_prompts", (EVALUATE,), whole(0, "prompts", note="0: no prediction")),
    Rule("evaluate.warmup", (EVALUATE,), whole(0, "prompts")),
    Rule("evaluate.repeats", (EVALUATE,), whole(1, "passes")),
    Rule("evaluate.report", (EVALUATE,), path("file")),
    Rule("evaluate.simulated_tau", (EVALUATE,), FLAG),
    Rule("evaluate.plain_baseline", (EVALUATE,), FLAG),
    # in-loop validation through vLLM reads evaluate.vllm too
    *(Rule(f"evaluate.vllm.{k}", (EVALUATE, TRAIN), a) for k, a in VLLM.items()),
    # export
    Rule("export.source", (EXPORT,), path("directory")),
    Rule("export.root", (EXPORT,), path("directory")),
    Rule("export.dir", (EXPORT,), path("directory")),
)
RULES_BY_KEY = {rule.key: rule for rule in RULES}
_ABSENT = object()


def check_setting(key: str, value: Any) -> None:
    """Refuse `value` for the setting `key` unless its rule accepts it (ConfigError naming both and the range)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    accept = RULES_BY_KEY[key].accept
    if not accept.ok(value):
        raise ConfigError(f"{key}={value!r}: expected {accept.text}")


def setting(cfg: Any, key: str) -> Any:
    """The resolved value of a dotted setting; `_ABSENT` where the config has no such key (the code's default)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.select(cfg, key, default=_ABSENT)
    node = cfg
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return _ABSENT
        node = node[part]
    return node


def check_settings(cfg: Any, stage: str) -> None:
    """Every `RULES` row of a setting `stage` reads (the demo: every stage's), then what the typed configs check,
    the precompute rank against its world size and the vLLM environment a `vllm` backend runs in."""
    readers = {stage, *((ONLINE,) if trains_online(cfg, stage) else ())}
    if stage == PIPELINE:
        readers = {*EVERY, ONLINE, PIPELINE}
    if readers.intersection((*DATA, EVALUATE)):  # first: other settings interpolate data.* (max_prompt_tokens)
        from data.sources import DataConfig

        try:
            DataConfig.of(cfg.get("data"))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    for rule in RULES:
        if readers.intersection(rule.stages) and (value := setting(cfg, rule.key)) is not _ABSENT:
            check_setting(rule.key, value)
    check_target_settings(cfg.get("target") or {})
    if PRECOMPUTE in readers:
        from data.precompute import resolve_rank

        try:
            section = cfg.get("precompute") or {}
            resolve_rank(section.get("rank"), section.get("world_size"))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    for name in (PRECOMPUTE, REGENERATE):
        section = cfg.get(name) or {}
        runs = name in readers and (stage != PIPELINE or name == PRECOMPUTE or (cfg.get("pipeline") or {}).get(name))
        if runs and section.get("backend") == "vllm":
            from inference_eval.vllm_backend import VllmSettings, vllm_python

            try:
                VllmSettings.of(section.get("vllm"), f"{name}.vllm")
            except ValueError as e:
                raise ConfigError(str(e)) from e
            vllm_python((section.get("vllm") or {}).get("python"), f"{name}.vllm.python", f"{name}.backend=vllm")


def check_target_settings(target_cfg: Any) -> None:
    """target.dtype and target.fingerprint as the stages' TargetConfig checks them (its directory is resolved later:
    a packaged target is converted on first use)."""
    from inference_eval.targets import TargetConfig

    try:
        TargetConfig(dir=Path(str(target_cfg.get("path") or ".")), name=str(target_cfg.get("name") or ""),
                     dtype=str(target_cfg.get("dtype")), fingerprint_mode=str(target_cfg.get("fingerprint", "header")))
    except ValueError as e:
        raise ConfigError(str(e)) from e
