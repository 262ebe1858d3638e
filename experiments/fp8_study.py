"""What fp8 feature storage does to the trained head (issue: feature store, docs/design.md §6).

The same conversations are precomputed twice — `bfloat16` and `fp8` (e4m3 + a per-token scale) —
and the configured head is trained on each with the same batches, steps, schedule and seed. Both
heads are then scored on the *bf16* store's held-out split (top-1 agreement per depth, the
training-time-test unroll) and on MT-Bench through the engine (τ, greedy).

    python -m scripts.fp8_study run_name=fp8_study            # the demo's data and training settings

A head or evaluation report already on disk is reused only when it was made from the same inputs
(experiments/cache.py: resolved config sections + the store's / checkpoint's hashes, kept beside it as
`<result>.key.json`); otherwise it is recomputed and the reason logged. `cached` in the JSON marks reuse.

Writes `<run_dir>/fp8_study.json`; last line `fp8_study acc_d1_bf16=… acc_d1_fp8=… tau_bf16=… tau_fp8=…
bytes_per_token_bf16=… bytes_per_token_fp8=…`.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, open_dict

from core.files import atomic_write_bytes
from data.sources import target_config
from data.store import FeatureStore
from experiments.runner import run_point
from experiments.stages import run_precompute


def run_fp8_study(cfg: DictConfig) -> dict:
    target = target_config(cfg.target)
    target_dir, fingerprint = target.dir, target.fingerprint
    depth = int(cfg.get("fp8_study", {}).get("eval_depth", 3))
    results = {}
    for dtype in ("bfloat16", "fp8"):
        c = cfg.copy()
        with open_dict(c):
            c.store_dir = f"{cfg.run_dir}/features_{dtype}"
            c.head_dir = f"{cfg.run_dir}/head_{dtype}"
            c.train.checkpoint_dir = f"{cfg.run_dir}/checkpoints_{dtype}"
            c.train.untrained_dir = None
            c.precompute.store_dtype = dtype
        store_dir, _ = run_precompute(c)
        # held-out agreement of both heads on the bf16 store's validation split (the accurate features)
        point = run_point(c, Path(store_dir), dtype, [c.evaluate.k], fingerprint,
                          heldout_store=Path(f"{cfg.run_dir}/features_bfloat16"), depth=depth)
        store = FeatureStore(store_dir)
        tokens = sum(s["num_tokens"] for s in store.manifest["shards"])
        size = sum((Path(store_dir) / s["file"]).stat().st_size for s in store.manifest["shards"])
        evaluation = point["tau"][c.evaluate.k]
        results[dtype] = {"store": str(store_dir), "bytes_per_token": size / tokens, "head": c.head_dir,
                          "tau": evaluation["tau"], "alpha": evaluation["alpha"], "heldout": point["heldout"],
                          "cached": {"head": point["cached"], "evaluation": evaluation["cached"]}}
    heldout_conversations = results["bfloat16"]["heldout"]["conversations"]
    out = Path(cfg.run_dir) / "fp8_study.json"
    atomic_write_bytes(out, json.dumps({"results": results, "heldout_conversations": heldout_conversations},
                                       indent=2).encode())
    b, f = results["bfloat16"], results["fp8"]
    print(f"fp8_study report={out}")
    print(" ".join(["fp8_study"] + [f"acc_d{d + 1}_{n}={r['heldout']['acc'][d]:.4f}" for n, r in (("bf16", b), ("fp8", f))
                                     for d in range(depth)]
                   + [f"tau_bf16={b['tau']:.3f}", f"tau_fp8={f['tau']:.3f}",
                      f"bytes_per_token_bf16={b['bytes_per_token']:.1f}", f"bytes_per_token_fp8={f['bytes_per_token']:.1f}"]))
    return results

