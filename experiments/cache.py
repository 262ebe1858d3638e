"""Result caches for the study scripts (experiments/ablation.py, experiments/fp8_study.py, experiments/study.py): a result on disk
(a trained head's directory, an evaluation report) is reused only when it was made from exactly the
same inputs.

The key of a result is a JSON object: the resolved config sections that produce it
(`OmegaConf.to_container(..., resolve=True)`) and the fingerprints of the artifacts it reads — the
feature store (sha256 of its manifest.json, which lists every shard with its hash and the target's
fingerprint), a head checkpoint (sha256 of each of its files: model.safetensors, config.json, ...),
the target (data.store.target_fingerprint). It is written beside the result as
`<result>.key.json` once the result is complete, together with what the script wants back on reuse
(`meta`: e.g. the training run's final metrics) and the hashes of the result itself. `lookup` returns
that record only on an exact key match with the result unchanged since (a head directory overwritten by
another run is not the head the record describes); otherwise it logs why (no result, no key, which
parts differ), removes the stale key file — so an interrupted recompute can never be taken for a
finished one — and the caller recomputes.

Paths are part of the key where the config holds them (run_dir, head_dir, report paths): a run
directory moved elsewhere recomputes.

A training interrupted (killed, the machine gone) resumes from its last Lightning checkpoint when it is run
again with the same key (`cached_training`): the checkpoint directory holds the key it was written under
(`<checkpoint_dir>.key.json`), a checkpoint of another key is removed rather than resumed, and the head ends as an
uninterrupted run's (tests/test_resume.py). `train.resume` and `train.checkpoint_every_n_steps` are not in the
key: where a training resumed from and how often it saved do not change the head it ends with.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from core.files import atomic_write_bytes, sha256_file
from experiments.stages import run_evaluation, run_training

log = logging.getLogger(__name__)

# the config sections a trained head depends on (its store, its training) and an evaluation report
TRAIN_SECTIONS = ("seed", "target", "data", "precompute", "head", "train", "trainer")
EVAL_SECTIONS = ("seed", "target", "data", "evaluate")  # the head enters as its checkpoint's hashes


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()


def config_sections(cfg: DictConfig, sections: tuple[str, ...]) -> dict[str, Any]:
    """The resolved values of `sections` (absent ones as None)."""
    out = {}
    for name in sections:
        value = cfg.get(name)
        out[name] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def dir_fingerprint(path: str | Path) -> dict[str, str] | None:
    """sha256 of every file under a checkpoint directory (relative path → hash); None if it is absent.
    A single file is hashed alone."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    if not path.is_dir():
        return None
    return {str(f.relative_to(path)): sha256_file(f) for f in sorted(path.rglob("*")) if f.is_file()}


def store_fingerprint(store_dir: str | Path) -> str | None:
    """sha256 of the feature store's manifest.json (shards, their hashes, the target's fingerprint)."""
    manifest = Path(store_dir) / "manifest.json"
    return sha256_file(manifest) if manifest.exists() else None


# Settings added after results were cached, with the value that does what the code did before them: a key
# leaves them out at that value, so a head trained before the setting existed is still found
ADDED_SETTINGS: dict[tuple[str, ...], Any] = {
    ("train", "module", "loss_on"): "assistant",
    ("train", "module", "kl_temperature"): 1.0,
    ("train", "module", "detach_depths"): False,
    ("train", "module", "clip_scope"): "all",
    ("train", "module", "input_noise"): 0.0,
    ("train", "module", "deep_lr_scale"): 1.0,
    ("train", "module", "deep_from_step"): 0,
    ("train", "module", "dropout"): 0.0,
    ("train", "module", "offpolicy_weight"): 1.0,
    ("train", "module", "betas"): [0.9, 0.95],
    ("head", "layer_init"): "random",
    ("head", "aux_layers"): None,
}


# Settings that change how a training runs, not the head it ends with (resume == uninterrupted): never in a key
HOW_NOT_WHAT: tuple[tuple[str, ...], ...] = (("train", "resume"), ("train", "checkpoint_every_n_steps"))


