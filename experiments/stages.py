"""The stage entries: the hydra config → the typed configs → the library's stage. Each typed config is built here,
once per stage (`precompute_config`, `regenerate_config`, `eval_config`, `training_paths`, `validation_settings`,
the target's data/sources.py `target_config`), and the library below takes it instead of the config
(tests/test_layout.py: no library function takes the hydra config). `run_precompute`, `regenerate`,
`use_regenerated`, `run_evaluation` and `run_training` are what the entry points (scripts/<stage>.py), the demo
(scripts/pipeline.py) and the studies (experiments/) call; `run_training` also assembles Lightning's trainer, logger
and callbacks from the config's `trainer` and `logger` sections.

It imports no other module of experiments/. Each function imports its stage's modules itself: precompute does not
load Lightning, nor evaluation training's modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from core.progress import DEFAULT_EVERY_S, log_interval

if TYPE_CHECKING:
    from data.precompute import PrecomputeConfig, PrecomputeStats
    from data.regenerate import RegenerateConfig, RegenerateStats
    from evaluation.settings import EvalConfig
    from train.run import TrainingPaths
    from train.validation import EngineValidationSettings


def progress_every_s(cfg: DictConfig) -> float | None:
    """Seconds between progress lines (`progress_log_s`, core/progress.py `log_interval`)."""
    return log_interval(cfg.get("progress_log_s", DEFAULT_EVERY_S))


# ---- precompute ------------------------------------------------------------------------------------------------

def precompute_config(cfg: DictConfig) -> PrecomputeConfig:
    """data/precompute.py `PrecomputeConfig` of a run config: `precompute.*`, the `data` section, `store_dir`, the
    head's target layers, progress."""
    from data.precompute import PrecomputeConfig
    from data.sources import DataConfig
    from heads.registry import head_config
    from inference_eval.vllm_backend import VllmSettings

    pcfg = cfg.get("precompute") or {}
    path = (cfg.get("data") or {}).get("path")
    return PrecomputeConfig(
        data=DataConfig.of(cfg.get("data")), data_path=None if path is None else str(path),
        store_dir=Path(str(cfg.store_dir)), store_dtype=str(pcfg.get("store_dtype", "bfloat16")),
        shard_tokens=int(pcfg.get("shard_tokens", 262144)), aux_layers=pcfg.get("aux_layers", "auto"),
        head_layers=head_config(cfg.get("head") or {})[1], backend=pcfg.get("backend"),
        batch_tokens=int(pcfg.get("batch_tokens", 8192)), workers=pcfg.get("workers"),
        on_changed=str(pcfg.get("on_changed", "recompute")), rank=pcfg.get("rank"), world_size=pcfg.get("world_size"),
        vllm=VllmSettings.of(pcfg.get("vllm"), "precompute.vllm"), progress=bool(cfg.get("progress", True)),
        every_s=progress_every_s(cfg))


def run_precompute(cfg: DictConfig) -> tuple[Path, PrecomputeStats]:
    """The precompute entry point's body: target + data config → a complete store at cfg.store_dir
    (data/precompute.py `precompute_stage`: under several ranks this rank's share, each directory's writer lock,
    the ranks' merged manifest)."""
    from data.precompute import precompute_stage
    from data.sources import target_config

    return precompute_stage(precompute_config(cfg), target_config(cfg.target))


# ---- regenerate ------------------------------------------------------------------------------------------------

def regenerate_config(cfg: DictConfig) -> RegenerateConfig:
    """data/regenerate.py `RegenerateConfig` of a run config: the `regenerate` section, the `data` section,
    progress."""
    from data.regenerate import GenerationSettings, RegenerateConfig
    from data.sources import DataConfig
    from inference_eval.vllm_backend import VllmSettings

    rcfg = cfg.regenerate
    out = rcfg.get("out")
    return RegenerateConfig(
        settings=GenerationSettings.of(rcfg), data=DataConfig.of(cfg.get("data")), batch_size=int(rcfg.batch_size),
        max_prompt_tokens=int(rcfg.max_prompt_tokens), backend=rcfg.get("backend"),
        out=None if out in (None, "auto") else Path(str(out)).expanduser(), device=rcfg.get("device") or None,
        vllm=VllmSettings.of(rcfg.get("vllm"), "regenerate.vllm"), progress=bool(cfg.get("progress", True)),
        every_s=progress_every_s(cfg))


