"""The seed's production draft: a small Llama LM as the draft model (head family `draft_lm`).

    x_j  = E t_j                                           (the target's embedding, frozen, shared)
    h_j  = DecoderLayer_N(… DecoderLayer_1(x)…)_j           (N Llama layers: the target's first N, or random)
    L̂_j  = W_lm · N_d(h_j)                                 (the target's lm_head, frozen, shared;
                                                             N_d: the draft's own final norm, a trainable
                                                             copy of the target's N_f)

Unlike the heads, the draft reads no target features at inference: it sees only tokens and keeps its
own KV cache, served by the engine's draft-model proposer (`PagedDraftModelProposer`), which it
satisfies with the same forward signature as the engine's target model (`args`, `model.norm`,
`lm_head`, `forward(ids, positions, cache, start, logits)`). It trains on the same feature store as
the heads, by KL to the target's logits recomputed from the stored pre-norm states
(`KL(softmax(W_lm N_f(H_j)) || softmax(L̂_j))`, train/module.py's chunked `fused_linear_kl`).

Row conventions of the training unroll (heads/unroll.py): row i of depth d estimates H_{i+d}; for a
draft LM that is its own state at position i+d over the true tokens t_0..t_{i+d} — what its draft
loop computes at draft step d once the target accepted up to position i and d_1..d_{d-1} were right.
Depth d > 1 therefore scores the same kind of prediction at shifted positions (no training-time test:
a draft LM never consumes its own states).

The final norm is a trainable copy (initialised from N_f): with the target's first N layers the
residual stream at layer N is not the one N_f was fitted to, and a free norm costs H parameters.
Layer-skip drafts (`LlamaForCausalLM.truncated`) keep N_f frozen instead; `init: target` with
training off is exactly that draft.

Export (`draft-hf`, artifacts/formats/draft_hf.py): a plain HF checkpoint of the target's own class (`LlamaForCausalLM` for a Llama
target) — the target's config with `num_hidden_layers: N`, `model.embed_tokens.weight` copied from the target (and `lm_head.weight` for an
untied target), the draft's layers and norm — which vLLM / SGLang load as a separate draft model and
spechead's engine loads with `LlamaForCausalLM.from_pretrained` (`evaluate.draft_models.<label>.path`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from heads.base import DraftHead, TiedTarget, init_random
from heads.layers import LLAMA_FAMILY, DecoderLayer, LlamaArgs, RMSNorm, linear
from heads.unroll import packed_mask


@dataclass(frozen=True)
class DraftLMConfig:
    num_layers: int = 2
    init: Literal["target", "random"] = "target"  # target: the target's first num_layers decoder layers
    init_std: float = 0.02

    def to_dict(self) -> dict:
        return {"type": "draft_lm", **asdict(self)}


@dataclass
class DraftLMOutput:
    hidden: torch.Tensor  # [B, T, H] the last draft layer's output, before the draft's final norm
    logits: torch.Tensor | None  # [B, T or 1, V] or None
    aux: list[torch.Tensor]  # always empty (the engine asks a draft model for no layer inputs)


class DraftLMHead(DraftHead):
    kind = "draft_lm"
    packed_unroll = True  # heads/unroll.py passes packed rows' positions and segments to `unroll`

    def __init__(self, args: LlamaArgs, cfg: DraftLMConfig, tied: TiedTarget) -> None:
        if cfg.init not in ("target", "random"):
            raise ValueError(f"draft_lm init={cfg.init!r}: expected target or random")
        if cfg.num_layers < 1:
            raise ValueError(f"draft_lm num_layers={cfg.num_layers}: at least one layer")
        super().__init__(dataclasses.replace(args, num_hidden_layers=cfg.num_layers), tied)
        self.cfg = cfg
        self.gradient_checkpointing = False
        self.model = nn.Module()  # HF names: model.layers.{i}.*, model.norm.weight (the export's own keys)
        self.model.layers = nn.ModuleList(DecoderLayer(self.args) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    # ---- the engine's draft-model interface (inference_eval/engine/draft_model.py PagedDraftModelProposer) -------
    @property
    def device(self) -> torch.device:
        return self.tied.embed.device

    @property
    def num_cache_layers(self) -> int:
        return len(self.model.layers)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """W_lm x, capped where the target's family caps its logits: the target's frozen lm_head (the
        engine calls `lm_head(model.norm(h))`)."""
        return self.tied.cap_logits(linear(x, self.tied.lm_head))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None, start: int = 0,
                logits: Literal["all", "last", "none"] = "all", capture_layers: tuple[int, ...] = (),
                attn_mask: torch.Tensor | None = None) -> DraftLMOutput:
        """The draft over tokens [B, T] at `positions` (default start..start+T-1); `cache`: a contiguous
        KVCache or the engine's PagedCache; `attn_mask` [B, 1, T, T]: packed rows (training)."""
        if capture_layers:
            raise ValueError("a draft LM captures no target layers")
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        x = self.embed(input_ids).to(self.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            kv = cache.layer(i) if cache is not None else None
            if self.gradient_checkpointing and torch.is_grad_enabled() and kv is None:
                x = checkpoint(layer, x, cos, sin, None, start, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, kv, start, attn_mask)
        out = None
        if logits != "none":
            out = self.logits(x[:, -1:] if logits == "last" else x)
        return DraftLMOutput(hidden=x, logits=out, aux=[])

    # ---- the training interface (train/module.py) ----------------------------------------------------
    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """N_d(h): what the frozen lm_head projects."""
        return self.model.norm(hidden)

    def regression_target(self, hidden_next: torch.Tensor) -> None:
        return None  # KL only: the draft's residual stream is not the target's

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, depth: int, aux: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> list[torch.Tensor]:
        """[ĥ^1, …, ĥ^D], each [B, T-1, H]: row i of ĥ^d is the draft's state at position i+d (zero rows
        past the end, which the loss masks). `hidden` (the target's states) is not read: the draft sees
        tokens only. Packed rows attend within their own sample (`segments`, `positions`)."""
        mask = packed_mask(segments)[:, None] if segments is not None else None
        h = self(input_ids, positions, logits="none", attn_mask=mask).hidden  # [B, T, H]
        return [F.pad(h[:, d:], (0, 0, 0, d - 1)) for d in range(1, depth + 1)]

    @torch.no_grad()
    def teacher_forced_states(self, ids: torch.Tensor, depth: int, rows: list[int]) -> dict[int, list[torch.Tensor]]:
        """{d: the draft's state at position i+d for each i in `rows`} over the true tokens `ids` [T]
        (inference_eval/scoring.py): what its draft loop computes at step d once the target accepted up
        to i. Positions past the end give zero states (never scored)."""
        t = ids.shape[0]
        h = self(ids[None].to(self.device), logits="none").hidden[0]  # [T, H]
        zero = h.new_zeros(h.shape[-1])
        return {d: [h[i + d] if i + d < t else zero for i in rows] for d in range(1, depth + 1)}

    @torch.no_grad()
    def probe(self, seed: int = 0, length: int = 8) -> torch.Tensor:
        """Logits on a fixed random token sequence, flattened: a fingerprint of the function (export)."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.args.vocab_size, (1, length), generator=gen).to(self.device)
        return self(tokens).logits.float().reshape(-1)

    # ---- initialisation ------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random layers (heads/base.py init_random), the final norm ← N_f (its multiplier in Llama form:
        Gemma's 1 + w). With `init: target` the layers are then overwritten by `copy_target_layers`
        (train/run.py init_head does it)."""
        gen = torch.Generator().manual_seed(seed)
        init_random(self.model.layers, gen, self.cfg.init_std)
        self.model.norm.weight.copy_(self.tied.norm_scale)

    @torch.no_grad()
    def copy_target_layers(self, state: dict[str, torch.Tensor]) -> None:
        """Load the target's first N decoder layers: `state` holds `model.layers.{i}.*` for i < N, by the
        target's own names (`artifacts.draft_hf.read_target_layers`). Only a Llama-architecture target's layers are the
        draft's: another family's (Gemma 3: four norms of the (1 + w) form, q/k norms) load under the
        same names but compute something else, so they are refused."""
        if self.args.model_type not in LLAMA_FAMILY:
            raise ValueError(f"draft_lm init=target: a {self.args.model_type!r} target's layers are not Llama "
                             "layers (the draft's); use head.init=random for this target")
        own = {k: v for k, v in self.state_dict().items() if k.startswith("model.layers.")}
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"draft_lm init=target: the target lacks {missing[:5]} "
                             f"({len(missing)} tensors of its first {self.cfg.num_layers} layers)")
        for k, p in own.items():
            p.copy_(state[k].to(p.dtype))
