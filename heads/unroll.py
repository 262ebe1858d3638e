"""The training-time test unroll (DESIGN.md §4), shared by every head with the small interface.

For original position i, depth d consumes the state Ĥ^{d-1}_i (depth 1: the target's H_i) and the
token t_{i+d} at RoPE position i+d-1 and produces Ĥ^d_i, trained against H_{i+d} and the target's
L_{i+d} (which predicts t_{i+d+1}). Its query attends the depth-1 keys of positions ≤ i plus the
keys of depths 2..d at position i — what the engine's draft KV cache holds at draft step d once the
target accepted up to position i. Rows whose token t_{i+d} lies past the sequence get token 0; the
loss masks them out.
"""

from __future__ import annotations

import torch


def unroll(head, hidden: torch.Tensor, input_ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """hidden [B, T, H] (target H_0..H_{T-1}), input_ids [B, T] → [Ĥ^1, …, Ĥ^D], each [B, T-1, H];
    row i of Ĥ^d estimates H_{i+d}."""
    if depth > 1 and len(getattr(head, "layers", [])) > 1:
        raise NotImplementedError("the training-time test unroll drives single-module heads (num_modules: 1)")
    b, t, _ = hidden.shape
    rows = t - 1
    base_pos = torch.arange(rows, device=hidden.device).expand(b, rows)
    state = hidden[:, :-1].to(head.dtype)
    base, extras, outs = None, [], []
    for d in range(1, depth + 1):
        tokens = torch.zeros(b, rows, dtype=input_ids.dtype, device=input_ids.device)
        tokens[:, : max(t - d, 0)] = input_ids[:, d:]  # t_{i+d}
        x = head.fuse(state, head.embed(tokens), d)
        state, kv = head.step_unrolled(x, base_pos + (d - 1), base, extras, d)
        if base is None:
            base = kv
        else:
            extras.append(kv)
        outs.append(state)
    return outs
