"""`spechead <stage> [hydra overrides]`: one command over the entry points in scripts/,
plus `spechead verify <store_dir>` (recomputes every shard's sha256) and
`spechead precompute-merge <store_dir>` (writes the merged manifest of a store precomputed by several
ranks; the last rank to finish does it by itself) and `spechead status <run_dir>` (each stage's state from
`<run_dir>/status.json`, a `running` one whose process is gone shown as stale)."""

import runpy
import sys

STAGES = ("precompute", "regenerate", "train", "evaluate", "export", "pipeline")
TOOLS = ("verify", "precompute-merge", "status")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in (*STAGES, *TOOLS):
        print(f"usage: spechead {{{','.join(STAGES + TOOLS)}}} [overrides...]", file=sys.stderr)
        raise SystemExit(2)
    stage = sys.argv[1]
    if stage in TOOLS and len(sys.argv) != 3:
        raise SystemExit(f"usage: spechead {stage} <{'run_dir' if stage == 'status' else 'store_dir'}>")
    if stage == "status":
        from scripts.runtime import status_lines

        try:
            print("\n".join(status_lines(sys.argv[2])))
        except (OSError, ValueError) as e:
            raise SystemExit(f"status: {sys.argv[2]}: no readable status.json ({e})") from None
        raise SystemExit(0)
    if stage == "verify":
        from data.store import FeatureStore, StoreError

        try:  # opening already checks sizes and headers: a damaged shard is reported, not a traceback
            bad = FeatureStore(sys.argv[2], require_complete=False).verify()
        except StoreError as e:
            print(f"CORRUPT {e}")
            raise SystemExit(1) from None
        for path in bad:
            print(f"CORRUPT {path}")
        print("ok" if not bad else f"{len(bad)} corrupt shard(s)")
        raise SystemExit(1 if bad else 0)
    if stage == "precompute-merge":
        from data.store import StoreError, merge_rank_manifests

        try:
            merged = merge_rank_manifests(sys.argv[2])
        except StoreError as e:
            raise SystemExit(f"precompute-merge: {e}") from None
        print(f"merged ranks={merged['ranks']['world_size']} shards={len(merged['shards'])} "
              f"samples={sum(s['num_samples'] for s in merged['shards'])} store={sys.argv[2]}")
        raise SystemExit(0)
    # Run the stage as `python -m scripts.<stage>` does (alter_sys: argv[0] becomes its file): hydra
    # resolves config_path="../conf" against the file of a `__main__` module, but as a package path
    # ("conf", not importable) for an imported one.
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(f"scripts.{stage}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
