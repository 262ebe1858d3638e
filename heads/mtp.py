"""The RMSNorm-restored MTP head (the default) — docs/design.md §3.

One module computes, for position i, from the target state H_i and the next token t_{i+1}:

    x   = eh_proj [ enorm(E t_{i+1}) ; hnorm(H_i) ]          (DeepSeek-V3 MTP module shape)
    Ĥ   = DecoderLayer(x)                                      (input_layernorm restored)
    L̂   = W_lm · shared_head.norm(Ĥ)                          (frozen, shared lm_head)

With `aux_layers: [a, b, …]` (off by default) the head also reads the inputs of those target layers, as EAGLE-3
does (Li et al., 2025): they are fused into the state depth 1 reads, each normed on its own, through a projection
that starts at zero (the head starts as the plain one):

    H'_i = H_i + aux_fc [ aux_norm_a(A^a_i) ; aux_norm_b(A^b_i) ; … ]            (then H'_i in place of H_i)

H'_i is H wide, so every module and the deeper steps run as without aux layers; vLLM's EAGLE-3 path computes it
once per target position (`combine_hidden_states`, inference_eval/vllm_mtp.py), as spechead's engine does.

Ĥ stands in for H_{i+1} at the next depth. `num_modules: 1` reuses one module at every depth.
`num_modules: D` keeps D modules, module d at depth d (DeepSeek-V3 style), each with its own KV cache:
module d's cache holds its own pass over the target's states (H_j, t_{j+1}) at committed positions j and
its own keys of the inputs of the earlier draft steps (every module of a deeper step runs on each step's
input: what vLLM's draft loop reads, docs/export.md), and its depth-d query attends those plus its own key.
The training unroll (heads/unroll.py), the engine's draft loop and the vLLM plugin build exactly that
context; drafting deeper than D is refused. Names follow the
DeepSeek MTP export (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`).

The small interface (`embed`, `fuse`, `step`, `logits`) is what both the training unroll and the
engine's draft loop call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from heads.base import DraftHead, TiedTarget, check_aux_ids, init_random
from heads.layers import LLAMA_FAMILY, DecoderLayer, Linear, LlamaArgs, RMSNorm


@dataclass(frozen=True)
class MTPConfig:
    """Head hyper-parameters beyond the target's shapes."""

    num_modules: int = 1
    init: Literal["copy", "random"] = "copy"  # copy: start near "pass the hidden state through"
    init_std: float = 0.02
    # hnorm's starting multiplier: `target` = N_f's (w, Gemma's 1 + w), `ones` = 1. The final norm starts
    # as N_f either way, so with `ones` (and init=copy) step 0 projects ≈ N_f(x̂) = N_f(H_i): the target's own
    # logits; with `target` N_f applies twice (N_f(N_f(H_i))), far off where N_f's multipliers are far from 1
    # (Gemma-3-270M's span 0.19..301: a starting KL of 110 against 6.4). `auto`: ones for a target whose
    # final norm is not Llama's (Gemma's (1 + w)), target for the Llama family.
    # `ones` is the default: with enorm at 1 too it trained +0.02 held-out top-1 at every depth on two seeds
    # at the demo's budget (docs/RESULTS.md §8)
    hnorm_init: Literal["auto", "target", "ones"] = "ones"
    # enorm's start: `ones` = 1 (the default), `target` = the target's layer-0 input norm (it normalises the same
    # embeddings). SmolLM2's layer-0 input norm is ≈ 0 (RMS 0.04), so `target` starts
    # a head that barely sees t_{i+1}: `ones` trained +0.08 τ at 100k tokens and more at the demo's budget
    # (docs/RESULTS.md §8)
    enorm_init: Literal["target", "ones"] = "ones"
    # each module's decoder layer starts as: `random` (init_std; the default) or `target` = a copy of the target's
    # last decoder layer (train/run.py init_head; a Llama-family target)
    layer_init: Literal["random", "target"] = "random"
    # inputs of these target layers fused into H_i (EAGLE-3's "input of layer i" ids, ascending, 1..L-1; the store
    # must hold them: precompute.aux_layers auto captures them); None / []: H_i alone (the default)
    aux_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.aux_layers is not None:
            object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers) or None)
        if self.layer_init not in ("random", "target"):
            raise ValueError(f"mtp layer_init={self.layer_init!r}: expected random or target")
        if self.hnorm_init not in ("auto", "target", "ones"):
            raise ValueError(f"mtp hnorm_init={self.hnorm_init!r}: expected auto, target or ones")
        if self.enorm_init not in ("target", "ones"):
            raise ValueError(f"mtp enorm_init={self.enorm_init!r}: expected target or ones")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers) if self.aux_layers else None
        return {"type": "mtp", **d}


class MTPModule(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        h = args.hidden_size
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(args, input_norm=True)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)


