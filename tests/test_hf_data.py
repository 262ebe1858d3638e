"""data.source=hf: conversations through Hugging Face `datasets` — parquet, arrow, JSON files and globs, directories
written by save_to_disk, Hub dataset ids from the hub cache offline — read as the same records as the equivalent
JSONL, with the same rejection accounting and `<file>:<row>` places, and precomputed to the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data.sources import DataConfig, SourceError, check_source, load_conversations
from tests.conftest import CONVERSATIONS, compose_config

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _offline_caches(tmp_path, monkeypatch):
    """datasets' cache and the hub cache in the test's directory, the Hub off: nothing leaves the machine."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _formats(root: Path, records: list[dict]) -> dict[str, Path | str]:
    """The same records as JSONL, parquet, an Arrow stream file, a save_to_disk directory and two parquet shards."""
    import datasets
    import pyarrow as pa

    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(root / "all.parquet")
    with open(root / "all.arrow", "wb") as f:
        writer = pa.ipc.new_stream(f, ds.data.table.schema)
        writer.write_table(ds.data.table)
        writer.close()
    ds.save_to_disk(root / "saved")
    (root / "shards").mkdir()
    half = len(records) // 2
    for i, part in enumerate((records[:half], records[half:])):
        datasets.Dataset.from_list(part).to_parquet(root / "shards" / f"part-{i}.parquet")
    return {"jsonl": _jsonl(root / "all.jsonl", records), "parquet": root / "all.parquet",
            "arrow": root / "all.arrow", "saved": root / "saved", "glob": f"{root}/shards/*.parquet",
            "shard_dir": root / "shards"}


def test_every_format_reads_the_records_of_the_equivalent_jsonl(tmp_path):
    paths = _formats(tmp_path, CONVERSATIONS)
    reference = load_conversations(DataConfig(source="jsonl", path=paths["jsonl"]))
    assert [sid for sid, _ in reference.items] == [r["id"] for r in CONVERSATIONS]
    for kind, path in paths.items():
        for streaming in (None, False):
            got = load_conversations(DataConfig.of({"source": "hf", "path": str(path), "streaming": streaming}))
            assert got.items == reference.items, (kind, streaming)
            assert got.rejected == {}
    shards = load_conversations(DataConfig.of({"source": "hf", "path": paths["glob"]}))
    half = len(CONVERSATIONS) // 2
    assert shards.where["c0"] == f"{tmp_path}/shards/part-0.parquet:0"
    assert shards.where[f"c{half + 1}"] == f"{tmp_path}/shards/part-1.parquet:1"
    # the range of usable records and the held-out range after it count the same way
    for skip, num in ((3, 4), (0, 1), (10, None)):
        ref = load_conversations(DataConfig(source="jsonl", path=paths["jsonl"], skip=skip, max_samples=num))
        got = load_conversations(DataConfig(source="hf", path=paths["parquet"], skip=skip, max_samples=num))
        assert got.items == ref.items and len(got.items) == min(num or 99, len(CONVERSATIONS) - skip)
    held = DataConfig(source="hf", path=paths["parquet"], max_samples=5).held_out(3)
    assert [sid for sid, _ in load_conversations(held).items] == ["c5", "c6", "c7"]