def regenerate(cfg: DictConfig) -> tuple[Path, RegenerateStats]:
    """The regenerate entry point's body: target + data config + `regenerate:` → the JSONL at
    `regenerate.out` (`auto`: the cache's file for these settings). A file that already holds every
    conversation is returned as it is, before the target is loaded."""
    from data.regenerate import regenerate_stage
    from data.sources import target_config

    return regenerate_stage(regenerate_config(cfg), target_config(cfg.target))


def use_regenerated(cfg: DictConfig) -> tuple[Path, RegenerateStats]:
    """Regenerate the configured conversations (or reuse their cached regeneration) and point `cfg.data`
    at the result (a JSONL source, every record of it): what `pipeline.regenerate: true` and the recipe
    study's `regen` variants precompute and train on."""
    path, stats = regenerate(cfg)
    with open_dict(cfg):
        cfg.data.source, cfg.data.path, cfg.data.skip, cfg.data.max_samples = "jsonl", str(path), 0, None
    return path, stats


# ---- evaluate --------------------------------------------------------------------------------------------------

def _plain(section: Any) -> Any:
    """A DictConfig section as plain containers (a mapping or list already plain is returned as it is)."""
    if section is None or isinstance(section, (dict, list, str, int, float, bool)):
        return section
    return OmegaConf.to_container(section, resolve=True)


def _probe_labels(spec: Any) -> tuple[str, ...] | None:
    """`evaluate.auto_probe`: None for `all`, else the labels listed."""
    spec = _plain(spec)
    if spec is None or str(spec) == "all":
        return None
    if isinstance(spec, str) or not isinstance(spec, (list, tuple)) or not all(isinstance(x, str) for x in spec):
        raise ValueError(f"evaluate.auto_probe={spec!r}: expected all or a list of head / draft-model labels")
    return tuple(spec)


def engine_compile(value: Any) -> str:
    """evaluate.compile as the engine takes it: YAML reads an unquoted on / off as true / false."""
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else str(value)


def eval_config(cfg: DictConfig) -> EvalConfig:
    """evaluation/settings.py `EvalConfig` of a run config: its `evaluate` section and the run-wide settings an
    evaluation reads (the seed, `store_dir`, `run_dir`, the `data` range, progress, the logger)."""
    from data.prompts import PromptSet
    from data.sources import DataConfig
    from evaluation.settings import EvalConfig
    from inference_eval.vllm_backend import VllmSettings

    ecfg = cfg.evaluate
    k = ecfg.get("k", 3)
    if str(k) != "auto" and not (str(k).isdigit() and int(k) >= 1):
        raise ValueError(f"evaluate.k={k!r}: expected auto or a number of draft tokens ≥ 1")
    prompts_path = ecfg.get("prompts_path")
    prompt_set = PromptSet(dataset=ecfg.get("dataset", "mtbench"), num_prompts=ecfg.get("num_prompts"),
                           turns=tuple(int(t) for t in ecfg.get("turns", [1])),
                           prompts_path=Path(str(prompts_path)) if prompts_path else None,
                           max_new_tokens=int(ecfg.get("max_new_tokens", 64)), data=DataConfig.of(cfg.get("data")))
    proposer = ecfg.get("proposer", "chain")
    tree = ({key: int(v) for key, v in (_plain(ecfg.get("tree")) or {}).items()} if proposer == "tree" else None)
    if tree is not None:
        tree.setdefault("depth", 4)
    heads = {str(label): str(path) for label, path in (_plain(ecfg.get("heads")) or {}).items() if path}
    draft_models = {str(label): dict(spec) for label, spec in (_plain(ecfg.get("draft_models")) or {}).items() if spec}
    store_dir = cfg.get("store_dir")
    return EvalConfig(
        prompts=prompt_set, report=Path(str(ecfg.get("report", "eval.json"))), k=None if str(k) == "auto" else int(k),
        heads=heads, draft_models=draft_models, auto_max_k=int(ecfg.get("auto_max_k", 4)),
        auto_prompts=int(ecfg.get("auto_prompts", 4)), auto_pairs=int(ecfg.get("auto_pairs", 2)),
        auto_probe=_probe_labels(ecfg.get("auto_probe", "all")),
        auto_draft_vocab=tuple(None if n is None else int(n) for n in (_plain(ecfg.get("auto_draft_vocab")) or [None])),
        temperature=float(ecfg.get("temperature", 0.0)), top_p=float(ecfg.get("top_p", 1.0)),
        top_k=int(ecfg.get("top_k", 0)), batch_size=int(ecfg.get("batch_size", 1)), proposer=proposer, tree=tree,
        head_dtype=ecfg.get("head_dtype") or None, weight_dtype=ecfg.get("weight_dtype") or None,
        compile=engine_compile(ecfg.get("compile", "off")),
        stop_below=None if ecfg.get("stop_below") is None else float(ecfg.get("stop_below")),
        simulated_tau=bool(ecfg.get("simulated_tau", True)), plain_baseline=bool(ecfg.get("plain_baseline", False)),
        speed_pairs=int(ecfg.get("speed_pairs", 4)), predict_prompts=int(ecfg.get("predict_prompts", 2)),
        warmup=int(ecfg.get("warmup", 0)), repeats=int(ecfg.get("repeats", 1)),
        engine=ecfg.get("engine", "spechead"), vllm=VllmSettings.of(ecfg.get("vllm"), "evaluate.vllm"),
        seed=int(cfg.get("seed", 0)), store_dir=Path(str(store_dir)) if store_dir else None,
        run_dir=Path(str(cfg.get("run_dir", "runs/eval"))), show_bar=bool(cfg.get("progress", True)),
        every_s=progress_every_s(cfg), logger=_plain(cfg.get("logger")) or {})


