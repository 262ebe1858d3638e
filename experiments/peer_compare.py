"""The side-by-side comparison with the peer trainer, speculators 0.9 (docs/RESULTS.md §8): the
peer's EAGLE-3 and spechead's heads trained on the same conversations, split and token budget, and scored
by one harness. With `peer_compare.peer_type: dflash` (or `dspark`; conf/experiment/peer_compare_dflash.yaml) the
peer trains its own block drafter (`speculators train --speculator-type dflash`) against our `head=dflash`.

    make vllm-env speculators-env
    python -m scripts.peer_compare experiment=peer_compare
    python -m scripts.peer_compare experiment=peer_compare_dflash

1. **One store**: the configured conversations precomputed once with EAGLE-3's aux layers — for a block peer, the
   target layers our `dflash` head reads (`<run_dir>/stores/<hash>`, experiments/study.py `store_for`); the peer reads its states from it, so
   neither trainer runs the target, and both see the same token ids, loss masks and split.
2. **Ours**: each head of `peer_compare.ours` (`{label: {head: <conf/head name>, overrides: {...}}}`)
   trained `peer_compare.epochs` epochs over the store's training split (experiments/runner.py), or, with
   `peer_compare.tokens: N`, N training tokens (`trainer.max_steps` by the study's rule, `budget_steps`).
3. **The peer**: the training split exported in its format (experiments/peer_data.py), its own
   `speculators train` (experiments/peer_shims.py in `.venv-speculators`) for the same epochs — or the
   same N tokens (`--max-steps`, `peer_schedule`) — with `peer_compare.peer_args` added, its last
   checkpoint read by artifacts/formats/speculators.py (EAGLE-3) or speculators_dflash.py (DFlash, DSpark) — the
   readers evaluate's `load_any` uses — into a native checkpoint. A block peer is shaped as our head of the same
   kind (conf/head/<peer_type>.yaml: draft layers, block size, mask token, vocabulary; every layer full attention)
   and otherwise keeps its own recipe (its loss, D-PACE weights, anchors, Muon).
4. **Scoring, the same for every head**: held-out top-1 per depth against the target's full argmax
   (the TTT unroll over the held-out split), the engine's τ and α_d at each k of `peer_compare.ks`, and,
   with `peer_compare.vllm: true`, real vLLM's own acceptance counters on the same prompts
   (inference_eval/vllm_serve_worker.py in `.venv-vllm`): ours exported to its vLLM format, the peer's
   checkpoint as speculators wrote it (vLLM reads that format).

Every step is cached under its inputs (experiments/cache.py, the peer's checkpoint under the export's
digest and its arguments), so an interrupted comparison resumes. Writes `<run_dir>/peer_compare.json` and
`.md`; last line `peer_compare <label>=<τ at the largest k> … runtime_s=<s>`. It is slow (the peer trains
≈ 6 s per 1,024-token step on this CPU): tens of minutes at the demo's budget.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import AutoTokenizer

from artifacts.checkpoint import load_native, save_native
from artifacts.export import default_formats, detect_format, export_head, load_any
from artifacts.formats import VLLM_METHODS
from core.files import atomic_write_bytes
from core.paths import CONF
from data.prompts import mtbench_prompts
from data.sources import target_config
from experiments.cache import cached_training, dir_fingerprint, digest, lookup, record
from experiments.peer_data import export as export_peer_data
from experiments.peer_data import block_peer_shape, peer_command
from experiments.runner import cached_heldout, evaluate_point, head_preset
from experiments.study import apply_overrides, flatten, mean_batch_tokens, store_for
from inference_eval.model import tied_target
from inference_eval.vllm_spec import spec_figures

log = logging.getLogger(__name__)

ROOT = CONF.parent
SPEC_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PEER_SEED = 42  # `speculators train --seed` default (speculators/train/config/schema.py): its sampler's shuffle


def budget_steps(cfg: DictConfig, store: Path, tokens: int, fp: dict[str, Any] | None = None) -> int:
    """trainer.max_steps for `tokens` training tokens on `store` under cfg.train.data: the study's rule
    (experiments/study.py `study_point`): round(tokens / the mean tokens of one epoch's training batches)."""
    per_batch, _ = mean_batch_tokens(cfg, store, fp)
    return max(1, round(int(tokens) / per_batch))


def our_config(cfg: DictConfig, label: str, spec: dict[str, Any], store: Path,
               fp: dict[str, Any] | None = None) -> DictConfig:
    """The run config of one of our heads: its conf/head, its overrides, the shared store, `epochs` epochs
    (or, with peer_compare.tokens set, that many training tokens: `budget_steps`)."""
    out = cfg.copy()
    with open_dict(out):
        out.head, preset = head_preset(spec.get("head", "mtp"))
        apply_overrides(out, preset | flatten(spec.get("overrides") or {}), f"peer_compare.ours.{label}")
        out.store_dir = str(store)
        out.head_dir = f"{cfg.run_dir}/heads/{label}"
        out.train.checkpoint_dir = f"{cfg.run_dir}/checkpoints/{label}"
        out.train.untrained_dir, out.train.resume = None, None
        tokens = cfg.peer_compare.get("tokens")
        if tokens is None:
            out.trainer.max_epochs, out.trainer.max_steps = int(cfg.peer_compare.epochs), -1
        else:
            out.trainer.max_steps, out.trainer.max_epochs = budget_steps(out, store, int(tokens), fp), -1
    return out


def peer_schedule(tokens: int, train_tokens: int, epoch_batches: list[int]) -> tuple[int, int]:
    """(--max-steps, --epochs) that give the peer `tokens` training tokens, by the rule our heads get
    (`budget_steps`): N = round(tokens / the mean tokens of its steps in epoch 0), where a step is one of
    its packed batches (≤ --total-seq-len tokens) and `train_tokens` the training rows' tokens as its sampler
    counts them (each clipped at --total-seq-len); `epoch_batches[e]` its batches in epoch e. --epochs is
    the fewest epochs that hold N steps: its loop runs every epoch of --epochs and takes one step of each
    epoch past the one where max_steps was reached before it stops again (speculators/train/trainer.py)."""
    steps = max(1, round(int(tokens) * epoch_batches[0] / max(int(train_tokens), 1)))
    done = 0
    for epoch, n in enumerate(epoch_batches, 1):
        done += n
        if done >= steps:
            return steps, epoch
    raise ValueError(f"{steps} steps need more than the {len(epoch_batches)} epochs counted ({epoch_batches})")


PEER_BATCHES = """
import json, sys
from datasets import load_from_disk
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
data, n_train, max_len, seed, epochs = sys.argv[1], *map(int, sys.argv[2:6])
lengths = list(load_from_disk(data).with_format(None)["seq_len"])[:n_train]
sampler = MultipackDistributedBatchSamplerV2(batch_max_length=max_len, lengths=lengths, num_replicas=1, rank=0,
                                             seed=seed)
counts = []
for e in range(epochs):
    sampler.set_epoch(e)
    counts.append(len(sampler))
print(json.dumps({"train_tokens": int(sampler.lengths.sum()), "epoch_batches": counts}))
"""


def peer_epoch_batches(data: Path, n_train: int, total_seq_len: int, seed: int, epochs: int) -> dict[str, Any]:
    """The peer's own sampler (its train loader's, one process) over the exported training rows:
    {train_tokens (clipped as it clips them), epoch_batches: its batches in each of `epochs` epochs}."""
    run = subprocess.run([str(SPEC_PYTHON), "-c", PEER_BATCHES, str(data), str(n_train), str(total_seq_len),
                          str(seed), str(epochs)], cwd=ROOT, capture_output=True, text=True, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode != 0:
        raise RuntimeError(f"counting the peer's batches failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def peer_train_command(cfg: DictConfig, data: Path, info: dict[str, Any], save: Path) -> tuple[list[str], Path, dict]:
    """(the peer's `speculators train` command, the checkpoint dir it ends with, the budget it trains)."""
    pc = cfg.peer_compare
    extra = [str(a) for a in pc.get("peer_args") or []]
    epochs, budget = int(pc.epochs), {"tokens": None}
    if pc.get("tokens") is not None:
        seed = int(extra[extra.index("--seed") + 1]) if "--seed" in extra else PEER_SEED
        counted = peer_epoch_batches(data, int(info["train_samples"]), int(cfg.data.max_length), seed,
                                     math.ceil(int(pc.tokens) / max(int(info["train_tokens"]), 1)) + 2)
        steps, epochs = peer_schedule(int(pc.tokens), counted["train_tokens"], counted["epoch_batches"])
        budget = {"tokens": int(pc.tokens), "max_steps": steps, "epochs": epochs, **counted,
                  "train_tokens_seen": round(steps * counted["train_tokens"] / counted["epoch_batches"][0])}
        extra = ["--max-steps", str(steps), *extra]
    kind = peer_type(cfg)
    vd, block = pc.get("draft_vocab_size"), None
    if kind in BLOCK_PEERS:  # shaped as our head of that kind
        ours = peer_shape_head(cfg, kind)
        block = block_peer_shape(OmegaConf.to_container(ours, resolve=True),
                                 json.loads((Path(info["verifier"]) / "config.json").read_text())["vocab_size"])
        vd = ours.get("draft_vocab_size")
    command = peer_command(data, info, str(save), epochs=epochs, draft_vocab_size=None if vd is None else int(vd),
                           total_seq_len=int(cfg.data.max_length), speculator_type=kind, block=block).split() + extra
    return command, save / str(epochs - 1), budget  # speculators saves `<save>/<epoch>/` after each epoch


BLOCK_PEERS = ("dflash", "dspark")


def peer_type(cfg: DictConfig) -> str:
    """The peer's `--speculator-type`: eagle3 (the default), dflash or dspark."""
    kind = str(cfg.peer_compare.get("peer_type") or "eagle3")
    if kind not in ("eagle3", *BLOCK_PEERS):
        raise ValueError(f"peer_compare.peer_type={kind!r}: one of eagle3, {', '.join(BLOCK_PEERS)}")
    return kind


def store_head(cfg: DictConfig) -> DictConfig:
    """The head whose capture layers the shared store holds: EAGLE-3's aux layers, or for a block peer the target
    layers of our block head (`peer_compare.aux_layers`, else each kind's default)."""
    layers = cfg.peer_compare.get("aux_layers")
    if peer_type(cfg) in BLOCK_PEERS:
        return OmegaConf.create({"type": "dflash", "target_layers": layers})
    return OmegaConf.create({"type": "eagle3", "aux_layers": layers})


def peer_shape_head(cfg: DictConfig, kind: str) -> DictConfig:
    """The head config the block peer is shaped as: the first of `peer_compare.ours` of that kind, its overrides
    applied (else conf/head/<kind>.yaml)."""
    for label, spec in (cfg.peer_compare.ours or {}).items():
        spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
        out = cfg.copy()
        with open_dict(out):
            out.head, preset = head_preset(spec.get("head", "mtp"))
            apply_overrides(out, preset | flatten(spec.get("overrides") or {}), f"peer_compare.ours.{label}")
        if out.head.get("type") == kind:
            return out.head
    return head_preset(kind)[0]


def peer_native(ckpt: Path, out: Path, target_dir: Path, fp: dict[str, Any]) -> Path:
    """The peer's checkpoint (any speculators format load_any reads) as a native spechead checkpoint."""
    tied, args, _ = tied_target(target_dir)
    return save_native(load_any(ckpt, tied, args), out, fp)


def train_peer(cfg: DictConfig, store: Path, target_dir: Path) -> tuple[Path, float, dict[str, Any]]:
    """The peer's head trained on `store`'s training split (cached): (its checkpoint dir, seconds, export info)."""
    if not SPEC_PYTHON.exists():
        raise FileNotFoundError(f"{SPEC_PYTHON} is missing: `make speculators-env` builds the peer's environment")
    data = Path(cfg.run_dir) / "peer" / "data"
    info_file = data / "peer_data.json"
    if info_file.exists() and json.loads(info_file.read_text()).get("store") == str(store.resolve()):
        info = json.loads(info_file.read_text())
    else:
        info = export_peer_data(store, data, int(cfg.train.data.split_seed), float(cfg.train.data.val_fraction),
                                verifier=str(target_dir), overwrite=True)
    save = Path(cfg.run_dir) / "peer" / "ckpt"
    command, last, budget = peer_train_command(cfg, data, info, save)
    key = {"command": command, "budget": budget.get("tokens"),
           "export": {k: info[k] for k in ("heldout_sha256", "train_tokens", "store")}}
    marker = Path(cfg.run_dir) / "peer" / "train.json"
    hit = lookup(marker, key, "the peer's head")
    if hit is not None and last.exists():
        return last, float(json.loads(marker.read_text())["seconds"]), {**info, "budget": budget}
    log.info("peer_compare: training the peer: %s", " ".join(command))
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))}
    subprocess.run([str(SPEC_PYTHON), *command[1:]], cwd=ROOT, env=env, check=True)
    seconds = time.perf_counter() - t0
    if not last.exists():
        done = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        if not done:
            raise FileNotFoundError(f"the peer wrote no checkpoint under {save}")
        last = done[-1]
    atomic_write_bytes(marker, json.dumps({"seconds": seconds, "checkpoint": str(last), "budget": budget}).encode())
    record(marker, key)
    return last, seconds, {**info, "budget": budget}


