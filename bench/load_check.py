"""Does a bench's per-core figure survive a busy machine? Runs one bench twice — on the machine as it is,
then beside a bounded busy loop (one process spinning on one core for at most `--busy-s` seconds,
stopped when the bench ends) — and compares the two runs' last lines (core/timing.py's `key=`,
`key_min=`, `key_max=` figures).

The check: the busy run's per-core figure (`<key>_1t`) holds the quiet run's median within
its own printed spread (busy min ≤ quiet median ≤ busy max, widened by `--slack`). The whole-machine
figure is printed beside it, for contrast: that is the one a busy machine moves.

    .venv/bin/python bench/load_check.py precompute --quick --rounds 4
    .venv/bin/python bench/load_check.py train_step --quick --rounds 3
    .venv/bin/python bench/load_check.py engine --quick --head <a trained head>

Last line: `load_check bench=<name> key=<key>_1t quiet=<m> busy=<m> busy_min=<a> busy_max=<b> within=<0|1>
whole_quiet=<m> whole_busy=<m> busy_other_runnable=<n>`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEYS = {"precompute": "speedup_vs_hf", "engine": "spec_speedup_b1", "train_step": "speed_ratio"}
SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def last_line(bench: str, args: list[str]) -> dict[str, str]:
    out = subprocess.run([sys.executable, str(HERE / f"{bench}.py"), *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"load_check: bench/{bench}.py failed:\n{out.stderr[-3000:]}")
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.strip()]
    for ln in lines[:-1]:
        if ln.startswith("UNSTABLE") or ln.startswith("load while timing"):
            print(f"  {ln}")
    print(f"  {lines[-1]}", flush=True)
    return dict(re.findall(r"(\w+)=(\S+)", lines[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=sorted(KEYS))
    ap.add_argument("--busy-s", type=float, default=1800.0, help="upper bound of the busy loop's life")
    ap.add_argument("--slack", type=float, default=0.0, help="relative widening of the busy run's spread")
    args, rest = ap.parse_known_args()
    key = KEYS[args.bench]
    print(f"load_check: bench/{args.bench}.py {' '.join(rest)} on the machine as it is", flush=True)
    quiet = last_line(args.bench, rest)
    print("load_check: the same beside one busy loop", flush=True)
    spin = subprocess.Popen([sys.executable, "-c", SPIN.format(s=args.busy_s)])
    try:
        busy = last_line(args.bench, rest)
    finally:
        spin.kill()
        spin.wait()
    per_core = f"{key}_1t"
    if per_core not in quiet or per_core not in busy:
        sys.exit(f"load_check: no {per_core}= on the bench's last line (run it with --threads all,1)")
    q, b = float(quiet[per_core]), float(busy[per_core])
    lo, hi = float(busy[f"{per_core}_min"]) * (1 - args.slack), float(busy[f"{per_core}_max"]) * (1 + args.slack)
    within = lo <= q <= hi
    print(f"load_check: per-core {per_core}: quiet {q:.3f}, busy {b:.3f} [{lo:.3f}–{hi:.3f}] → "
          f"{'holds' if within else 'MOVED'}; whole machine {key}: quiet {float(quiet[key]):.3f}, busy "
          f"{float(busy[key]):.3f}")
    print(f"load_check bench={args.bench} key={per_core} quiet={q:.3f} busy={b:.3f} busy_min={lo:.3f} "
          f"busy_max={hi:.3f} within={int(within)} whole_quiet={float(quiet[key]):.3f} whole_busy={float(busy[key]):.3f} "
          f"busy_other_runnable={busy.get('other_runnable', '?')}")


if __name__ == "__main__":
    main()
