"""`speculators-dflash` and `speculators-dspark`, the peer's block drafters: DFlash / DSpark checkpoints in the
vllm-project/speculators format (speculators 0.9.0 `models/dflash`, `models/dspark`), read into our DFlashHead /
DSparkHead (heads/dflash.py). Read only; spechead writes its block heads as `dflash-vllm` / `dspark-vllm`.

The peer trainer (`speculators train --speculator-type dflash|dspark`, experiments/peer_shims.py) writes
`<save_path>/<epoch>/config.json` + `model.safetensors`:

    config.json   speculators_model_type "dflash" / "dspark"; transformer_layer_config (the draft decoder's
                  Qwen3Config: num_hidden_layers = draft layers, the verifier's sizes and RoPE, layer_types);
                  aux_hidden_state_layer_ids; mask_token_id; block_size; draft_vocab_size; sample_from_anchor;
                  sliding_window_non_causal; target_hidden_size; speculators_config {algorithm, verifier, ...};
                  DSpark also markov_rank, markov_head_type, enable_confidence_head, confidence_head_with_markov
    tensors       fc.weight [H, K·H], hidden_norm.weight, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
                  self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}, norm.weight; with a
                  reduced vocabulary lm_head.weight [V_d, H], d2t [V_d] (offsets), t2d [V] (bool); DSpark
                  markov_head.markov_w{1,2}.weight, confidence_head.proj.{weight,bias}. embed_tokens, the
                  full-vocabulary lm_head and verifier_{norm,lm_head} are not saved (the verifier's are used).

Our tensor names are speculators' (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`, `lm_head`, `d2t`, `t2d`; DSpark's
`markov_head.` prefix dropped). The layer ids need no shift: speculators' aux id i is the hidden state entering target
layer i (its DFlash converter turns z-lab's / vLLM's `dflash_config.target_layer_ids` j into j + 1, and vLLM's
speculators reader `update_dflash` writes `target_layer_ids = [i - 1 for i in aux ids]`) — our "input of layer i".

The forward is ours (speculators/models/dflash/{core,model_definitions,attention}.py, checked line by line and by
tests/test_peer.py against speculators' own forward): the block [t_a, MASK × (B−1)] embedded with the verifier's frozen
E at positions a..a+B−1; context c = hidden_norm(fc [aux states]) of the same document's positions < a; per layer,
q = q_norm(q_proj(input_layernorm(x))), keys k_norm(k_proj(·)) and values v_proj(·) of [c ; input_layernorm(x)]
(no input norm on the context), RoPE at the context's and the block's positions, attention non-causal within the block
(full-attention layers; its sliding-window layers also cut the context to the window), residual, post-attention norm,
SwiGLU; logits = lm_head(norm(h)). With sample_from_anchor false (DFlash's default) row j ≥ 1 drafts t_{a+j} against
the target at a+j−1 — our DFlashHead; true (DSpark's default) every row j drafts t_{a+j+1} — our DSparkHead, whose
Markov bias W2 · W1[x] reads the token at the row's own position as speculators' does.

Not representable, refused with a ValueError naming the file and field: a draft width, heads, head_dim, MLP width or
RoPE other than the target's (our block layers are the target's shape), biases, an activation other than silu, a
trained embedding, aux ids outside 1..L−1 (speculators allows 0, the embeddings, and L, the last layer's output),
sample_from_anchor other than the head kind's, DSpark's gated / rnn Markov heads, and sliding-window layers
(`layer_types` "sliding_attention", speculators' default unless `--full-attention-indices` names every draft layer)
unless `allow_sliding_window=True` — identical while contexts stay under the window. DSpark's confidence head reads
[norm(h) ; W1[x]] in speculators, vLLM and ours alike, and is loaded with the rest.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from artifacts.formats.base import ExportFormat, loaded
from artifacts.formats.speculators import (
    IGNORED_TENSORS, _check_embed, _draft_vocab_size, _fail, _rope_theta, _vocab_mapping, check_bias_free_swiglu,
    read_config, read_tensors,
)
from core.safetensors_io import TensorInfo
from heads.base import DraftHead, TiedTarget
from heads.dflash import DFlashConfig, DFlashHead, DSparkConfig, DSparkHead
from heads.layers import LlamaArgs, TiedConventions
from inference_eval.model import tied_target

SPECULATORS_DFLASH = "speculators-dflash"
SPECULATORS_DSPARK = "speculators-dspark"
KNOWN_KEYS = {
    "architectures", "auto_map", "speculators_model_type", "speculators_version", "speculators_config",
    "transformer_layer_config", "draft_vocab_size", "aux_hidden_state_layer_ids", "mask_token_id", "block_size",
    "target_hidden_size", "sample_from_anchor", "sliding_window_non_causal", "tie_word_embeddings", "dtype",
    "torch_dtype", "transformers_version", "_name_or_path", "has_no_defaults_at_init", "return_dict",
    "output_hidden_states", "output_attentions", "use_cache", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "pad_token_id", "bos_token_id", "eos_token_id",
    "sep_token_id", "decoder_start_token_id",
}
DSPARK_KEYS = {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}
# speculators' DSpark names → ours
RENAMES = {"markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight"}
CONFIDENCE_TENSORS = {"confidence_head.proj.weight", "confidence_head.proj.bias"}


def _read_config(path: Path, kind: str) -> tuple[Path, dict[str, Any]]:
    """(config.json's path, its contents), checked to be a speculators `kind` config this reader understands."""
    return read_config(path, kind, KNOWN_KEYS | (DSPARK_KEYS if kind == "dspark" else set()))


def _check_layer_config(cfg_file: Path, layer: Any, args: LlamaArgs, allow_sliding_window: bool) -> int:
    """The draft decoder's settings against our block layers (the target's shape, Qwen3 q/k norms); returns the
    number of draft layers."""
    where = "transformer_layer_config"
    if not isinstance(layer, dict):
        raise _fail(cfg_file, where, "missing or not an object")
    # speculators builds Qwen3DFlashDecoderLayer (q/k norms) whatever the config class; only the sizes matter
    head_dim = layer.get("head_dim") or int(layer.get("hidden_size", 0)) // int(layer.get("num_attention_heads", 1))
    sizes = {"hidden_size": args.hidden_size, "vocab_size": args.vocab_size, "intermediate_size": args.intermediate_size,
             "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads}
    for key, want in sizes.items():
        if key not in layer:
            raise _fail(cfg_file, f"{where}.{key}", "missing")
        if int(layer[key]) != want:
            raise _fail(cfg_file, f"{where}.{key}", f"{layer[key]}, but the target's is {want} (our block layers "
                        "have the target's shape)")
    if int(head_dim) != args.head_dim:
        raise _fail(cfg_file, f"{where}.head_dim", f"{head_dim}, but the target's is {args.head_dim}")
    eps = float(layer.get("rms_norm_eps", args.rms_norm_eps))
    if abs(eps - args.rms_norm_eps) > 1e-12:
        raise _fail(cfg_file, f"{where}.rms_norm_eps", f"{eps}, but the target's is {args.rms_norm_eps}")
    check_bias_free_swiglu(cfg_file, layer, where, "our block layers")
    n = int(layer.get("num_hidden_layers", 0))
    if n < 1:
        raise _fail(cfg_file, f"{where}.num_hidden_layers", f"{layer.get('num_hidden_layers')!r}: no draft layer")
    types = layer.get("layer_types") or []
    if (any(t != "full_attention" for t in types) or (layer.get("use_sliding_window") and not types)) \
            and not allow_sliding_window:
        raise _fail(cfg_file, f"{where}.layer_types", f"{types} (sliding_window {layer.get('sliding_window')}): our "
                    "head reads the whole context; train the peer with --full-attention-indices naming every draft "
                    "layer, or pass allow_sliding_window=True (identical while contexts stay under the window)")
    theta, scaling = _rope_theta(layer)
    if theta is not None and abs(theta - args.rope_theta) > 1e-6 * args.rope_theta:
        raise _fail(cfg_file, f"{where}.rope_parameters.rope_theta", f"{theta}, but the target's is {args.rope_theta}")
    if bool(scaling) != bool(args.rope_scaling):
        raise _fail(cfg_file, f"{where}.rope_parameters", f"RoPE scaling {scaling} differs from the target's "
                    f"{args.rope_scaling}")
    return n


def _block_settings(cfg_file: Path, cfg: dict[str, Any], args: LlamaArgs, kind: str) -> dict[str, Any]:
    """DFlashConfig's fields from the speculators config (all but num_layers and draft_vocab_size)."""
    L, V = args.num_hidden_layers, args.vocab_size
    ids = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise _fail(cfg_file, "aux_hidden_state_layer_ids", f"{ids!r} is not a non-empty list of integers")
    if ids != sorted(set(ids)) or not all(1 <= i < L for i in ids):
        raise _fail(cfg_file, "aux_hidden_state_layer_ids", f"{ids}: our head reads the inputs of target layers "
                    f"1..{L - 1}, ascending and distinct (id 0, the embeddings, and id {L}, the last layer's output, "
                    "are not supported)")
    mask = cfg.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < V:
        raise _fail(cfg_file, "mask_token_id", f"{mask!r} is not a token id of the target (0..{V - 1})")
    block = cfg.get("block_size")
    if not isinstance(block, int) or block < 2:
        raise _fail(cfg_file, "block_size", f"{block!r}: must be an integer ≥ 2")
    want_anchor = kind == "dspark"
    if bool(cfg.get("sample_from_anchor", want_anchor)) != want_anchor:
        raise _fail(cfg_file, "sample_from_anchor", f"{cfg.get('sample_from_anchor')}: our {kind} head "
                    f"{'drafts from every block row' if want_anchor else 'drafts from rows 1..B-1 (row 0 holds the anchor)'}")
    ths = cfg.get("target_hidden_size")
    if ths is not None and int(ths) != args.hidden_size:
        raise _fail(cfg_file, "target_hidden_size", f"{ths}: a draft narrower than the target is not supported")
    if cfg.get("tie_word_embeddings"):
        raise _fail(cfg_file, "tie_word_embeddings", "true: not a speculators DFlash draft setting")
    out = {"block_size": block, "target_layers": tuple(ids), "mask_token_id": mask}
    if kind == "dspark":
        rank = cfg.get("markov_rank", 256)
        if not isinstance(rank, int) or rank < 1:
            raise _fail(cfg_file, "markov_rank", f"{rank!r}: our DSpark head has its Markov bias (rank ≥ 1); a head "
                        "without one is a DFlash head")
        if cfg.get("markov_head_type", "vanilla") != "vanilla":
            raise _fail(cfg_file, "markov_head_type", f"{cfg.get('markov_head_type')!r}: our Markov bias is vanilla")
        out["markov_rank"] = rank
    return out


def read_speculators_block(path: str | Path, tied: TiedTarget, args: LlamaArgs, *, kind: str | None = None,
                           allow_sliding_window: bool = False, embed_atol: float | None = None) -> DFlashHead:
    """Load a speculators-format DFlash / DSpark checkpoint directory as our DFlashHead / DSparkHead (frozen target
    tensors attached). `kind`: "dflash" or "dspark" (default: the config's speculators_model_type). Raises ValueError
    naming the file and field on anything it does not understand, and on any shape mismatch or missing tensor."""
    path = Path(path)
    if kind is None:
        cfg_file = path / "config.json"
        kind = json.loads(cfg_file.read_text()).get("speculators_model_type") if cfg_file.exists() else "dflash"
    if kind not in ("dflash", "dspark"):
        raise _fail(path / "config.json", "speculators_model_type", f"{kind!r}: this reader reads dflash and dspark")
    cfg_file, cfg = _read_config(path, kind)
    if tied.conventions != TiedConventions():
        raise ValueError(f"{cfg_file}: the target's tied conventions {tied.conventions} are not Llama's; speculators' "
                         "draft embeds and normalises the Llama way, which our head would not reproduce")
    num_layers = _check_layer_config(cfg_file, cfg.get("transformer_layer_config"), args, allow_sliding_window)
    settings = _block_settings(cfg_file, cfg, args, kind)
    tensors, origin = read_tensors(path)
    weights = path / "model.safetensors"
    if "lm_head.weight" in tensors:
        vd = _draft_vocab_size(cfg_file, weights, cfg, tensors, args.vocab_size)
    else:  # a full-vocabulary draft: speculators saves no lm_head (the verifier's is used)
        vd = int(cfg.get("draft_vocab_size") or args.vocab_size)
        if vd != args.vocab_size:
            raise _fail(weights, "lm_head.weight", f"missing, but draft_vocab_size {vd} < the target's {args.vocab_size}")
    confidence = kind == "dspark" and bool(cfg.get("enable_confidence_head", True))
    if kind == "dspark":
        if confidence and not cfg.get("confidence_head_with_markov", True):
            raise _fail(cfg_file, "confidence_head_with_markov", "false: our confidence head reads [h; W1[x]]")
        head = DSparkHead(args, DSparkConfig(num_layers=num_layers, draft_vocab_size=vd, confidence=confidence,
                                             **settings), tied)
    else:
        head = DFlashHead(args, DFlashConfig(num_layers=num_layers, draft_vocab_size=vd, **settings), tied)
    expected = head.state_dict()
    state: dict[str, torch.Tensor] = {}
    dropped = []
    for name, t in tensors.items():
        if name in IGNORED_TENSORS:
            continue
        if name == "embed_tokens.weight":
            _check_embed(origin[name], t, tied.embed, embed_atol)
            continue
        if name in CONFIDENCE_TENSORS and kind == "dspark" and not confidence:
            dropped.append(name)
            continue
        ours = RENAMES.get(name, name) if kind == "dspark" else name
        if ours not in expected:
            raise _fail(origin[name], name, f"not understood by this reader (no counterpart in our {kind} head with "
                        f"{num_layers} layers and draft vocabulary {vd})")
        if tuple(t.shape) != tuple(expected[ours].shape):
            raise _fail(origin[name], name, f"shape {list(t.shape)}, expected {list(expected[ours].shape)} (hidden "
                        f"{args.hidden_size}, {len(settings['target_layers'])} target layers, draft vocab {vd})")
        state[ours] = t
    if dropped:
        warnings.warn(f"{weights}: the DSpark confidence head ({', '.join(sorted(dropped))}) is not loaded: the "
                      "config disables it (enable_confidence_head: false)", stacklevel=2)
    if vd < args.vocab_size:
        _vocab_mapping(weights, state, vd, args.vocab_size)
    missing = [k for k in expected if k not in state]
    if missing:
        back = {v: k for k, v in RENAMES.items()}
        spec = [back.get(k, k) for k in missing]
        raise _fail(weights, spec[0], f"missing (all missing: {spec})")
    for k, v in state.items():
        if k in ("d2t", "t2d"):
            continue
        if not v.is_floating_point():
            raise _fail(weights, k, f"dtype {v.dtype} is not a float")
        state[k] = v.to(expected[k].dtype)
    return loaded(head, state, tied)


class SpeculatorsBlock(ExportFormat):
    """The peer's block drafters: read (and validated by reading) only."""

    kind: str

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return "speculators_config" in cfg and cfg.get("speculators_model_type") == self.kind

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        return read_speculators_block(path, tied, args, kind=self.kind)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        """What the reader refuses: the config alone, and against the target when it is given (the reader raises
        on the first violation, so at most one is listed)."""
        try:
            _read_config(path, self.kind)
            if target is not None:
                tied, args, _ = tied_target(target)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    read_speculators_block(path, tied, args, kind=self.kind)
        except (ValueError, OSError) as e:
            problems.append(str(e))


class SpeculatorsDFlash(SpeculatorsBlock):
    name = SPECULATORS_DFLASH
    kind = "dflash"
    vllm_method = "dflash"  # vLLM's speculators reader (update_dflash) serves the directory as it is


class SpeculatorsDSpark(SpeculatorsBlock):
    name = SPECULATORS_DSPARK
    kind = "dspark"
    vllm_method = "dspark"


SPECULATORS_DFLASH_FORMAT = SpeculatorsDFlash()
SPECULATORS_DSPARK_FORMAT = SpeculatorsDSpark()
