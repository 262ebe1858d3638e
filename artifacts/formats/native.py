"""`native`: spechead's own checkpoint of any head (docs/design.md §8; written and read by
artifacts/checkpoint.py) — config.json (head type and hyper-parameters, target shapes and fingerprint,
format version) + model.safetensors with the head's own tensors, the frozen target tensors excluded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from artifacts.checkpoint import FORMAT_VERSION, NATIVE_KIND, load_native, save_native
from artifacts.formats.base import ExportFormat
from artifacts.formats.checks import check_finite, check_keys, check_uniform_dtype
from core.safetensors_io import TensorInfo
from heads.base import DraftHead, TiedTarget
from heads.layers import LlamaArgs
from heads.registry import HEAD_TYPES, build_head
from inference_eval.families import args_from_hf_config


class Native(ExportFormat):
    name = "native"

    @property
    def artifact_kind(self) -> str:
        return NATIVE_KIND

    def holds(self, head: DraftHead) -> bool:
        return True

    def refusal(self, head: DraftHead) -> str | None:
        return None

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        return "spechead_format" in cfg

    def save(self, head: DraftHead, out_dir: Path, target_dir: Path, fingerprint: dict[str, Any] | None,
             source: str | Path | None = None) -> Path:
        return save_native(head, out_dir, fingerprint, marker={"exported_from": str(source)} if source else None)

    def load(self, path: Path, tied: TiedTarget, args: LlamaArgs,
             expected_fingerprint: dict[str, Any] | None = None) -> DraftHead:
        return load_native(path, tied, args, expected_fingerprint)  # the fingerprint is in its config.json

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        return load_native(path, tied, args)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        for key in ("spechead_format", "head", "target_args"):
            if key not in cfg:
                problems.append(f"config.json lacks {key!r}")
        if problems:
            return
        if cfg["spechead_format"] != FORMAT_VERSION:
            problems.append(f"spechead_format {cfg['spechead_format']} is not {FORMAT_VERSION}")
        if cfg["head"].get("type") not in HEAD_TYPES:
            problems.append(f"head type {cfg['head'].get('type')!r} is not one of {sorted(HEAD_TYPES)}")
            return
        args = LlamaArgs(**cfg["target_args"])
        with torch.device("meta"):  # shapes only: build the head without allocating it
            empty = torch.empty(0)
            head = build_head(cfg["head"], args, TiedTarget(empty, empty, empty, args.rms_norm_eps))
        state = head.state_dict()
        expected = {k: tuple(v.shape) for k, v in state.items()}
        check_keys(infos, expected, problems)
        floats = [k for k, v in state.items() if v.is_floating_point()]  # not eagle3's d2t / t2d maps
        for k in set(state) - set(floats):
            want = str(state[k].dtype).removeprefix("torch.")
            if k in infos and infos[k].dtype != want:
                problems.append(f"tensor {k!r} is {infos[k].dtype}, expected {want}")
        check_uniform_dtype(infos, floats, None, problems)
        check_finite(infos, floats, problems)
        if tcfg is not None:
            ta = args_from_hf_config(tcfg).layer_args()  # a head's layer: a Llama layer sized from any family's target
            for field in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
                if getattr(args, field) != getattr(ta, field):
                    problems.append(f"head was built for {field}={getattr(args, field)}, the target has "
                                    f"{getattr(ta, field)}")


NATIVE = Native()
