"""The evaluation stage's settings as one checked object: `EvalConfig`, the config's `evaluate` section and the
run-wide settings an evaluation uses (the seed, the training store whose token frequencies give k=auto's draft
vocabularies, progress, the data range whose held-out part `evaluate.dataset=sharegpt` reads, the logger for wandb),
built once at the stage's entry (experiments/stages.py `eval_config`); evaluation/evaluate.py and evaluation/vllm_eval.py
take it instead of the hydra config. The numeric ranges are `RULES` rows (scripts/checks.py) checked before work;
what is refused here are the choices and the combinations (the dataset, k, the engine, the proposer and what it
needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.progress import DEFAULT_EVERY_S
from data.prompts import PromptSet
from inference_eval.speculative import Sampling
from inference_eval.engine.static import COMPILE
from inference_eval.vllm_backend import VllmSettings

ENGINES = ("spechead", "vllm")
PROPOSERS = ("chain", "tree")


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
    weight_dtype: str | None = None  # the target's linear weights stored in this dtype (bfloat16: W16A32); None: its dtype
    compile: str = "off"  # the engine's static step: auto (compiled on CUDA), on, off (inference_eval/engine/static.py)
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
        if self.weight_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"evaluate.weight_dtype={self.weight_dtype!r}: expected null (the target's dtype), bfloat16 "
                             "(a float32 target's linear weights stored in bf16, computed in fp32) or float32")
        if self.weight_dtype is not None and self.engine != "spechead":
            raise ValueError(f"evaluate.weight_dtype={self.weight_dtype}: it sets how spechead's engine stores the target, "
                             f"not evaluate.engine={self.engine}; set it to null")
        if self.compile not in COMPILE:
            raise ValueError(f"evaluate.compile={self.compile!r}: expected one of {', '.join(COMPILE)}")
        if self.engine == "spechead" and self.tree is not None:
            if self.temperature != 0.0:
                raise ValueError("evaluate.proposer=tree verifies greedily: set evaluate.temperature=0")
            if self.k is None:
                raise ValueError("evaluate.k=auto chooses a chain's k; with evaluate.proposer=tree set "
                                 "evaluate.tree.depth")

    @property
    def auto(self) -> bool:
        return self.k is None

    def sampling(self) -> Sampling:
        """The decoding's sampling settings, with a generator seeded by the run's seed."""
        return Sampling(self.temperature, self.top_p, self.top_k, torch.Generator().manual_seed(self.seed))