def run_evaluation(cfg: DictConfig) -> dict[str, Any]:
    """The evaluation stage: its settings built once (`eval_config`, the target's `target_config`), then
    evaluation/evaluate.py `evaluation_stage` (`evaluate`, or `evaluation/vllm_eval.py` with
    `evaluate.engine=vllm`); the report written and, with the wandb logger, logged."""
    from data.sources import target_config
    from evaluation.evaluate import evaluation_stage

    return evaluation_stage(eval_config(cfg), target_config(cfg.target))


# ---- train -----------------------------------------------------------------------------------------------------

def training_paths(cfg: DictConfig) -> TrainingPaths:
    """train/run.py `TrainingPaths` of a run config: `run_dir`, `head_dir` and `train.checkpoint_dir` /
    `untrained_dir` / `resume`."""
    from train.run import TrainingPaths

    untrained = cfg.train.get("untrained_dir")
    return TrainingPaths(Path(str(cfg.run_dir)), Path(str(cfg.train.checkpoint_dir)), Path(str(cfg.head_dir)),
                         Path(str(untrained)) if untrained else None, cfg.train.get("resume"))


def validation_settings(cfg: DictConfig, target_dir: str | Path, progress_log_s: float | None = None
                        ) -> EngineValidationSettings:
    """train/validation.py `EngineValidationSettings` of a run config: `train.engine_validation`, `train.module`'s
    loss weights, the target."""
    from inference_eval.vllm_backend import VllmSettings
    from train.validation import EngineValidationSettings

    ev, m = cfg.train.engine_validation, cfg.train.module
    return EngineValidationSettings(
        target_dir, cfg.target.dtype, ev.get("every_n_steps"), int(ev.conversations), ev.get("max_rows"),
        int(ev.depth), int(ev.prompts), int(ev.k), int(ev.max_new_tokens), float(ev.tolerance),
        bool(m.normed_regression), float(m.w_hidden), float(m.w_kl), float(m.depth_decay),
        plot_dir=Path(cfg.run_dir) / "engine_val", temperature=float(ev.get("temperature", 0.0)),
        top_p=float(ev.get("top_p", 1.0)), top_k=int(ev.get("top_k", 0)), seed=int(cfg.seed),
        device=cfg.target.get("device", "auto"), strict=ev.get("strict"),
        wait_timeout_s=float(ev.get("wait_timeout_s", 86400)), progress_log_s=progress_log_s,
        engine=str(ev.get("engine", "spechead")),
        vllm=VllmSettings.of((cfg.get("evaluate") or {}).get("vllm"), "evaluate.vllm"))


