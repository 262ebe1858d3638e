"""One experiment point, the same in every experiment (the recipe study, the head ablation, the fp8-store
study): train the configured head on a store, score its top-1 agreement with the target per depth on a
store's held-out split, and evaluate it at each k — each step reused from disk when its inputs are
unchanged (experiments/cache.py), so a rerun recomputes exactly the points a setting changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from artifacts.checkpoint import load_native
from core.files import atomic_write_bytes
from core.paths import CONF
from data.sources import target_config
from experiments.cache import cached_evaluation, cached_training, dir_fingerprint, lookup, record, store_fingerprint
from inference_eval.model import tied_target
from train.data import FeatureDataModule, heldout_ids_digest
from train.module import heldout_agreement


def flatten(overrides: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} from a nested or dotted mapping (hydra's CLI nests dotted keys)."""
    if not isinstance(overrides, dict):
        return {prefix: overrides}
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        path = f"{prefix}.{k}" if prefix else str(k)
        out |= flatten(v, path) if isinstance(v, dict) else {path: v}
    return out


def apply_overrides(cfg: DictConfig, overrides: dict[str, Any], where: str) -> None:
    for path, value in overrides.items():
        if OmegaConf.select(cfg, path, default="__missing__") == "__missing__":
            raise ValueError(f"{where}: override {path!r} names no setting of the config")
        OmegaConf.update(cfg, path, value, merge=False)


def head_preset(name: str) -> tuple[DictConfig, dict[str, Any]]:
    """conf/head/<name>.yaml as an experiment swaps it in: (the `head` section, {dotted path: value} of the
    settings `head=<name>` composes beside it) — what the command line gives. A plain head file is the section
    itself; a preset (`# @package _global_`, as conf/head/mtp3.yaml) names its base head in its defaults
    (`- mtp@head`, or another preset: `- dspark_net`), sets `head:` on top of it and other settings beside
    (train.module.*). The settings hold every
    key any head preset sets: the preset's own values, else conf/config.yaml's — so a head swapped into a config
    composed with a preset (the default head, `mtp3`) does not keep that preset's training settings."""
    head, own = _head_file(name)
    config = OmegaConf.load(CONF / "config.yaml")
    base = {}
    for key in sorted(_preset_keys()):
        value = OmegaConf.select(config, key, default="__missing__")
        if value != "__missing__":
            base[key] = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
    return head, base | own


def _preset_keys() -> set[str]:
    """The dotted paths that the head presets of conf/head set beside `head`."""
    keys: set[str] = set()
    for path in (CONF / "head").glob("*.yaml"):
        keys |= set(_head_file(path.stem)[1]) if "defaults" in OmegaConf.load(path) else set()
    return keys


def _head_file(name: str) -> tuple[DictConfig, dict[str, Any]]:
    """conf/head/<name>.yaml's `head` section and the settings it makes itself (its base head's included)."""
    path = CONF / "head" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"head={name!r}: no {path}")
    raw = OmegaConf.load(path)
    if "defaults" not in raw:
        return raw, {}
    # one base: a head section (`- dflash_net@head`) or another preset of conf/head (`- dspark_net`)
    entry = raw.defaults[0] if len(raw.defaults) == 1 else None
    preset = isinstance(entry, str) and not entry.endswith("@head") and (CONF / "head" / f"{entry}.yaml").exists() \
        and "defaults" in OmegaConf.load(CONF / "head" / f"{entry}.yaml")
    if not isinstance(entry, str) or not (entry.endswith("@head") or preset):
        raise ValueError(f"{path}: a head preset's defaults are one '<head>@head' or '<head preset>' entry, got "
                         f"{list(raw.defaults)}")
    base, settings = _head_file(entry.removesuffix("@head"))
    rest = {k: v for k, v in OmegaConf.to_container(raw).items() if k not in ("defaults", "head")}
    return OmegaConf.merge(base, raw.get("head") or {}), settings | flatten(rest)


