"""What one training rank holds in memory, sized from the code: the head built at a target's real shapes on the
`meta` device (no data), its optimizer groups as train/optim.py forms them, the strategy's sharding, and the frozen
target tensors in the dtype `tied_dtype` gives them. docs/scale.md's "Memory per GPU" table is this module's output
(`python -m train.memory`; tests/test_gpu_correct_scale.py checks the doc against it).

Counted: weights, gradients, optimizer states, weights gathered by FSDP2 / ZeRO-3 during the step, the tied E / W_lm /
N_f, activations kept for backward (an estimate: see `activation_bytes_per_token`) and the KL chunks. Not counted:
the allocator's fragmentation, CUDA context (~0.5 GB), communication buckets, and rank 0's engine-validation target
(a whole target: 141 GB at 70B, which is why validation there runs through vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9


@dataclass(frozen=True)
class TargetShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def hf_config(self) -> dict:
        return {"hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                "tie_word_embeddings": False, "model_type": "llama"}


LLAMA_8B = TargetShape("llama3-8b", 4096, 14336, 32, 32, 8, 128256)
LLAMA_70B = TargetShape("llama3-70b", 8192, 28672, 80, 64, 8, 128256)
# trainer preset → how it shards the head (train/strategies.py, conf/trainer/*.yaml)
STRATEGIES = {"gpu": "single", "ddp": "ddp", "8xh100": "zero2", "8xh100_zero3": "zero3", "8xh100_fsdp": "fsdp2"}


def tied_dtype(precision: str | None, device: torch.device | str) -> torch.dtype:
    """The dtype the frozen target tensors (TiedTarget's E, W_lm, N_f) train in: the compute dtype of the trainer's
    precision on an accelerator (bf16-mixed autocast casts W_lm to bf16 at every product anyway: an fp32 copy only
    doubles their memory), fp32 where the head computes in fp32 (`32-true`) and on the CPU (where memory is not the
    limit and engine validation compares against an fp32 engine)."""
    precision = str(precision)
    if torch.device(device).type == "cpu":
        return torch.float32
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def meta_head(shape: TargetShape, head_spec: dict[str, Any]) -> torch.nn.Module:
    """The head a head spec (`{"type": "mtp", "num_modules": 3}`, what `build_head` takes) builds for a target of
    `shape`, on the meta device (shapes, no memory)."""
    from heads.base import TiedTarget
    from heads.layers import LlamaArgs
    from heads.registry import build_head

    args = LlamaArgs.from_hf_config(shape.hf_config())
    with torch.device("meta"):
        tied = TiedTarget(torch.empty(shape.vocab, shape.hidden), torch.empty(shape.vocab, shape.hidden),
                          torch.empty(shape.hidden), 1e-5)
        return build_head(dict(head_spec), args, tied)


def activation_bytes_per_token(shape: TargetShape) -> int:
    """bf16 bytes kept for backward per token and unrolled depth, an estimate: the fusion's input and output (3·H), the
    decoder layer's norms and residuals (4·H), q / k / v (H + 2·kv·d), attention output and o_proj input (2·H),
    the gate, up, activation and down input of the MLP (4·F)."""
    kv = shape.kv_heads * (shape.hidden // shape.heads)
    return 2 * (9 * shape.hidden + 2 * kv + 4 * shape.intermediate)


def rank_memory(shape: TargetShape, head_spec: dict[str, Any], preset: str, world: int, tokens: int, depth: int,
                optimizer: str = "auto", kl_chunk: int = 512, precision: str = "bf16-mixed") -> dict[str, float]:
    """GB per rank of training the head of `head_spec` on a target of `shape` with trainer `preset` over `world`
    ranks, `tokens` per rank per step, the unroll to `depth`. `optimizer: auto`: Muon for MUON_HEAD_TYPES outside
    DeepSpeed, else AdamW (train/optim.py `resolve_optimizer`); Muon keeps one fp32 momentum per matrix, AdamW two
    moments per tensor."""
    from train.optim import parameter_groups, resolve_optimizer

    kind = STRATEGIES[preset]
    head = meta_head(shape, head_spec)
    params = [p for p in head.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    opt = resolve_optimizer(optimizer, head_spec["type"], kind in ("zero2", "zero3"))
    groups = parameter_groups(head, opt, 0.0)
    muon = sum(p.numel() for g in groups if g.get("muon") for p in g["params"])
    state = 4 * muon + 8 * (n - muon)  # fp32 moments
    units = [sum(p.numel() for p in m.parameters()) for m in head.modules() if getattr(m, "fsdp_unit", False)]
    share = 1 / world
    if kind in ("single", "ddp"):  # fp32 weights and gradients, optimizer states, all whole
        weights, grads, opt_b, gathered = 4 * n, 4 * n, state, 0
    elif kind == "zero2":  # bf16 weights whole; fp32 master, states and gradients partitioned
        weights, grads, opt_b, gathered = 2 * n + 4 * n * share, 4 * n * share, state * share, 0
    elif kind == "zero3":  # everything partitioned; one layer's bf16 weights gathered at a time
        weights, grads, opt_b = (2 + 4) * n * share, 4 * n * share, state * share
        gathered = 2 * max(units, default=0)
    else:  # fsdp2: fp32 shards; bf16 gathered root tensors and the largest layer (a reused one kept for the step)
        weights, grads, opt_b = 4 * n * share, 4 * n * share, state * share
        gathered = 2 * (n - sum(units) + max(units, default=0))
    tied_b = torch.finfo(tied_dtype(precision, "cuda")).bits // 8  # as train/run.py places them on a GPU
    tied = tied_b * (2 * shape.vocab * shape.hidden + shape.hidden)
    act = activation_bytes_per_token(shape) * tokens * depth
    kl = kl_chunk * shape.vocab * 4 * 3  # teacher and student logits and the softmax of one chunk, fp32
    parts = {"params_b": n / 1e9, "weights": weights / GB, "grads": grads / GB, "optimizer": opt_b / GB,
             "gathered": gathered / GB, "tied": tied / GB, "activations": act / GB, "kl": kl / GB}
    parts["total"] = sum(v for k, v in parts.items() if k != "params_b")
    return parts


# the rows of docs/scale.md's table: (preset, target, head config, ranks, tokens per rank, depth)
TABLE = [("8xh100", LLAMA_70B, {"type": "mtp"}, 8, 16384, 1),
         ("ddp", LLAMA_70B, {"type": "mtp"}, 8, 16384, 1),
         ("8xh100_fsdp", LLAMA_70B, {"type": "mtp"}, 8, 16384, 3),
         ("8xh100_fsdp", LLAMA_70B, {"type": "mtp", "num_modules": 3}, 8, 16384, 3),
         ("8xh100_zero3", LLAMA_70B, {"type": "mtp", "num_modules": 3}, 8, 16384, 3),
         ("gpu", LLAMA_8B, {"type": "mtp", "num_modules": 3}, 1, 16384, 3),
         ("8xh100_fsdp", LLAMA_8B, {"type": "mtp", "num_modules": 3}, 8, 16384, 3)]


def table_rows() -> list[str]:
    """docs/scale.md's memory rows, one markdown line each."""
    rows = []
    for preset, shape, spec, world, tokens, depth in TABLE:
        m = rank_memory(shape, spec, preset, world, tokens, depth)
        head = spec["type"] + (f"×{spec['num_modules']}" if spec.get("num_modules", 1) > 1 else "")
        rows.append(f"| `{preset}` | {shape.name} | {head} ({m['params_b']:.2f} B), D = {depth} | {world} | "
                    f"{tokens:,} | {m['weights']:.1f} | {m['grads']:.1f} | {m['optimizer']:.1f} | {m['gathered']:.1f} | "
                    f"{m['tied']:.1f} | {m['activations']:.1f} | {m['kl']:.1f} | **{m['total']:.1f}** |")
    return rows


TABLE_HEADER = ("| preset | target | head (parameters), depth | ranks | tokens per rank | weights | grads | "
                "optimizer | gathered | tied E, W_lm, N_f | activations | KL chunk | GB per rank |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

if __name__ == "__main__":
    print(TABLE_HEADER)
    print("\n".join(table_rows()))
