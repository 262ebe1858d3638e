"""The recipe study (docs/RESULTS.md §7): which training recipe buys the most τ per
CPU-hour, and does τ keep rising with the token budget.

    python -m scripts.study experiment=study                 # the RESULTS.md run
    python -m scripts.study experiment=study study.budgets=[20000,60000] 'study.variants={default:{}}'

Each *variant* is a recipe: a head type (`head`: a conf/head name, default mtp), a data kind (`data`:
`sharegpt` — the configured conversations as they are — or `regen` — the same conversations with every
assistant turn replaced by the target's own reply, data/regenerate.py, cached per machine by its
inputs), config overrides (`overrides`: dotted paths, e.g. `train.module.depth: 3`; `data.*`,
`regenerate.*` and `precompute.*` ones shape the variant's store, e.g. a smaller pool) and optionally
its own `budgets`. Each variant is trained at each token *budget* (`study.budgets` unless it has its
own): the training tokens it sees (optimizer steps × the store's mean tokens per batch, the number of
steps rounded), drawn fresh from the variant's store (`trainer.max_steps`, no epoch limit) — a variant
that limits `train.data.train_samples` instead repeats epochs over fewer conversations at the same
steps. Every point is scored on
  * MT-Bench τ and α_d through the engine (greedy, `evaluate.num_prompts` first turns) for each k of
    `study.ks`, and of `study.ks_largest` at the variant's largest budget and at the *common* budget
    (the largest one every variant has, where variants are ranked);
  * held-out top-1 agreement per draft depth 1..`study.eval_depth` (teacher-forced, the TTT unroll)
    on the held-out split of the ShareGPT store of the variant's pool (the same rows for variants of
    one pool, whatever their data kind).
`study.repeat_seeds` retrains the `study.repeat` variants (a name, or `best`: the variant of the highest
τ at the common budget) at the common budget with each seed, to show which differences in the ranking
are noise.

Stores, regenerations, trained heads, evaluation reports and held-out scores are cached under keys of their full
config and inputs (experiments/cache.py; a store directory is named by the hash of what it holds), so an
interrupted study resumes and a changed setting recomputes — never a stale result. Writes
`<run_dir>/study.json`, `study.md` and `study.png` (τ and held-out top-1 against training tokens),
rewritten after every point (`complete: false` until the last).
Last line: `study best=<variant> tau_k<k>=<τ> … runtime_s=<s>`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from core.files import atomic_write_bytes
from core.paths import CONF
from data.sources import target_config
from data.store import FeatureStore
from experiments.cache import config_sections, digest
from experiments.runner import apply_overrides, flatten, head_preset, run_point
from heads.registry import head_aux_layers, head_config
from inference_eval.model import target_args
from experiments.stages import run_precompute
from train.data import FeatureDataModule

log = logging.getLogger(__name__)

DATA_KINDS = ("sharegpt", "regen")


def parse_variant(name: str, spec: Any) -> dict[str, Any]:
    spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else dict(spec or {})
    unknown = set(spec) - {"head", "data", "overrides", "budgets"}
    if unknown:
        raise ValueError(f"study.variants.{name}: unknown keys {sorted(unknown)} (expected head, data, overrides, budgets)")
    data = spec.get("data", "sharegpt")
    if data not in DATA_KINDS:
        raise ValueError(f"study.variants.{name}.data={data!r}: expected one of {DATA_KINDS}")
    head = spec.get("head", "mtp")
    if not (CONF / "head" / f"{head}.yaml").exists():
        raise ValueError(f"study.variants.{name}.head={head!r}: no conf/head/{head}.yaml")
    budgets = spec.get("budgets")
    return {"head": head, "data": data, "overrides": flatten(spec.get("overrides") or {}),
            "budgets": None if budgets is None else sorted(int(b) for b in budgets)}


DATA_SECTIONS = ("data.", "regenerate.", "precompute.")  # overrides that change the store, not the training


def split_overrides(variant: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(store-side overrides, training-side overrides) of a variant."""
    o = variant["overrides"]
    return ({k: v for k, v in o.items() if k.startswith(DATA_SECTIONS)},
            {k: v for k, v in o.items() if not k.startswith(DATA_SECTIONS)})


