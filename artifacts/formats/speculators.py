"""`speculators-eagle3`, the peer's format: an EAGLE-3 checkpoint in the vllm-project/speculators format, read
into our Eagle3Head.

The peer trainer (speculators 0.9.0, experiments/peer_shims.py) writes `<save_path>/<epoch>/config.json` +
`model.safetensors` (docs/reference/export_formats.md §5, §9.4):

    config.json   speculators_model_type "eagle3", no top-level model_type; transformer_layer_config (the
                  draft decoder's LlamaConfig: vocab_size = the target's V, num_hidden_layers = draft
                  layers); draft_vocab_size; eagle_aux_hidden_state_layer_ids; norm_before_residual,
                  norm_before_fc, fc_norm, norm_output; embed_requires_grad; target_hidden_size;
                  speculators_config {algorithm, proposal_methods, verifier}
    tensors       fc.weight [H, K·H], layers.0.{input_layernorm, hidden_norm, self_attn.{q,k,v}_proj [.., 2H],
                  self_attn.o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, norm.weight,
                  lm_head.weight [V_d, H], d2t [V_d] (offsets), t2d [V] (bool), input_norm.weight
                  (norm_before_fc), embed_tokens.weight (a frozen copy of the verifier's)

Mapping onto heads/eagle3.py: `layers.0.*` → `midlayer.*`; fc, norm, lm_head, d2t, t2d and input_norm keep
their names; embed_tokens is dropped after checking it is the target's (our head reads the target's frozen
E). The layer ids need no shift: speculators' id i is vLLM's capture point, the input of target layer i
(docs/reference/export_formats.md §1.2), which is ours. speculators' forward is ours: attention over
[input_layernorm(E t); hidden_norm(g)], residual g (or hidden_norm(g) with norm_before_residual), MLP,
and with norm_output the normed state is both what the lm_head reads and what the next step gets.
RoPE positions start one later in speculators' training (position_ids[1:]); RoPE is relative, so that
changes nothing.

Not representable in our head, refused with a ValueError naming the file and field: more than one draft
layer, a qwen3 draft layer, fc_norm, biases, trained embeddings, a draft hidden size other than the
target's, a RoPE or vocabulary other than the target's, aux ids outside 1..L−1 (e.g. the last layer's
output, id L), and sliding-window layers (`layer_types` "sliding_attention", speculators' default unless
`--full-attention-indices 0`) unless `allow_sliding_window=True` — our head attends to the whole context,
identical only while the context is shorter than the window.

vLLM (0.32, `vllm/transformers_utils/configs/speculators/algos.py` `update_eagle3`) serves this directory as
it is: it reads draft_vocab_size, target_hidden_size, norm_before_residual, norm_before_fc, fc_norm,
norm_output and eagle_aux_hidden_state_layer_ids from the speculators config and maps the llama draft to
Eagle3LlamaForCausalLM, so no extra vLLM config has to be written (there is no
`write_vllm_config_for_speculators`). Two caveats for serving: `speculators_config.verifier.name_or_path`
is the path the peer trained against (vLLM takes it as the target when the draft dir is served
directly), and the checkpoint ships `embed_tokens.weight` in bfloat16, which vLLM shares with the target
only when `torch.equal` holds (a bf16 target), else it keeps the rounded copy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from artifacts.checkpoint import save_native
from artifacts.formats.base import ExportFormat
from core.safetensors_io import TensorInfo, open_safetensors
from heads.base import DraftHead, TiedTarget
from heads.eagle3 import Eagle3Config, Eagle3Head
from heads.layers import LlamaArgs, TiedConventions
from inference_eval.model import tied_target

# top-level config keys this reader understands (the speculators fields) or that carry no semantics
KNOWN_KEYS = {
    "architectures", "auto_map", "speculators_model_type", "speculators_version", "speculators_config",
    "transformer_layer_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
    "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad", "target_hidden_size",
    "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "has_no_defaults_at_init",
    "return_dict", "output_hidden_states", "output_attentions", "use_cache", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "pad_token_id",
    "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
}
LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
IGNORED_TENSORS = {"verifier_lm_head.weight", "verifier_norm.weight"}  # excluded on save; harmless if present
SPECULATORS_EAGLE3 = "speculators-eagle3"  # the format's name (artifacts/formats/__init__.py FORMATS)


def _fail(where: Path, field: str, why: str) -> ValueError:
    return ValueError(f"{where}: {field}: {why}")


def _tensor_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise _fail(index, "weight_map", f"unreadable shard index ({e})") from e
        return [path / f for f in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{path}: no model.safetensors (nor model.safetensors.index.json)")


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the checkpoint, and the file each came from."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in _tensor_files(path):
        if not f.exists():
            raise FileNotFoundError(f"{f}: a shard named by the index is missing")
        with open_safetensors(f) as fh:  # a damaged file: refused naming it
            for k in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                if k in tensors:
                    raise _fail(f, k, f"tensor also in {origin[k]}")
                tensors[k] = fh.get_tensor(k)
                origin[k] = f
    return tensors, origin


def _rope_theta(layer: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    rope = dict(layer.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None) or layer.get("rope_theta")
    rtype = rope.get("rope_type", rope.get("type", "default"))
    scaling = rope if rtype != "default" else layer.get("rope_scaling")
    return (float(theta) if theta is not None else None), (scaling or None)


def _check_layer_config(cfg_file: Path, layer: dict[str, Any], args: LlamaArgs,
                        allow_sliding_window: bool) -> LlamaArgs:
    """The draft layer's settings against what our head can hold; returns the args to build it with."""
    where = "transformer_layer_config"
    if layer.get("model_type", "llama") != "llama":
        raise _fail(cfg_file, f"{where}.model_type", f"{layer.get('model_type')!r}: only the llama draft layer maps "
                    "onto our EAGLE-3 midlayer (a qwen3 layer has q/k norms)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise _fail(cfg_file, f"{where}.num_hidden_layers", f"{layer['num_hidden_layers']}: our EAGLE-3 head has one "
                    "draft layer (train the peer with --num-layers 1)")
    for key, want in (("hidden_size", args.hidden_size), ("vocab_size", args.vocab_size)):
        if key not in layer:
            raise _fail(cfg_file, f"{where}.{key}", "missing")
        if int(layer[key]) != want:
            raise _fail(cfg_file, f"{where}.{key}", f"{layer[key]}, but the target's is {want}")
    check_bias_free_swiglu(cfg_file, layer, where, "our EAGLE-3 layer's projections")
    if int(layer.get("pretraining_tp", 1) or 1) != 1:
        raise _fail(cfg_file, f"{where}.pretraining_tp", f"{layer['pretraining_tp']}: only 1 is supported")
    types = layer.get("layer_types") or []
    if (any(t != "full_attention" for t in types) or layer.get("use_sliding_window")) and not allow_sliding_window:
        raise _fail(cfg_file, f"{where}.layer_types", f"{types} (sliding_window {layer.get('sliding_window')}): our "
                    "head attends to the whole context; train the peer with --full-attention-indices 0, or pass "
                    "allow_sliding_window=True (identical while contexts stay under the window)")
    theta, scaling = _rope_theta(layer)
    if theta is not None and not math.isclose(theta, args.rope_theta, rel_tol=1e-6):
        raise _fail(cfg_file, f"{where}.rope_parameters.rope_theta", f"{theta}, but the target's is {args.rope_theta}")
    if bool(scaling) != bool(args.rope_scaling) or (
            scaling and scaling.get("rope_type", scaling.get("type")) != (args.rope_scaling or {}).get(
                "rope_type", (args.rope_scaling or {}).get("type"))):
        raise _fail(cfg_file, f"{where}.rope_parameters", f"RoPE scaling {scaling} differs from the target's "
                    f"{args.rope_scaling}")
    n_heads = int(layer.get("num_attention_heads", args.num_attention_heads))
    head_dim = layer.get("head_dim") or int(layer["hidden_size"]) // n_heads
    return dataclasses.replace(
        args, intermediate_size=int(layer.get("intermediate_size", args.intermediate_size)),
        num_attention_heads=n_heads, num_key_value_heads=int(layer.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim), rms_norm_eps=float(layer.get("rms_norm_eps", args.rms_norm_eps)))


