"""Tolerances the suite can defend on any CPU's kernel path (AVX-512, AVX2, the scalar `default`; 1 thread or many).

Two implementations of one function (transformers' Llama and ours, a packed row and separate rows, a paged
cache and a contiguous one) sum the same products in different orders, and which order a kernel takes
depends on the CPU's vector width, the thread count and the shapes. A float sum of n terms carries an
error of at most γ_n·Σ|x_i| with γ_n = n·u/(1 − n·u) (Higham, *Accuracy and Stability of Numerical
Algorithms*, Thm 3.1; u = eps/2 the unit roundoff), and in practice about √n·u·Σ|x_i|. A bound fitted to
the error one machine happened to show sits inside that spread and fails on the next CPU.

So:
- "the same function" is checked in **float64 on both sides** (`assert_same_function`): the reordering
  error is then ≈ 1e-16 relative, a bound of 1e-9 × the values' scale leaves six orders of magnitude of
  room on every kernel path, and any real defect (a wrong norm, a missing bias, a shifted position: errors
  of 1e-3 and up) still fails it by as many orders;
- where a comparison must stay in float32 (transformers' own model, a float32 kernel against torch's, a
  head whose tied tensors are float32), the bound comes from `float32_bound`: the probabilistic error of
  the longest reduction feeding the compared values, times their scale, times the number of dependent
  reductions that pass an error on.
"""

from __future__ import annotations

import math

import torch

# 1e-9 of the values' scale: float64's reordering error (≈ n·2^-53 ≈ 1e-13 for n ≤ 1e3 terms, through a few
# layers) is below it with room to spare; float32's (≈ 1e-7) and any real defect are far above it
FLOAT64_REL = 1e-9


def assert_same_function(got: torch.Tensor, want: torch.Tensor, msg: str | None = None) -> None:
    """`got` and `want`, both computed in float64, are the same function's values up to summation order."""
    assert got.dtype == want.dtype == torch.float64, (got.dtype, want.dtype)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, atol=FLOAT64_REL * max(scale, 1.0), rtol=0.0, msg=msg)


# Higham & Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5), 2019): with rounding errors independent
# and of mean zero, a sum of n terms errs by at most λ·√n·u·Σ|x_i| with probability ≥ 1 − 2·exp(−λ²/2)·n;
# λ = 6 puts a failure below 1e-5 per reduction even at n = 1e3 (Thm 3.1's worst case n·u is a bound no
# real kernel comes near: tens of times looser at these sizes, it would hide real defects)
LAMBDA = 6.0


def float32_bound(want: torch.Tensor, terms: int, layers: int = 1) -> float:
    """An absolute bound on |a − b| for two float32 evaluations of `want`'s function that differ only in
    summation order: each side errs by at most λ·√terms·u·scale per dependent reduction (`layers` of them
    chained; errors add to first order), and the two sides can err in opposite directions (the factor 2).
    `terms`: the longest reduction (hidden or intermediate size, the sequence in attention); scale: the
    compared values' largest magnitude (at least 1: near-zero values carry their inputs' absolute error)."""
    u = torch.finfo(torch.float32).eps / 2
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    return 2 * layers * LAMBDA * math.sqrt(terms) * u * scale


def assert_close_float32(got: torch.Tensor, want: torch.Tensor, terms: int, layers: int = 1,
                         msg: str | None = None) -> None:
    """float32 values of one function computed in two summation orders, within `float32_bound`."""
    bound = float32_bound(want, terms, layers)
    assert math.isfinite(bound)
    torch.testing.assert_close(got, want, atol=bound, rtol=0.0, msg=msg)


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of `model` (parameters and buffers), for same-function checks in float64."""
    import copy

    return copy.deepcopy(model).to(torch.float64)


def decoder_chain(num_layers: int) -> int:
    """Dependent reductions from the embedding to the logits of a decoder with `num_layers` layers: per layer
    two norms, q/k/v, q·k, softmax·v, o_proj, gate/up, down (8), then the final norm and lm_head."""
    return 8 * num_layers + 2


def assert_matches_hf(got: torch.Tensor, want: torch.Tensor, args, seq_len: int, msg: str | None = None) -> None:
    """Our float32 forward against transformers' float32 forward of the same checkpoint (`args`: its
    LlamaArgs-like config): within `float32_bound` over the whole decoder's chain of reductions."""
    terms = max(args.hidden_size, args.intermediate_size, seq_len)
    assert_close_float32(got, want, terms=terms, layers=decoder_chain(args.num_hidden_layers), msg=msg)


def assert_same_states(got: torch.Tensor, want: torch.Tensor, model_dir, msg: str | None = None) -> None:
    """Hidden states of the checkpoint at `model_dir` computed in two float32 ways (another batch, another
    backend, transformers): within `float32_bound` over its decoder (read from its config.json); the
    sequence is `want`'s first dimension."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    args = SimpleNamespace(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                           num_hidden_layers=cfg["num_hidden_layers"])
    assert_matches_hf(got, want, args, seq_len=want.shape[0] if want.dim() > 1 else 1, msg=msg)
