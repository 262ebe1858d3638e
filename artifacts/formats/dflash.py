"""`dflash-vllm` and `dspark-vllm`: the block drafters (heads/dflash.py) as vLLM loads them (0.32 CPU, 0.33 CUDA;
docs/export.md "Block drafters").

DFlash: arch `DFlashDraftModel`, `model_type: qwen3` (vLLM builds a Qwen3 config and its DFlash Qwen3 model from it),
the draft's own sizes (`num_hidden_layers`: its layers), the target's RoPE written out (vLLM's DFlash defaults a
missing theta to 1e6), `target_hidden_size`, `block_size`, and `dflash_config {mask_token_id, target_layer_ids,
use_aux_hidden_state}`. vLLM's `target_layer_ids` name the *output* of target layer i — spechead's ids name the
*input* of layer i (the output of layer i-1), so the export writes `[i - 1 for i in target_layers]` and the reader
adds 1 back (vLLM itself adds 1 to turn them into its aux-state ids). Tensors unprefixed, exactly the head's state
dict: `fc`, `hidden_norm`, `layers.{i}.*` (q/k norms), `norm`; with a reduced vocabulary `lm_head` [V_d, H] and `d2t`
(int64 offsets: target id = draft id + d2t; `t2d` is not written, vLLM skips it). No `embed_tokens` / full-vocabulary
`lm_head`: vLLM shares the target's.

DSpark: arch `Qwen3DSparkModel`, the DFlash keys plus `markov_rank`, `markov_head_type: vanilla`,
`enable_confidence_head`, `confidence_head_with_markov: true`, `sample_from_anchor: true` (every block row drafts),
and the tensors `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V_d, r],
`confidence_head.proj.{weight,bias}`. vLLM's CPU build (0.32) does not run DSpark (its V1 runner refuses it; the V2
runner needs Triton): docs/export.md.

vLLM fills a missing tensor with its initial values without a word: the validator checks the exact key set, and a
wrong layer id or mask id shows only in acceptance (tests/test_vllm_serving.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from artifacts.formats.base import ExportFormat, dtype_name, head_state, loaded, read_json, t2d_of, write_config
from artifacts.formats.checks import check_keys, check_own_tensors, check_positions, llama_layer_shapes
from core.safetensors_io import TensorInfo, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.dflash import DFlashConfig, DFlashHead, DSparkConfig, DSparkHead
from heads.layers import LlamaArgs

DFLASH_ARCH = "DFlashDraftModel"
DSPARK_ARCH = "Qwen3DSparkModel"
# spechead's DSpark tensor names → vLLM's (its Markov head is a module of its own)
DSPARK_NAMES = {"markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight"}


def vllm_layer_ids(target_layers: tuple[int, ...] | list[int]) -> list[int]:
    """spechead's "input of layer i" ids → vLLM's DFlash `target_layer_ids` ("output of layer i")."""
    return [int(i) - 1 for i in target_layers]


def spechead_layer_ids(vllm_ids: list[int]) -> list[int]:
    """vLLM's DFlash `target_layer_ids` → spechead's "input of layer i" ids."""
    return [int(i) + 1 for i in vllm_ids]


def block_config(head: DFlashHead, target_cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    a, c = head.args, head.cfg
    dtype = dtype_name(head)
    rope = target_cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": a.rope_theta,
                                                 **(a.rope_scaling or {})}
    cfg = {
        "architectures": [arch], "model_type": "qwen3",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "num_hidden_layers": c.num_layers, "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps, "vocab_size": a.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": a.hidden_size,
        "max_position_embeddings": max(a.max_position_embeddings, target_cfg.get("max_position_embeddings", 0)),
        "rope_theta": a.rope_theta, "rope_scaling": a.rope_scaling, "rope_parameters": rope,
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype,
        "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": vllm_layer_ids(c.target_layers),
                          "use_aux_hidden_state": True},
    }
    if isinstance(head, DSparkHead):
        cfg |= {"markov_rank": head.cfg.markov_rank, "markov_head_type": "vanilla",
                "enable_confidence_head": head.cfg.confidence, "confidence_head_with_markov": True,
                "sample_from_anchor": True}
    return cfg


def block_shapes(a: LlamaArgs, num_layers: int, num_target_layers: int, draft_vocab: int, markov_rank: int | None,
                 confidence: bool) -> dict[str, tuple[int, ...]]:
    """The export's exact key set and shapes (d2t checked apart)."""
    h = a.hidden_size
    layer = llama_layer_shapes(dataclasses.replace(a, qk_norm=True, attention_bias=False))
    shapes = {"fc.weight": (h, num_target_layers * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    shapes |= {f"layers.{i}.{k}": s for i in range(num_layers) for k, s in layer.items()}
    if draft_vocab < a.vocab_size:
        shapes["lm_head.weight"] = (draft_vocab, h)
    if markov_rank is not None:
        shapes |= {"markov_head.markov_w1.weight": (a.vocab_size, markov_rank),
                   "markov_head.markov_w2.weight": (draft_vocab, markov_rank)}
        if confidence:
            shapes |= {"confidence_head.proj.weight": (1, h + markov_rank), "confidence_head.proj.bias": (1,)}
    return shapes


class BlockFormat(ExportFormat):
    arch: str
    spark: bool

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return cfg.get("architectures") == [self.arch]

    def write(self, head: DFlashHead, out: Path, target_dir: Path) -> None:
        state = head_state(head)
        state.pop("t2d", None)  # vLLM skips it; the reader rebuilds it from d2t
        state = {DSPARK_NAMES.get(k, k): v for k, v in state.items()}
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        write_config(out, block_config(head, read_json(target_dir / "config.json"), self.arch))

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg, infos = read_json(path / "config.json"), scan_tensors(path)
        dc = cfg["dflash_config"]
        common = {"num_layers": cfg["num_hidden_layers"], "block_size": cfg["block_size"],
                  "target_layers": spechead_layer_ids(dc["target_layer_ids"]), "mask_token_id": dc["mask_token_id"],
                  "draft_vocab_size": cfg.get("draft_vocab_size") or args.vocab_size}
        if self.spark:
            head = DSparkHead(args, DSparkConfig(**common, markov_rank=cfg["markov_rank"],
                                                 confidence=bool(cfg.get("enable_confidence_head"))), tied)
        else:
            head = DFlashHead(args, DFlashConfig(**common), tied)
        back = {v: k for k, v in DSPARK_NAMES.items()}
        state = {back.get(k, k): load_tensor(info, k) for k, info in infos.items()}
        if "d2t" in state:
            state["t2d"] = t2d_of(state["d2t"], args.vocab_size)
        return loaded(head, state, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        ids = self._check_config(cfg, tcfg, problems)
        try:
            a = LlamaArgs.from_hf_config({**cfg, "model_type": "qwen3"})
        except (KeyError, ValueError, TypeError) as e:
            problems.append(f"the export's config.json does not size a Qwen3 layer: {e!r}")
            return
        check_positions(cfg, tcfg, problems)
        if ids is not None and isinstance(cfg.get("num_hidden_layers"), int):
            self._check_tensors(cfg, infos, a, ids, problems)

    def _check_config(self, cfg: dict[str, Any], tcfg: dict[str, Any] | None, problems: list[str]) -> list[int] | None:
        """The config's keys against vLLM's reading and the target; the target layer ids, or None if unreadable."""
        if cfg.get("architectures") != [self.arch]:
            problems.append(f"architectures must be [{self.arch!r}], got {cfg.get('architectures')}")
        if cfg.get("model_type") != "qwen3":
            problems.append(f"model_type must be 'qwen3' (vLLM builds the draft's Qwen3 layers from it), got "
                            f"{cfg.get('model_type')!r}")
        if cfg.get("attention_bias"):
            problems.append("attention_bias is set: vLLM's DFlash layers would add q/k/v/o biases the head has not")
        dc = cfg.get("dflash_config") or {}
        vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
        mask = dc.get("mask_token_id")
        if mask is None or mask != cfg.get("mask_token_id", mask):
            problems.append(f"dflash_config.mask_token_id {mask!r} must be written (and equal the top-level "
                            f"mask_token_id {cfg.get('mask_token_id')!r})")
        elif not isinstance(mask, int) or not 0 <= mask < (vocab or 0):
            problems.append(f"mask_token_id {mask!r} is not a token id of the vocabulary (0..{(vocab or 0) - 1})")
        ids = dc.get("target_layer_ids")
        t_layers = (tcfg or {}).get("num_hidden_layers")
        if not ids or not all(isinstance(i, int) for i in ids) or ids != sorted(set(ids)):
            problems.append(f"dflash_config.target_layer_ids {ids!r} must be distinct ascending integers (vLLM "
                            "concatenates the captured states in ascending order)")
            ids = None
        elif ids[0] < 0 or (t_layers is not None and ids[-1] > t_layers - 2):
            problems.append(f"dflash_config.target_layer_ids {ids} name outputs of target layers; spechead's heads "
                            f"read 0..{'L-2' if t_layers is None else t_layers - 2} (inputs of layers 1..L-1: "
                            "vllm id = spechead id - 1)")
        if dc.get("use_aux_hidden_state") is False:
            problems.append("dflash_config.use_aux_hidden_state is false: vLLM then builds no fc")
        if cfg.get("target_hidden_size", hidden) != hidden:
            problems.append(f"target_hidden_size {cfg.get('target_hidden_size')} differs from hidden_size {hidden}")
        if tcfg is not None:
            problems += [f"{key} {cfg.get(key)} differs from the target's {tcfg.get(key)}"
                         for key in ("hidden_size", "vocab_size") if cfg.get(key) != tcfg.get(key)]
        if not isinstance(cfg.get("block_size"), int) or cfg["block_size"] < 2:
            problems.append(f"block_size {cfg.get('block_size')!r} must be an integer ≥ 2")
        if self.spark:
            if cfg.get("sample_from_anchor") is not True:
                problems.append("sample_from_anchor must be true: every block row of spechead's DSpark head drafts")
            if cfg.get("markov_head_type", "vanilla") != "vanilla":
                problems.append(f"markov_head_type {cfg.get('markov_head_type')!r}: spechead's Markov bias is vanilla")
            if cfg.get("enable_confidence_head") and not cfg.get("confidence_head_with_markov"):
                problems.append("confidence_head_with_markov must be true: the head's confidence reads W1[x_{j-1}]")
        return ids

    def _check_tensors(self, cfg: dict[str, Any], infos: dict[str, TensorInfo], a: LlamaArgs, ids: list[int],
                       problems: list[str]) -> None:
        """The exact key set and shapes, d2t, one dtype, finite values, and an fc that reads the target."""
        vd = cfg.get("draft_vocab_size") or a.vocab_size
        rank = cfg.get("markov_rank") if self.spark else None
        expected = block_shapes(a, cfg["num_hidden_layers"], len(ids), vd, rank, bool(cfg.get("enable_confidence_head")))
        check_keys(infos, expected, problems, eagle=True, optional=("d2t",))
        if vd < a.vocab_size and "d2t" not in infos:
            problems.append(f"missing tensor 'd2t': required when draft_vocab_size {vd} < vocab_size {a.vocab_size}")
        if "d2t" in infos:
            d2t = infos["d2t"]
            if d2t.shape != (vd,) or d2t.dtype != "int64":
                problems.append(f"d2t is {d2t.dtype} {list(d2t.shape)}, expected int64 [{vd}] offsets")
            else:
                tgt = load_tensor(d2t, "d2t") + torch.arange(vd)
                if bool((tgt < 0).any() or (tgt >= a.vocab_size).any()) or tgt.unique().numel() != vd:
                    problems.append("d2t must map the draft ids to distinct target ids (offsets, not absolute ids)")
        check_own_tensors(infos, expected, cfg, problems)
        if "fc.weight" in infos and infos["fc.weight"].shape == expected["fc.weight"] and \
                not bool(load_tensor(infos["fc.weight"], "fc.weight").any()):
            problems.append("tensor 'fc.weight' is all zeros: the draft would ignore the target's states (vLLM loads "
                            "it without a word)")


class DFlashVLLM(BlockFormat):
    name = "dflash-vllm"
    head_kind = "dflash"
    vllm_method = "dflash"
    arch = DFLASH_ARCH
    spark = False


class DSparkVLLM(BlockFormat):
    name = "dspark-vllm"
    head_kind = "dspark"
    vllm_method = "dspark"
    arch = DSPARK_ARCH
    spark = True


DFLASH_VLLM = DFlashVLLM()
DSPARK_VLLM = DSparkVLLM()
