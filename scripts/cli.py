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
        lines, code = verify_store(sys.argv[2])
        print("\n".join(lines))
        raise SystemExit(code)
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


def verify_store(root: str) -> tuple[list[str], int]:
    """`spechead verify`: the lines it prints and its exit code — 0 `ok` (complete, every shard's sha256 as
    recorded), 1 `CORRUPT <shard>` for each damaged shard (a rerun of precompute repairs them), 2 `incomplete` for a
    store whose precompute has not finished (its finished shards checked; what resumes it is named)."""
    from pathlib import Path

    from data.store import FeatureStore, StoreError

    path = Path(root)
    if not (path / "manifest.json").exists() and (path / "ranks").is_dir():
        return [f"incomplete: {path} holds ranks/ but no merged manifest.json: the precompute ranks have not all "
                f"finished — run the missing ranks (the same precompute command), or `spechead precompute-merge "
                f"{path}` once every rank is complete"], 2
    try:  # opening already checks sizes and headers: a damaged shard is reported, not a traceback
        store = FeatureStore(path, require_complete=False)
        bad = store.verify()
    except StoreError as e:
        return [f"CORRUPT {e}"], 1
    if bad:
        return [*(f"CORRUPT {p}" for p in bad),
                f"{len(bad)} corrupt shard(s): rerun the precompute that wrote the store (the same command) to "
                "recompute their samples"], 1
    if not store.manifest.get("complete"):
        shards = store.manifest["shards"]
        return [f"incomplete: {path} — the precompute writing it has not finished ({len(shards)} finished "
                f"shard(s), {len(store)} samples, their sha256 as recorded); rerun the same precompute command to "
                "resume it (nothing done is computed again)"], 2
    return ["ok"], 0


if __name__ == "__main__":
    main()