class MTPHead(DraftHead):
    kind = "mtp"

    def __init__(self, args: LlamaArgs, cfg: MTPConfig, tied: TiedTarget) -> None:
        super().__init__(args, tied)
        aux = cfg.aux_layers or ()
        check_aux_ids(aux, args.num_hidden_layers, "mtp aux_layers")
        self.cfg = cfg
        self.layers = nn.ModuleList(MTPModule(args) for _ in range(cfg.num_modules))
        if aux:  # the aux layers' scales differ by orders of magnitude: each gets its own norm
            h = args.hidden_size
            self.aux_norm = nn.ModuleList(RMSNorm(h, args.rms_norm_eps) for _ in aux)
            self.aux_fc = Linear(len(aux) * h, h, bias=False)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layers or ()

    def target_input(self, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        """H, or with aux layers H' = H + aux_fc [aux_norm(A^a) ; …] (in the head's dtype)."""
        if not self.capture_layers:
            return hidden
        h, k = self.args.hidden_size, len(self.capture_layers)
        if aux is None:
            raise ValueError(f"the mtp head reads the inputs of target layers {list(self.capture_layers)} (head.aux_layers), "
                             "and none were given: precompute the store with those aux layers (precompute.aux_layers)")
        if aux.shape[-1] != k * h:
            raise ValueError(f"aux hidden states are {aux.shape[-1]} wide; the mtp head expects "
                             f"{k} layers × {h} = {k * h}")
        parts = aux.to(self.dtype).split(h, dim=-1)
        return hidden.to(self.dtype) + self.aux_fc(torch.cat([n(a) for n, a in zip(self.aux_norm, parts)], dim=-1))

    @property
    def separate_modules(self) -> bool:
        return len(self.layers) > 1

    @property
    def max_depth(self) -> int | None:
        return len(self.layers) if len(self.layers) > 1 else None

    def depth_modules(self) -> list[nn.Module]:
        return list(self.layers) if self.separate_modules else []

    def key_writers(self, depth: int, k: int) -> range:
        return range(depth + 1, min(k, len(self.layers)) + 1) if self.separate_modules else range(0)

    def module(self, depth: int) -> MTPModule:
        return self.layers[self.cache_layer(depth)]

    def cache_layer(self, depth: int) -> int:
        return min(depth, len(self.layers)) - 1

    def decoder(self, depth: int) -> DecoderLayer:
        return self.module(depth).layer

    def fuse(self, hidden: torch.Tensor, embeds: torch.Tensor, depth: int = 1) -> torch.Tensor:
        m = self.module(depth)
        return m.eh_proj(torch.cat([m.enorm(embeds), m.hnorm(hidden)], dim=-1))

    @torch.no_grad()
    def copy_target_layer(self, state: dict[str, torch.Tensor]) -> None:
        """`layer_init: target`: every module's decoder layer becomes the target's layer whose tensors `state` holds
        (artifacts.draft_hf.read_target_layer: names within the layer). Only a Llama-family target's layer is this
        head's layer; another family's loads under the same names and computes something else, so it is refused."""
        if self.args.model_type not in LLAMA_FAMILY:
            raise ValueError(f"mtp layer_init=target: a {self.args.model_type!r} target's layers are not Llama layers "
                             "(the head's); use head.layer_init=random for this target")
        for m in self.layers:
            own = m.layer.state_dict()
            if set(own) != set(state):
                raise ValueError(f"mtp layer_init=target: the target's layer holds {sorted(state)[:6]}, the head's layer "
                                 f"{sorted(own)[:6]}")
            m.layer.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})

    def features(self, hidden: torch.Tensor, depth: int = 1) -> torch.Tensor:
        """N_o(Ĥ): what the frozen lm_head projects (the training loss works on these)."""
        return self.module(depth).shared_head.norm(hidden)

    def regression_target(self, hidden_next: torch.Tensor) -> torch.Tensor:
        """What Ĥ is regressed against: H_{i+1} itself (Ĥ lives in the pre-norm residual space)."""
        return hidden_next

    def _hnorm_from_target(self) -> bool:
        if self.cfg.hnorm_init == "auto":
            return not self.tied.conventions.norm_offset
        return self.cfg.hnorm_init == "target"

    @torch.no_grad()
    def reset_parameters(self, seed: int, first_input_norm: torch.Tensor | None = None) -> None:
        """Random decoder weights (heads/base.py init_random); norms from the target's norms where
        they play the same role (the final norm ← N_f, enorm ← layer 0's input norm, hnorm ← N_f or 1 by
        `hnorm_init`); with
        init=copy, eh_proj starts as [small noise | I] so x ≈ hnorm(H_i) at step 0, and aux_fc at 0."""
        gen = torch.Generator().manual_seed(seed)
        h = self.args.hidden_size
        for m in self.layers:
            init_random(m, gen, self.cfg.init_std)
            m.hnorm.weight.copy_(self.tied.norm_scale if self._hnorm_from_target() else 1.0)
            m.shared_head.norm.weight.copy_(self.tied.norm_scale)
            if first_input_norm is not None and self.cfg.enorm_init == "target":
                m.enorm.weight.copy_(first_input_norm)
            elif self.cfg.enorm_init == "ones":
                m.enorm.weight.fill_(1.0)
            if self.cfg.init == "copy":
                m.eh_proj.weight[:, h:].copy_(torch.eye(h))
        if self.capture_layers:  # drawn after the modules (theirs are the plain head's); 0 with init=copy: H' = H
            init_random(self.aux_fc, gen, self.cfg.init_std)
            for n in self.aux_norm:
                n.weight.fill_(1.0)
            if self.cfg.init == "copy":
                self.aux_fc.weight.zero_()
