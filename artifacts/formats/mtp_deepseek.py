"""DeepSeek-style MTP layouts of the `mtp` head (docs/reference/export_formats.md §4.3, §8, §9.5): the MTP
module's own names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`) and a Llama decoder layer under
`model.layers.{i}.*`.

- `mtp-stitched`   a copy of the target plus `model.layers.{N+k}.*` in an extra shard, with the frozen
                   embed_tokens / shared_head.head copied bit for bit, and the target's config with
                   `num_nextn_predict_layers`;
- `mtp-standalone` SGLang's NextN layout (its export_deepseek_nextn.py applied to our head): `model.layers.0.*`,
                   `num_hidden_layers: 1`, a `...NextN` architecture, no frozen copies.

No engine serves either for a target of the families spechead implements (Llama, Mistral, Qwen2/3): vLLM's
`mtp` method and SGLang's NEXTN need a DeepSeek/MiMo-style target class, and SGLang has no Llama NextN layer
(docs/export.md). They are written on request (`export.formats`) only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from artifacts.checkpoint import copy_target_files
from artifacts.formats.base import ExportFormat, loaded, read_json, target_embed_and_head, write_config
from artifacts.formats.checks import (check_finite, check_keys, check_positions, check_same_as_target,
                                      check_uniform_dtype, llama_args, llama_layer_shapes)
from core.safetensors_io import INDEX_FILE, TensorInfo, load_safetensors_dir, load_tensor, scan_tensors
from heads.base import DraftHead, TiedTarget
from heads.layers import LlamaArgs
from heads.mtp import MTPConfig, MTPHead

MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # frozen target copies (§8)


def mtp_to_deepseek(name: str, base: int) -> str:
    """`layers.k.<own>` / `layers.k.layer.<llama>` → `model.layers.{base+k}.<own or llama name>` (§8)."""
    k, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    return f"model.layers.{base + int(k)}.{rest.removeprefix('layer.')}"


def deepseek_to_mtp(name: str, base: int, n: int) -> str | None:
    """Inverse of `mtp_to_deepseek` for the MTP layers; None for other tensors and the frozen copies."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None or not base <= int(m.group(1)) < base + n:
        return None
    k, rest = int(m.group(1)) - base, m.group(2)
    if rest in MTP_COPIES:
        return None
    own = rest in MTP_OWN
    return f"layers.{k}.{rest if own else 'layer.' + rest}"