def test_rows_are_rejected_one_by_one_with_file_and_row(tmp_path):
    """A parquet file mixing OpenAI and ShareGPT rows (every row gets both columns, null where it had none), a tool
    conversation, a row with neither field and an unknown role: each counted under its reason at `<file>:<row>`."""
    import datasets

    rows = [
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "openai", "messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
        {"id": "tools", "messages": [{"role": "user", "content": "q3"}, {"role": "tool", "content": "r"},
                                     {"role": "assistant", "content": "a3"}]},
        {"id": "neither"},
        {"id": "robot", "conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]},
        {"id": "openai", "messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "x"}]},
    ]
    path = tmp_path / "mixed.parquet"
    columns = ("id", "conversations", "messages")  # every row gets every column, as in a parquet file of such rows
    datasets.Dataset.from_dict({c: [r.get(c) for r in rows] for c in columns}).to_parquet(path)
    got = load_conversations(DataConfig(source="hf", path=path))
    assert [sid for sid, _ in got.items] == ["sharegpt", "openai"]
    assert got.items[1][1] == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert got.rejected == {"tool_turn": 1, "malformed": 1, "unknown_role": 1, "duplicate_id": 1}
    where = {e["reason"]: (e["where"], e["id"]) for e in got.examples}
    assert where == {"tool_turn": (f"{path}:2", "tools"), "malformed": (f"{path}:3", "neither"),
                     "unknown_role": (f"{path}:4", "robot"), "duplicate_id": (f"{path}:5", "openai")}


def test_column_mapping(tmp_path):
    """UltraChat's shape: the turns in another column, the id in `prompt_id`; mapped, they read as `messages` and
    `id` (for the JSON sources too)."""
    import datasets

    rows = [{"prompt_id": f"p{i}", "prompt": f"q{i}", "chat": [{"role": "user", "content": f"q{i}"},
                                                                 {"role": "assistant", "content": f"a{i}"}]}
            for i in range(3)]
    path = tmp_path / "ultra.parquet"
    datasets.Dataset.from_list(rows).to_parquet(path)
    unmapped = load_conversations(DataConfig(source="hf", path=path))
    assert unmapped.items == [] and unmapped.rejected == {"malformed": 3}
    for source, file in (("hf", path), ("jsonl", _jsonl(tmp_path / "ultra.jsonl", rows))):
        got = load_conversations(DataConfig.of({"source": source, "path": str(file),
                                                "columns": {"messages": "chat", "id": "prompt_id"}}))
        assert [sid for sid, _ in got.items] == ["p0", "p1", "p2"]
        assert got.items[2][1] == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    cfg = compose_config(["data.source=hf", f"data.path={path}", "data.columns={messages:chat,id:prompt_id}"])
    assert DataConfig.of(cfg.data).columns == {"messages": "chat", "id": "prompt_id"}


def _hub_dataset(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """A dataset repository in the hub cache as `hf download --repo-type dataset` leaves it: refs/main, the
    snapshot's files as relative symlinks into blobs/."""
    import hashlib

    root = cache / f"datasets--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for rel, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (len(Path(rel).parts) + 1)) / "blobs" / blob.name)
    return root / "snapshots" / commit


def test_a_hub_dataset_id_offline_from_the_hub_cache(tmp_path):
    import datasets

    paths = _formats(tmp_path, CONVERSATIONS)
    datasets.Dataset.from_list(CONVERSATIONS[:2]).to_parquet(tmp_path / "test.parquet")
    snapshot = _hub_dataset(tmp_path / "hub", "org/chats", {
        "data/train-00000-of-00001.parquet": paths["parquet"],
        "data/test-00000-of-00001.parquet": tmp_path / "test.parquet", "README.md": paths["jsonl"]})
    reference = load_conversations(DataConfig(source="jsonl", path=paths["jsonl"]))
    data = DataConfig.of({"source": "hf", "path": "org/chats"})
    check_source(data)  # a Hub id passes the checks before work
    got = load_conversations(data)
    assert got.items == reference.items
    assert got.where["c0"] == f"{snapshot}/data/train-00000-of-00001.parquet:0"
    test = load_conversations(DataConfig.of({"source": "hf", "path": "org/chats", "split": "test"}))
    assert [sid for sid, _ in test.items] == ["c0", "c1"]
    with pytest.raises(SourceError, match=r"data.path=org/chats .*data.split=validation\).*no data file for that "
                                          r"split"):
        load_conversations(DataConfig.of({"source": "hf", "path": "org/chats", "split": "validation"}))
    with pytest.raises(SourceError, match=r"data.path=org/missing .*holds no snapshot of it.*hf download "
                                          r"--repo-type dataset org/missing"):
        load_conversations(DataConfig.of({"source": "hf", "path": "org/missing"}))


def test_refusals_name_the_setting(tmp_path):
    paths = _formats(tmp_path, CONVERSATIONS)
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        ({"source": "hf", "path": f"{tmp_path}/nothing/*.parquet"}, r"data.path=.*nothing/\*.parquet: no file matches"),
        ({"source": "hf", "path": f"{tmp_path}/notes.txt"}, r"notes.txt is not a data file datasets reads here"),
        ({"source": "hf", "path": f"{tmp_path}/missing.parquet"}, r"missing.parquet: no such file or directory"),
        ({"source": "hf"}, r"data.source=hf needs data.path"),
        ({"source": "jsonl", "path": str(paths["jsonl"]), "split": "train"}, r"data.split='train' applies to "
                                                                             r"data.source=hf only"),
        ({"source": "hf", "path": str(paths["parquet"]), "streaming": "yes"}, r"data.streaming='yes': expected"),
        ({"source": "hf", "path": str(paths["parquet"]), "columns": {"turns": "chat"}}, r"data.columns.turns: not a "
                                                                                        r"field read"),
        ({"source": "hf", "path": str(paths["parquet"]), "columns": {"messages": "a", "conversations": "b"}},
         r"map either conversations .* or messages"),
        ({"source": "hf", "path": str(paths["saved"]), "split": "train"}, r"data.split=train: .* holds one dataset"),
    ]
    for section, message in cases:
        with pytest.raises(SourceError, match=message):
            data = DataConfig.of(section)
            check_source(data)
            load_conversations(data)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(SourceError, match=r"broken.parquet: datasets cannot read it as parquet"):
        load_conversations(DataConfig(source="hf", path=tmp_path / "broken.parquet"))


def test_precompute_of_parquet_and_arrow_equals_the_jsonl_store(tiny_overrides, tmp_path):
    from data.store import FeatureStore
    from experiments.stages import run_precompute

    paths = _formats(tmp_path, CONVERSATIONS)
    stores = {}
    for kind in ("jsonl", "parquet", "arrow", "glob"):
        source = "jsonl" if kind == "jsonl" else "hf"
        cfg = compose_config(tiny_overrides + [f"data.source={source}", f"data.path={paths[kind]}",
                                               f"store_dir={tmp_path / kind}", "data.max_samples=null"])
        store_dir, stats = run_precompute(cfg)
        assert stats.samples == len(CONVERSATIONS) and stats.rejected == {}
        stores[kind] = FeatureStore(store_dir)
    manifest = json.loads((tmp_path / "glob" / "manifest.json").read_text())
    assert [f["name"] for f in manifest["data_file"]["files"]] == ["part-0.parquet", "part-1.parquet"]
    reference = stores.pop("jsonl")
    ids = [sid for shard in reference.manifest["shards"] for sid in shard["sample_ids"]]
    for kind, store in stores.items():
        assert [sid for shard in store.manifest["shards"] for sid in shard["sample_ids"]] == ids, kind
        for i in range(len(ids)):
            want, got = reference[i], store[i]
            assert want.keys() == got.keys()
            for key in want:
                assert torch.equal(want[key], got[key]), (kind, ids[i], key)

