"""Parallel block drafters: the DFlash head and the DSpark head (docs/design.md §3).

DFlash (Chen et al., 2026) drafts a whole block in one forward pass. For an anchor position a (the last token the
target has accepted, t_a, whose target state is not computed yet) the draft's input block is

    x_0 = E t_a,  x_j = E [MASK]   (j = 1..B-1)                at RoPE positions a..a+B-1

and its context is the committed prefix 0..a-1, read from the target: the inputs of a few target layers
(`target_layers`, spread over depth) concatenated and projected,

    c_p = hidden_norm( fc [ A^{l_1}_p ; … ; A^{l_K}_p ] )       (H wide, p < a)

Every draft layer is a Qwen3-style decoder layer (q/k norms) whose attention reads the keys and values of
[c_0..c_{a-1} ; its own block input] — the context through the layer's own k_proj / v_proj (k_norm, RoPE at p; no
input norm: c is normed already), the block non-causally (every block row sees the whole block). The block's last
layer output goes through the draft's final norm and the target's frozen lm_head (the seed's lesson: the norm that
puts the draft back in the target's space before its lm_head):

    logits_j = W_lm · norm(h_j)                 row j predicts t_{a+j} (rows 1..B-1; row 0 holds t_a)

so one pass drafts B-1 tokens. Row j is trained against the target's distribution at position a+j-1 (which
predicts t_{a+j}). Training draws random anchors per sequence and runs all their blocks at once; one mask of
[blocks·B, T + blocks·B] per sequence says what each block row sees (no [T × T] mask per block).

DSpark adds two small heads on the DFlash backbone:
- a rank-r Markov bias, applied left to right over the block: logits_j += W2 · W1[x_{j-1}] with x_{j-1} the token
  before row j's (t_a for row 1, the previous draft after it), so the block's drafts depend on each other at the
  cost of a [V × r] lookup and an [r → V] projection per row;
- a confidence head: σ(w · [norm(h_j) ; W1[x_{j-1}]] + b), trained (BCE) against the acceptance probability of row j,
  1 − ½‖p_draft − p_target‖₁; the engine may end a block early where it predicts a rejection.

Tensor names follow vLLM's Qwen3 DFlash / DSpark drafts (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`,
`markov_w1`, `markov_w2`, `confidence_head.proj`), so the export renames nothing but the frozen tensors it omits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead, TiedTarget, check_aux_ids, init_random
from heads.layers import DecoderLayer, Linear, LlamaArgs, RMSNorm, apply_rope


def default_target_layers(num_layers: int, count: int = 4) -> tuple[int, ...]:
    """`count` target layers spread from the second layer's output to the output of layer L-3 (DFlash's spread), in
    spechead's "input of layer i" convention (the output of layer i-1): ascending, distinct, within 1..L-1."""
    lo, hi = 1, max(num_layers - 3, 1)
    outs = [lo] if count == 1 else [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
    return tuple(sorted({min(max(o + 1, 1), num_layers - 1) for o in outs}))


@dataclass(frozen=True)
class DFlashConfig:
    num_layers: int = 3  # draft decoder layers (each as wide as the target's layers)
    block_size: int = 8  # B: the anchor and B-1 drafted rows; the engine drafts k ≤ B-1 of them
    target_layers: tuple[int, ...] | None = None  # "input of layer i" ids; None: default_target_layers(L)
    mask_token_id: int | None = None  # the block's placeholder token; None: the target's last id (V-1)
    draft_vocab_size: int | None = None  # None (or ≥ V): the target's vocabulary through its frozen lm_head
    init_std: float = 0.02

    kind = "dflash"

    def __post_init__(self) -> None:
        if self.target_layers is not None:
            object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        if self.num_layers < 1:
            raise ValueError(f"{self.kind} num_layers={self.num_layers}: needs at least one draft layer")
        if self.block_size < 2:
            raise ValueError(f"{self.kind} block_size={self.block_size}: a block holds the anchor and ≥ 1 drafted row")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers) if self.target_layers is not None else None
        return {"type": self.kind, **d}


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    markov_rank: int = 64  # r of the Markov bias W2 · W1[x_{j-1}]
    confidence: bool = True  # the acceptance-probability head

    kind = "dspark"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 1:
            raise ValueError(f"dspark markov_rank={self.markov_rank}: must be ≥ 1 (a DSpark head without its Markov "
                             "bias is head=dflash)")


