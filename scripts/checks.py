"""Configuration checks that run before any model or data work (docs/pipeline.md "Checks before work").

Each entry point runs `check_before_work(cfg, stage)` before its stage (scripts/runtime.py `stage_main`;
`run_pipeline` for the demo): what the config and a few bytes on disk can
tell is refused at once — an unknown data source, a missing file, a source/path mismatch, a target
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
        from data.sources import check_source

        check_source(cfg.data)
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

        check_evaluation_config(cfg, heads_must_exist="evaluate" in needs)


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


def check_target(target_cfg: Any) -> Path | None:
    """target.path's directory (None for a packaged source, converted on first use)."""
    if target_cfg.get("path"):
        path = Path(str(target_cfg["path"])).expanduser()
        if not path.is_dir():
            raise ConfigError(f"target.path={path}: no such directory (an HF checkpoint directory with config.json "
                              "and *.safetensors)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"target.path={path}: no config.json (expected an HF checkpoint directory)")
        return path
    from data.assets import TARGET_SOURCES

    if target_cfg.get("source") in TARGET_SOURCES:
        return None
    raise ConfigError("target: set target.path=<HF checkpoint directory> or target.source="
                      + " | ".join(TARGET_SOURCES))


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
    from heads.registry import HEAD_TYPES

    kind = head_cfg.get("type", "mtp")
    if kind not in HEAD_TYPES:
        raise ConfigError(f"head.type={kind!r}: unknown head type; known: {', '.join(sorted(HEAD_TYPES))} "
                          "(head=<name> picks conf/head/<name>.yaml)")
