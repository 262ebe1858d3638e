"""Hostile inputs: one bad record never stops a precompute, is counted under its reason with where
it is, and leaves the good records beside it stored bit-identical to a run without it; only a file
that cannot be read as a whole stops the run, with an error naming it.

Each case writes the same good records with broken ones among them, runs the real precompute on a
tiny random target (built once for the module) and compares the shards with a run on the good
records alone: the bad records are dropped before batches are planned, so the good ones are packed
into the same batches and their shard files come out byte-identical.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import threading
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from core.jsonio import json_array_records, jsonl_records, read_jsonl
from data.precompute import tokenize_all
from data.sources import MAX_EXAMPLES, DataConfig, SourceError, check_source, load_conversations, record_rejection
from data.store import FeatureStore
from experiments.stages import run_precompute
from tests.conftest import compose_config, make_hf_model
from tests.tiny_tokenizer import CHATML_TEMPLATE, make_tiny_tokenizer
from tests.numerics import assert_same_states

# ChatML (SmolLM2's template) that, like many templates, refuses a system message after the first.
pytestmark = pytest.mark.unit

STRICT_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
                   "{{ raise_exception('System message must be at the beginning') }}{% endif %}{% endfor %}"
                   + CHATML_TEMPLATE)


def sharegpt(sid, *turns, **extra):
    return {"id": sid, "conversations": [{"from": f, "value": v} for f, v in turns], **extra}


GOOD = [
    sharegpt("g0", ("human", "What is 2 + 2?"), ("gpt", "2 + 2 is 4.")),
    sharegpt("g1", ("system", "Be brief."), ("human", "Capital of France?"), ("gpt", "Paris."),
             ("human", "And of Italy?"), ("gpt", "Rome.")),
    {"id": "g2", "messages": [{"role": "user", "content": "Café ☕ or tea?"},
                              {"role": "assistant", "content": "Tea."}]},
    sharegpt("g3", ("human", "Count to three."), ("gpt", "One, two, three.")),
]
GOOD_LINES = [json.dumps(r, ensure_ascii=False).encode() for r in GOOD]


def line(obj) -> bytes:
    return json.dumps(obj).encode()


def raw(text: str) -> bytes:
    """A line written by hand: for escapes json.dumps would not produce the way a hostile file does."""
    return text.encode()


TURN_OK = {"from": "gpt", "value": "fine"}
# A record whose turns nest 10,000 arrays deep (the parser itself gives up near 1,000), after a string holding
# brackets and an escaped quote: what finds the record's end without a parse must skip strings.
DEEP = raw('{"id": "x", "note": "] } \\" [ {", "conversations": ' + "[" * 10000 + '"]"' + "]" * 10000 + "}")


@dataclass(frozen=True)
class Case:
    name: str
    bad: list[bytes]  # lines of the broken records (JSONL), written between GOOD[1] and GOOD[2]
    reason: str
    detail: str  # a substring of the first rejection's detail: what exactly is wrong
    sample_id: str | None = None  # the id reported with the rejection
    count: int = 1  # rejections (one per bad line unless said otherwise)


CASES = [
    # wrong types at every level
    Case("record_is_array", [line([1, 2])], "malformed", "record: expected an object, got array"),
    Case("record_is_string", [line("hello")], "malformed", "record: expected an object, got string"),
    Case("record_is_number", [line(42)], "malformed", "record: expected an object, got number"),
    Case("record_is_null", [line(None)], "malformed", "record: expected an object, got null"),
    Case("no_turns_field", [line({"id": "x", "text": "hi"})], "malformed", "no 'conversations'", "x"),
    Case("conversations_is_string", [line({"id": "x", "conversations": "hi"})], "malformed",
         "conversations: expected an array of turns, got string", "x"),
    Case("conversations_is_object", [line({"id": "x", "conversations": {"from": "human", "value": "hi"}})],
         "malformed", "conversations: expected an array of turns, got object", "x"),
    Case("conversations_is_null", [line({"id": "x", "conversations": None})], "malformed",
         "conversations: expected an array of turns, got null", "x"),
    Case("messages_is_number", [line({"id": "x", "messages": 3})], "malformed",
         "messages: expected an array of turns, got number", "x"),
    Case("turn_is_string", [line({"id": "x", "conversations": ["hi", TURN_OK]})], "malformed",
         "conversations[0]: expected an object with 'from' and 'value', got string", "x"),
    Case("turn_is_nested_list", [line({"id": "x", "conversations": [[{"from": "human", "value": "hi"}], TURN_OK]})],
         "malformed", "conversations[0]: expected an object with 'from' and 'value', got array", "x"),
    Case("turn_is_null", [line({"id": "x", "conversations": [{"from": "human", "value": "q"}, None]})],
         "malformed", "conversations[1]: expected an object", "x"),
    Case("from_is_number", [line(sharegpt("x", (7, "hi"), ("gpt", "a")))], "malformed",
         "conversations[0].from: expected a string, got number", "x"),
    Case("from_is_null", [line(sharegpt("x", ("human", "q"), (None, "a")))], "malformed",
         "conversations[1].from: expected a string, got null", "x"),
    Case("from_missing", [line({"id": "x", "conversations": [{"value": "q"}, TURN_OK]})], "malformed",
         "conversations[0]: no 'from'", "x"),
    Case("value_is_number", [line(sharegpt("x", ("human", "q"), ("gpt", 4)))], "malformed",
         "conversations[1].value: expected a string, got number", "x"),
    Case("value_is_null", [line(sharegpt("x", ("human", None), ("gpt", "a")))], "malformed",
         "conversations[0].value: expected a string, got null", "x"),
    Case("value_is_bool", [line(sharegpt("x", ("human", True), ("gpt", "a")))], "malformed",
         "conversations[0].value: expected a string, got boolean", "x"),
    Case("value_is_nested_list", [line(sharegpt("x", ("human", [["q"]]), ("gpt", "a")))], "malformed",
         "conversations[0].value: expected a string, got array", "x"),
    Case("value_missing", [line({"id": "x", "conversations": [{"from": "human"}, TURN_OK]})], "malformed",
         "conversations[0]: no 'value'", "x"),
    Case("role_is_list", [line({"id": "x", "messages": [{"role": ["user"], "content": "q"}]})], "malformed",
         "messages[0].role: expected a string, got array", "x"),
    Case("tool_result", [line({"id": "x", "messages": [
        {"role": "user", "content": "q"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "a"}]})],
         "tool_turn", "messages[1].role: 'tool' (a tool result; tool conversations are not trained on)", "x"),
    # a list of text parts is joined into one string; a list with an image part is not text
    Case("content_is_image_part", [line({"id": "x", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]}
    ]})],
         "malformed", "messages[1].content: expected a string, got array", "x"),
    Case("content_is_object", [line({"id": "x", "messages": [{"role": "user", "content": {"text": "q"}}]})],
         "malformed", "messages[0].content: expected a string, got object", "x"),
    Case("id_is_list", [line(sharegpt(["x"], ("human", "q"), ("gpt", "a")))], "malformed",
         "id: expected a string or an integer, got array"),
    Case("id_is_bool", [line(sharegpt(True, ("human", "q"), ("gpt", "a")))], "malformed",
         "id: expected a string or an integer, got boolean"),
    Case("id_is_float", [line(sharegpt(1.5, ("human", "q"), ("gpt", "a")))], "malformed",
         "id: expected a string or an integer, got number"),
    Case("id_is_blank", [line(sharegpt("  ", ("human", "q"), ("gpt", "a")))], "malformed", "id: blank"),
    # characters no tokenizer can take, or that mark binary data
    Case("lone_high_surrogate_in_value", [raw('{"id": "x", "conversations": [{"from": "human", "value": "a\\ud800b"}, '
                                              '{"from": "gpt", "value": "ok"}]}')],
         "lone_surrogate", "conversations[0].value: lone surrogate '\\ud800' at character 1", "x"),
    Case("lone_low_surrogate_in_answer", [raw('{"id": "x", "messages": [{"role": "user", "content": "q"}, '
                                              '{"role": "assistant", "content": "\\udc00"}]}')],
         "lone_surrogate", "messages[1].content: lone surrogate '\\udc00' at character 0", "x"),
    Case("lone_surrogate_in_role", [raw('{"id": "x", "conversations": [{"from": "hu\\udfffman", "value": "q"}, '
                                        '{"from": "gpt", "value": "a"}]}')],
         "lone_surrogate", "conversations[0].from: lone surrogate", "x"),
    Case("lone_surrogate_in_id", [raw('{"id": "x\\ud800", "conversations": [{"from": "human", "value": "q"}, '
                                      '{"from": "gpt", "value": "a"}]}')],
         "lone_surrogate", "id: lone surrogate '\\ud800' at character 1", "x\\ud800"),
    Case("escaped_nul_in_value", [raw('{"id": "x", "conversations": [{"from": "human", "value": "a\\u0000b"}, '
                                      '{"from": "gpt", "value": "ok"}]}')],
         "nul_char", "conversations[0].value: NUL character at character 1", "x"),
    Case("raw_nul_byte_in_string", [b'{"id": "x", "conversations": [{"from": "human", "value": "a\x00b"}]}'],
         "not_json", "Invalid control character"),
    Case("raw_control_char_in_string", [b'{"id": "x", "conversations": [{"from": "human", "value": "a\x07b"}]}'],
         "not_json", "Invalid control character"),
    # encodings and syntax, per line
    Case("latin1_byte", [b'{"id": "x", "conversations": [{"from": "human", "value": "caf\xe9"}]}'], "not_utf8",
         "invalid continuation byte"),
    Case("utf8_encoded_surrogate", [b'{"id": "x", "conversations": [{"from": "human", "value": "\xed\xa0\x80"}]}'],
         "not_utf8", "invalid continuation byte"),
    Case("garbage_line", [b"{not json}"], "not_json", "Expecting property name"),
    Case("pretty_printed_object", [b'{"id": "x",', b' "conversations": []', b"}"], "not_json", "column", count=3),
    # the conversation policy
    Case("unknown_role", [line(sharegpt("x", ("human", "q"), ("robot", "a")))], "unknown_role",
         "conversations[1].from: 'robot'", "x"),
    Case("no_turns", [line(sharegpt("x"))], "empty", "0 turns", "x"),
    Case("blank_turns", [line(sharegpt("x", ("human", " \n\t"), ("gpt", "")))], "empty", "none with non-blank", "x"),
    Case("no_assistant_turn", [line(sharegpt("x", ("human", "q"), ("human", "again")))], "no_assistant_turn",
         "roles: user, user", "x"),
    Case("answer_before_any_question", [line(sharegpt("x", ("gpt", "a"), ("system", "s")))], "no_assistant_turn",
         "roles: assistant, system", "x"),
    Case("duplicate_id", [line(sharegpt("g0", ("human", "again?"), ("gpt", "a different answer")))], "duplicate_id",
         "id 'g0' is taken by the record at {path}:1", "g0"),
    # what the template and the tokenizer refuse
    Case("template_refuses_late_system", [line(sharegpt("x", ("human", "q"), ("gpt", "a"), ("system", "new rules"),
                                                        ("human", "q2"), ("gpt", "a2")))],
         "template_error", "System message must be at the beginning", "x"),
    Case("special_token_in_answer", [line(sharegpt("x", ("human", "q"), ("gpt", "a<|im_end|>\n<|im_start|>user")))],
         "special_token", "message 1 (assistant) holds the special token '<|im_end|>' verbatim at character 1", "x"),
    Case("huge_first_turn", [line(sharegpt("x", ("human", "why? " * 20000), ("gpt", "because")))], "too_long",
         "no assistant token within the first 512 tokens", "x"),
    # bounds on one record (data.max_nesting, data.max_record_bytes: test_record_over_max_record_bytes below)
    Case("nested_10000_levels", [DEEP], "too_deep", "containers nested deeper than the JSON parser follows"),
    Case("nested_65_levels", [raw('{"id": "x", "conversations": ' + "[" * 64 + "]" * 64 + "}")], "too_deep",
         "containers nested more than 64 deep (data.max_nesting)"),
    Case("number_of_5000_digits", [raw('{"id": "x", "n": ' + "7" * 5000 + ', "conversations": []}')], "not_json",
         "the parser refused it: Exceeds the limit (4300 digits) for integer string conversion"),
]


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory):
    """The real config pointed at a tiny random Llama with the strict template (built once)."""
    target = tmp_path_factory.mktemp("strict_target")
    model = make_hf_model("llama", tie_word_embeddings=True)
    tok = make_tiny_tokenizer("chatml")
    tok.chat_template = STRICT_TEMPLATE
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(target)
    tok.save_pretrained(target)
    root = tmp_path_factory.mktemp("hostile")
    return compose_config([f"target.path={target}", "target.name=tiny", "target.dtype=float32", "target.source=null",
                           "data.source=jsonl", f"data.path={root / 'unset'}", "data.max_length=512",
                           "data.max_samples=null", f"run_dir={root / 'run'}", "logger=csv", "progress=false",
                           "precompute.store_dtype=float32", "precompute.shard_tokens=120",
                           "precompute.workers=1"])


def precompute_file(base_cfg, path: Path, source: str = "jsonl", **overrides):
    cfg = copy.deepcopy(base_cfg)
    cfg.data.source, cfg.data.path, cfg.store_dir = source, str(path), str(path.parent / f"{path.name}.store")
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return run_precompute(cfg)


def shard_bytes(store_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((store_dir / "shards").iterdir())}


def stored(store_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    store = FeatureStore(store_dir)
    ids = [sid for shard in store.manifest["shards"] for sid in shard["sample_ids"]]
    return {sid: store[i] for i, sid in enumerate(ids)}


@pytest.fixture(scope="module")
def reference(base_cfg, tmp_path_factory):
    """The store of the good records alone: ids in order, shard hashes, tensors."""
    path = tmp_path_factory.mktemp("ref") / "good.jsonl"
    path.write_bytes(b"\n".join(GOOD_LINES) + b"\n")
    store_dir, stats = precompute_file(base_cfg, path)
    assert stats.samples == len(GOOD) and stats.rejected == {}
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert manifest["rejected"] == {"total": 0, "counts": {}, "examples": [],
                                    "examples_cap": {"per_reason": 10, "total": MAX_EXAMPLES}}
    assert len(manifest["shards"]) > 1  # several shards: the comparison covers shard boundaries
    return {"shards": shard_bytes(store_dir), "tensors": stored(store_dir)}


def assert_good_records_identical(store_dir: Path, reference) -> None:
    got = stored(store_dir)
    assert list(got) == [r["id"] for r in GOOD]
    for sid, want in reference["tensors"].items():
        for key in ("input_ids", "loss_mask", "hidden"):
            assert torch.equal(got[sid][key], want[key]), (sid, key)
    assert shard_bytes(store_dir) == reference["shards"]


def assert_rejected(store_dir, stats, reason, count, examples):
    assert stats.rejected == {reason: count}
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert manifest["rejected"]["total"] == count and manifest["rejected"]["counts"] == {reason: count}
    assert manifest["rejected"]["examples"] == examples  # as JSON: what a reader of the manifest gets


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_record_is_counted_and_the_good_ones_stored_unchanged(case, base_cfg, reference, tmp_path, caplog):
    path = tmp_path / f"{case.name}.jsonl"
    path.write_bytes(b"\n".join([*GOOD_LINES[:2], *case.bad, *GOOD_LINES[2:]]) + b"\n")
    with caplog.at_level("WARNING"):
        store_dir, stats = precompute_file(base_cfg, path)
    assert stats.samples == len(GOOD)
    first = json.loads((store_dir / "manifest.json").read_text())["rejected"]["examples"][0]
    assert case.detail.format(path=path) in first["detail"], first
    examples = [{"reason": case.reason, "where": f"{path}:{3 + i}", "id": case.sample_id, "detail": e["detail"]}
                for i, e in enumerate(json.loads((store_dir / "manifest.json").read_text())["rejected"]["examples"])]
    assert_rejected(store_dir, stats, case.reason, case.count, examples)
    assert len(examples) == case.count
    assert f"{path}:3" in caplog.text and case.reason in caplog.text  # the log names it too
    assert_good_records_identical(store_dir, reference)


def test_cases_cover_every_reason_of_the_source_and_the_template():
    kinds = {c.name for c in CASES} | {c.name for c in JSON_CASES} | set(WHOLE_FILE)
    assert len(kinds) >= 30
    assert {c.reason for c in CASES + JSON_CASES} | {"too_large"} == {  # too_large: its own test, a bound set low
        "malformed", "lone_surrogate", "nul_char", "not_json", "not_utf8", "truncated", "unknown_role", "tool_turn",
        "empty", "no_assistant_turn", "duplicate_id", "template_error", "special_token", "too_long", "too_deep",
        "too_large"}


def test_file_cut_mid_record(base_cfg, reference, tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"\n".join(GOOD_LINES) + b'\n{"id": "cut", "conversations": [{"from": "human", "val')
    store_dir, stats = precompute_file(base_cfg, path)
    assert_rejected(store_dir, stats, "truncated", 1, [
        {"reason": "truncated", "where": f"{path}:5", "id": None,
         "detail": "column 51: Unterminated string starting at (the file ends inside this record)"}])
    assert_good_records_identical(store_dir, reference)


def test_utf8_bom_is_not_part_of_the_first_record(base_cfg, reference, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(GOOD_LINES) + b"\n")
    store_dir, stats = precompute_file(base_cfg, path)
    assert stats.rejected == {} and stats.samples == len(GOOD)
    assert_good_records_identical(store_dir, reference)


def test_control_characters_other_than_nul_are_kept_as_text(base_cfg, reference, tmp_path):
    answer = "\x1b[31mred\x1b[0m\x07\x0c done"
    path = tmp_path / "ctrl.jsonl"
    path.write_bytes(b"\n".join([*GOOD_LINES, line(sharegpt("ctrl", ("human", "colour?"), ("gpt", answer)))]) + b"\n")
    store_dir, stats = precompute_file(base_cfg, path)
    assert stats.rejected == {} and stats.samples == len(GOOD) + 1
    got = stored(store_dir)
    tok = make_tiny_tokenizer("chatml")
    ids, mask = got["ctrl"]["input_ids"], got["ctrl"]["loss_mask"]
    assert tok.decode(ids[mask].tolist()) == answer + "<|im_end|>"
    for sid, want in reference["tensors"].items():  # other batches now: same tokens, same states up to rounding
        assert torch.equal(got[sid]["input_ids"], want["input_ids"])
        assert torch.equal(got[sid]["loss_mask"], want["loss_mask"])
        assert_same_states(got[sid]["hidden"], want["hidden"], base_cfg.target.path)


# ---------------------------------------------------------------------------------- JSON arrays


def json_array(records: list[bytes]) -> bytes:
    return b"[\n" + b",\n".join(records) + b"\n]\n"


@dataclass(frozen=True)
class JsonCase:
    name: str
    content: bytes
    reason: str
    line: int
    detail: str
    sample_id: str | None = None


JSON_CASES = [
    JsonCase("element_is_number", json_array([*GOOD_LINES[:2], b"42", *GOOD_LINES[2:]]), "malformed", 4,
             "record: expected an object, got number"),
    JsonCase("element_is_nested_array", json_array([*GOOD_LINES[:2], line([GOOD[0]]), *GOOD_LINES[2:]]),
             "malformed", 4, "record: expected an object, got array"),
    JsonCase("record_not_utf8", json_array([*GOOD_LINES[:2], b'{"id": "x", "conversations": [{"from": "human", '
                                            b'"value": "caf\xe9"}, {"from": "gpt", "value": "a"}]}', *GOOD_LINES[2:]]),
             "not_utf8", 4, "line 4: byte 0xe9 is not UTF-8"),
    JsonCase("lone_surrogate", json_array([*GOOD_LINES[:2], raw('{"id": "x", "conversations": [{"from": "human", '
                                                                '"value": "\\ud83d"}, {"from": "gpt", "value": "a"}]}'),
                                           *GOOD_LINES[2:]]),
             "lone_surrogate", 4, "conversations[0].value: lone surrogate '\\ud83d'", "x"),
    JsonCase("cut_mid_record", json_array(GOOD_LINES)[:-3] + b',\n{"id": "cut", "conversations": [{"fr',
             "truncated", 6, "the file ends inside this record (Unterminated string"),
    JsonCase("cut_between_records", json_array(GOOD_LINES)[:-3] + b",\n", "truncated", 6,
             "the file ends without the closing ']' after 4 records"),
    JsonCase("duplicate_id", json_array([*GOOD_LINES, line(sharegpt("g1", ("human", "q"), ("gpt", "a")))]),
             "duplicate_id", 6, "id 'g1' is taken by the record at {path}:3", "g1"),
    JsonCase("element_nested_10000_levels", json_array([*GOOD_LINES[:2], DEEP, *GOOD_LINES[2:]]), "too_deep", 4,
             "containers nested deeper than the JSON parser follows"),
    JsonCase("element_nested_65_levels", json_array([*GOOD_LINES[:2], b"[" * 65 + b"]" * 65, *GOOD_LINES[2:]]),
             "too_deep", 4, "containers nested more than 64 deep (data.max_nesting)"),
    JsonCase("element_of_5000_digits", json_array([*GOOD_LINES[:2], b"7" * 5000, *GOOD_LINES[2:]]), "not_json", 4,
             "the parser refused it: Exceeds the limit (4300 digits)"),
    JsonCase("cut_inside_a_deep_element", json_array(GOOD_LINES)[:-3] + b",\n" + b"[" * 10000, "too_deep", 6,
             "the file ends inside this record after 4 complete records"),
]


@pytest.mark.parametrize("case", JSON_CASES, ids=[c.name for c in JSON_CASES])
def test_json_array_bad_record(case, base_cfg, reference, tmp_path):
    path = tmp_path / f"{case.name}.json"
    path.write_bytes(case.content)
    store_dir, stats = precompute_file(base_cfg, path, source="json")
    examples = json.loads((store_dir / "manifest.json").read_text())["rejected"]["examples"]
    assert case.detail.format(path=path) in examples[0]["detail"], examples
    assert_rejected(store_dir, stats, case.reason, 1, [
        {"reason": case.reason, "where": f"{path}:{case.line}", "id": case.sample_id, "detail": examples[0]["detail"]}])
    assert_good_records_identical(store_dir, reference)


def test_json_array_with_bom_and_one_line(base_cfg, reference, tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf[" + b", ".join(GOOD_LINES) + b"]")
    store_dir, stats = precompute_file(base_cfg, path, source="json")
    assert stats.rejected == {}
    assert_good_records_identical(store_dir, reference)


# ------------------------------------------------------------------------------ whole-file failures


def _pretty_array(path):
    path.write_text(json.dumps(GOOD, indent=2))


WHOLE_FILE = {  # name -> (source, write the file (None: leave it missing), what the error says)
    "missing_file": ("jsonl", None, "no such file"),
    "directory": ("jsonl", lambda p: p.mkdir(), "a directory"),
    "zero_bytes_jsonl": ("jsonl", lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    "zero_bytes_json": ("json", lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    "blank_lines_only": ("jsonl", lambda p: p.write_bytes(b"\n  \n\t\n"), "no records (only blank lines)"),
    "whitespace_only_json": ("json", lambda p: p.write_bytes(b" \n "), "no records (only whitespace)"),
    "empty_json_array": ("json", lambda p: p.write_bytes(b"[ ]\n"), "an empty JSON array"),
    "utf16_jsonl": ("jsonl", lambda p: p.write_bytes("\n".join(map(json.dumps, GOOD)).encode("utf-16")),
                    "UTF-16 byte-order mark"),
    "utf16_json": ("json", lambda p: p.write_bytes(json.dumps(GOOD).encode("utf-16")), "UTF-16 byte-order mark"),
    "gzip_jsonl": ("jsonl", lambda p: p.write_bytes(gzip.compress(b"\n".join(GOOD_LINES))), "gzip-compressed"),
    "pretty_json_array_as_jsonl": ("jsonl", _pretty_array, "a JSON array of records, not JSONL"),
    "one_line_json_array_as_jsonl": ("jsonl", lambda p: p.write_text(json.dumps(GOOD)), "set data.source=json"),
    "jsonl_as_json": ("json", lambda p: p.write_bytes(b"\n".join(GOOD_LINES)), "for JSONL (one object per line) set "
                                                                               "data.source=jsonl"),
    "csv_as_jsonl": ("jsonl", lambda p: p.write_text("id,question,answer\n1,hi,hello\n"),
                     "none of its 2 non-blank lines is a UTF-8 JSON value"),
    "json_syntax_error_mid_array": ("json", lambda p: p.write_bytes(json_array([GOOD_LINES[0], b'{"id": x}',
                                                                                *GOOD_LINES[1:]])),
                                    ":3:8: not valid JSON (Expecting value) in the record starting at line 3"),
    "json_data_after_array": ("json", lambda p: p.write_bytes(json_array(GOOD_LINES) + json_array(GOOD_LINES)),
                              ":7: data after the array's closing ']'"),
}


@pytest.mark.parametrize("name", WHOLE_FILE)
def test_unreadable_file_stops_with_its_name(name, tmp_path):
    source, write, message = WHOLE_FILE[name]
    path = tmp_path / f"{name}.data"
    if write:
        write(path)
    with pytest.raises(SourceError) as err:
        load_conversations(DataConfig.of({"source": source, "path": str(path)}))
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_precompute_stops_on_an_unreadable_file_before_any_store(base_cfg, tmp_path):
    path = tmp_path / "gone.jsonl"
    with pytest.raises(SourceError, match=f"data.path={path}: no such file"):
        precompute_file(base_cfg, path)
    assert not (tmp_path / "gone.jsonl.store").exists()


def test_source_without_path_is_refused():
    with pytest.raises(SourceError, match="data.source=jsonl needs data.path"):
        load_conversations(DataConfig.of({"source": "jsonl", "path": None}))


# ------------------------------------------------------------------------- bounds on one record


@pytest.mark.parametrize("source", ["jsonl", "json"])
def test_record_over_max_record_bytes(source, base_cfg, reference, tmp_path):
    big = line(sharegpt("big", ("human", "q" * 3000), ("gpt", "a")))
    records = [*GOOD_LINES[:2], big, *GOOD_LINES[2:]]
    path = tmp_path / f"big.{source}"
    path.write_bytes(json_array(records) if source == "json" else b"\n".join(records) + b"\n")
    store_dir, stats = precompute_file(base_cfg, path, source, **{"data.max_record_bytes": 2000})
    assert_rejected(store_dir, stats, "too_large", 1, [
        {"reason": "too_large", "where": f"{path}:{4 if source == 'json' else 3}", "id": None,
         "detail": f"{len(big):,} bytes, over the limit of 2,000 bytes per record (data.max_record_bytes)"}])
    assert_good_records_identical(store_dir, reference)


def test_a_line_over_the_bound_is_never_held_whole(tmp_path):
    """A JSONL line of 20 MB under a bound of 1 MiB is counted in pieces: the reader's peak stays far below the
    line (Python's allocations, traced)."""
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.write(GOOD_LINES[0] + b"\n" + line(sharegpt("big", ("human", "q"), ("gpt", "x" * 20_000_000))) + b"\n")
        f.write(GOOD_LINES[1] + b"\n")
    tracemalloc.start()
    try:
        convs = load_conversations(DataConfig.of({"source": "jsonl", "path": str(path),
                                                     "max_record_bytes": 1 << 20}))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert convs.rejected == {"too_large": 1} and [sid for sid, _ in convs.items] == ["g0", "g1"]
    assert convs.examples[0]["where"] == f"{path}:2" and convs.examples[0]["detail"].startswith("20,000,")
    assert peak < 4 << 20, f"peak {peak:,} bytes while reading a line of 20 MB"


def test_strict_reader_names_a_record_over_the_bounds(tmp_path):
    """Prompt files go through the strict reader: the first record over a bound stops it, naming its line."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n' + DEEP + b"\n")
    with pytest.raises(ValueError, match=f"{path}:2: nested too deep"):
        list(read_jsonl(path))


@pytest.mark.parametrize(("key", "value"), [("max_record_bytes", 0), ("max_record_bytes", -1),
                                            ("max_record_bytes", "8MB"), ("max_nesting", 0), ("max_nesting", None),
                                            ("max_nesting", True)])
def test_bounds_that_are_not_positive_numbers_are_refused(key, value, tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_bytes(b"\n".join(GOOD_LINES) + b"\n")
    with pytest.raises(SourceError, match=f"data.{key}={value!r}: expected a positive whole number"):
        DataConfig.of({"source": "jsonl", "path": str(path), key: value})  # refused before any reader runs


def _returns_at_once(call, fifo: Path | None = None):
    """`call()` run in a thread, which must end within 10 s: its exception (None if it returned). A reader that
    opens a FIFO waits for a writer forever; after 10 s a writer that closes at once releases it, and the test
    fails."""
    outcome = {}

    def run():
        try:
            call()
            outcome["error"] = None
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader blocked in open() sees an empty file
        thread.join(10)
    assert "error" in outcome, f"{call} still running after 10 s"
    return outcome["error"]


NON_FILE_READERS = {
    "check_source": lambda p: check_source(DataConfig.of({"source": "jsonl", "path": str(p)})),
    "load_conversations": lambda p: load_conversations(DataConfig.of({"source": "jsonl", "path": str(p)})),
    "load_conversations_json": lambda p: load_conversations(DataConfig.of({"source": "json", "path": str(p)})),
    "jsonl_records": lambda p: list(jsonl_records(p)),
    "json_array_records": lambda p: list(json_array_records(p)),
    "read_jsonl": lambda p: list(read_jsonl(p)),
}


@pytest.mark.parametrize("reader", NON_FILE_READERS)
def test_a_fifo_is_refused_without_being_opened(reader, tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    err = _returns_at_once(lambda: NON_FILE_READERS[reader](fifo), fifo)
    named = f"data.path={fifo}" if reader in ("check_source", "load_conversations", "load_conversations_json") else fifo
    assert isinstance(err, ValueError) and f"{named}: a FIFO (named pipe), not a regular file" in str(err), err


def test_a_device_is_refused_before_it_is_read():
    """/dev/zero never ends: a reader that opened it would read zeros until memory runs out. The checks before
    work refuse it first (so the reader is never reached if they do not), then the reader itself."""
    for reader in ("check_source", "load_conversations", "load_conversations_json"):
        err = _returns_at_once(lambda: NON_FILE_READERS[reader](Path("/dev/zero")))
        assert isinstance(err, SourceError) and "data.path=/dev/zero: a character device, not a regular file" in str(
            err), (reader, err)


# ----------------------------------------------------------------------- counting, resume, ranks


def test_many_bad_records_all_counted_examples_bounded(base_cfg, reference, tmp_path):
    bad = [line({"id": f"b{i}", "conversations": i}) for i in range(150)] + [b"{"] * 30
    path = tmp_path / "many.jsonl"
    path.write_bytes(b"\n".join([*GOOD_LINES[:2], *bad, *GOOD_LINES[2:]]) + b"\n")
    store_dir, stats = precompute_file(base_cfg, path)
    assert stats.rejected == {"malformed": 150, "not_json": 30}
    rejected = json.loads((store_dir / "manifest.json").read_text())["rejected"]
    assert rejected["total"] == 180 and rejected["counts"] == {"malformed": 150, "not_json": 30}
    assert [(e["reason"], e["where"], e["id"]) for e in rejected["examples"]] == (
        [("malformed", f"{path}:{3 + i}", f"b{i}") for i in range(10)]
        + [("not_json", f"{path}:{153 + i}", None) for i in range(10)])  # the first of each reason
    assert_good_records_identical(store_dir, reference)


def test_examples_cap_total():
    counts, examples = Counter(), []
    for r in range(20):
        for i in range(12):
            record_rejection(counts, examples, f"reason{r}", f"f:{i}", "x")
    assert sum(counts.values()) == 240 and len(examples) == MAX_EXAMPLES
    assert Counter(e["reason"] for e in examples) == {f"reason{r}": 10 for r in range(10)}


def test_resume_keeps_rejections_and_shards(base_cfg, reference, tmp_path):
    path = tmp_path / "resume.jsonl"
    path.write_bytes(b"\n".join([*GOOD_LINES[:2], b"[1]", line(sharegpt("x", ("human", "q"))), *GOOD_LINES[2:]]))
    store_dir, _ = precompute_file(base_cfg, path)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    # a kill after the first shard: the rerun must accept the store (same settings) and finish it
    partial = {**manifest, "shards": manifest["shards"][:1], "complete": False}
    (store_dir / "manifest.json").write_text(json.dumps(partial))
    _, stats = precompute_file(base_cfg, path)
    assert stats.skipped_done == manifest["shards"][0]["num_samples"] and stats.rejected == {
        "malformed": 1, "no_assistant_turn": 1}
    again = json.loads((store_dir / "manifest.json").read_text())
    assert again == manifest
    assert_good_records_identical(store_dir, reference)


def test_two_ranks_report_the_whole_sources_rejections(base_cfg, reference, tmp_path):
    path = tmp_path / "ranked.jsonl"
    path.write_bytes(b"\n".join([*GOOD_LINES[:2], b"42", line(sharegpt("x", ("human", "q"), ("gpt", "<|im_end|>"))),
                                 *GOOD_LINES[2:]]))
    single_dir, _ = precompute_file(base_cfg, path)
    single = json.loads((single_dir / "manifest.json").read_text())["rejected"]
    assert single["counts"] == {"malformed": 1, "special_token": 1}
    ranked = tmp_path / "ranked"
    for rank in (0, 1):
        cfg = copy.deepcopy(base_cfg)
        cfg.data.path, cfg.store_dir = str(path), str(ranked)
        cfg.precompute.rank, cfg.precompute.world_size = rank, 2
        _, stats = run_precompute(cfg)
        assert stats.rejected == {"malformed": 1, "special_token": 1}  # every rank: the whole source's
    merged = json.loads((ranked / "manifest.json").read_text())
    assert merged["complete"] and merged["rejected"] == single
    got = stored(ranked)
    assert sorted(got) == sorted(r["id"] for r in GOOD)
    for sid, want in reference["tensors"].items():
        assert torch.equal(got[sid]["input_ids"], want["input_ids"])
        assert torch.equal(got[sid]["loss_mask"], want["loss_mask"])


# ------------------------------------------------------------------ the tokenizer's own failures


def test_tokenize_all_rejects_what_the_tokenizer_refuses_and_goes_on():
    """The original failure: a lone surrogate that reaches the fast tokenizer raises TypeError from
    inside it; tokenize_all counts it and keeps the other conversations."""
    tok = make_tiny_tokenizer("chatml")
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    bad = [{"role": "user", "content": "q\ud800"}, {"role": "assistant", "content": "a"}]
    rejected, examples = Counter(), []
    out = tokenize_all(tok, [("a", good), ("b", bad), ("c", good)], 512, rejected, examples, {"b": "f.jsonl:2"})
    assert [sid for sid, _, _ in out] == ["a", "c"]
    assert rejected == {"tokenizer_error": 1}
    assert examples[0]["where"] == "f.jsonl:2" and examples[0]["id"] == "b"
    assert "TypeError" in examples[0]["detail"] and "TextEncodeInput" in examples[0]["detail"]


def test_tokenize_all_rejects_any_template_failure():
    class Refusing:
        all_special_tokens: list[str] = []

        def apply_chat_template(self, messages, **kwargs):
            if any("boom" in m["content"] for m in messages):
                raise RuntimeError("template exploded")
            return make_tiny_tokenizer("chatml").apply_chat_template(messages, **kwargs)

        def __call__(self, text, **kwargs):
            return make_tiny_tokenizer("chatml")(text, **kwargs)

    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    bad = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "a"}]
    rejected, examples = Counter(), []
    out = tokenize_all(Refusing(), [("a", good), ("b", bad)], 512, rejected, examples)
    assert [sid for sid, _, _ in out] == ["a"] and rejected == {"template_error": 1}
    assert examples == [{"reason": "template_error", "where": None, "id": "b",
                         "detail": "the chat template refused messages[:2]: RuntimeError: template exploded"}]