def vllm_tau(cfg: DictConfig, label: str, draft: Path, fmt_method: str, k: int, target_dir: Path) -> dict[str, Any]:
    """Greedy decoding of the evaluation prompts by real vLLM with `draft`: τ and the conditional α per position from
    vLLM's own counters (`spec_figures`, as evaluation reads them; cached under the draft's digest)."""
    if not VLLM_PYTHON.exists():
        raise FileNotFoundError(f"{VLLM_PYTHON} is missing: `make vllm-env` (or peer_compare.vllm=false)")
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p["ids"] for p in mtbench_prompts(tok, int(cfg.evaluate.num_prompts))]
    job = {"target": str(target_dir), "prompts": prompts, "max_tokens": int(cfg.evaluate.max_new_tokens),
           "dtype": str(cfg.target.dtype), "max_model_len": int(cfg.data.max_length) + int(cfg.evaluate.max_new_tokens),
           "speculative_config": {"method": fmt_method, "model": str(draft), "num_speculative_tokens": k}}
    out = Path(cfg.run_dir) / "eval" / f"{label}_vllm_k{k}.json"
    key = {"job": job, "draft": dir_fingerprint(draft)}
    if lookup(out, key, f"the {label} vLLM k={k} run") is not None:
        return json.loads(out.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    job_file = out.with_suffix(".job.json")
    job_file.write_text(json.dumps(job))
    raw = out.with_suffix(".raw.json")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(VLLM_PYTHON), "-m", "inference_eval.vllm_serve_worker", str(job_file), str(raw)],
                   cwd=ROOT, env=env, check=True)
    spec = json.loads(raw.read_text())["spec"]
    result = {**spec_figures(spec, k), "prompts": len(prompts)}
    atomic_write_bytes(out, json.dumps(result, indent=1).encode())
    record(out, key)
    return result


