"""The evaluation stage's settings as one checked object: `EvalConfig.of(cfg)` reads the config's `evaluate` section
and the run-wide settings an evaluation uses (the seed, the training store whose token frequencies give k=auto's
draft vocabularies, progress, the data range whose held-out part `evaluate.dataset=sharegpt` reads, the logger for
wandb) once, at the stage's entry; evaluation/evaluate.py and evaluation/vllm_eval.py take it instead of the hydra
config. The numeric ranges are `RULES` rows (scripts/checks.py) checked before work; what is refused here are the
choices and the combinations (the dataset, k, the engine, the proposer and what it needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.progress import DEFAULT_EVERY_S, log_interval
from data.prompts import PromptSet
from data.sources import DataConfig
from inference_eval.speculative import Sampling
from inference_eval.vllm_backend import VllmSettings

ENGINES = ("spechead", "vllm")
PROPOSERS = ("chain", "tree")


def _plain(section: Any) -> Any:
    """A DictConfig section as plain containers (a mapping or list already plain is returned as it is)."""
    if section is None or isinstance(section, (dict, list, str, int, float, bool)):
        return section
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True)


def _probe_labels(spec: Any) -> tuple[str, ...] | None:
    """`evaluate.auto_probe`: None for `all`, else the labels listed."""
    spec = _plain(spec)
    if spec is None or str(spec) == "all":
        return None
    if isinstance(spec, str) or not isinstance(spec, (list, tuple)) or not all(isinstance(x, str) for x in spec):
        raise ValueError(f"evaluate.auto_probe={spec!r}: expected all or a list of head / draft-model labels")
    return tuple(spec)


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation runs: the prompts, the heads and draft-model baselines, how each proposer's k is chosen
    (a fixed k, or k=auto's probe: `auto_*`), the decoding (sampling, batch size, chain or tree), the timing protocol
    (paired passes beside plain decoding), the engine (this process's or real vLLM) and where the report goes."""

    prompts: PromptSet
    report: Path
    k: int | None = 3  # None: k=auto
    heads: dict[str, str] = field(default_factory=dict)  # label -> a native checkpoint or export (the set ones)
    draft_models: dict[str, dict] = field(default_factory=dict)  # label -> {layers: N} | {path: <HF dir>}
    auto_max_k: int = 4
    auto_prompts: int = 4
    auto_pairs: int = 2
    auto_probe: tuple[str, ...] | None = None  # None: every proposer
    auto_draft_vocab: tuple[int | None, ...] = (None,)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 1
    proposer: str = "chain"
    tree: dict[str, int] | None = None  # proposer=tree: depth, topk, total
    stop_below: float | None = None  # a block head with a confidence head: the adaptive draft length's threshold
    head_dtype: str | None = None
    simulated_tau: bool = True
    plain_baseline: bool = False
    speed_pairs: int = 4
    predict_prompts: int = 2
    warmup: int = 0
    repeats: int = 1
    engine: str = "spechead"
    vllm: VllmSettings = field(default_factory=lambda: VllmSettings("evaluate.vllm"))
    seed: int = 0
    store_dir: Path | None = None  # the training store: k=auto's draft vocabularies come from its token counts
    run_dir: Path = Path("runs/eval")
    show_bar: bool = True
    every_s: float | None = DEFAULT_EVERY_S
    logger: dict[str, Any] = field(default_factory=dict)  # the logger section (report_to_wandb)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"evaluate.engine={self.engine!r}: expected spechead (this process's engine) or vllm")
        if self.batch_size < 1 or self.proposer not in PROPOSERS:
            raise ValueError(f"evaluate.batch_size={self.batch_size} (≥ 1) / evaluate.proposer={self.proposer!r} "
                             "(chain or tree)")
        if self.engine == "spechead" and self.tree is not None:
            if self.temperature != 0.0:
                raise ValueError("evaluate.proposer=tree verifies greedily: set evaluate.temperature=0")
            if self.k is None:
                raise ValueError("evaluate.k=auto chooses a chain's k; with evaluate.proposer=tree set "
                                 "evaluate.tree.depth")

    @classmethod
    def of(cls, cfg: Any) -> "EvalConfig":
        """The typed form of a run config's `evaluate` section and the run-wide settings it reads."""
        ecfg = cfg.evaluate
        k = ecfg.get("k", 3)
        if str(k) != "auto" and not (str(k).isdigit() and int(k) >= 1):
            raise ValueError(f"evaluate.k={k!r}: expected auto or a number of draft tokens ≥ 1")
        dataset = ecfg.get("dataset", "mtbench")
        prompts_path = ecfg.get("prompts_path")
        prompt_set = PromptSet(dataset=dataset, num_prompts=ecfg.get("num_prompts"),
                               turns=tuple(int(t) for t in ecfg.get("turns", [1])),
                               prompts_path=Path(str(prompts_path)) if prompts_path else None,
                               max_new_tokens=int(ecfg.get("max_new_tokens", 64)), data=DataConfig.of(cfg.get("data")))
        proposer = ecfg.get("proposer", "chain")
        tree = ({key: int(v) for key, v in (_plain(ecfg.get("tree")) or {}).items()} if proposer == "tree" else None)
        if tree is not None:
            tree.setdefault("depth", 4)
        heads = {str(label): str(path) for label, path in (_plain(ecfg.get("heads")) or {}).items() if path}
        draft_models = {str(label): dict(spec) for label, spec in (_plain(ecfg.get("draft_models")) or {}).items()
                        if spec}
        store_dir = cfg.get("store_dir")
        return cls(prompts=prompt_set, report=Path(str(ecfg.get("report", "eval.json"))),
                   k=None if str(k) == "auto" else int(k), heads=heads, draft_models=draft_models,
                   auto_max_k=int(ecfg.get("auto_max_k", 4)), auto_prompts=int(ecfg.get("auto_prompts", 4)),
                   auto_pairs=int(ecfg.get("auto_pairs", 2)), auto_probe=_probe_labels(ecfg.get("auto_probe", "all")),
                   auto_draft_vocab=tuple(None if n is None else int(n)
                                          for n in (_plain(ecfg.get("auto_draft_vocab")) or [None])),
                   temperature=float(ecfg.get("temperature", 0.0)), top_p=float(ecfg.get("top_p", 1.0)),
                   top_k=int(ecfg.get("top_k", 0)), batch_size=int(ecfg.get("batch_size", 1)), proposer=proposer,
                   tree=tree, head_dtype=ecfg.get("head_dtype") or None,
                   stop_below=None if ecfg.get("stop_below") is None else float(ecfg.get("stop_below")),
                   simulated_tau=bool(ecfg.get("simulated_tau", True)),
                   plain_baseline=bool(ecfg.get("plain_baseline", False)),
                   speed_pairs=int(ecfg.get("speed_pairs", 4)), predict_prompts=int(ecfg.get("predict_prompts", 2)),
                   warmup=int(ecfg.get("warmup", 0)), repeats=int(ecfg.get("repeats", 1)),
                   engine=ecfg.get("engine", "spechead"), vllm=VllmSettings.of(ecfg.get("vllm"), "evaluate.vllm"),
                   seed=int(cfg.get("seed", 0)), store_dir=Path(str(store_dir)) if store_dir else None,
                   run_dir=Path(str(cfg.get("run_dir", "runs/eval"))), show_bar=bool(cfg.get("progress", True)),
                   every_s=log_interval(cfg.get("progress_log_s", DEFAULT_EVERY_S)),
                   logger=_plain(cfg.get("logger")) or {})

    @property
    def auto(self) -> bool:
        return self.k is None

    def sampling(self) -> Sampling:
        """The decoding's sampling settings, with a generator seeded by the run's seed."""
        return Sampling(self.temperature, self.top_p, self.top_k, torch.Generator().manual_seed(self.seed))
