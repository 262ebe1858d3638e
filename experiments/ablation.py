"""The seed's ablation (docs/RESULTS.md): several head types trained on one feature store with the
same batches, steps, LR schedule and seed, then compared on
  * held-out top-1 agreement with the target per draft depth 1..`ablation.eval_depth`
    (teacher-forced, training-time-test unroll over the store's validation split), and
  * τ and α_d on MT-Bench through the engine, greedy, for each k in `ablation.ks`.

    python -m scripts.ablation experiment=ablation            # the RESULTS.md run
    python -m scripts.ablation experiment=ablation ablation.heads=[mtp]

Each finished stage is kept (store, trained head, per-k report) and reused on a rerun only when it was
made from the same inputs (experiments/cache.py: a key of the resolved config sections and the store's /
checkpoint's hashes, kept beside it as `<result>.key.json`); anything else is recomputed, with the
reason logged. So an interrupted ablation continues where it stopped, and a changed setting never
reports an old result. `cached: true` in the JSON marks a reused head or report. Writes
`<run_dir>/ablation.json` and `.md`.
Last line: `ablation <head>_acc_d<d>=… <head>_tau_k<k>=… runtime_s=…`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from core.files import atomic_write_bytes
from data.sources import target_config
from data.store import FeatureStore
from experiments.runner import apply_overrides, head_preset, run_point
from heads.eagle3 import default_aux_layers
from inference_eval.model import target_args
from experiments.stages import run_precompute


def head_config(cfg: DictConfig, name: str) -> DictConfig:
    """The run config with `head` replaced by conf/head/<name>.yaml and per-head output paths."""
    hcfg, preset = head_preset(name)
    out = cfg.copy()
    with open_dict(out):
        out.head = hcfg
        apply_overrides(out, preset, f"conf/head/{name}.yaml")  # what a preset (mtp3) sets beside its head
        out.head_dir = f"{cfg.run_dir}/heads/{name}"
        out.train.checkpoint_dir = f"{cfg.run_dir}/checkpoints/{name}"
        out.train.untrained_dir = None
        if hcfg.get("type") == "medusa":  # Medusa's heads are its depths: head d is trained at depth d
            out.train.module.depth = int(hcfg.get("num_heads", 4))
        if out.get("logger") and "name" in out.logger:
            out.logger.name = f"{cfg.run_name}-{name}"
    return out


def store_aux_layers(cfg: DictConfig, heads: list[str]) -> tuple[int, ...]:
    """The aux layers the compared heads read (EAGLE-3's); the heads must agree on them."""
    wanted = set()
    for name in heads:
        h = head_preset(name)[0]
        if h.get("type") == "eagle3":
            wanted.add(tuple(h.get("aux_layers") or
                             default_aux_layers(target_args(target_config(cfg.target).dir).num_hidden_layers)))
    if len(wanted) > 1:
        raise ValueError(f"ablation heads read different aux layers {sorted(wanted)}: one store cannot serve them")
    return wanted.pop() if wanted else ()



def run_ablation(cfg: DictConfig) -> dict:
    t0 = time.perf_counter()
    acfg = cfg.ablation
    aux = store_aux_layers(cfg, list(acfg.heads))
    if aux:  # the shared store must hold what an eagle3 head reads
        with open_dict(cfg):
            cfg.precompute.aux_layers = list(aux)
    store, _ = run_precompute(cfg)  # resumes: a finished store is reused as is
    manifest = FeatureStore(store).manifest
    store_conversations = sum(s["num_samples"] for s in manifest["shards"])
    store_tokens = sum(s["num_tokens"] for s in manifest["shards"])
    print(f"ablation store: {store_conversations} conversations, {store_tokens} tokens → {store}")
    target = target_config(cfg.target)
    target_dir, fingerprint = target.dir, target.fingerprint
    results: dict[str, dict] = {}
    for name in acfg.heads:
        hc = head_config(cfg, name)
        # a cost bound on the held-out scoring: the first n held-out conversations
        entry = run_point(hc, Path(store), name, [int(k) for k in acfg.ks], fingerprint,
                          depth=int(acfg.eval_depth), heldout_limit=acfg.get("heldout_conversations"))
        entry = {"head": OmegaConf.to_container(hc.head, resolve=True), "checkpoint": str(hc.head_dir), **entry,
                 "heldout_conversations": entry["heldout"]["conversations"]}
        for k, t in entry["tau"].items():
            print(f"ablation {name} k={k} tau={t['tau']:.3f}")
        results[name] = entry
    summary = {"run_name": cfg.run_name, "store": str(store), "store_tokens": store_tokens,
               "store_conversations": store_conversations, "seed": int(cfg.seed), "trainer": OmegaConf.to_container(cfg.trainer, resolve=True),
               "train": OmegaConf.to_container(cfg.train, resolve=True),
               "evaluate": {"dataset": cfg.evaluate.dataset, "num_prompts": cfg.evaluate.num_prompts,
                            "max_new_tokens": cfg.evaluate.max_new_tokens, "turns": list(cfg.evaluate.turns)},
               "results": results}
    out = Path(cfg.run_dir) / acfg.get("out", "ablation.json")
    atomic_write_bytes(out, json.dumps(summary, indent=2, default=str).encode())
    atomic_write_bytes(out.with_suffix(".md"), markdown(summary).encode())
    print(f"ablation report={out} md={out.with_suffix('.md')}")
    fields = []
    for name, e in results.items():
        fields += [f"{name}_acc_d{d}={a:.3f}" for d, a in enumerate(e["heldout"]["acc"], start=1)]
        fields += [f"{name}_tau_k{k}={v['tau']:.3f}" for k, v in e["tau"].items()]
    print("ablation " + " ".join(fields) + f" runtime_s={time.perf_counter() - t0:.0f}")
    return summary


def markdown(summary: dict) -> str:
    results = summary["results"]
    depth = max(len(e["heldout"]["acc"]) for e in results.values())
    ks = sorted({int(k) for e in results.values() for k in e["tau"]})
    lines = [f"Store: {summary['store_conversations']} conversations, {summary['store_tokens']:,} tokens; "
             f"seed {summary['seed']}.", "",
             "| head | " + " | ".join(f"held-out acc d{d}" for d in range(1, depth + 1)) + " | sim. τ | "
             + " | ".join(f"τ k={k}" for k in ks) + " |",
             "| --- " * (2 + depth + len(ks)) + "|"]
    for name, e in results.items():
        h = e["heldout"]
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in h["acc"]) + f" | {h['sim_tau']:.3f} | "
                     + " | ".join(f"{e['tau'][k]['tau']:.3f}" if k in e["tau"] else "–" for k in ks) + " |")
    lines += ["", "α_d (conditional acceptance per draft position) at the largest k:", ""]
    for name, e in results.items():
        if ks and ks[-1] in e["tau"]:
            lines.append(f"- {name}: " + ", ".join(f"α{d}={a:.3f}" for d, a in enumerate(e["tau"][ks[-1]]["alpha"], 1)))
    return "\n".join(lines) + "\n"