def mtp_layer_shapes(a: LlamaArgs, layer_id: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3 MTP module keys (§8) with a Llama decoder layer, without the frozen copies."""
    h = a.hidden_size
    own = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,)}
    return {f"model.layers.{layer_id}.{k}": s for k, s in (own | llama_layer_shapes(a)).items()}


class DeepSeekMTP(ExportFormat):
    head_kind = "mtp"

    def __init__(self, name: str) -> None:
        self.name = name
        self.stitched = name == "mtp-stitched"

    def serves(self, head: DraftHead) -> bool:
        return False

    def refusal(self, head: DraftHead) -> str | None:
        if (why := super().refusal(head)) is not None:
            return why
        if head.capture_layers:
            return (f"format {self.name!r} cannot hold this mtp head: it reads target layers "
                    f"{list(head.capture_layers)} besides H (head.aux_layers), which the DeepSeek MTP layout has no "
                    "place for; export mtp-vllm (spechead's vLLM plugin) or native")
        return None

    def detect(self, path: Path, cfg: dict[str, Any]) -> bool:
        if not cfg.get("num_nextn_predict_layers"):
            return False
        return self.stitched != any(a.endswith("NextN") for a in cfg.get("architectures") or [])

    def write(self, head: MTPHead, out: Path, target_dir: Path) -> None:
        if self.stitched:
            write_mtp_stitched(head, out, target_dir)
        else:
            write_mtp_standalone(head, out, target_dir)

    def read(self, path: Path, tied: TiedTarget, args: LlamaArgs) -> DraftHead:
        cfg, infos = read_json(path / "config.json"), scan_tensors(path)
        base = cfg["num_hidden_layers"] if self.stitched else 0
        n = cfg["num_nextn_predict_layers"]
        head = MTPHead(args, MTPConfig(num_modules=n), tied)
        state = {}
        for k, info in infos.items():
            name = deepseek_to_mtp(k, base, n)
            if name is not None:
                state[name] = load_tensor(info, k)
        return loaded(head, state, tied)

    def validate(self, path: Path, cfg: dict[str, Any], infos: dict[str, TensorInfo], target: Path | None,
                 tcfg: dict[str, Any] | None, problems: list[str]) -> None:
        stitched = self.stitched
        n = cfg.get("num_nextn_predict_layers")
        if not isinstance(n, int) or n < 1:
            problems.append(f"num_nextn_predict_layers must be a positive integer, got {n!r}")
            return
        if not stitched:
            if cfg.get("num_hidden_layers") != 1:
                problems.append(f"num_hidden_layers must be 1 in a standalone NextN dir, "
                                f"got {cfg.get('num_hidden_layers')}")
            if n != 1:
                problems.append(f"num_nextn_predict_layers must be 1 in a standalone NextN dir (SGLang requires it), "
                                f"got {n}")
            if not all(str(x).endswith("NextN") for x in cfg.get("architectures") or [None]):
                problems.append(f"architectures must name a NextN class, got {cfg.get('architectures')}")
        a = llama_args(cfg, problems, "the export's")
        if a is None:
            return
        if tcfg is not None:
            changed = {"num_nextn_predict_layers"} | (set() if stitched else {"num_hidden_layers", "architectures"})
            for key in sorted((set(cfg) | set(tcfg)) - changed - {"max_position_embeddings"}):
                if cfg.get(key) != tcfg.get(key):
                    problems.append(f"config {key!r} is {cfg.get(key)!r}, the target's is {tcfg.get(key)!r} "
                                    "(an MTP dir keeps the target's config)")
        check_positions(cfg, tcfg, problems)
        base = cfg["num_hidden_layers"] if stitched else 0
        expected: dict[str, tuple[int, ...]] = {}
        copies = {}
        for k in range(n):
            expected |= mtp_layer_shapes(a, base + k)
            copies |= {f"model.layers.{base + k}.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                       f"model.layers.{base + k}.shared_head.head.weight": (a.vocab_size, a.hidden_size)}
        own = list(expected)
        if stitched:
            expected |= copies  # vLLM computes logits with shared_head.head: required (§3.3)
            if target is not None:
                tinfos = scan_tensors(target)
                for key in sorted(set(tinfos) - set(infos)):
                    problems.append(f"missing target tensor {key!r}")
                for key in sorted(set(tinfos) & set(infos)):
                    if (tinfos[key].shape, tinfos[key].dtype) != (infos[key].shape, infos[key].dtype):
                        problems.append(f"target tensor {key!r} changed: {infos[key].dtype} {list(infos[key].shape)} "
                                        f"vs the target's {tinfos[key].dtype} {list(tinfos[key].shape)}")
                expected |= {k: v.shape for k, v in tinfos.items()}
            else:  # without the target, accept the main model's tensors of the dir itself
                mtp_prefixes = tuple(f"model.layers.{base + k}." for k in range(n))
                expected |= {k: v.shape for k, v in infos.items() if not k.startswith(mtp_prefixes)}
        check_keys(infos, expected, problems, optional=() if stitched else tuple(copies))
        present_copies = [k for k in copies if k in infos]
        if present_copies:
            if target is not None:
                embed, lm_head = target_embed_and_head(target)
            elif "model.embed_tokens.weight" in infos:
                embed = load_tensor(infos["model.embed_tokens.weight"], "model.embed_tokens.weight")
                tied = cfg.get("tie_word_embeddings") or "lm_head.weight" not in infos
                lm_key = "model.embed_tokens.weight" if tied else "lm_head.weight"
                lm_head = load_tensor(infos[lm_key], lm_key)
            else:
                embed = lm_head = None
                problems.append(f"{present_copies} shipped without the target to compare with: pass --target (§1.4)")
            for key in present_copies:
                if embed is not None and infos[key].shape == copies[key]:
                    check_same_as_target(key, infos[key], embed if key.endswith("embed_tokens.weight") else lm_head,
                                         problems)
        check_uniform_dtype(infos, own, None, problems)
        check_finite(infos, own, problems)


def write_mtp_stitched(head: MTPHead, out: Path, target_dir: Path) -> None:
    """§9.5: a copy of the target checkpoint plus `model.layers.{N+k}.*` in an extra shard
    (`model-mtp.safetensors`), with embed_tokens and shared_head.head copied bit for bit from the target,
    an index over all shards, and the target config with `num_nextn_predict_layers`."""
    tcfg = read_json(target_dir / "config.json")
    n_layers, n = tcfg["num_hidden_layers"], len(head.layers)
    copy_target_files(target_dir, out, skip_weights=False)
    tied = tcfg.get("tie_word_embeddings", False)
    frozen = load_safetensors_dir(target_dir, {"model.embed_tokens.weight", "lm_head.weight"})
    embed = frozen["model.embed_tokens.weight"]
    lm_head = embed if tied or "lm_head.weight" not in frozen else frozen["lm_head.weight"]
    state = {mtp_to_deepseek(k, n_layers): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    for k in range(n):
        state[f"model.layers.{n_layers + k}.embed_tokens.weight"] = embed.clone()
        state[f"model.layers.{n_layers + k}.shared_head.head.weight"] = lm_head.clone()
    save_file(state, out / "model-mtp.safetensors", metadata={"format": "pt"})
    weight_map = {name: info.file.name for name, info in scan_tensors(out).items()}
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_config(out, {**tcfg, "num_nextn_predict_layers": n})


def write_mtp_standalone(head: MTPHead, out: Path, target_dir: Path) -> None:
    """§4.3 (SGLang's export_deepseek_nextn.py applied to our head): target config with
    `num_hidden_layers: 1` and a `...NextN` architecture, keys `model.layers.0.*`, no frozen copies.
    No engine implements a Llama NextN class: see docs/export.md."""
    if len(head.layers) != 1:
        raise ValueError(f"mtp-standalone holds one NextN layer (SGLang requires num_nextn_predict_layers == 1); "
                         f"this head has {len(head.layers)} modules: export mtp-stitched instead")
    tcfg = read_json(target_dir / "config.json")
    copy_target_files(target_dir, out, skip_weights=True)
    state = {mtp_to_deepseek(k, 0): v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    archs = [f"{a}NextN" for a in tcfg.get("architectures") or ["LlamaForCausalLM"]]
    cfg = {**tcfg, "architectures": archs, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}
    write_config(out, cfg)


MTP_STITCHED = DeepSeekMTP("mtp-stitched")
MTP_STANDALONE = DeepSeekMTP("mtp-standalone")