def training_callbacks(cfg: DictConfig, dm, target, target_dir: Path, every_s: float | None,
                       extra_callbacks: list | None):
    """(the trainer's callbacks in order, in-loop engine validation or None, the `LastValidation` callback): the run
    directory check, `trainer.callbacks`, the caller's, Lightning's checkpoints, progress lines, online training's
    write-through, engine validation (online: on the target already loaded, not a second copy)."""
    from hydra.utils import instantiate

    from train.progress import ProgressLog
    from train.run import Checkpoints, LastValidation, SharedRunDir
    from train.validation import EngineValidation

    checkpoints = Checkpoints(dirpath=cfg.train.checkpoint_dir, save_last=True,  # at epoch ends, or:
                              every_n_train_steps=cfg.train.get("checkpoint_every_n_steps"))
    validated = LastValidation()
    callbacks = [SharedRunDir(cfg.run_dir), *(instantiate(cfg.trainer.get("callbacks")) or []),
                 *(extra_callbacks or []), checkpoints, ProgressLog(every_s), validated]
    if getattr(dm, "write_through", None) is not None:
        callbacks.append(dm.write_through)
    ev = cfg.train.get("engine_validation")
    engine_val = None
    if ev is not None and ev.get("enabled"):
        engine_val = EngineValidation(validation_settings(cfg, target_dir, every_s), target)
        callbacks.append(engine_val)
    return callbacks, engine_val, validated


def run_training(cfg: DictConfig, extra_callbacks: list | None = None) -> tuple[Path, dict[str, float]]:
    """Train the head on the store at cfg.store_dir; write the native checkpoint to cfg.head_dir.
    Returns that directory and the final logged metrics.

    Lightning checkpoints (`last.ckpt`, written at each epoch end or every
    train.checkpoint_every_n_steps steps, and when max_steps stops training) go to
    cfg.train.checkpoint_dir; `train.resume=<ckpt>` (or `last`) continues exactly, mid-epoch included
    (the train loader is stateful, train/data.py). The LR schedule spans the configured run
    (trainer.max_steps / max_epochs), so a resumed run reproduces an uninterrupted one only when
    both have the same schedule horizon.

    Only global rank 0 writes files, holding the locks of the checkpoint, head and untrained directories while
    it does (core/lock.py: a second training into one of them is refused). With `ddp` (and DeepSpeed) every rank
    runs this function; with
    `ddp_spawn` / `ddp_fork` only the parent does, and Lightning loads rank 0's final weights back
    into the parent's module after fit — so `head` below is the trained head in every case."""
    import contextlib

    import lightning as L
    from hydra.utils import instantiate

    from core.lock import writer_locks
    from data.sources import target_config
    from train.module import DraftHeadModule
    from train.run import (AtomicCheckpointIO, check_training_dirs_free, data_module, fit_and_save, init_head,
                           place_tied, resolve_precision)
    from train.settings import ModuleSettings

    L.seed_everything(int(cfg.seed), workers=True)
    settings = ModuleSettings.from_config(cfg.train.module)  # checked before the data and the target load
    paths = training_paths(cfg)
    check_training_dirs_free(paths)  # another training writing here: refused before anything loads
    tc = target_config(cfg.target)
    dm, target = data_module(OmegaConf.to_container(cfg.train.data, resolve=True), precompute_config(cfg), tc)
    dm.setup("fit")
    head = init_head(OmegaConf.to_container(cfg.head, resolve=True), cfg.seed, tc.dir, dm, target)
    module = DraftHeadModule(head, settings)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks, engine_val, validated = training_callbacks(cfg, dm, target, tc.dir, progress_every_s(cfg),
                                                          extra_callbacks)
    # the data module shards batches over ranks itself; Lightning cannot inject its sampler there
    trainer: L.Trainer = instantiate(cfg.trainer, logger=logger, default_root_dir=cfg.run_dir, callbacks=callbacks,
                                     use_distributed_sampler=False, plugins=[AtomicCheckpointIO()],
                                     precision=resolve_precision(cfg.trainer.get("precision"),
                                                                 cfg.trainer.get("accelerator")))
    place_tied(head, trainer, shared_with_target=target is not None)
    # rank 0 alone writes files, so it alone holds the locks (the ranks Lightning starts itself come later)
    with writer_locks(paths.written, "train") if trainer.is_global_zero else contextlib.nullcontext():
        return fit_and_save(paths, trainer, module, dm, head, engine_val, tc.fingerprint, validated)