class BlockLayer(DecoderLayer):
    """A Qwen3-style decoder layer whose attention also reads context keys and values computed from the target's
    states. In the engine it is DecoderLayer's paged forward (the context sits in the draft's KV cache); in training
    `block=(context_kv, mask)` runs the blocks of every anchor at once. `context=True` returns only the (k, v) of
    context states (no input norm). Both through the module call, so sharded strategies gather the layer."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv=None, start: int = 0,
                attn_mask: torch.Tensor | None = None, unrolled: tuple | None = None, kv_only: bool = False,
                block: tuple | None = None, context: bool = False):
        attn = self.self_attn
        if context:  # x: the context states c [B, T, H]
            b, t, _ = x.shape
            k = attn.k_norm(attn.k_proj(x).view(b, t, attn.n_kv, attn.head_dim))
            v = attn.v_proj(x).view(b, t, attn.n_kv, attn.head_dim).transpose(1, 2)
            return apply_rope(k.transpose(1, 2), cos, sin), v
        if block is None:
            return super().forward(x, cos, sin, kv, start, attn_mask, unrolled, kv_only)
        (k_ctx, v_ctx), mask = block
        b, t, _ = x.shape
        q, k, v = attn.project(self.input_layernorm(x), cos, sin)
        out = F.scaled_dot_product_attention(q, torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2),
                                             attn_mask=mask, enable_gqa=attn.n_kv != attn.n_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    kind = "dflash"
    chain = False
    block = True  # drafts a block per pass: the engine's PagedBlockProposer, train/losses.py block_terms
    # which block rows draft: DFlash's rows 1..B-1 each predict the token at their own position (row 0 holds the
    # anchor); DSpark's rows 0..B-1 each predict the next one (vLLM's `sample_from_anchor`). Either way draft i
    # (1-based) predicts t_{a+i}, from row i - 1 + first_row, against the target's distribution at a+i-1.
    predict_anchor = False

    def __init__(self, args: LlamaArgs, cfg: DFlashConfig, tied: TiedTarget) -> None:
        super().__init__(args, tied)
        layers = cfg.target_layers or default_target_layers(args.num_hidden_layers)
        check_aux_ids(layers, args.num_hidden_layers, f"{self.kind} target_layers")
        mask_id = args.vocab_size - 1 if cfg.mask_token_id is None else int(cfg.mask_token_id)
        if not 0 <= mask_id < args.vocab_size:
            raise ValueError(f"{self.kind} mask_token_id={mask_id} is not a token id of the target (0..{args.vocab_size - 1})")
        vd = min(cfg.draft_vocab_size or args.vocab_size, args.vocab_size)
        if vd < 1:
            raise ValueError(f"{self.kind} draft_vocab_size {cfg.draft_vocab_size} must be positive")
        self.cfg = dataclasses.replace(cfg, target_layers=tuple(layers), mask_token_id=mask_id, draft_vocab_size=vd)
        h = args.hidden_size
        self.layer_args = dataclasses.replace(self.args, qk_norm=True)  # Qwen3 layers, what vLLM's drafts are
        self.fc = Linear(len(layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(self.layer_args) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, args.rms_norm_eps)
        if vd < args.vocab_size:  # a reduced vocabulary: its own lm_head, target id = draft id + d2t
            self.lm_head = Linear(h, vd, bias=False)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(args.vocab_size, dtype=torch.bool))
            self.t2d[:vd] = True

    # ---- the small interface ---------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def first_row(self) -> int:
        """The block row of draft 1."""
        return 0 if self.predict_anchor else 1

    @property
    def max_depth(self) -> int:
        """Drafts per block: B - first_row."""
        return self.cfg.block_size - self.first_row

    def block_rows(self, k: int) -> int:
        """Rows of the engine's block for k drafts: the anchor and what the k drafts need (vLLM shortens the block
        to the drafts served, so a block of fewer rows than training's is what serving runs)."""
        return k + self.first_row

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    @property
    def state_size(self) -> int:
        return len(self.cfg.target_layers) * self.args.hidden_size

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers)

    def target_input(self, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        """The context states c = hidden_norm(fc [A^{l_1} ; …]) [.., H] of target positions."""
        k, h = len(self.cfg.target_layers), self.args.hidden_size
        if aux is None or aux.shape[-1] != k * h:
            got = "none" if aux is None else f"{aux.shape[-1]} wide"
            raise ValueError(f"the {self.kind} head reads the inputs of target layers {list(self.cfg.target_layers)} "
                             f"({k} × {h} = {k * h} wide), got {got}: precompute the store with those layers "
                             "(precompute.aux_layers: auto captures what the configured head reads)")
        return self.hidden_norm(self.fc(aux.to(self.dtype)))

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        return self.norm(hidden)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if hasattr(self, "lm_head") else self.tied.lm_head

    @property
    def draft_ids(self) -> torch.Tensor | None:
        if not hasattr(self, "d2t"):
            return None
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if hasattr(self, "d2t") else ids

    def regression_target(self, hidden_next: torch.Tensor) -> None:
        return None  # trained on the target's distribution only

    def depth_modules(self) -> list[nn.Module]:
        return []

    @torch.no_grad()
    def set_draft_vocab(self, counts: torch.Tensor) -> None:
        """A reduced vocabulary: the V_d most frequent target ids of `counts` [V] (ties: lower id), ascending; d2t and
        t2d as vLLM reads them. Nothing to choose for a head over the target's whole vocabulary."""
        if not hasattr(self, "d2t"):
            return
        vd = self.cfg.draft_vocab_size
        order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))[:vd]
        ids = torch.tensor(sorted(order), dtype=torch.long, device=self.d2t.device)
        self.d2t.copy_(ids - torch.arange(vd, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    # ---- the block pass --------------------------------------------------------------------------
    def block_inputs(self, anchors: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Token ids of the blocks [..., rows] (default B) for anchor tokens [...]: t_a then mask tokens."""
        ids = anchors.new_full((*anchors.shape, rows or self.block_size), self.mask_token_id)
        ids[..., 0] = anchors
        return ids

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) [B, nKV, T, d] of context states `ctx` [B, T, H] at `positions` [B, T]."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer(ctx, cos, sin, context=True) for layer in self.layers]

    def block_forward(self, ctx: torch.Tensor, ctx_positions: torch.Tensor, block_ids: torch.Tensor,
                      block_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Training's pass over many blocks at once: context `ctx` [B, T, H] at `ctx_positions` [B, T]; the blocks'
        tokens `block_ids` [B, N] (N = blocks · block_size) at `block_positions` [B, N]; `mask` [B, 1, N, T + N] bool
        (what each block row sees: its context prefix and its own block) → the last layer's output [B, N, H]."""
        x = self.embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(block_positions, x.dtype)
        ccos, csin = self.rotary(ctx_positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, block=(layer(ctx, ccos, csin, context=True), mask))
        return x

    def forward(self, block_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The engine's pass: block rows `block_ids` [1, N] at `positions` [1, N] through the draft layers over a
        paged cache holding the context (each block's rows see the committed context and their whole block) →
        [1, N, H]."""
        x = self.embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.layer(i))
        return x

    def row_logits(self, h: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the head's vocabulary of block rows `h` [..., H]; `prev` [...]: the token before each row's
        (the Markov bias of DSpark; DFlash ignores it)."""
        return self.logits(h)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Predicted acceptance logits [...] of block rows (DSpark's confidence head); None without one."""
        return None

    @torch.no_grad()
    def probe(self, seed: int = 0, length: int = 12) -> torch.Tensor:
        """A fingerprint of the function: every block row's logits (after the true token before it), and the
        confidence where there is one, for blocks at three anchors of fixed random target states and tokens."""
        gen = torch.Generator().manual_seed(seed)
        aux = torch.randn(1, length, self.state_size, generator=gen).to(self.dtype)
        ids = torch.randint(0, self.args.vocab_size, (1, length), generator=gen)
        anchors = torch.tensor([[1, length // 2, length - 2]])
        h = block_unroll(self, aux.to(self.tied.embed.device), ids.to(self.tied.embed.device),
                         anchors.to(self.tied.embed.device))[0]  # [3, B, H]
        prev = ids[0, (anchors[0, :, None] + torch.arange(self.block_size) - self.first_row).clamp(0, length - 1)]
        prev = prev.to(h.device)
        outs = [self.row_logits(h, prev).float().reshape(-1)]
        conf = self.confidence(h, prev)
        if conf is not None:
            outs.append(conf.float().reshape(-1))
        if self.draft_ids is not None:
            outs.append(self.draft_ids.float())
        return torch.cat(outs)

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random layers (init_random: norms 1); the final norm starts as the target's N_f (the draft's output then
        lives where the target's last state lives); a reduced lm_head as the target's rows (set_draft_vocab first)."""
        gen = torch.Generator().manual_seed(seed)
        init_random(self, gen, self.cfg.init_std)
        self.norm.weight.copy_(self.tied.norm_scale)
        if hasattr(self, "lm_head"):
            self.lm_head.weight.copy_(self.tied.lm_head[self.draft_ids.to(self.tied.lm_head.device)].to(self.lm_head.weight.dtype))


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)


class DSparkHead(DFlashHead):
    kind = "dspark"
    predict_anchor = True

    def __init__(self, args: LlamaArgs, cfg: DSparkConfig, tied: TiedTarget) -> None:
        super().__init__(args, cfg, tied)
        r = cfg.markov_rank
        self.markov_w1 = nn.Embedding(args.vocab_size, r)  # indexed by target token ids
        self.markov_w2 = Linear(r, self.cfg.draft_vocab_size, bias=False)
        if cfg.confidence:
            self.confidence_head = ConfidenceHead(args.hidden_size + r)

    def row_logits(self, h: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        if prev is None:
            raise ValueError("the dspark head's logits need the token before each row (its Markov bias)")
        return self.logits(h) + self.markov_w2(self.markov_w1(prev).to(h.dtype))

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if not hasattr(self, "confidence_head"):
            return None
        # the row's normed state (what the lm_head reads), as vLLM's DSpark and speculators' compute it
        return self.confidence_head(torch.cat([self.norm(h), self.markov_w1(prev).to(h.dtype)], dim=-1))

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """DFlash's start, then the Markov bias at 0 (W2 = 0: the head starts as its DFlash backbone) and W1 small."""
        super().reset_parameters(seed, first_input_norm)
        gen = torch.Generator().manual_seed(seed + 1)
        self.markov_w1.weight.copy_(torch.randn(self.markov_w1.weight.shape, generator=gen) * 0.01)
        self.markov_w2.weight.zero_()
        if hasattr(self, "confidence_head"):
            self.confidence_head.proj.weight.zero_()
            self.confidence_head.proj.bias.zero_()


def block_mask(anchors: torch.Tensor, t: int, rows: int, segments: torch.Tensor | None = None) -> torch.Tensor:
    """What the rows of the blocks at `anchors` [B, n] (indices into rows of length t) see: [B, 1, n·rows, t + n·rows]
    bool — the context keys before their anchor (of the anchor's sample, for packed rows) and every row of their own
    block. One mask per sequence; no [t × t] mask per block."""
    b, n = anchors.shape
    dev = anchors.device
    ctx = torch.arange(t, device=dev)[None, None, :] < anchors[:, :, None]  # [B, n, t]
    if segments is not None:
        ctx = ctx & (segments[:, None, :] == segments.gather(1, anchors)[:, :, None])
    blocks = torch.arange(n, device=dev).repeat_interleave(rows)
    own = (blocks[:, None] == blocks[None, :]).expand(b, -1, -1)  # [B, n·rows, n·rows]
    return torch.cat([ctx.repeat_interleave(rows, dim=1), own], dim=-1)[:, None]


def block_unroll(head: DFlashHead, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                 positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The training forward of a block head: for anchors [B, n] (indices into the rows, each ≥ 1), every block
    row's last-layer output [B, n, block_size, H], each block seeing its anchor's committed prefix as context (the
    target states `aux` [B, T, K·H] of positions < a) — what the engine's block pass computes once the target has
    accepted up to a-1. `positions` [B, T]: packed rows' per-sample positions; `segments` [B, T]: their samples."""
    b, t = input_ids.shape
    rows = head.block_size
    pos = positions if positions is not None else torch.arange(t, device=input_ids.device).expand(b, t)
    ctx = head.target_input(None, aux)
    ids = head.block_inputs(input_ids.gather(1, anchors)).view(b, -1)
    block_pos = (pos.gather(1, anchors)[:, :, None] + torch.arange(rows, device=pos.device)).view(b, -1)
    h = head.block_forward(ctx, pos, ids, block_pos, block_mask(anchors, t, rows, segments))
    return h.view(b, anchors.shape[1], rows, -1)