def read_speculators_eagle3(path: str | Path, tied: TiedTarget, args: LlamaArgs, *,
                            allow_sliding_window: bool = False, embed_atol: float | None = None) -> Eagle3Head:
    """Load a speculators-format EAGLE-3 checkpoint directory as our Eagle3Head (frozen target tensors attached).

    `args`: the target's LlamaArgs (`inference_eval.model.tied_target`). The draft layer's own sizes
    (intermediate_size, heads, head_dim, rms_norm_eps) come from the checkpoint; hidden size, vocabulary and
    RoPE must be the target's. `embed_atol`: how far a shipped `embed_tokens.weight` may be from the target's
    E (default: bfloat16 rounding of E's largest entry). Raises ValueError naming the file and field on anything
    it does not understand, and on any shape mismatch or missing tensor."""
    path = Path(path)
    cfg_file, cfg = read_config(path)
    if tied.conventions != TiedConventions():
        raise ValueError(f"{cfg_file}: the target's tied conventions {tied.conventions} are not Llama's; speculators' "
                         "draft embeds and normalises the Llama way, which our head would not reproduce")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise _fail(cfg_file, "transformer_layer_config", "missing or not an object")
    head_args = _check_layer_config(cfg_file, layer, args, allow_sliding_window)
    flags = _norm_flags(cfg_file, cfg, args)
    ids = _aux_layer_ids(cfg_file, cfg, args.num_hidden_layers)
    tensors, origin = read_tensors(path)
    weights = path / "model.safetensors"
    vd = _draft_vocab_size(cfg_file, weights, cfg, tensors, args.vocab_size)
    head = Eagle3Head(head_args, Eagle3Config(aux_layers=tuple(ids), draft_vocab_size=vd, init="random", **flags), tied)
    expected = head.state_dict()
    state = _our_tensors(tensors, origin, expected, tied, embed_atol,
                         f"(hidden {args.hidden_size}, {len(ids)} aux layers, draft vocab {vd})")
    vocab_buffers = {"d2t", "t2d"}
    missing = [k for k in expected if k not in state and k not in vocab_buffers]
    if missing:
        spec = [k.replace("midlayer.", "layers.0.") for k in missing]
        raise _fail(weights, spec[0], f"missing (all missing: {spec})")
    _vocab_mapping(weights, state, vd, args.vocab_size)
    with torch.no_grad():
        for k, v in state.items():
            target = expected[k]
            if k == "t2d":
                v = v.to(torch.bool)
            elif k == "d2t":
                v = v.to(torch.long)
            elif not v.is_floating_point():
                raise _fail(weights, k, f"dtype {v.dtype} is not a float")
            target.copy_(v)  # cast into the head's dtype
    head.load_state_dict(expected, strict=True)
    return head.to(tied.embed.dtype)


