"""What every draft head shares: the frozen target tensors (`TiedTarget`) and the small interface
that both the training unroll and the engine's draft loop call (`DraftHead`).

A head step at position i consumes (state_i, t_{i+1}): `embed` the token, `fuse` it with the state,
run one decoder layer (`step`, or `step_unrolled` for the training-time test), and `logits` projects
the result with the target's frozen lm_head. Subclasses define `fuse`, `decoder(depth)`,
`features`, `regression_target`, `dtype` and `reset_parameters`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.layers import (DecoderLayer, KVCache, LlamaArgs, Rotary, TiedConventions, linear, scale_embedding,
                          store_linear_weights)


class TiedTarget(nn.Module):
    """Frozen target tensors shared by a head: E, W_lm, N_f. Non-persistent buffers, so they are
    never trained, never in the optimizer and never in a head checkpoint. `conventions`: how the
    target's family uses them (Gemma: E·√H, N_f = x̂·(1 + w), maybe capped logits)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor, eps: float,
                 conventions: TiedConventions | None = None) -> None:
        super().__init__()
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)
        self.register_buffer("norm_weight", norm.detach(), persistent=False)
        self.eps = eps
        self.conventions = conventions or TiedConventions()

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """E t, scaled as the target scales it."""
        e = F.embedding(tokens, self.embed)
        scale = self.conventions.embed_scale
        return e if scale is None else scale_embedding(e, scale)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """N_f: the target's final norm (F_i = N_f(H_i)), in its family's form."""
        offset = self.conventions.norm_offset
        normed = F.rms_norm(h.float(), (h.shape[-1],), eps=self.eps)
        if offset:  # Gemma: multiply in fp32, then cast
            return (normed * (offset + self.norm_weight.float())).to(h.dtype)
        return self.norm_weight * normed.to(h.dtype)

    @property
    def norm_scale(self) -> torch.Tensor:
        """N_f's multiplier of the normalised state (w, or Gemma's 1 + w): what a head's Llama-form
        RMSNorm copies to start as N_f."""
        offset = self.conventions.norm_offset
        return self.norm_weight.float() + offset if offset else self.norm_weight

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's tanh soft-cap of its final logits, where its family has one."""
        cap = self.conventions.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def teacher_logits(self, h: torch.Tensor) -> torch.Tensor:
        """L = W_lm N_f(H): the target's logits recomputed from a stored state."""
        return self.cap_logits(linear(self.final_norm(h), self.lm_head))