def score(cfg: DictConfig, label: str, head_dir: Path, store: Path, fp: dict[str, Any],
          vllm_draft: tuple[Path, str] | None, target_dir: Path) -> dict[str, Any]:
    """The one harness: held-out top-1 per depth, the engine's τ at each k, vLLM's τ at each k."""
    pc = cfg.copy()
    with open_dict(pc):
        pc.head_dir = str(head_dir)
    ks = [int(k) for k in cfg.peer_compare.ks]
    held = cached_heldout(pc, label, head_dir, store, int(cfg.peer_compare.eval_depth),
                          cfg.peer_compare.get("heldout_conversations"), fp)
    out = {"heldout": held, "engine": {k: evaluate_point(pc, label, k, fp) for k in ks}}
    if vllm_draft is not None:
        out["vllm"] = {k: vllm_tau(cfg, label, vllm_draft[0], vllm_draft[1], k, target_dir) for k in ks}
    return out


def vllm_export(cfg: DictConfig, label: str, head_dir: Path, target_dir: Path, fp: dict[str, Any]) -> tuple[Path, str]:
    """Our head in its vLLM format (the export's own validation and read-back included)."""
    tied, args, _ = tied_target(target_dir)
    head = load_native(head_dir, tied, args, expected_fingerprint=fp)
    fmt = default_formats(head)[1]
    out = Path(cfg.run_dir) / "exports" / label / fmt
    if not (out / "config.json").exists():
        export_head(head, {fmt: out}, target_dir, fp)
    return out, VLLM_METHODS[fmt]  # mtp-vllm (our plugin) and eagle3: method eagle3; dflash-vllm: dflash


