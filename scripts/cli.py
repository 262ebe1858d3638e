"""`spechead <stage> [hydra overrides]`: one command over the entry points in scripts/,
plus `spechead verify <store_dir>` (recomputes every shard's sha256)."""

import importlib
import sys

STAGES = ("precompute", "train", "evaluate", "export", "pipeline")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in (*STAGES, "verify"):
        print(f"usage: spechead {{{','.join(STAGES)},verify}} [overrides...]", file=sys.stderr)
        raise SystemExit(2)
    stage = sys.argv[1]
    if stage == "verify":
        from data.store import FeatureStore

        if len(sys.argv) != 3:
            raise SystemExit("usage: spechead verify <store_dir>")
        bad = FeatureStore(sys.argv[2], require_complete=False).verify()
        for path in bad:
            print(f"CORRUPT {path}")
        print("ok" if not bad else f"{len(bad)} corrupt shard(s)")
        raise SystemExit(1 if bad else 0)
    sys.argv = [f"spechead-{stage}", *sys.argv[2:]]
    importlib.import_module(f"scripts.{stage}").main()


if __name__ == "__main__":
    main()