class DraftHead(nn.Module):
    kind = "base"
    # Chain heads (mtp, eagle1, eagle3) draft token j from their own state at depth j-1; a parallel head
    # (medusa) drafts all k tokens at once from the target's state (`chain = False`).
    chain = True

    def __init__(self, args: LlamaArgs, tied: TiedTarget) -> None:
        super().__init__()
        self.args, self.tied = args.layer_args(), tied  # plain LlamaArgs: what the checkpoint records
        self.rotary = Rotary(args)

    # ---- defined by each head ---------------------------------------------------------------------
    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int = 1) -> torch.Tensor:
        raise NotImplementedError

    def decoder(self, depth: int) -> DecoderLayer:
        raise NotImplementedError

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """What the frozen lm_head projects (the training loss works on these)."""
        raise NotImplementedError

    def regression_target(self, hidden_next: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the linear weights may be stored in another, `store_weights`)."""
        return getattr(self, "_compute_dtype", None) or next(self.parameters()).dtype

    def store_weights(self, dtype: torch.dtype) -> "DraftHead":
        """Inference: keep the head's linear weights and the lm_head it projects with in `dtype` (bf16 under a float32
        head: W16A32, as `LlamaForCausalLM.store_weights` does for the target); the embedding it reads, its norms and
        its states stay in its dtype. The shared tensors get a TiedTarget of their own (the target's is not touched).
        Call it after any `.to(dtype)`, which would widen the weights back."""
        compute = self.dtype
        if dtype == compute:
            return self
        store_linear_weights(self, dtype, compute)
        t = self.tied
        self.tied = TiedTarget(t.embed, t.lm_head.to(dtype), t.norm_weight, t.eps, t.conventions)
        self._compute_dtype = compute
        return self

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose *inputs* the head consumes besides the last pre-norm state (EAGLE-3)."""
        return ()

    @property
    def state_size(self) -> int:
        """Width of the target state the head consumes at depth 1."""
        return self.args.hidden_size

    def target_input(self, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        """The depth-1 input from the target: its last pre-norm state H (here), or the aux layers."""
        return hidden

    @property
    def separate_modules(self) -> bool:
        """True when depth d runs its own module with its own KV cache (mtp with num_modules > 1)."""
        return False

    @property
    def max_depth(self) -> int | None:
        """The deepest draft step the head defines (None: unbounded, a reused module)."""
        return None

    def depth_modules(self) -> list[nn.Module]:
        """The head's modules of its own per draft depth (module d drafts depth d); [] when one module
        serves every depth. `train.module.clip_scope: module` clips each one's gradient by its own norm."""
        return []

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """What `features` are projected with: the target's frozen lm_head unless the head has its own."""
        return self.tied.lm_head

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the head's vocabulary rows; None when it is the target's whole vocabulary."""
        return None

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map argmax indices of `logits` to target token ids (identity for a full-vocabulary head)."""
        return ids

    def cache_layer(self, depth: int) -> int:
        return 0

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tied.embed_tokens(tokens)

    def step(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
             start: int = 0, depth: int = 1) -> torch.Tensor:
        cos, sin = self.rotary(positions, x.dtype)
        kv = cache.layer(self.cache_layer(depth)) if cache is not None else None
        return self.decoder(depth)(x, cos, sin, kv, start)

    def step_unrolled(self, x: torch.Tensor, positions: torch.Tensor,
                      base: tuple[torch.Tensor, torch.Tensor] | None,
                      extras: list[tuple[torch.Tensor, torch.Tensor]], depth: int = 1,
                      mask: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`step` for the training-time test (heads/unroll.py): all rows at once, each attending what
        the engine's draft cache would hold at this depth (Attention.forward_unrolled); `mask` [B, T, T]
        for packed rows."""
        cos, sin = self.rotary(positions, x.dtype)
        return self.decoder(depth)(x, cos, sin, unrolled=(base, extras, mask))

    def key_writers(self, depth: int, k: int) -> range:
        """The depths whose modules also write their KV of draft step `depth`'s input when drafting k steps:
        with separate modules every module that answers a deeper step (heads/mtp.py); none for one reused
        module, whose cache already holds each step."""
        return range(0)

    def keys_unrolled(self, x: torch.Tensor, positions: torch.Tensor, depth: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k, v) that depth `depth`'s decoder writes for the fused input `x` at `positions`, without
        its attention or MLP (heads/unroll.py: a deeper module's keys of an earlier draft step)."""
        cos, sin = self.rotary(positions, x.dtype)
        return self.decoder(depth)(x, cos, sin, kv_only=True)

    def logits(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        return self.tied.cap_logits(linear(self.features(hidden, depth), self.lm_head_weight))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, start: int = 0, depth: int = 1) -> torch.Tensor:
        """(state_i, t_{i+1}) at RoPE position `positions` → Ĥ, the head's next state."""
        x = self.fuse(hidden.to(self.dtype), self.embed(tokens), depth)
        return self.step(x, positions, cache, start, depth)

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        a = self.args
        return KVCache(self.num_cache_layers, batch, a.num_key_value_heads, max_len, a.head_dim, self.dtype,
                       self.tied.embed.device)


def check_aux_ids(ids, num_layers: int, setting: str) -> None:
    """Aux layer ids, in the "input of layer i" convention: ascending, distinct, within 1..L-1."""
    if list(ids) != sorted(set(ids)) or not all(1 <= i < num_layers for i in ids):
        raise ValueError(f"{setting} {list(ids)} must be ascending, distinct and within 1..{num_layers - 1} "
                         "(ids are inputs of target layers)")


@torch.no_grad()
def init_random(module: nn.Module, gen: torch.Generator, std: float) -> None:
    """Norm weights 1, biases 0, matrices N(0, std²) with residual-output projections (o_proj,
    down_proj) at std/√2, GPT-2 style."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.ndim == 2:
            scale = std / 2 ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        else:
            p.zero_()