def _parent(config: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    """The section holding the setting at `path` (None where the config has no such section)."""
    node: Any = config
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _without_added_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` less HOW_NOT_WHAT's settings and less ADDED_SETTINGS at their neutral values."""
    for path in HOW_NOT_WHAT:
        node = _parent(config, path)
        if node is not None:
            node.pop(path[-1], None)
    for path, neutral in ADDED_SETTINGS.items():
        node = _parent(config, path)
        if node is not None and path[-1] in node and _canonical(node[path[-1]]) == _canonical(neutral):
            del node[path[-1]]
    return config


def _normalised(key: Any) -> Any:
    """A recorded key as today's code writes it: its config without HOW_NOT_WHAT's settings and ADDED_SETTINGS at their
    neutral values (a key recorded before a setting lacks it; one recorded after writes it out)."""
    if isinstance(key, dict) and isinstance(key.get("config"), dict):
        return {**key, "config": _without_added_defaults(json.loads(_canonical(key["config"])))}
    return key


def training_key(cfg: DictConfig, store_dir: str | Path) -> dict[str, Any]:
    """What a trained head depends on: its config (less ADDED_SETTINGS at their neutral values) and the
    store it was trained on."""
    return {"config": _without_added_defaults(config_sections(cfg, TRAIN_SECTIONS)),
            "store_manifest_sha256": store_fingerprint(store_dir)}


def evaluation_key(cfg: DictConfig, target_fingerprint: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an evaluation report depends on: its config, the target, every evaluated checkpoint."""
    heads = OmegaConf.to_container(cfg.evaluate.heads, resolve=True) or {}
    return {"config": config_sections(cfg, EVAL_SECTIONS), "target_fingerprint": target_fingerprint,
            "heads": {label: dir_fingerprint(p) if p else None for label, p in sorted(heads.items())}}


def key_path(result: str | Path) -> Path:
    result = Path(result)
    return result.parent / f"{result.name}.key.json"


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two keys differ (for the log line)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if _canonical(old) == _canonical(new) else [prefix or "<key>"]


def lookup(result: str | Path, key: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The stored record ({"key", "digest", "result_sha256", "meta"}) when `result` exists, was made
    with exactly `key` and is unchanged since; otherwise None, after logging why and removing a stale
    key file."""
    result, kfile = Path(result), key_path(result)
    why = None
    if not result.exists():
        why = f"no {result}"
    elif not kfile.exists():
        why = f"{result} has no key file {kfile.name} (made before keys were kept, or interrupted)"
    else:
        try:
            rec = json.loads(kfile.read_text())
            stored = rec["key"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            why, rec = f"unreadable key file {kfile} ({e})", None
        if rec is not None:
            stored, wanted = _normalised(stored), _normalised(key)
            if _canonical(stored) != _canonical(wanted):
                diffs = _differences(stored, wanted)  # the log names real differences, not neutral additions
                why = f"{result} was made with other inputs: {', '.join(diffs[:8])}" + (
                    f" and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            elif rec.get("result_sha256") != dir_fingerprint(result):
                changed = _differences(rec.get("result_sha256"), dir_fingerprint(result))
                why = f"{result} changed since it was made ({', '.join(changed[:8])})"
            else:
                log.info("cache: reusing %s (%s): config and checkpoints match", what, result)
                return rec
    log.info("cache: computing %s: %s", what, why)
    kfile.unlink(missing_ok=True)
    return None


def record(result: str | Path, key: dict[str, Any], **meta: Any) -> Path:
    """Mark `result` (now complete) as made from `key`; `meta` comes back from `lookup` on reuse."""
    kfile = key_path(result)
    rec = {"key": key, "digest": digest(key), "result_sha256": dir_fingerprint(result), "meta": meta}
    atomic_write_bytes(kfile, json.dumps(rec, indent=1, sort_keys=True, default=str).encode())
    return kfile


def cached_training(cfg: DictConfig, store_dir: str | Path, what: str) -> tuple[dict[str, float], float | None, bool]:
    """Train the head of `cfg` (experiments/stages.py `run_training`) unless `cfg.head_dir` holds one made from the same
    key; (final metrics, training seconds, reused) — on reuse, the figures of the run that made it. A training of
    this key that was interrupted resumes from its last checkpoint (`interrupted_checkpoint`; experiments save every
    `train.checkpoint_every_n_steps`), and its seconds are those behind the final weights, across resumes."""
    head_dir, key = Path(cfg.head_dir), training_key(cfg, store_dir)
    trained = lookup(head_dir, key, what)
    if trained is not None:
        return trained["meta"].get("final_metrics", {}), trained["meta"].get("train_seconds"), True
    from train.run import TrainingClock

    clock = TrainingClock()
    if cfg.train.get("resume") is None:
        resume = interrupted_checkpoint(Path(str(cfg.train.checkpoint_dir)), key, what)
        if resume is not None:
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.train.resume = str(resume)
    _, metrics = run_training(cfg, extra_callbacks=[clock])
    seconds = clock.seconds
    record(head_dir, key, final_metrics=metrics, train_seconds=seconds, resumed=cfg.train.get("resume") is not None)
    return metrics, seconds, False


def interrupted_checkpoint(checkpoint_dir: Path, key: dict[str, Any], what: str) -> Path | None:
    """The `last.ckpt` of an interrupted training of this `key` in `checkpoint_dir`, to resume from; None: a fresh
    start. The key the checkpoints belong to is kept beside the directory (`<checkpoint_dir>.key.json`, written
    before the training starts); checkpoints of another key, or of none, are removed first, so a checkpoint in the
    directory is always the training's of the key there."""
    last, kfile = checkpoint_dir / "last.ckpt", key_path(checkpoint_dir)
    wanted = digest(_normalised(key))
    try:
        written = json.loads(kfile.read_text()).get("digest") if kfile.exists() else None
    except (OSError, ValueError, AttributeError) as e:
        log.warning("cache: unreadable %s (%s): its checkpoints are not resumed", kfile, e)
        written = None
    if last.exists() and written == wanted:
        log.info("cache: resuming %s from %s (an interrupted training of the same key)", what, last)
        return last
    stale = sorted(checkpoint_dir.glob("*.ckpt")) if checkpoint_dir.is_dir() else []
    if stale:
        log.info("cache: removing %d checkpoint(s) in %s: %s", len(stale), checkpoint_dir,
                 "written by a training of another key" if kfile.exists() else "of no recorded key")
        for f in stale:
            f.unlink()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(kfile, json.dumps({"digest": wanted, "key": key}, indent=1, sort_keys=True,
                                         default=str).encode())
    return None


def cached_evaluation(cfg: DictConfig, what: str, target_fingerprint: dict[str, Any] | None) -> tuple[dict, bool]:
    """The evaluation report of `cfg` (experiments/stages.py `run_evaluation`) at `cfg.evaluate.report`, computed
    unless the one there was made from the same key; (report, reused)."""
    path, key = Path(cfg.evaluate.report), evaluation_key(cfg, target_fingerprint)
    if lookup(path, key, what) is not None:
        return json.loads(path.read_text()), True
    report = run_evaluation(cfg)
    record(path, key)
    return report, False
