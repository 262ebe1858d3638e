"""The `scale` and `paths` parts of bench/gpu_check.py (its docstring says what each measures), and the arithmetic
they report against: FLOPs per trained token, MFU, the training-time test's attention memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.memory import LLAMA_8B, LLAMA_70B, TargetShape  # noqa: E402

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM
TINY = TargetShape("tiny", 64, 128, 2, 4, 2, 256)
# batch shapes of the scale part: (name, rows, tokens per row, packed)
BATCHES = [("1x1408", 1, 1408, False), ("16x1024", 16, 1024, False), ("packed16k", 1, 16384, True)]
PRESETS = ("8xh100_fsdp", "ddp", "8xh100", "8xh100_zero3")
MATH_KERNELS = ("_scaled_dot_product_attention_math",)


def train_flops_per_token(shape: TargetShape, head: torch.nn.Module, depth: int) -> float:
    """Model FLOPs of one trained token through the unroll to `depth`: per depth, forward and backward of the
    parameters that depth runs (6 × the head's parameters / its per-depth modules), the teacher logits (2·V·H) and
    the student logits' forward and input gradient (4·V·H). Attention's T-dependent FLOPs are left out (small next
    to the vocabulary products at these lengths), so the MFU is a lower bound."""
    n = sum(p.numel() for p in head.parameters() if p.requires_grad)
    per_depth = n / max(1, len(head.depth_modules()))
    return depth * (6 * per_depth + 6 * shape.vocab * shape.hidden)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float = H100_BF16_PEAK) -> float:
    return flops_per_token * tokens_per_s / peak


def attention_memory_gb(shape: TargetShape, rows: int, tokens: int, depth: int, packed: bool = False) -> float:
    """Bytes the unrolled attention keeps at depth `depth` (heads/layers.py `unrolled_mask`: one SDPA call over the
    depth's key blocks): bf16 keys and values of every block, the boolean [T, D·T] mask, the kernel's fp32
    log-sum-exp. Packed rows share one mask as well."""
    d = shape.hidden // shape.heads
    kv = 2 * rows * shape.kv_heads * tokens * d * 2 * depth
    mask = tokens * depth * tokens
    lse = rows * shape.heads * tokens * 4
    return (kv + mask + lse) / 1e9


def _batch(shape: TargetShape, rows: int, tokens: int, packed: bool, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    batch = {"hidden": torch.randn(rows, tokens, shape.hidden, generator=g).to(device, torch.bfloat16),
             "input_ids": torch.randint(0, shape.vocab, (rows, tokens), generator=g).to(device),
             "valid": torch.ones(rows, tokens, dtype=torch.bool, device=device),
             "loss_mask": torch.ones(rows, tokens, dtype=torch.bool, device=device)}
    if packed:  # eight samples of equal length in one row
        seg = torch.arange(tokens, device=device) // (tokens // 8)
        batch["segments"] = seg[None]
        batch["positions"] = (torch.arange(tokens, device=device) % (tokens // 8))[None]
    return batch


def sdpa_kernels(fn) -> list[str]:
    """The scaled-dot-product-attention implementations `fn()` ran (torch.profiler's aten op names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "_efficient_attention" in e.key
                   or "_flash_attention" in e.key or "cudnn_attention" in e.key})


def time_train_step(shape: TargetShape, head_cfg: dict, depth: int, optimizer: str, rows: int, tokens: int,
                    packed: bool, device: torch.device, steps: int) -> dict:
    """A head on random weights at `shape` trained `steps` timed steps (after 2 warm-up steps): tok/s, MFU, the
    optimizer's share of the step's time, peak memory, the SDPA kernels of one step."""
    from heads.base import TiedTarget
    from heads.layers import LlamaArgs
    from heads.registry import build_head
    from train.module import DraftHeadModule
    from train.optim import build_optimizer

    args = LlamaArgs.from_hf_config(shape.hf_config())
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    tied = TiedTarget(torch.randn(shape.vocab, shape.hidden, generator=g).to(device, dt) * 0.02,
                      torch.randn(shape.vocab, shape.hidden, generator=g).to(device, dt) * 0.02,
                      torch.ones(shape.hidden, device=device, dtype=dt), 1e-5)
    head = build_head(dict(head_cfg), args, tied).to(device)
    head.reset_parameters(0)
    module = DraftHeadModule(head, depth=depth)
    opt = build_optimizer(head, optimizer, 1e-4, 0.0, (0.9, 0.95))
    batch = _batch(shape, rows, tokens, packed, device)
    if head.capture_layers:  # the inputs of the target layers the head reads (EAGLE-3, the block drafter)
        batch["aux_hidden"] = torch.randn(rows, tokens, len(head.capture_layers) * shape.hidden,
                                          generator=torch.Generator().manual_seed(1)).to(device, batch["hidden"].dtype)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        with amp:
            loss = module.compute_loss(batch)["loss"]
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(steps)]
    fb, op = sum(t[0] for t in times), sum(t[1] for t in times)
    tok_s = rows * tokens * steps / (fb + op)
    kernels = sdpa_kernels(lambda: step())
    return {"tok_s": tok_s, "mfu": mfu(train_flops_per_token(shape, head, depth), tok_s),
            "optimizer_share": op / (fb + op), "step_s": (fb + op) / steps, "sdpa": kernels,
            "math_fallback": any(k in m for k in kernels for m in MATH_KERNELS),
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            "params": sum(p.numel() for p in head.parameters())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def precompute_mfu(shape: TargetShape, layers: int, tokens: int, device: torch.device) -> dict:
    """The target's forward without logits (what precompute runs) on random weights at `shape`'s width, `layers`
    decoder layers (MFU is per layer; the whole 8B does not need loading for it): tokens/s and MFU by 2 × the
    layers' matmul parameters per token."""
    from heads.layers import LlamaArgs
    from inference_eval.model import LlamaForCausalLM

    cfg = {**shape.hf_config(), "num_hidden_layers": layers}
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(LlamaArgs.from_hf_config(cfg)).to(dt).eval()
    ids = torch.randint(0, shape.vocab, (1, tokens), device=device)
    with torch.no_grad():
        model(ids, logits="none")
        _sync(device)
        t0 = time.perf_counter()
        model(ids, logits="none")
        _sync(device)
    seconds = time.perf_counter() - t0
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n)
    return {"tok_s": tokens / seconds, "mfu": mfu(2 * matmul, tokens / seconds), "layers": layers}