def data_config(cfg: DictConfig, variant: dict[str, Any], where: str) -> DictConfig:
    """The config whose data section is the variant's store's: the configured conversations, or their
    regeneration (run here unless cached, data/regenerate.py) as a JSONL source."""
    out = cfg.copy()
    with open_dict(out):
        apply_overrides(out, split_overrides(variant)[0], where)
    if variant["data"] == "regen":
        from experiments.stages import use_regenerated

        path, stats = use_regenerated(out)
        log.info("study: regenerated data %s (%d conversations, %d new tokens%s)", path,
                 stats.conversations + stats.skipped_done, stats.tokens, ", cached" if stats.cached else "")
    return out


def store_key(cfg: DictConfig) -> str:
    """The name of a study's store: a hash of what determines its contents — the target, the data and the
    precompute settings, less those of a backend that does not run (`precompute.vllm` unless
    `precompute.backend=vllm`: its memory setting changing must not recompute an engine-made store)."""
    sections = config_sections(cfg, ("target", "data", "precompute"))
    pre = sections.get("precompute") or {}
    if pre.get("backend") != "vllm":
        pre.pop("vllm", None)
    return digest(sections)[:16]


def store_for(cfg: DictConfig, head_cfg: DictConfig) -> Path:
    """A feature store for this data and head (EAGLE-3, or mtp with `aux_layers`, reads aux layers): `<run_dir>/stores/<hash>` of
    what it holds, precomputed (or resumed / reused) here."""
    sc = cfg.copy()
    with open_dict(sc):
        sc.head = head_cfg
        num_layers = target_args(target_config(cfg.target).dir).num_hidden_layers
        sc.precompute.aux_layers = list(head_aux_layers(head_config(head_cfg)[1], num_layers))
        sc.store_dir = str(Path(cfg.run_dir) / "stores" / store_key(sc))
    store, _ = run_precompute(sc)
    return Path(store)


def mean_batch_tokens(cfg: DictConfig, store: Path, fp: dict[str, Any]) -> tuple[float, int]:
    """(tokens per training batch, training tokens of one epoch) of this store under cfg.train.data;
    `fp`: the target's fingerprint, which the store must carry."""
    dm = FeatureDataModule(str(store), fp, **OmegaConf.to_container(cfg.train.data, resolve=True))
    dm.setup("fit")
    epoch_tokens = sum(dm.lengths[i] for i in dm.train_idx)
    batches = len(dm._loader(dm.train_idx, shuffle=True).batch_sampler)
    return epoch_tokens / max(batches, 1), epoch_tokens


def point_config(cfg: DictConfig, name: str, variant: dict[str, Any], budget: int, seed: int) -> DictConfig:
    """The run config of one (variant, budget, seed) point, its outputs under <run_dir>/points/<label>."""
    out = cfg.copy()
    label = f"{name}-b{budget}-s{seed}"
    with open_dict(out):
        out.seed = seed
        out.regenerate.seed = int(cfg.seed)  # a repeat retrains on the same data
        out.head, preset = head_preset(variant["head"])  # a preset's own settings first, the variant's on top
        apply_overrides(out, preset | split_overrides(variant)[1], f"study.variants.{name}")
        if out.head.get("type") == "medusa":
            out.train.module.depth = int(out.head.get("num_heads", 4))
        out.head_dir = f"{cfg.run_dir}/points/{label}/head"
        out.train.checkpoint_dir = f"{cfg.run_dir}/points/{label}/checkpoints"
        out.train.untrained_dir = None
        out.train.resume = None
        if out.get("logger") and "name" in out.logger:
            out.logger.name = f"{cfg.run_name}-{label}"
    return out