def run_peer_compare(cfg: DictConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    pc = cfg.peer_compare
    target = target_config(cfg.target)
    target_dir, fp = target.dir, target.fingerprint
    store = store_for(cfg, store_head(cfg))
    results: dict[str, Any] = {}
    for label, spec in (pc.ours or {}).items():
        oc = our_config(cfg, label, OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec,
                        store, fp)
        metrics, seconds, _ = cached_training(oc, store, f"the {label} head")
        draft = vllm_export(cfg, label, Path(oc.head_dir), target_dir, fp) if pc.vllm else None
        results[label] = {"train_seconds": seconds, "final_metrics": metrics, "max_steps": int(oc.trainer.max_steps),
                          **score(oc, label, Path(oc.head_dir), store, fp, draft, target_dir)}
    if pc.peer:
        ckpt, seconds, info = train_peer(cfg, store, target_dir)
        native = peer_native(ckpt, Path(cfg.run_dir) / "heads" / "peer", target_dir, fp)  # cheap: rewritten each run
        served = (ckpt, VLLM_METHODS[detect_format(ckpt)]) if pc.vllm else None  # vLLM reads the peer's format
        results["peer"] = {"train_seconds": seconds, "checkpoint": str(ckpt), "train_tokens": info["train_tokens"],
                           "budget": info["budget"], "peer_type": peer_type(cfg),
                           **score(cfg, "peer", native, store, fp, served, target_dir)}
    summary = {"target": cfg.target.name, "store": str(store), "peer_type": peer_type(cfg), "epochs": int(pc.epochs), "tokens": pc.get("tokens"),
               "ks": list(pc.ks),
               "evaluate": {"num_prompts": int(cfg.evaluate.num_prompts), "max_new_tokens": int(cfg.evaluate.max_new_tokens)},
               "config_digest": digest(OmegaConf.to_container(pc, resolve=True)), "results": results,
               "runtime_s": time.perf_counter() - t0}
    out = Path(cfg.run_dir) / "peer_compare.json"
    atomic_write_bytes(out, json.dumps(summary, indent=1, default=str).encode())
    atomic_write_bytes(out.with_suffix(".md"), markdown(summary).encode())
    k = max(int(x) for x in pc.ks)
    line = " ".join(f"{label}={r['engine'][k]['tau']:.3f}" for label, r in results.items())
    print(f"peer_compare report={out} k={k} engine_tau: {line} runtime_s={summary['runtime_s']:.0f}")
    return summary


def markdown(summary: dict[str, Any]) -> str:
    ks = [int(k) for k in summary["ks"]]
    rows = ["| head | held-out top-1 d1 / d2 / d3 | " + " | ".join(f"engine τ k={k} (α)" for k in ks)
            + " | " + " | ".join(f"vLLM τ k={k} (α)" for k in ks) + " | train s |",
            "| --- | --- | " + " | ".join("---" for _ in ks * 2) + " | --- |"]
    for label, r in summary["results"].items():
        acc = " / ".join(f"{a:.3f}" for a in r["heldout"]["acc"])
        eng = " | ".join(f"{r['engine'][k]['tau']:.3f} ({' / '.join(f'{a:.2f}' for a in r['engine'][k]['alpha'])})"
                         for k in ks)
        vl = " | ".join((f"{r['vllm'][k]['tau']:.3f} ({' / '.join(f'{a:.2f}' for a in r['vllm'][k]['alpha'])})"
                         if "vllm" in r else "–") for k in ks)
        rows.append(f"| {label} | {acc} | {eng} | {vl} | {r['train_seconds']:.0f} |")
    budget = (f"{summary['epochs']} epochs" if summary.get("tokens") is None
              else f"{summary['tokens']} training tokens")
    return (f"Target {summary['target']}; {budget} of the store's training split; "
            f"{summary['evaluate']['num_prompts']} MT-Bench first turns, greedy, "
            f"{summary['evaluate']['max_new_tokens']} new tokens.\n\n" + "\n".join(rows) + "\n")
