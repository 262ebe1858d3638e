"""The training-time test unroll (docs/design.md §4), shared by every head with the small interface.

For original position i, depth d consumes the state Ĥ^{d-1}_i (depth 1: the target's state, H_i or
the aux layers of EAGLE-3) and the token t_{i+d} at RoPE position i+d-1 and produces Ĥ^d_i, trained
against H_{i+d} and the target's L_{i+d} (which predicts t_{i+d+1}). Its query attends what the
engine's draft KV cache holds at draft step d once the target accepted up to position i:

- one reused module (mtp `num_modules: 1`, eagle1, eagle3): the depth-1 keys of positions ≤ i plus the
  keys of depths 2..d at position i (one shared cache);
- separate modules (mtp `num_modules: D`), one cache per module: module d's own keys from its pass over
  the target's states at positions ≤ i, its own keys of the inputs of depths 2..d-1 at position i, plus
  its own depth-d key. At each draft step every module that answers a deeper step writes its key of that
  step's input (Ĥ^{j-1}, t_{i+j}) too — what vLLM's draft loop needs: its query at depth d attends
  module d's slots of every earlier draft step (docs/export.md `mtp-vllm`).

Rows whose token t_{i+d} lies past the sequence get token 0; the loss masks them out. Parallel heads
(medusa) define their own `unroll`.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _step(head, x, positions, base, extras, depth, mask):
    """One decoder step of the unroll; recomputed in backward when `head.gradient_checkpointing` is on
    (set by the training module): activations inside the layer are then not kept for backward."""
    if getattr(head, "gradient_checkpointing", False) and torch.is_grad_enabled():
        return checkpoint(head.step_unrolled, x, positions, base, extras, depth, mask, use_reentrant=False)
    return head.step_unrolled(x, positions, base, extras, depth, mask)


def packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] sample index per token (packed rows) → [B, T, T] bool: causal within each sample."""
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    return causal & (segments[:, :, None] == segments[:, None, :])


def unroll(head, hidden: torch.Tensor, input_ids: torch.Tensor, depth: int,
           aux: torch.Tensor | None = None, positions: torch.Tensor | None = None,
           segments: torch.Tensor | None = None, detach: bool = False) -> list[torch.Tensor]:
    """hidden [B, T, H] (target H_0..H_{T-1}), input_ids [B, T], aux [B, T, K·H] or None →
    [Ĥ^1, …, Ĥ^D], each [B, T-1, H]; row i of Ĥ^d estimates H_{i+d}. Packed rows pass `positions`
    (restarting at 0 in each sample) and `segments` (sample index per token): attention then stays
    inside each sample, and rows whose i+d crosses into the next sample are garbage the loss masks.
    `detach`: Ĥ^{d-1} enters depth d as a constant, so depth d's loss trains depth d's pass and not,
    through its input, the passes before it (the values are the same)."""
    if hasattr(head, "unroll"):
        if detach:
            raise ValueError(f"{type(head).__name__} unrolls its own way: train.module.detach_depths applies to the "
                             "heads with the shared unroll (mtp, eagle1, eagle3)")
        if getattr(head, "packed_unroll", False):  # attends across rows (draft_lm): needs the packing metadata
            return head.unroll(hidden, input_ids, depth, aux, positions, segments)
        return head.unroll(hidden, input_ids, depth, aux)
    if head.max_depth is not None and depth > head.max_depth:
        raise ValueError(f"depth {depth} exceeds the head's {head.max_depth} modules (module d drafts depth d)")
    b, t, _ = hidden.shape
    rows = t - 1
    base_pos = (positions[:, :-1] if positions is not None
                else torch.arange(rows, device=hidden.device).expand(b, rows))
    mask = packed_mask(segments[:, :-1]) if segments is not None else None
    target_state = head.target_input(hidden[:, :-1], aux[:, :-1] if aux is not None else None).to(head.dtype)
    state = target_state
    base, extras, outs = None, [], []
    own: dict[int, list] = {}  # separate modules: module e → [its base keys, its keys of depths 2..]
    for d in range(1, depth + 1):
        tokens = torch.zeros(b, rows, dtype=input_ids.dtype, device=input_ids.device)
        tokens[:, : max(t - d, 0)] = input_ids[:, d:]  # t_{i+d}
        embeds = head.embed(tokens)
        inp = state.detach() if detach and d > 1 else state
        if head.separate_modules:
            # every deeper module's keys of this step's input: at d = 1 its pass over (H_j, t_{j+1}) at every
            # position (causal), at d > 1 its key of (Ĥ^{d-1}_i, t_{i+d}) at row i (diagonal)
            for e in head.key_writers(d, depth):
                kv_e = head.keys_unrolled(head.fuse(inp, embeds, e), base_pos + (d - 1), e)
                if d == 1:
                    own[e] = [kv_e, []]
                else:
                    own[e][1].append(kv_e)
            if d > 1:
                base, extras = own[d]
        x = head.fuse(inp, embeds, d)
        state, kv = _step(head, x, base_pos + (d - 1), base, extras, d, mask)
        if base is None:
            base = kv
        elif not head.separate_modules:
            extras.append(kv)
        outs.append(state)
    return outs
