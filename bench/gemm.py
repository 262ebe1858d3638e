"""The few-row fp32 linears of CPU decoding, per row count: the native kernel (core/native.py, up to 48 rows),
F.linear (MKL's x·Wᵀ) and (W·xᵀ)ᵀ over SmolLM2-135M's linear shapes (30 layers' q, k, v, o, gate, up, down and
the 49,152-row lm_head; random weights, streamed from memory as a decode step streams them), paired and
alternated — and whether core/gemm_choice.py's once-per-CPU answer for the row count picks the faster GEMM form.
`--quick`: 8 layers and the lm_head, rows 1, 64, 128.

Last line: `gemm threads=<n> rows=<r,…> mm_over_F_<r>=<paired median> … choice_<r>=<F|mm> …
native_over_F_<r>=… … agree=<answers that name the faster form>/<row counts> other_runnable=<the largest
median of other runnable threads seen>`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core import gemm_choice, native  # noqa: E402
from core.timing import Paired, measure_pairs, thread_budget, thread_settings, warn_if_unstable  # noqa: E402

H, KV, F_DIM, VOCAB, LAYERS = 576, 192, 1536, 49152, 30  # SmolLM2-135M


def weights(layers: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layer = [(H, H), (KV, H), (KV, H), (H, H), (F_DIM, H), (F_DIM, H), (H, F_DIM)]
    return [torch.randn(n, k, generator=g) for _ in range(layers) for n, k in layer] + \
        [torch.randn(VOCAB, H, generator=g)]


def side(form: str, ws: list[torch.Tensor], rows: int):
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in ws}}
    lib = native.load() if form == "native" else None

    def run() -> None:
        with torch.inference_mode():
            for w in ws:
                x = xs[w.shape[1]]
                if form == "native":
                    native.call(lib, x, w, None)
                else:
                    gemm_choice.apply(form, x, w)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=None, help="comma list of row counts (default 1,2,8,32,48,64,128,256)")
    ap.add_argument("--threads", default="all,1")
    ap.add_argument("--pairs", type=int, default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in (args.rows or ("1,64,128" if args.quick else "1,2,8,32,48,64,128,256")).split(",")]
    pairs = args.pairs or (3 if args.quick else 5)
    ws = weights(8 if args.quick else LAYERS)
    print(f"gemm: {len(ws)} weights, {sum(w.numel() for w in ws) * 4 / 2**20:.0f} MiB; native kernel "
          f"{'available' if native.available() else 'unavailable: ' + native.error()}", flush=True)
    last = ""
    for threads in thread_settings(args.threads):
        with thread_budget(threads):
            figures, agree, others = [], 0, 0.0
            for rows in rows_list:
                t0 = time.perf_counter()
                choice = gemm_choice.form(rows)
                chose_s = time.perf_counter() - t0
                sides = {"F": side("F", ws, rows), "mm": side("mm", ws, rows)}
                if rows <= 48 and native.available():
                    sides["native"] = side("native", ws, rows)
                t = measure_pairs(sides, pairs)
                s = t.seconds
                mm_f = Paired.of(s["mm"], s["F"])
                faster = "F" if mm_f.median > 1 else "mm"
                agree += choice == faster
                line = (f"rows {rows:4d}: F.linear {sorted(s['F'])[pairs // 2] * 1e3:7.1f} ms, (W·xᵀ)ᵀ "
                        f"{sorted(s['mm'])[pairs // 2] * 1e3:7.1f} ms (mm/F {mm_f.text()})")
                figures.append(mm_f.kv(f"mm_over_F_{rows}"))
                if "native" in s:
                    nat = Paired.of(s["native"], s["F"])
                    line += f", native {sorted(s['native'])[pairs // 2] * 1e3:7.1f} ms (native/F {nat.text()})"
                    figures.append(nat.kv(f"native_over_F_{rows}"))
                figures.append(f"choice_{rows}={choice}")
                print(f"  {threads} thread(s) {line}; gemm_choice: {choice} ({chose_s:.2f} s to answer)", flush=True)
                warning = warn_if_unstable(f"mm_over_F_{rows}", mm_f, t.load, threads)
                if warning:
                    print(warning, flush=True)
                others = max(others, t.load.median)
                print(f"  load: {t.load.text()}", flush=True)
            last = (f"gemm threads={threads} rows={','.join(map(str, rows_list))} {' '.join(figures)} "
                    f"agree={agree}/{len(rows_list)} other_runnable={others:g}")
            print(last, flush=True)
    print(last)


if __name__ == "__main__":
    main()
