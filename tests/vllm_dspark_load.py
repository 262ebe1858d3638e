"""A dspark-vllm export through vLLM's own loader, in vLLM's process (tests/test_vllm_serving.py: vLLM 0.32's CPU
build serves no DSpark draft, so the contract is tested here instead). Runs in vLLM's environment:

    .venv-vllm/bin/python tests/vllm_dspark_load.py <export_dir> <target_dir> <out.json>

- vLLM's VllmConfig of the target (float32, eager, max_model_len 256) with the speculative config
  {"method": "dspark", "model": <export_dir>, "num_speculative_tokens": 3}, built by EngineArgs. Its post-init
  refuses dspark on the V1 model runner (the CPU build's only runner); that single refusal is dropped here, in this
  process, while the config is built (any other unsupported feature still raises) — vLLM itself is not patched;
- vLLM's single-process distributed state (world size 1, gloo) and the config set current, as a CPU worker does;
- vLLM's DefaultModelLoader creates the draft from the export's architecture (Qwen3DSparkModel → vLLM's
  Qwen3DSparkForCausalLM) and feeds it every tensor of model.safetensors through vLLM's own iterator into the
  model's own `load_weights` (name mapping, q/k/v and gate/up stacking, `_build_fused_kv_buffers`); a tensor vLLM
  refuses fails this script with vLLM's error. Every parameter's weight loader is wrapped (here, not in vLLM) to
  record which export tensor reached which parameter (and shard);
- then vLLM's process_weights_after_loading, and vLLM's module methods on fixed inputs: `markov_embed(ids)`,
  `markov_bias(markov_embed)` (its logits processor over markov_w2), `compute_confidence(head_hidden, markov_embed)`
  where the export has a confidence head, `compute_draft_logits(head_hidden)` and `map_draft_to_target` where it has
  its own (reduced) lm_head, and `combine_hidden_states(aux)` (fc). head_hidden is vLLM's final norm of a fixed random
  state (the draft's forward ends in it; the speculator hands its output to these methods).

Writes out.json {"vllm", "model_class", "v1_refusal_dropped", "parameters": {name: shape}, "consumed": {export
tensor: [[parameter, shard], ...]}, "not_consumed": [...], "loaded": [parameters that received a tensor],
"has_confidence", "has_lm_head", "values": [...], "tensors": <file>} and <out stem>.safetensors: "param/<name>" —
each loaded parameter as loaded (before process_weights_after_loading, which may repack CPU GEMM weights), and
"value/<name>" — the inputs (ids, hidden, aux) and vLLM's outputs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

K = 3
REFUSAL = "dspark speculative decoding"  # vLLM's V1-runner refusal (VllmConfig._validate_v1_model_runner)


def build_config(export_dir: str, target_dir: str):
    """The VllmConfig vLLM builds for serving the target with this draft; whether the V1 refusal was dropped."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    original = VllmConfig._get_v1_model_runner_unsupported_features
    seen: list[str] = []

    def tolerated(self) -> list[str]:
        got = original(self)
        seen.extend(got)
        return [f for f in got if f != REFUSAL]

    VllmConfig._get_v1_model_runner_unsupported_features = tolerated  # this process only, while the config is built
    try:
        args = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                          enable_prefix_caching=False,
                          speculative_config={"method": "dspark", "model": export_dir, "num_speculative_tokens": K})
        config = args.create_engine_config()
    finally:
        VllmConfig._get_v1_model_runner_unsupported_features = original
    return config, REFUSAL in seen