def store_seconds_per_shard(shape: TargetShape, shard_tokens: int, shards: int = 2) -> float:
    """The store writer (data/store.py) cutting `shards` shards of `shard_tokens` bf16 states of width H."""
    from data.store import Sample, StoreWriter

    with tempfile.TemporaryDirectory() as root:
        writer = StoreWriter(root, {"name": "bench"}, shape.hidden, dtype="bfloat16", shard_tokens=shard_tokens)
        per = 2048
        hidden = torch.randn(per, shape.hidden).to(torch.bfloat16)
        t0 = time.perf_counter()
        for i in range(shards * shard_tokens // per):
            writer.add(Sample(f"s{i}", torch.zeros(per, dtype=torch.long), torch.ones(per, dtype=torch.long), hidden))
        writer.close()
        return (time.perf_counter() - t0) / shards


def run_scale(args) -> dict:
    from inference_eval.model import resolve_device

    device = resolve_device(args.device)
    quick = args.quick
    shape = TINY if quick else LLAMA_8B
    batches = [(n, r, max(16, t // 64) if quick else t, p) for n, r, t, p in BATCHES]
    heads = [("mtp3", {"type": "mtp", "num_modules": 3}, 3), ("dflash", {"type": "dflash"}, 1)]
    plan = {"shape": shape.name, "batches": batches, "heads": [h[0] for h in heads], "optimizers": ["adamw", "muon"]}
    if args.dry_run:
        print(json.dumps(plan))
        return plan
    out: dict = {"device": str(device), "plan": plan, "train": {}, "errors": {}}
    for name, cfg, depth in heads:
        for opt in ("adamw", "muon"):
            for bname, rows, tokens, packed in batches:
                key = f"{name}/{opt}/{bname}"
                try:
                    out["train"][key] = time_train_step(shape, cfg, depth, opt, rows, tokens, packed, device,
                                                        steps=2 if quick else 5)
                except Exception as err:  # reported, not hidden: the part fails below
                    out["errors"][key] = f"{type(err).__name__}: {err}"
                print(key, out["train"].get(key) or out["errors"][key], flush=True)
    out["attention_memory_gb"] = {s.name: {b: attention_memory_gb(s, r, t, 3, p) for b, r, t, p in BATCHES}
                                  for s in (LLAMA_8B, LLAMA_70B)}
    out["precompute"] = precompute_mfu(shape, 2 if quick else 4, 256 if quick else 8192, device)
    out["store_s_per_shard"] = store_seconds_per_shard(shape, 4096 if quick else 262144)
    math = [k for k, v in out["train"].items() if v["math_fallback"] and device.type == "cuda"]
    out["ok"] = not out["errors"] and not math
    _write(args, "gpu_check_scale.json", out)
    best = max((v["mfu"] for v in out["train"].values()), default=float("nan"))
    print(f"gpu_check_scale ok={out['ok']} best_train_mfu={best:.3f} precompute_mfu={out['precompute']['mfu']:.3f} "
          f"store_s_per_shard={out['store_s_per_shard']:.2f} math_fallback={len(math)}")
    if math:
        raise SystemExit(f"SDPA fell back to the math kernel in {math}")
    return out


def path_commands(work: Path, target: Path, data: Path) -> dict[str, list[str]]:
    """The torchrun command of each trainer preset at world size 1: 30 steps, engine validation every 10."""
    common = [f"target.path={target}", "target.name=tiny", "target.source=null", "data.source=jsonl",
              f"data.path={data}", "data.max_length=512", "logger=csv", "progress=false", "trainer.devices=1",
              "trainer.max_steps=30", "trainer.max_epochs=-1", "train.data.batch_tokens=1024",
              "train.engine_validation.every_n_steps=10", "train.engine_validation.prompts=1",
              "train.engine_validation.max_new_tokens=8"]
    return {p: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "scripts.train",
                *common, f"trainer={p}", f"run_dir={work / p}", f"store_dir={work / 'store'}"] for p in PRESETS}


def count_per_token(fn, tokens: int) -> dict:
    """CUDA kernel launches and host synchronisations per generated token while `fn()` runs (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaEventSynchronize"))
    return {"launches_per_token": launches / tokens, "syncs_per_token": syncs / tokens}


def run_paths(args) -> dict:
    work = Path(args.out) / "paths"
    target, data = work / "tiny_target", work / "conversations.jsonl"
    commands = path_commands(work, target, data)
    if args.dry_run:
        for p, cmd in commands.items():
            print(p, " ".join(cmd))
        return {"commands": commands}
    from tests.conftest import CONVERSATIONS, make_hf_model
    from tests.tiny_tokenizer import make_tiny_tokenizer

    work.mkdir(parents=True, exist_ok=True)
    model, tok = make_hf_model("llama", tie_word_embeddings=True), make_tiny_tokenizer("chatml")
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(target)
    tok.save_pretrained(target)
    data.write_text("\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n")
    out: dict = {"presets": {}}
    env = {**os.environ, "WANDB_MODE": "disabled"}
    subprocess.run([sys.executable, "-m", "scripts.precompute", *commands["ddp"][6:]], cwd=ROOT, env=env, check=True)
    for p, cmd in commands.items():
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        res = {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "tail": (proc.stdout + proc.stderr)[-1500:]}
        if proc.returncode == 0:
            res["reloaded"] = _reload(work / p / "head", target)
        out["presets"][p] = res
        print(p, res["rc"], res.get("reloaded"), flush=True)
    out["decode"] = _decode_counts(target)
    out["ok"] = all(r["rc"] == 0 and r.get("reloaded") for r in out["presets"].values())
    _write(args, "gpu_check_paths.json", out)
    print("gpu_check_paths ok=%s %s" % (out["ok"], " ".join(f"{p}={r['rc']}" for p, r in out["presets"].items())))
    return out


def _reload(head_dir: Path, target: Path) -> bool:
    from artifacts.checkpoint import load_native
    from inference_eval.model import tied_target

    tied, args, _ = tied_target(target)
    head = load_native(head_dir, tied, args)
    return all(torch.isfinite(p).all() for p in head.parameters())


def _decode_counts(target: Path) -> dict:
    from inference_eval.engine import engine_generate
    from inference_eval.model import LlamaForCausalLM, resolve_device

    device = resolve_device("auto")
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.bfloat16, device=device)
    out = {}
    for b in (1, 8):
        prompts = [[1 + i, 2, 3, 4] for i in range(b)]
        new = 32
        out[f"b{b}"] = count_per_token(lambda: engine_generate(model, prompts, new, max_batch=b, max_seq_len=64),
                                       b * new)
    return out


def _write(args, name: str, obj: dict) -> Path:
    path = Path(args.out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))
    print(f"wrote {path}")
    return path