def head_depth_limit(head: DictConfig) -> int | None:
    """The largest k a head of this config drafts (heads' `max_depth`): D for an mtp head of D > 1 modules,
    medusa's num_heads; None: any k."""
    kind = head.get("type", "mtp")
    if kind == "mtp" and int(head.get("num_modules", 1)) > 1:
        return int(head.num_modules)
    return int(head.get("num_heads", 4)) if kind == "medusa" else None


class Study:
    """One study run: its variants and budgets, the stores made so far (one per data config and aux
    layers), the points trained, and the report rewritten after each point."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg, self.t0 = cfg, time.perf_counter()
        scfg = cfg.study
        self.variants = {name: parse_variant(name, spec) for name, spec in scfg.variants.items()}
        self.budgets = sorted({int(b) for b in scfg.budgets} | {b for v in self.variants.values() for b in v["budgets"] or ()})
        if not self.variants or not self.budgets:
            raise ValueError("study: set at least one variant (study.variants) and one budget (study.budgets)")
        self.own = {name: v["budgets"] or sorted(int(b) for b in scfg.budgets) for name, v in self.variants.items()}
        self.common = max(set.intersection(*(set(b) for b in self.own.values())), default=None)  # where ranked
        if self.common is None:
            raise ValueError(f"study: the variants share no budget to be compared at ({self.own})")
        self.ks = [int(k) for k in scfg.ks]
        self.ks_largest = [int(k) for k in (scfg.get("ks_largest") or scfg.ks)]
        self.k_rank = 3 if 3 in self.ks_largest else self.ks_largest[-1]
        for name, v in self.variants.items():  # a head of D per-depth modules drafts at most k = D: say so now
            head = point_config(cfg, name, v, self.own[name][-1], int(cfg.seed)).head
            limit = head_depth_limit(head)
            for key, ks in (("ks", self.ks), ("ks_largest", self.ks_largest)):
                if limit is not None and max(ks) > limit:
                    raise ValueError(f"study.{key}={ks}: variant {name!r} trains a head of {limit} per-depth modules "
                                     f"(head={v['head']}), which drafts at most k={limit}; set study.{key} to k ≤ {limit}")
        target = target_config(cfg.target)
        self.num_layers = target_args(target.dir).num_hidden_layers
        self.fingerprint = target.fingerprint
        self.data_cfgs: dict[str, DictConfig] = {}
        self.stores: dict[tuple[str, tuple[int, ...]], Path] = {}
        self.points: list[dict[str, Any]] = []
        self.out = Path(cfg.run_dir) / scfg.get("out", "study.json")

    def store(self, name: str, variant: dict[str, Any], head_cfg: DictConfig) -> tuple[DictConfig, Path]:
        """The variant's data config and its store (made once per data and aux layers)."""
        key = json.dumps([variant["data"], split_overrides(variant)[0]], sort_keys=True, default=str)
        if key not in self.data_cfgs:
            self.data_cfgs[key] = data_config(self.cfg, variant, f"study.variants.{name}")
        aux = head_aux_layers(head_config(head_cfg)[1], self.num_layers)
        if (key, aux) not in self.stores:
            self.stores[(key, aux)] = store_for(self.data_cfgs[key], head_cfg)
        return self.data_cfgs[key], self.stores[(key, aux)]

    def point(self, name: str, budget: int, seed: int) -> dict[str, Any]:
        """Train and score one point (cached, experiments/runner.py), append it to the points."""
        variant, scfg = self.variants[name], self.cfg.study
        pc = point_config(self.cfg, name, variant, budget, seed)
        dc, st = self.store(name, variant, pc.head)
        # the held-out rows: the ShareGPT conversations of the variant's pool (the same for its data kinds)
        _, base = self.store(name, {"data": "sharegpt", "overrides": split_overrides(variant)[0]}, pc.head)
        with open_dict(pc):
            for section in ("data", "regenerate", "precompute"):
                pc[section] = dc[section]
            pc.precompute.aux_layers = FeatureStore(st).aux_layers
            pc.store_dir = str(st)
        per_batch, epoch_tokens = mean_batch_tokens(pc, st, self.fingerprint)
        steps = max(1, round(budget / per_batch))
        with open_dict(pc):
            pc.trainer.max_steps, pc.trainer.max_epochs = steps, -1
        label = f"{name}-b{budget}-s{seed}"
        ks = self.ks_largest if budget in (self.common, self.own[name][-1]) else self.ks
        ran = run_point(pc, st, label, ks, self.fingerprint, heldout_store=base, depth=int(scfg.eval_depth),
                        heldout_limit=scfg.get("heldout_conversations"))
        held, train_s = ran["heldout"], ran["train_seconds"]
        point = {"variant": name, "budget": budget, "seed": seed, "steps": steps,
                 "train_tokens": round(steps * per_batch), "epochs": steps * per_batch / max(epoch_tokens, 1),
                 "head": variant["head"], "data": variant["data"], "overrides": variant["overrides"],
                 "store": str(st), "train_seconds": train_s, "cached": ran["cached"],
                 "final_metrics": ran["final_metrics"], "heldout": held, "tau": ran["tau"]}
        taus = " ".join(f"tau_k{k}={v['tau']:.3f}" for k, v in point["tau"].items())
        print(f"study {label}: tokens={point['train_tokens']} epochs={point['epochs']:.2f} "
              f"acc_d1={held['acc'][0]:.3f} {taus} train_s={train_s:.0f}", flush=True)
        self.points.append(point)
        return point

    def report(self, best: str | None) -> dict[str, Any]:
        """The report so far (rewritten after every point: an interrupted study shows what it has)."""
        cfg = self.cfg
        summary = {"run_name": cfg.run_name, "target": cfg.target.name, "budgets": self.budgets,
                   "common_budget": self.common, "ks": self.ks, "ks_largest": self.ks_largest, "k_rank": self.k_rank,
                   "best": best, "points": self.points, "variants": self.variants,
                   "evaluate": {"dataset": cfg.evaluate.dataset, "num_prompts": cfg.evaluate.num_prompts,
                                "max_new_tokens": cfg.evaluate.max_new_tokens},
                   "complete": best is not None, "runtime_s": time.perf_counter() - self.t0}
        atomic_write_bytes(self.out, json.dumps(summary, indent=2, default=str).encode())
        atomic_write_bytes(self.out.with_suffix(".md"), markdown(summary).encode())
        plot(summary, self.out.with_suffix(".png"))
        return summary

    def run(self) -> dict[str, Any]:
        """Every variant at each of its budgets; the best at the common budget (τ at k_rank); the repeats."""
        seed0 = int(self.cfg.seed)
        for name in self.variants:
            for budget in self.own[name]:
                self.point(name, budget, seed0)
                self.report(None)
        at_common = {p["variant"]: p["tau"][self.k_rank]["tau"] for p in self.points if p["budget"] == self.common}
        best = max(at_common, key=at_common.get)
        scfg = self.cfg.study
        for seed in scfg.get("repeat_seeds") or []:
            for name in dict.fromkeys(best if v == "best" else v for v in scfg.get("repeat") or []):
                if int(seed) != seed0:
                    self.point(name, self.common, int(seed))
        summary = self.report(best)
        print(f"study report={self.out} md={self.out.with_suffix('.md')} png={self.out.with_suffix('.png')}")
        best_taus = " ".join(f"tau_k{k}={v['tau']:.3f}" for p in self.points
                             if p["variant"] == best and p["budget"] == self.common and p["seed"] == seed0
                             for k, v in p["tau"].items())
        print(f"study best={best} {best_taus} runtime_s={summary['runtime_s']:.0f}")
        return summary