def check_bias_free_swiglu(cfg_file: Path, layer: dict[str, Any], where: str, ours: str) -> None:
    """A draft layer config with no biases and a SiLU-gated MLP (`ours`: what the reader's head has), else refused."""
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise _fail(cfg_file, f"{where}.{key}", f"true: {ours} carry no biases")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(cfg_file, f"{where}.hidden_act", f"{act!r}: {ours} use SwiGLU (silu)")


def read_config(path: Path, kind: str = "eagle3", known: set[str] | frozenset[str] | None = None
                ) -> tuple[Path, dict[str, Any]]:
    """(config.json's path, its contents), checked to be a speculators `kind` checkpoint's config whose fields all
    are in `known` (default: the EAGLE-3 reader's)."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json — not a speculators checkpoint")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise _fail(cfg_file, "config.json", f"unreadable JSON ({e})") from e
    if "speculators_config" not in cfg:
        raise _fail(cfg_file, "speculators_config", "missing — not a speculators-format checkpoint")
    if cfg.get("speculators_model_type") != kind:
        raise _fail(cfg_file, "speculators_model_type", f"{cfg.get('speculators_model_type')!r}, expected {kind!r}")
    algo = (cfg["speculators_config"] or {}).get("algorithm", kind)
    if algo != kind:
        raise _fail(cfg_file, "speculators_config.algorithm", f"{algo!r}, expected {kind!r}")
    known = KNOWN_KEYS if known is None else known
    unknown = sorted(k for k in cfg if k not in known and cfg[k] not in (None, False, [], {}))
    if unknown:
        raise _fail(cfg_file, unknown[0], f"not understood by this reader (unknown fields: {unknown})")
    return cfg_file, cfg


def _norm_flags(cfg_file: Path, cfg: dict[str, Any], args: LlamaArgs) -> dict[str, bool]:
    """The EAGLE-3.1 norm flags (Eagle3Config's), after refusing the options our head has no counterpart for."""
    if cfg.get("fc_norm"):
        raise _fail(cfg_file, "fc_norm", "true (per-layer norms before fc) has no counterpart in our head; "
                    "norm_before_fc (one norm over the concatenation) does")
    if cfg.get("embed_requires_grad"):
        raise _fail(cfg_file, "embed_requires_grad", "true: the draft trained its own embeddings; ours reads the "
                    "target's frozen E")
    ths = cfg.get("target_hidden_size")
    if ths is not None and int(ths) != args.hidden_size:
        raise _fail(cfg_file, "target_hidden_size", f"{ths}: a draft narrower than the target is not supported")
    if "norm_before_residual" not in cfg:  # speculators' class defaults to false, vLLM's updater to true
        raise _fail(cfg_file, "norm_before_residual", "missing, and its default differs between speculators (false) "
                    "and vLLM (true): refusing to guess")
    flags = {}
    for key in ("norm_before_residual", "norm_before_fc", "norm_output"):
        v = cfg.get(key, False)
        if not isinstance(v, bool):
            raise _fail(cfg_file, key, f"{v!r} is not a boolean")
        flags[key] = v
    return flags


def _aux_layer_ids(cfg_file: Path, cfg: dict[str, Any], L: int) -> list[int]:
    """The target layers whose inputs the draft reads (speculators' default [2, L/2, L-3] when unset)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # speculators' (and vLLM's) default
        ids = [2, L // 2, L - 3]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise _fail(cfg_file, "eagle_aux_hidden_state_layer_ids", f"{ids!r} is not a list of integers")
    if ids != sorted(set(ids)) or not all(1 <= i < L for i in ids):
        raise _fail(cfg_file, "eagle_aux_hidden_state_layer_ids", f"{ids}: our head reads the inputs of target layers "
                    f"1..{L - 1}, ascending and distinct (id {L}, the last layer's output, and id 0, the embeddings, "
                    "are not supported)")
    return ids


def _draft_vocab_size(cfg_file: Path, weights: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
                      vocab_size: int) -> int:
    """The draft vocabulary's size: lm_head's rows, which config's draft_vocab_size must agree with."""
    vd = cfg.get("draft_vocab_size")
    if "lm_head.weight" not in tensors:
        raise _fail(weights, "lm_head.weight", "missing")
    vd_tensor = int(tensors["lm_head.weight"].shape[0])
    vd = vd_tensor if vd is None else int(vd)
    if vd != vd_tensor:
        raise _fail(cfg_file, "draft_vocab_size", f"{vd}, but lm_head.weight has {vd_tensor} rows")
    if vd > vocab_size:
        raise _fail(cfg_file, "draft_vocab_size", f"{vd} exceeds the target's vocabulary {vocab_size}")
    return vd


def _our_tensors(tensors: dict[str, torch.Tensor], origin: dict[str, Path], expected: dict[str, torch.Tensor],
                 tied: TiedTarget, embed_atol: float | None, shapes: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our Eagle3Head's names (layers.0.* → midlayer.*), each checked for a
    counterpart and its shape; a shipped embedding is checked against the target's E and dropped."""
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in IGNORED_TENSORS:
            continue
        if name == "embed_tokens.weight":
            _check_embed(origin[name], t, tied.embed, embed_atol)
            continue
        ours = name
        if name.startswith("layers."):
            idx, _, rest = name[len("layers."):].partition(".")
            if idx != "0":
                raise _fail(origin[name], name, "a second draft layer; our head has one")
            ours = f"midlayer.{rest}"
        # (midlayer.*: the converter's / EAGLE's own naming, accepted as it is)
        if ours not in expected:
            raise _fail(origin[name], name, "not understood by this reader (no counterpart in our Eagle3Head)")
        if ours in state:
            raise _fail(origin[name], name, "given twice (as layers.0.* and midlayer.*)")
        want = tuple(expected[ours].shape)
        if tuple(t.shape) != want:
            raise _fail(origin[name], name, f"shape {list(t.shape)}, expected {list(want)} for the target {shapes}")
        state[ours] = t
    return state


def _vocab_mapping(weights: Path, state: dict[str, torch.Tensor], vd: int, v: int) -> None:
    """d2t (offsets: target id = draft id + d2t[draft id]) and t2d; required when V_d < V, checked consistent."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is None:
        if vd < v:
            raise _fail(weights, "d2t", f"missing, but the draft vocabulary ({vd}) is smaller than the target's ({v}): "
                        "without it draft ids would be read as target ids 0..V_d-1")
        d2t = torch.zeros(vd, dtype=torch.long)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise _fail(weights, "d2t", f"dtype {d2t.dtype}, expected an integer tensor")
    targets = d2t.long() + torch.arange(vd)
    if int(targets.min()) < 0 or int(targets.max()) >= v or len(set(targets.tolist())) != vd:
        raise _fail(weights, "d2t", "draft ids + offsets must be distinct target ids in 0..V-1")
    derived = torch.zeros(v, dtype=torch.bool)
    derived[targets] = True
    if t2d is None:
        t2d = derived
    elif not torch.equal(t2d.to(torch.bool), derived):
        raise _fail(weights, "t2d", "does not mark the target ids d2t maps to")
    state["d2t"], state["t2d"] = d2t.long(), t2d.to(torch.bool)


def _check_embed(where: Path, embed: torch.Tensor, target: torch.Tensor, atol: float | None) -> None:
    if tuple(embed.shape) != tuple(target.shape):
        raise _fail(where, "embed_tokens.weight", f"shape {list(embed.shape)}, the target's E is {list(target.shape)}")
    ref = target.detach().float()
    if atol is None:  # bf16 keeps 8 mantissa bits: a relative rounding error of at most 2^-8
        atol = float(ref.abs().max()) * 2.0 ** -8 + 1e-12
    diff = float((embed.float() - ref).abs().max())
    if diff > atol:
        raise _fail(where, "embed_tokens.weight", f"differs from the target's embeddings by up to {diff:.3g} "
                    f"(> {atol:.3g}): a draft trained with its own embeddings, or another target")


class SpeculatorsEagle3(ExportFormat):
    """The peer's format: read (and validated by reading) only; spechead writes EAGLE-3 as `eagle3`."""

    name = SPECULATORS_EAGLE3
    vllm_method = "eagle3"  # vLLM serves the directory as it is (see above)

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return "speculators_config" in cfg

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        return read_speculators_eagle3(path, tied, args)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        """What the reader refuses: the config's fields alone, and against the target when it is given (the
        reader raises on the first violation, so at most one is listed)."""
        try:
            read_config(path)
            if target is not None:
                tied, args, _ = tied_target(target)
                read_speculators_eagle3(path, tied, args)
        except (ValueError, OSError) as e:
            problems.append(str(e))


SPECULATORS = SpeculatorsEagle3()


def to_native(path: str | Path, out: str | Path, target_dir: str | Path | None = None,
              fingerprint: dict[str, Any] | None = None, **kwargs: Any) -> Path:
    """Read a speculators checkpoint and save it as a native spechead checkpoint (what `evaluate.heads` loads
    today). `target_dir`: the target's HF directory (default: the checkpoint's speculators_config.verifier
    .name_or_path); `fingerprint`: the target fingerprint to record (e.g. the store's), else none."""
    path = Path(path)
    if target_dir is None:
        cfg = json.loads((path / "config.json").read_text())
        target_dir = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if not target_dir or not (Path(target_dir) / "config.json").exists():
            raise _fail(path / "config.json", "speculators_config.verifier.name_or_path",
                        f"{target_dir!r} is not a local target directory: pass the target's directory")
    tied, args, _ = tied_target(target_dir)
    head = read_speculators_eagle3(path, tied, args, **kwargs)
    return save_native(head, out, fingerprint)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="a speculators EAGLE-3 checkpoint → a native spechead checkpoint")
    p.add_argument("checkpoint", help="speculators checkpoint directory (<save_path>/<epoch>)")
    p.add_argument("out", help="native checkpoint directory to write")
    p.add_argument("--target-dir", default=None, help="the target's HF directory (default: the verifier path)")
    p.add_argument("--store", default=None, help="record this feature store's target fingerprint")
    p.add_argument("--allow-sliding-window", action="store_true")
    a = p.parse_args(argv)
    fp = None
    if a.store:
        fp = json.loads((Path(a.store) / "manifest.json").read_text()).get("target_fingerprint")
    out = to_native(a.checkpoint, a.out, a.target_dir, fp, allow_sliding_window=a.allow_sliding_window)
    print(f"native checkpoint {out}")


if __name__ == "__main__":
    main()