def spy_weight_loaders(model, names_by_id: dict[int, tuple[str, object]], consumed: dict[str, list]) -> None:
    """Wrap every parameter's weight loader to record (parameter, shard) per export tensor it is handed."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for pname, param in model.named_parameters():
        inner = getattr(param, "weight_loader", default_weight_loader)

        def spy(p, w, *args, _name=pname, _inner=inner, **kwargs):
            src = names_by_id.get(id(w))
            shard = getattr(w, "shard_id", None) if not args else args[0]
            key = src[0] if src is not None else f"<unknown tensor {list(w.shape)}>"
            consumed.setdefault(key, []).append([_name, shard])
            return _inner(p, w, *args, **kwargs)

        param.weight_loader = spy


def main(export_dir: str, target_dir: str, out_json: str) -> None:
    import torch
    from safetensors.torch import save_file

    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config, refused = build_config(export_dir, target_dir)
    draft_cfg = config.speculative_config.draft_model_config
    out = Path(out_json)
    tensors: dict[str, torch.Tensor] = {}
    with set_current_vllm_config(config), tempfile.TemporaryDirectory() as tmp:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/pg",
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        loader = get_model_loader(config.load_config)
        device = torch.device("cpu")
        with set_default_torch_dtype(draft_cfg.dtype), device:  # as BaseModelLoader.load_model
            model = loader.create_model(vllm_config=config, model_config=draft_cfg)
        # which export tensor reaches which parameter: vLLM's own iterator, traced by tensor identity
        names_by_id: dict[int, tuple[str, object]] = {}
        consumed: dict[str, list] = {}
        get_all = loader.get_all_weights

        def traced(model_config, mod):
            for name, t in get_all(model_config, mod):
                names_by_id[id(t)] = (name, t)  # the tensor kept alive: its id stays unique
                yield name, t

        loader.get_all_weights = traced
        spy_weight_loaders(model, names_by_id, consumed)
        with set_default_torch_dtype(draft_cfg.dtype):
            loader.load_weights(model, draft_cfg)  # → Qwen3DSparkForCausalLM.load_weights; raises on a refused tensor
        loaded = sorted({p for recs in consumed.values() for p, _ in recs})
        params = dict(model.named_parameters())
        shapes = {n: list(p.shape) for n, p in params.items()}
        tensors |= {f"param/{n}": params[n].detach().clone().contiguous() for n in loaded}
        process_weights_after_loading(model, draft_cfg, device)
        model.eval()

        inner = model.model
        has_conf, has_lm_head = inner.confidence_head is not None, "lm_head.weight" in loaded
        gen = torch.Generator().manual_seed(0)
        h = draft_cfg.hf_config.hidden_size
        v = draft_cfg.hf_config.vocab_size
        ids = torch.tensor([0, 1, 2, 17, 100, 1000, 8191, 8192, 30000, v - 1])
        hidden = torch.randn(len(ids), h, generator=gen)
        aux = torch.randn(len(ids), inner.fc.input_size, generator=gen)
        vals = {"ids": ids, "hidden": hidden, "aux": aux}
        with torch.no_grad():
            head_hidden = inner.norm(hidden.clone())  # the draft forward's last step (DFlashQwen3Model.forward)
            vals["head_hidden"] = head_hidden
            vals["markov_embed"] = model.markov_embed(ids)
            vals["markov_bias"] = model.markov_bias(vals["markov_embed"])
            vals["fc"] = model.combine_hidden_states(aux)
            if has_conf:
                vals["confidence"] = model.compute_confidence(head_hidden, vals["markov_embed"])
            if has_lm_head:
                vals["draft_logits"] = model.compute_draft_logits(head_hidden)
                vals["draft_to_target"] = model.map_draft_to_target(
                    torch.arange(model.config.draft_vocab_size))
        tensors |= {f"value/{k}": t.detach().contiguous() for k, t in vals.items()}
        assert inner._num_attn_layers == len(inner.layers)  # _build_fused_kv_buffers ran on CPU (in load_weights)

    save_file(tensors, str(out.with_suffix(".safetensors")))
    exported = sorted(name for name, _ in names_by_id.values())
    report = {"vllm": vllm.__version__, "model_class": type(model).__name__, "v1_refusal_dropped": refused,
              "draft_vocab_size": model.config.draft_vocab_size,
              "parameters": shapes,
              "exported": exported, "consumed": consumed,
              "not_consumed": [n for n in exported if n not in consumed], "loaded": loaded,
              "has_confidence": has_conf, "has_lm_head": has_lm_head, "values": sorted(vals),
              "tensors": str(out.with_suffix(".safetensors"))}
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