def run_study(cfg: DictConfig) -> dict[str, Any]:
    """The recipe study (docs/RESULTS.md §7): every variant trained and scored at its budgets, ranked."""
    return Study(cfg).run()


def markdown(summary: dict[str, Any]) -> str:
    points = summary["points"]
    depth = max(len(p["heldout"]["acc"]) for p in points)
    ks = sorted({int(k) for p in points for k in p["tau"]})
    best = (f"Best at the largest budget every variant has, {summary['common_budget']:,} tokens "
            f"(τ at k={summary['k_rank']}): **{summary['best']}**." if summary["best"]
            else "Incomplete: the points finished so far.")
    lines = [f"Target {summary['target']}; MT-Bench {summary['evaluate']['num_prompts']} first turns, greedy, "
             f"{summary['evaluate']['max_new_tokens']} new tokens. {best}", "",
             "| variant | seed | tokens | epochs | steps | train s | "
             + " | ".join(f"acc d{d}" for d in range(1, depth + 1)) + " | " + " | ".join(f"τ k={k}" for k in ks) + " |",
             "| --- " * (6 + depth + len(ks)) + "|"]
    for p in points:
        acc = p["heldout"]["acc"] + [math.nan] * (depth - len(p["heldout"]["acc"]))
        lines.append(f"| {p['variant']} | {p['seed']} | {p['train_tokens']:,} | {p['epochs']:.2f} | {p['steps']} | "
                     f"{p['train_seconds'] or 0:.0f} | " + " | ".join("–" if math.isnan(a) else f"{a:.3f}" for a in acc)
                     + " | " + " | ".join(tau_cell(p["tau"][k]) if k in p["tau"] else "–" for k in ks) + " |")
    return "\n".join(lines) + "\n"


