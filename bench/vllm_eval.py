"""Evaluation and regeneration through real vLLM against spechead's engine (bench/README.md's figures): the default
target (SmolLM2-135M-Instruct) in float32, one trained head, side by side in one run.

Four sides, their order rotating pair by pair (core/timing.py `measure_pairs`, no warm-up: every call is a
whole stage — the engine side loads the target, the vLLM side starts a vLLM process — which is what a user waits
for):
- `eval_engine`: `evaluate.engine=spechead` (scripts.evaluate's `run_evaluation`) of the head on `--prompts`
  MT-Bench first turns, greedy, k = 3, `--new-tokens` new tokens, all prompts in one batch;
- `eval_vllm`: the same with `evaluate.engine=vllm` (the head exported, one vLLM process, vLLM's counters);
- `regen_engine`: `regenerate.backend=engine` of `--conversations` ShareGPT conversations (their replies
  rewritten greedily, `--new-tokens` each, one batch), into a fresh file each time;
- `regen_vllm`: the same with `regenerate.backend=vllm`.
Figures, each the median over pairs: wall seconds of each side; the evaluation's decode tokens/s as each report
gives it (vLLM: new tokens / generation seconds, its start excluded; the engine: its decode loop's); regeneration
tokens/s = new tokens / the stage's wall seconds (start included); τ of both engines (equal for an `mtp` head:
tests/test_vllm_serving.py). `vllm_over_engine_*` are pair-by-pair ratios of wall seconds (engine / vLLM: > 1 =
vLLM faster). `--quick` (2 prompts, 16 tokens, no regeneration, one pair) checks the bench runs.

  python bench/vllm_eval.py --head runs/peer_recipe/points/mtpn-b408000-s0/head
Last line: `vllm_eval eval_s_engine=… eval_s_vllm=… eval_tok_s_engine=… eval_tok_s_vllm=… vllm_over_engine_eval=…
regen_tok_s_engine=… regen_tok_s_vllm=… vllm_over_engine_regen=… tau_engine=… tau_vllm=… pairs=… other_runnable=…`.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.timing import Load, measure_pairs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from inference_eval.targets import register_target_resolvers

    register_target_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["target.dtype=float32", "logger=csv", "progress=false", *overrides])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="a trained head (native checkpoint) for the default target")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 16 new tokens, no regeneration, one pair")
    ap.add_argument("--prompts", type=int, help="MT-Bench first turns evaluated (default 24; --quick 2)")
    ap.add_argument("--conversations", type=int, default=8, help="ShareGPT conversations regenerated (default 8)")
    ap.add_argument("--new-tokens", type=int, help="new tokens per prompt / reply (default 64; --quick 16)")
    ap.add_argument("--pairs", type=int, help="pairs (default 2; --quick 1)")
    args = ap.parse_args()
    prompts = args.prompts or (2 if args.quick else 24)
    new = args.new_tokens or (16 if args.quick else 64)
    pairs = args.pairs or (1 if args.quick else 2)
    logging.basicConfig(level=logging.WARNING)
    from experiments.stages import regenerate, run_evaluation

    with tempfile.TemporaryDirectory(prefix="spechead-bench-vllm-") as tmp:
        reports: dict[str, list[dict]] = {"eval_engine": [], "eval_vllm": [], "regen_engine": [], "regen_vllm": []}
        runs = [0]

        def evaluation(engine: str):
            def run() -> None:
                runs[0] += 1
                cfg = config([f"run_dir={tmp}/eval{runs[0]}", "evaluate.dataset=mtbench", f"evaluate.num_prompts={prompts}",
                              "evaluate.k=3", f"evaluate.max_new_tokens={new}", f"evaluate.batch_size={prompts}",
                              "evaluate.plain_baseline=false", "evaluate.simulated_tau=false", f"evaluate.engine={engine}",
                              "evaluate.heads.trained=null", "evaluate.heads.untrained=null",
                              f"+evaluate.heads.head={Path(args.head).resolve()}"])
                reports[f"eval_{'engine' if engine == 'spechead' else 'vllm'}"].append(run_evaluation(cfg)["results"]["head"])
            return run

        def regeneration(backend: str):
            def run() -> None:
                runs[0] += 1
                cfg = config([f"run_dir={tmp}/regen{runs[0]}", "data.source=sharegpt", f"data.max_samples={args.conversations}",
                              f"regenerate.backend={backend}", f"regenerate.out={tmp}/regen{runs[0]}.jsonl",
                              f"regenerate.max_new_tokens={new}", f"regenerate.batch_size={args.conversations}"])
                _, stats = regenerate(cfg)
                reports[f"regen_{backend}"].append({"tokens": stats.tokens})
            return run

        sides = {"eval_engine": evaluation("spechead"), "eval_vllm": evaluation("vllm")}
        if not args.quick:
            sides |= {"regen_engine": regeneration("engine"), "regen_vllm": regeneration("vllm")}
        load = Load()
        t = measure_pairs(sides, pairs, warmup=0, load=load, on_pair=lambda i, got: print(
            f"pair {i + 1}/{pairs}: " + ", ".join(f"{k} {v:.1f} s" for k, v in got.items()), flush=True))
    med = {k: statistics.median(v) for k, v in t.seconds.items()}
    tok_s = {k: statistics.median(r["tokens_per_s"] for r in reports[k]) for k in ("eval_engine", "eval_vllm")}
    tau = {k: reports[k][0]["tau"] for k in ("eval_engine", "eval_vllm")}
    ratio = t.ratio("eval_engine", "eval_vllm")
    line = (f"vllm_eval eval_s_engine={med['eval_engine']:.1f} eval_s_vllm={med['eval_vllm']:.1f} "
            f"eval_tok_s_engine={tok_s['eval_engine']:.1f} eval_tok_s_vllm={tok_s['eval_vllm']:.1f} "
            f"{ratio.kv('vllm_over_engine_eval')}")
    print(f"evaluation, engine wall over vLLM wall: {ratio.text(3)}")
    if not args.quick:
        regen = {k: statistics.median(r["tokens"] / s for r, s in zip(reports[k], t.seconds[k]))
                 for k in ("regen_engine", "regen_vllm")}
        rr = t.ratio("regen_engine", "regen_vllm")
        print(f"regeneration, engine wall over vLLM wall: {rr.text(3)}")
        line += (f" regen_tok_s_engine={regen['regen_engine']:.1f} regen_tok_s_vllm={regen['regen_vllm']:.1f} "
                 f"{rr.kv('vllm_over_engine_regen')}")
    print(f"load while timing: {load.text()}")
    print(f"{line} tau_engine={tau['eval_engine']:.4f} tau_vllm={tau['eval_vllm']:.4f} prompts={prompts} "
          f"new_tokens={new} pairs={pairs} other_runnable={load.median:g}")


if __name__ == "__main__":
    main()
