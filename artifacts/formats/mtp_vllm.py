"""`mtp-vllm`: the `mtp` head for spechead's vLLM plugin (inference_eval/vllm_plugin.py, served with
`method="eagle3"`): arch `Eagle3SpecheadMTPForCausalLM`, a Llama config whose `num_hidden_layers` is the
number of MTP modules, the aux ids [head.aux_layers…, L] (L = the target's layer count: vLLM then passes
the target's last pre-norm state H), and the head's tensors under its own names; no embed_tokens / lm_head
(vLLM shares the target's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from artifacts.formats.base import ExportFormat, dtype_name, head_state, loaded, read_json, write_config
from artifacts.formats.checks import check_keys, check_own_tensors, draft_args, llama_layer_shapes
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.layers import LlamaArgs
from heads.mtp import MTPConfig, MTPHead

MTP_VLLM_ARCH = "Eagle3SpecheadMTPForCausalLM"  # = inference_eval/vllm_plugin.py MTP_ARCH (tests/test_export.py)


class MTPVLLM(ExportFormat):
    name = "mtp-vllm"
    head_kind = "mtp"
    vllm_method = "eagle3"

    def serves(self, head: DraftHead) -> bool:
        return not head.args.qk_norm

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return cfg.get("architectures") == [MTP_VLLM_ARCH]

    def write(self, head: MTPHead, out: Path, target_dir: Path) -> None:
        """spechead's vLLM plugin (inference_eval/vllm_plugin.py, served with `method: "eagle3"`): a Llama
        config naming the plugin's architecture, `num_hidden_layers` = the number of MTP modules, the single
        aux id L = the target's layer count (vLLM then passes the target's last pre-norm state H) after the head's
        `aux_layers` if it has any (vLLM passes the states in ascending id order, H last; the plugin's
        `combine_hidden_states` fuses them into H' as the head does), and the head's own tensors under its own names
        (`layers.{d}.enorm.weight`, `layers.{d}.layer.self_attn.q_proj.weight`, `aux_fc.weight`, ...). No
        embed_tokens / lm_head: vLLM shares the target's."""
        n, a = len(head.layers), head.args
        if a.qk_norm:
            raise ValueError("mtp-vllm export: the plugin's decoder layer is Llama's (no q/k norm; a Qwen3 target)")
        tcfg = read_json(target_dir / "config.json")
        ids = [*head.capture_layers, int(tcfg["num_hidden_layers"])]
        state = head_state(head)
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        dtype = dtype_name(head)
        cfg = {
            "architectures": [MTP_VLLM_ARCH], "model_type": "llama",
            "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
            "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
            "head_dim": a.head_dim, "num_hidden_layers": n, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
            "vocab_size": a.vocab_size, "draft_vocab_size": a.vocab_size,
            "max_position_embeddings": max(a.max_position_embeddings, tcfg.get("max_position_embeddings", 0)),
            "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling,
            "attention_bias": a.attention_bias, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": dtype, "dtype": dtype,
            "num_aux_hidden_states": len(ids),
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "spechead_head": {"type": "mtp", "num_modules": n, "aux_layers": list(head.capture_layers) or None},
        }
        if "rope_parameters" in tcfg:
            cfg["rope_parameters"] = tcfg["rope_parameters"]
        write_config(out, cfg)

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg, infos = read_json(path / "config.json"), scan_tensors(path)
        aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"][:-1]  # before L (validated): head.aux_layers
        head = MTPHead(args, MTPConfig(num_modules=cfg["num_hidden_layers"], aux_layers=aux or None), tied)
        return loaded(head, {k: load_tensor(info, k) for k, info in infos.items()}, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        """The plugin's contract: its architecture, a Llama config with `num_hidden_layers` = the modules
        (≥ 1), the aux ids ending in L = the target's layer count (top-level and in eagle_config,
        use_aux_hidden_state true: vLLM then passes the pre-norm H) after the head's own aux layers, if any, in
        ascending order, `draft_vocab_size` = `vocab_size`, no EAGLE-3.1 flags, and exactly the head's tensors
        `layers.{d}.*` (and `aux_norm.{i}` / `aux_fc` with aux layers; no embed_tokens / lm_head: shared)."""
        if cfg.get("architectures") != [MTP_VLLM_ARCH]:
            problems.append(f"architectures must be [{MTP_VLLM_ARCH!r}] (the class spechead's vLLM plugin registers), "
                            f"got {cfg.get('architectures')}")
        if cfg.get("model_type") != "llama":
            problems.append(f"model_type must be 'llama', got {cfg.get('model_type')!r}")
        n = cfg.get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            problems.append(f"num_hidden_layers (the MTP modules) must be an integer ≥ 1, got {n!r}")
            return
        if cfg.get("tie_word_embeddings") is not False:
            problems.append(f"tie_word_embeddings must be false, got {cfg.get('tie_word_embeddings')!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        if cfg.get("qk_norm") or cfg.get("model_type") == "qwen3" or cfg.get("bias"):
            problems.append("the plugin's layer is Llama's: no q/k norms, no `bias` flag")
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if cfg.get(flag) or (cfg.get("eagle_config") or {}).get(flag):
                problems.append(f"{flag} is set: the plugin has no such step")
        if cfg.get("draft_vocab_size") != cfg.get("vocab_size"):
            problems.append(f"draft_vocab_size must equal vocab_size (the head drafts over the target's vocabulary), "
                            f"got {cfg.get('draft_vocab_size')!r}")
        top = cfg.get("eagle_aux_hidden_state_layer_ids")
        econf = cfg.get("eagle_config") or {}
        if econf.get("use_aux_hidden_state") is not True:
            problems.append("eagle_config.use_aux_hidden_state must be true (vLLM then passes the aux state H, "
                            "not N_f(H))")
        num_aux = 0
        if (top != econf.get("eagle_aux_hidden_state_layer_ids") or not isinstance(top, list) or not top
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in top)):
            problems.append(f"eagle_aux_hidden_state_layer_ids must be a list of ids, top-level and in eagle_config "
                            f"alike, got {top!r} / {econf.get('eagle_aux_hidden_state_layer_ids')!r}")
        else:
            num_aux = len(top) - 1
            if top != sorted(set(top)) or top[0] < 1:
                problems.append(f"eagle_aux_hidden_state_layer_ids must ascend from ≥ 1 without repeats "
                                f"(vLLM passes the states in ascending id order), got {top}")
            if tcfg is not None and top[-1] != tcfg.get("num_hidden_layers"):
                problems.append(f"the last aux id must be the target's layer count {tcfg.get('num_hidden_layers')} "
                                f"(its last pre-norm state H, what hnorm reads; the others are the head's aux_layers), got {top}")
            if cfg.get("num_aux_hidden_states", len(top)) != len(top):
                problems.append(f"num_aux_hidden_states must be {len(top)} (the aux ids), got "
                                f"{cfg.get('num_aux_hidden_states')!r}")
        a = draft_args(cfg, tcfg, problems)
        if a is None:
            return
        h = a.hidden_size
        own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
               "shared_head.norm.weight": (h,)}
        expected = {f"layers.{d}.{k}": s for d in range(n) for k, s in own.items()}
        expected |= {f"layers.{d}.layer.{k}": s for d in range(n) for k, s in llama_layer_shapes(a).items()}
        if num_aux:  # the head's fusion of its aux layers into H (heads/mtp.py)
            expected |= {f"aux_norm.{i}.weight": (h,) for i in range(num_aux)} | {"aux_fc.weight": (h, num_aux * h)}
        check_keys(infos, expected, problems)
        check_own_tensors(infos, expected, cfg, problems)


MTP_VLLM = MTPVLLM()
