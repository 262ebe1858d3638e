"""The model class of spechead's vLLM plugin (inference_eval/vllm_plugin.py registers it by name):
`SpecheadMTPForCausalLM`, the default `mtp` head (docs/design.md §3) as an EAGLE-3 draft for vLLM's
`eagle3` speculative method. Imports vLLM at module top: only vLLM's model registry imports this
module, inside vLLM's own environment (`make vllm-env`).

What vLLM 0.32 passes (vllm/v1/spec_decode/llm_base_proposer.py `propose`, read in the installed
source) and how the head's computation is reproduced exactly:
- eagle3: the target runs with aux-state capture at the draft config's
  `eagle_aux_hidden_state_layer_ids`; an id i is recorded after i decoder layers as
  `hidden_states + residual` (models/llama.py, interfaces.py `_maybe_add_hidden_state`), and the states
  are concatenated in ascending id order. The export asks for the id L = num_hidden_layers, i.e. the
  target's last **pre-norm** state H — what the head's `hnorm` reads — after the head's `aux_layers`, if
  any. `combine_hidden_states` (applied once, before the first draft step, by the proposer, which requires
  an `Eagle3LlamaForCausalLM` instance and an output `hidden_size` wide) is the identity for a head without
  aux layers, and with them H' = H + aux_fc [aux_norm_i(A_i) …], as the head's `target_input` computes.
- First draft pass: every new target position j gets (t_{j+1}, H_j) at RoPE position j (input ids
  shifted by one, the bonus token at the last accepted row): the same rows as spechead's engine's
  refresh. Every module runs over them (module d's KV cache holds its own pass over the target's
  states, as in spechead's engine); module 1's output feeds the first draft token.
- Draft step d ≥ 2: vLLM feeds back the second value the draft's forward returned at the sampled row —
  here Ĥ, the head's pre-final-norm output (EAGLE-3's `aux_output` = `hidden_prenorm` is the same
  convention) — with the previous draft token, at the next position (KV slot = position). spechead's
  engine feeds the same Ĥ. The logits are W_lm · shared_head.norm(Ĥ) with the target's lm_head and
  embedding (shared by vLLM's proposer: the export ships neither).
- `num_modules: D` > 1: vLLM calls the draft's forward exactly `num_speculative_tokens` times per
  proposal (the first pass, then k − 1 steps; `dummy_run` does the same), so the call index modulo k
  gives the depth: module d answers depth d (a Python counter: D > 1 needs `enforce_eager`). At depth
  d vLLM's query at KV slot m+d−2 attends module d's slots m..m+d−3 of the earlier draft steps: so at
  draft step j every module that answers a deeper step of the proposal (j < d ≤ k) runs on step j's
  input too and writes its slot m+j−2, as spechead's engine and training unroll do (heads/unroll.py).
  k must be ≤ D (spechead's engine refuses deeper drafts too).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama_eagle import LlamaDecoderLayer
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import get_draft_quant_config, maybe_prefix

from inference_eval.vllm_plugin import MTP_ARCH

_STACKED = {  # checkpoint name part -> (vLLM parameter part, shard id)
    ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class MTPModule(nn.Module):
    """enorm, hnorm, eh_proj, one Llama decoder layer (input_layernorm kept), shared_head.norm."""

    def __init__(self, vllm_config: VllmConfig, config, layer_prefix: str) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps=eps)
        self.hnorm = RMSNorm(h, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, params_dtype=vllm_config.model_config.dtype,
                                        quant_config=get_draft_quant_config(vllm_config),
                                        prefix=f"{layer_prefix}.eh_proj", return_bias=False)
        # the attention layer's name carries one integer (vLLM's KV-cache binding): N + d, after the target's
        self.layer = LlamaDecoderLayer(vllm_config, False, prefix=layer_prefix, config=config)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps=eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.layer(positions, x, None)
        h_hat = x + residual  # Ĥ: the module's pre-final-norm output
        return self.shared_head.norm(h_hat), h_hat

class SpecheadMTPModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0) -> None:
        super().__init__()
        spec = vllm_config.speculative_config
        self.config = config = spec.draft_model_config.hf_config
        self.num_modules = int(config.num_hidden_layers)
        self.k = int(spec.num_speculative_tokens)
        if self.num_modules > 1 and self.k > self.num_modules:
            raise ValueError(f"{MTP_ARCH}: num_speculative_tokens={self.k}, but the head has {self.num_modules} "
                             "separate MTP modules (one per depth): use num_speculative_tokens <= num_modules")
        if self.num_modules > 1 and not vllm_config.model_config.enforce_eager:
            raise ValueError(f"{MTP_ARCH}: a head with {self.num_modules} separate modules picks the module from a "
                             "Python call counter, which CUDA graphs / torch.compile would freeze: serve it with "
                             "enforce_eager=True (--enforce-eager)")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            MTPModule(vllm_config, config, maybe_prefix(prefix, f"layers.{start_layer_id + d}"))
            for d in range(self.num_modules))
        self.num_aux = len(config.eagle_aux_hidden_state_layer_ids) - 1  # the head's aux layers (before H)
        if self.num_aux:  # H' = H + aux_fc [aux_norm_i(A_i) …] (heads/mtp.py target_input)
            h = config.hidden_size
            self.aux_norm = nn.ModuleList(RMSNorm(h, eps=config.rms_norm_eps) for _ in range(self.num_aux))
            self.aux_fc = ReplicatedLinear(self.num_aux * h, h, bias=False, params_dtype=vllm_config.model_config.dtype,
                                           quant_config=get_draft_quant_config(vllm_config),
                                           prefix=maybe_prefix(prefix, "aux_fc"), return_bias=False)
        self._calls = 0

    def combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's aux states, ascending by id ([A^a, …, H]: H is id L, the last) → the state module 1 reads."""
        if not self.num_aux:
            return hidden_states  # one aux state, H: hnorm reads it as is
        *aux, h = hidden_states.chunk(self.num_aux + 1, dim=-1)
        return h + self.aux_fc(torch.cat([norm(a) for norm, a in zip(self.aux_norm, aux)], dim=-1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, hidden_states, input_embeds=None):
        if input_embeds is None:
            input_embeds = self.embed_input_ids(input_ids)
        if self.num_modules == 1:
            return self.layers[0](positions, input_embeds, hidden_states)
        step = self._calls % self.k  # 0: the first pass over the target's states; s: depth s + 1
        self._calls += 1
        if step > 0:
            # the modules of the deeper steps of this proposal write their KV of this step's input (their
            # queries attend it: spechead's engine and training unroll do the same); only module step + 1 answers
            for module in self.layers[step + 1: self.k]:
                module(positions, input_embeds, hidden_states)
            return self.layers[step](positions, input_embeds, hidden_states)
        out = self.layers[0](positions, input_embeds, hidden_states)
        for module in self.layers[1:]:  # fill each module's KV cache with its pass over the target's states
            module(positions, input_embeds, hidden_states)
        return out

class SpecheadMTPForCausalLM(Eagle3LlamaForCausalLM):
    """spechead's MTP head as an EAGLE-3 draft: no fc (the aux state is H itself), the target's
    embedding and lm_head shared, Ĥ fed back between steps."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)
        spec = vllm_config.speculative_config
        self.config = spec.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        ids = list(getattr(self.config, "eagle_aux_hidden_state_layer_ids", None) or [])
        if not ids or ids[-1] != target_layers or ids != sorted(set(ids)) or ids[0] < 1:
            raise ValueError(f"{MTP_ARCH}: eagle_aux_hidden_state_layer_ids must end in {target_layers} (the target's "
                             f"last pre-norm state H), after the head's aux layers in ascending order, got {ids}")
        self.config.target_layer_count = target_layers
        self.model = SpecheadMTPModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                      start_layer_id=target_layers)
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.config.vocab_size,
                                                scale=getattr(self.config, "logit_scale", 1.0))
        self.draft_id_to_target_id = None
        self.use_parallel_drafting = spec.parallel_drafting
        if self.use_parallel_drafting:
            raise ValueError(f"{MTP_ARCH}: parallel drafting is not supported")

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.combine(hidden_states)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: every checkpoint name must map to a parameter and every parameter (but the
        shared embedding / lm_head) must be loaded, or loading fails."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            if name.startswith(("lm_head.", "embed_tokens.")):
                raise ValueError(f"{MTP_ARCH}: unexpected tensor {name!r}: the head shares the target's "
                                 "embedding and lm_head; the export must not ship them")
            target = "model." + name
            for part, (new, shard) in _STACKED.items():
                if part in target:
                    pname = target.replace(part, new)
                    if pname not in params:
                        raise ValueError(f"{MTP_ARCH}: unexpected tensor {name!r}")
                    params[pname].weight_loader(params[pname], w, shard)
                    loaded.add(f"{pname}:{shard}")
                    break
            else:
                if target not in params:
                    raise ValueError(f"{MTP_ARCH}: unexpected tensor {name!r}")
                p = params[target]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(target)
        expected = set()
        for pname in params:
            if pname.startswith(("lm_head.", "model.embed_tokens.")):
                continue
            if pname.endswith(".qkv_proj.weight"):
                expected |= {f"{pname}:q", f"{pname}:k", f"{pname}:v"}
            elif pname.endswith(".gate_up_proj.weight"):
                expected |= {f"{pname}:0", f"{pname}:1"}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"{MTP_ARCH}: the checkpoint lacks {missing}")
        return {n.split(":")[0] for n in loaded}