def tau_cell(v: dict[str, Any]) -> str:
    """τ, with its standard error over prompts when the evaluation recorded one (evaluation/tau_stats.py)."""
    return f"{v['tau']:.3f}" + (f" ± {v['tau_se']:.3f}" if v.get("tau_se") is not None else "")


def plot(summary: dict[str, Any], path: Path) -> None:
    """τ at k_rank and held-out top-1 (depth 1) against training tokens, one line per variant (seed of
    the run; repeats as separate markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = int(summary["k_rank"])
    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    # taus keyed by int k (a report read back from JSON has string keys)
    summary = {**summary, "points": [{**p, "tau": {int(kk): v for kk, v in p["tau"].items()}} for p in summary["points"]]}
    seed0 = min(p["seed"] for p in summary["points"])
    colors = plt.get_cmap("tab10" if len(summary["variants"]) <= 10 else "tab20")  # a colour per variant
    for i, name in enumerate(summary["variants"]):
        pts = sorted((p for p in summary["points"] if p["variant"] == name and p["seed"] == seed0),
                     key=lambda p: p["train_tokens"])
        pts = [p for p in pts if k in p["tau"]]
        if not pts:
            continue
        x = [p["train_tokens"] for p in pts]
        line = ax_tau.plot(x, [p["tau"][k]["tau"] for p in pts], marker="o", label=name, color=colors(i))[0]
        ax_acc.plot(x, [p["heldout"]["acc"][0] for p in pts], marker="o", color=line.get_color(), label=name)
        for p in summary["points"]:
            if p["variant"] == name and p["seed"] != seed0 and k in p["tau"]:
                ax_tau.plot([p["train_tokens"]], [p["tau"][k]["tau"]], marker="x", color=line.get_color())
                ax_acc.plot([p["train_tokens"]], [p["heldout"]["acc"][0]], marker="x", color=line.get_color())
    for ax, title in ((ax_tau, f"MT-Bench τ at k={k} (greedy)"), (ax_acc, "held-out top-1, depth 1")):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tau.legend(fontsize=8)
    fig.suptitle(f"recipe study on {summary['target']} (x: repeats with another seed)")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())