def run_point(cfg: DictConfig, store: Path, label: str, ks: list, fingerprint: dict[str, Any],
              heldout_store: Path | None = None, depth: int = 3, heldout_limit: int | None = None) -> dict[str, Any]:
    """Train `cfg`'s head on `store` (to cfg.head_dir), its held-out agreement on `heldout_store`'s split
    (default: `store`'s) and its evaluation at each k of `ks` (an int, or `auto`).
    {train_seconds, cached, final_metrics, heldout, tau: {k: {tau, alpha, ...}}}."""
    metrics, train_s, cached = cached_training(cfg, store, f"the {label} head")
    held = cached_heldout(cfg, label, Path(cfg.head_dir), Path(heldout_store or store), depth, heldout_limit,
                          fingerprint)
    tau = {k: evaluate_point(cfg, label, k, fingerprint) for k in ks}
    return {"train_seconds": train_s, "cached": cached, "final_metrics": metrics, "heldout": held, "tau": tau}


def heldout_split(cfg: DictConfig, store: Path, fp: dict[str, Any], limit: int | None) -> FeatureDataModule:
    """The data module of cfg.train.data on `store`, its held-out split cut to the first `limit` conversations."""
    dm = FeatureDataModule(str(store), fp, **OmegaConf.to_container(cfg.train.data, resolve=True))
    dm.setup("validate")
    if limit is not None:
        dm.val_idx, dm.val_ids = dm.val_idx[: int(limit)], dm.val_ids[: int(limit)]
    return dm


def cached_heldout(cfg: DictConfig, label: str, head_dir: Path, store: Path, depth: int, limit: int | None,
                   fp: dict[str, Any]) -> dict[str, Any]:
    """`heldout`, reused from `<run_dir>/eval/<label>_heldout.json` when it was made from the same head
    checkpoint, store, held-out rows (their ids' digest), depth and target (experiments/cache.py)."""
    dm = heldout_split(cfg, store, fp, limit)
    path = Path(cfg.run_dir) / "eval" / f"{label}_heldout.json"
    key = {"train_data": OmegaConf.to_container(cfg.train.data, resolve=True), "depth": int(depth),
           "limit": None if limit is None else int(limit), "target_fingerprint": fp,
           "store_manifest_sha256": store_fingerprint(store), "head": dir_fingerprint(head_dir),
           "heldout_sha256": heldout_ids_digest(dm.val_ids)}
    if lookup(path, key, f"the {label} held-out agreement") is not None:
        return json.loads(path.read_text())
    result = heldout(cfg, head_dir, dm, depth, fp)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(result, indent=1, default=str).encode())
    record(path, key)
    return result


def heldout(cfg: DictConfig, head_dir: Path, dm: FeatureDataModule, depth: int, fp: dict[str, Any]) -> dict[str, Any]:
    """Top-1 agreement per depth of the head at `head_dir` with the target on dm's held-out split."""
    tied, args, _ = tied_target(target_config(cfg.target).dir)
    head = load_native(head_dir, tied, args, expected_fingerprint=fp)
    depth = min(depth, head.max_depth or depth)
    dm.read_layers_of(head)  # a store captured for more layers than the head reads
    return heldout_agreement(head, dm.val_dataloader(), depth) | {"conversations": len(dm.val_idx),
                                                                   "heldout_sha256": heldout_ids_digest(dm.val_ids)}


def evaluate_point(pc: DictConfig, label: str, k: int | str, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The head at pc.head_dir evaluated alone at k (report `<run_dir>/eval/<label>_k<k>.json`, reused when
    made from the same inputs)."""
    ec = pc.copy()
    with open_dict(ec):
        ec.evaluate.k = k
        ec.evaluate.heads = {label: str(pc.head_dir)}
        ec.evaluate.draft_models = {}
        ec.evaluate.report = f"{pc.run_dir}/eval/{label}_k{k}.json"
    report, reused = cached_evaluation(ec, f"the {label} k={k} evaluation", fingerprint)
    r = report["results"][label]
    return {"tau": r["tau"], "alpha": r["alpha"], "tokens_per_s": r["tokens_per_s"], "speedup": r.get("speedup"),
            "per_category_tau": r.get("per_category_tau"), "prompts": report["prompts"], "cached": reused,
            "tau_se": r.get("tau_se"), "per_prompt": r.get("per_prompt")}
