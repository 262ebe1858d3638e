"""Data sources: every malformed record is counted under its reason, none is silently included or
silently dropped, and a bad line does not stop the file."""

import json
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.jsonio import MAX_NESTING, MAX_RECORD_BYTES, RecordBounds
from data.sources import DataConfig, load_conversations


def sharegpt(sid, *turns):
    return {"id": sid, "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [
    sharegpt("g1", ("human", "Hi"), ("gpt", "Hello!")),
    {"id": "g2", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    sharegpt("g3", ("system", "Be brief."), ("human", "Café?"), ("gpt", "Oui — ☕")),  # non-ASCII UTF-8
    sharegpt("g4", ("gpt", "(continued)"), ("human", "More"), ("gpt", "Sure")),  # leading answer dropped
]

BAD = {  # reason -> raw lines
    "malformed": [
        json.dumps({"id": "m1"}),  # no conversations / messages field
        json.dumps(sharegpt("m2", ("human", "a"))["conversations"][0]),  # a turn, not a record
        json.dumps({"id": "m3", "conversations": [{"from": "human"}]}),  # turn without value
        json.dumps({"id": "m4", "conversations": "hello"}),  # wrong type: str for list
        json.dumps({"id": "m5", "conversations": [{"from": "human", "value": 42}]}),  # wrong type: int value
        json.dumps({"id": "m6", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),  # list content
        json.dumps(["not", "an", "object"]),
    ],
    "unknown_role": [json.dumps(sharegpt("u1", ("human", "a"), ("robot", "b")))],
    "empty": [json.dumps(sharegpt("e1")), json.dumps(sharegpt("e2", ("human", "  "), ("gpt", "\n")))],
    "no_assistant_turn": [json.dumps(sharegpt("n1", ("human", "anyone?")))],
    "not_json": ['{"id": "j1", "conversations": [', "{not json}"],
    "duplicate_id": [json.dumps(sharegpt("g1", ("human", "again"), ("gpt", "a different answer")))],
}

NOT_UTF8 = [
    # latin-1 é
    b'{"id": "x1", "conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}',
    b"\xff\xfe{\x00",  # UTF-16 BOM
    b'{"id": "x3", "conversations": [{"from": "human", "value": "\xc3"}, {"from": "gpt", "value": "cut"}]}',
]


@pytest.mark.unit
def test_jsonl_rejects_counted_per_reason(tmp_path):
    lines = [json.dumps(GOOD[0]).encode(), *(line.encode() for line in BAD["malformed"][:3]), NOT_UTF8[0],
             json.dumps(GOOD[1]).encode(), b"", b"   ", *(line.encode() for line in BAD["malformed"][3:]),
             *NOT_UTF8[1:], json.dumps(GOOD[2]).encode()]
    for reason in ("unknown_role", "empty", "no_assistant_turn", "not_json", "duplicate_id"):
        lines += [line.encode() for line in BAD[reason]]
    lines.append(json.dumps(GOOD[3]).encode())
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")

    convs = load_conversations(DataConfig.of({"source": "jsonl", "path": str(path)}))

    expected = Counter({reason: len(raw) for reason, raw in BAD.items()})
    expected["not_utf8"] = len(NOT_UTF8)
    assert convs.rejected == expected  # blank lines are not records: not counted
    assert [sid for sid, _ in convs.items] == ["g1", "g2", "g3", "g4"]
    by_id = dict(convs.items)
    assert by_id["g1"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert by_id["g3"][1:] == [{"role": "user", "content": "Café?"}, {"role": "assistant", "content": "Oui — ☕"}]
    assert by_id["g4"] == [{"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure"}]
    assert sum(convs.rejected.values()) + len(convs.items) == sum(1 for line in lines if line.strip())


@pytest.mark.unit
def test_skip_and_max_samples_count_only_usable_records(tmp_path):
    path = tmp_path / "d.jsonl"
    good = [sharegpt(f"s{i}", ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(6)]
    lines = [json.dumps(good[0]).encode(), NOT_UTF8[0], *(json.dumps(r).encode() for r in good[1:])]
    path.write_bytes(b"\n".join(lines))
    convs = load_conversations(DataConfig.of({"source": "jsonl", "path": str(path), "skip": 2, "max_samples": 3}))
    assert [sid for sid, _ in convs.items] == ["s2", "s3", "s4"]
    assert convs.rejected == {"not_utf8": 1}


@pytest.mark.unit
def test_rejections_say_where_and_which_id(tmp_path):
    lines = [json.dumps(GOOD[0]).encode(), b"", BAD["malformed"][3].encode(), NOT_UTF8[0],
             BAD["duplicate_id"][0].encode(), b'{"id": "cu']
    path = tmp_path / "w.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline at the end: the last line is cut
    convs = load_conversations(DataConfig.of({"source": "jsonl", "path": str(path)}))
    assert convs.rejected == {"malformed": 1, "not_utf8": 1, "duplicate_id": 1, "truncated": 1}
    assert [(e["reason"], e["where"], e["id"]) for e in convs.examples] == [
        ("malformed", f"{path}:3", "m4"), ("not_utf8", f"{path}:4", None), ("duplicate_id", f"{path}:5", "g1"),
        ("truncated", f"{path}:6", None)]
    assert convs.examples[0]["detail"] == "conversations: expected an array of turns, got string"
    assert convs.examples[1]["detail"] == "byte 62 (b'\\xe9\"},'...): invalid continuation byte"
    assert convs.examples[2]["detail"] == f"id 'g1' is taken by the record at {path}:1"
    assert convs.where == {"g1": f"{path}:1"}


def test_json_array_reader_matches_the_packaged_sharegpt():
    """The default source reads the packaged ShareGPT dump (cut inside its last record) record for
    record like data/assets.py, and counts the cut record instead of dropping it unseen."""
    from data.assets import load_sharegpt, sharegpt_path
    from data.conversations import normalize_record

    convs = load_conversations(DataConfig.of({"source": "sharegpt", "max_samples": None}))
    expected, ids = [], set()
    for n, record in enumerate(load_sharegpt()):
        if normalize_record(record)[0] is not None and str(record["id"]) not in ids:
            ids.add(str(record["id"]))
            expected.append(str(record["id"]))
    assert [sid for sid, _ in convs.items] == expected
    assert convs.rejected == {"no_assistant_turn": 155, "empty": 126, "truncated": 1}  # no id repeats
    cut = [e for e in convs.examples if e["reason"] == "truncated"]
    assert len(cut) == 1 and cut[0]["where"].startswith(f"{sharegpt_path()}:")
    assert "after 17671 complete records" in cut[0]["detail"]


@pytest.mark.unit
def test_record_bounds_default_to_the_configs():
    """conf/data/sharegpt.yaml sets the readers' own defaults, which a data section without the keys gets."""
    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "data" / "sharegpt.yaml")
    want = RecordBounds(MAX_RECORD_BYTES, MAX_NESTING, settings="data")
    assert DataConfig.of(conf).bounds == DataConfig.of(OmegaConf.create({"source": "sharegpt"})).bounds == want
    assert DataConfig.of({"max_record_bytes": 10, "max_nesting": 2}).bounds == RecordBounds(10, 2, "data")
