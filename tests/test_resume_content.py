"""Precompute resume keyed by content, and shard repair: a record edited after its sample was stored is
recomputed (`precompute.on_changed=recompute`, the other samples kept byte for byte) or refused naming it
(`refuse`, the store left as it is); a store without per-sample hashes resumes by content too; a shard whose
bytes are corrupt at the same size (only its sha256 tells) is repaired by a rerun, into the store a fresh
precompute writes; removing samples from finished shards loses nothing else, even when killed."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import data.store as store_mod
from core.files import sha256_file
from data.store import STAMP, FeatureStore, Sample, StoreError, StoreWriter, sample_hash
from experiments.stages import run_precompute
from tests.conftest import CONVERSATIONS, compose_config
from tests.numerics import assert_same_states

EDITED = "c5"


def _write_data(path: Path, edited: set[str] = frozenset()) -> Path:
    """The conftest conversations as JSONL, with the first answer of each record in `edited` rewritten."""
    records = json.loads(json.dumps(CONVERSATIONS))
    for r in records:
        if r["id"] in edited:
            r["conversations"][1]["value"] = f"Rewritten: {r['id']} has a new, longer answer now."
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(tiny_overrides, data: Path, store: Path, *extra: str):
    base = [o for o in tiny_overrides if not o.startswith("data.path=")]
    return compose_config([*base, f"data.path={data}", f"store_dir={store}", "precompute.shard_tokens=300", *extra])


def _by_id(root: Path) -> dict[str, dict[str, bytes]]:
    """Each sample's stored tensors as bytes, by id."""
    store = FeatureStore(root, verify="full")
    return {sid: {k: v.numpy().tobytes() for k, v in store[i].items()} for i, sid in enumerate(store.sample_ids())}


def _files(root: Path) -> dict[str, bytes]:
    """The manifest and the shard files (the verification stamp aside), by path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != STAMP}


def _shard_of(root: Path, sid: str) -> dict:
    return next(s for s in json.loads((root / "manifest.json").read_text())["shards"] if sid in s["sample_ids"])


def _flip_data_byte(path: Path, keep_mtime: bool = False) -> None:
    """One tensor byte changed, the size and header unchanged: only the sha256 sees it."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[(start + len(data)) // 2] ^= 0x01
    st = path.stat()
    path.write_bytes(bytes(data))
    # keep_mtime: bit rot, which leaves the mtime; else a visible write (coarse clocks: a second later)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + (0 if keep_mtime else 1_000_000_000)))


# ------------------------------------------------------------------------------------------ changed records


@pytest.mark.unit
def test_an_edited_record_is_recomputed_and_the_others_kept_byte_for_byte(tiny_overrides, tiny_target, tmp_path,
                                                                          caplog):
    data, store = _write_data(tmp_path / "data.jsonl"), tmp_path / "store"
    run_precompute(_config(tiny_overrides, data, store))
    before, files = _by_id(store), _files(store)
    shards = json.loads((store / "manifest.json").read_text())["shards"]
    assert len(shards) >= 3
    old_shard = _shard_of(store, EDITED)

    _write_data(data, {EDITED})
    with caplog.at_level(logging.WARNING, logger="data.precompute"):
        _, stats = run_precompute(_config(tiny_overrides, data, store))
    assert stats.samples == 1 and f"'{EDITED}'" in caplog.text and "precompute.on_changed=recompute" in caplog.text

    fresh = tmp_path / "fresh"  # a precompute of the edited file from scratch
    run_precompute(_config(tiny_overrides, data, fresh))
    after, want = _by_id(store), FeatureStore(fresh)
    assert sorted(after) == sorted(before) == sorted(c["id"] for c in CONVERSATIONS)
    j = want.sample_ids().index(EDITED)
    assert after[EDITED]["input_ids"] == want[j]["input_ids"].numpy().tobytes() != before[EDITED]["input_ids"]
    assert after[EDITED]["loss_mask"] == want[j]["loss_mask"].numpy().tobytes()
    got = FeatureStore(store)
    assert_same_states(got[got.sample_ids().index(EDITED)]["hidden"], want[j]["hidden"], tiny_target)
    for sid in before:
        if sid != EDITED:
            assert after[sid] == before[sid], sid  # input ids, loss mask and hidden states: the same bytes

    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["complete"] and FeatureStore(store).verify() == []
    assert all(len(s["sample_hashes"]) == s["num_samples"] for s in manifest["shards"])
    for shard in manifest["shards"]:  # the shards without the edited sample: the same files, untouched
        if shard["file"] in files and shard["file"] != old_shard["file"]:
            assert (store / shard["file"]).read_bytes() == files[shard["file"]]
    assert old_shard["file"] not in {s["file"] for s in manifest["shards"]}  # rewritten under a new name...
    assert not (store / old_shard["file"]).exists()  # ...and the old file gone
    assert {p.relative_to(store).as_posix() for p in (store / "shards").iterdir()} == {
        s["file"] for s in manifest["shards"]}
    shard = _shard_of(store, EDITED)
    assert shard["sample_hashes"][shard["sample_ids"].index(EDITED)] == sample_hash(want[j]["input_ids"],
                                                                                  want[j]["loss_mask"])
    assert manifest["data_file"] == {"name": "data.jsonl", "bytes": data.stat().st_size, "sha256": sha256_file(data)}


@pytest.mark.unit
def test_refuse_names_the_changed_ids_and_the_setting_and_leaves_the_store(tiny_overrides, tmp_path):
    data, store = _write_data(tmp_path / "data.jsonl"), tmp_path / "store"
    run_precompute(_config(tiny_overrides, data, store))
    files = _files(store)

    _write_data(data, {EDITED})
    with pytest.raises(StoreError) as err:
        run_precompute(_config(tiny_overrides, data, store, "precompute.on_changed=refuse"))
    message = str(err.value)
    assert f"1 whose tokenized input changed ('{EDITED}')" in message, message
    assert "precompute.on_changed=recompute" in message
    assert _files(store) == files  # manifest and shards: the same bytes

    _write_data(data, {c["id"] for c in CONVERSATIONS})  # many: the first ten named, the rest counted
    with pytest.raises(StoreError, match=r"12 whose tokenized input changed \('c0', 'c1', .*'c9' and 2 more\)"):
        run_precompute(_config(tiny_overrides, data, store, "precompute.on_changed=refuse"))
    assert _files(store) == files


@pytest.mark.unit
def test_a_store_without_sample_hashes_resumes_by_content(tiny_overrides, tmp_path):
    """A store written before the manifest held `sample_hashes`: the hashes come from the shards' own input ids
    and loss masks, so an edited record is found as in a new store, and the manifest gains them."""
    data, store = _write_data(tmp_path / "data.jsonl"), tmp_path / "store"
    run_precompute(_config(tiny_overrides, data, store))
    before = _by_id(store)
    manifest = json.loads((store / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard.pop("sample_hashes", None)
    (store / "manifest.json").write_text(json.dumps(manifest, indent=1))

    _write_data(data, {EDITED})
    _, stats = run_precompute(_config(tiny_overrides, data, store))
    assert stats.samples == 1
    after = _by_id(store)
    assert after[EDITED]["input_ids"] != before[EDITED]["input_ids"]
    assert all(after[sid] == before[sid] for sid in before if sid != EDITED)
    assert all("sample_hashes" in s for s in json.loads((store / "manifest.json").read_text())["shards"])


# ---------------------------------------------------------------------------------------------- shard repair


@pytest.mark.unit
def test_a_rerun_repairs_a_shard_only_its_checksum_catches(tiny_overrides, tmp_path, caplog):
    data, store = _write_data(tmp_path / "data.jsonl"), tmp_path / "store"
    run_precompute(_config(tiny_overrides, data, store))  # a fresh precompute: what the repair must give back
    fresh_shards = [s["sha256"] for s in json.loads((store / "manifest.json").read_text())["shards"]]
    fresh = _by_id(store)
    damaged = store / json.loads((store / "manifest.json").read_text())["shards"][1]["file"]
    _flip_data_byte(damaged)
    FeatureStore(store, verify="header")  # size and header intact
    with pytest.raises(StoreError, match="sha256"):
        FeatureStore(store, verify="full")

    with caplog.at_level(logging.WARNING, logger="data.store"):
        _, stats = run_precompute(_config(tiny_overrides, data, store))
    assert f"{damaged}: sha256" in caplog.text and stats.samples > 0
    store_now = FeatureStore(store, verify="full")
    assert store_now.verify() == [] and store_now.manifest["complete"]
    assert [s["sha256"] for s in store_now.manifest["shards"]] == fresh_shards  # the fresh store, byte for byte
    assert _by_id(store) == fresh


def _samples(n=7, h=8, aux=0):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        t = 3 + 2 * i
        out.append(Sample(f"s{i}", torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                          torch.randn(t, h, generator=g), torch.randn(t, aux * h, generator=g) if aux else None))
    return out


def _writer(root, dtype="float32", aux=0):
    return StoreWriter(root, {"name": "tiny"}, hidden_size=8, dtype=dtype, shard_tokens=20,
                       captured={"hidden": "last_layer_pre_norm", **({"aux_layers": [1, 2][:aux]} if aux else {})})


@pytest.mark.unit
def test_verify_removes_a_stamp_that_vouches_for_a_corrupt_shard_so_a_resume_repairs_it(tmp_path, caplog):
    w = _writer(tmp_path)
    for s in _samples():
        w.add(s)
    w.close()
    FeatureStore(tmp_path, verify="full")  # stamped
    shard = tmp_path / w.manifest["shards"][1]["file"]
    _flip_data_byte(shard, keep_mtime=True)  # bit rot: size and mtime as stamped
    FeatureStore(tmp_path, verify="full")  # the stamp vouches for it: no hashing
    assert FeatureStore(tmp_path, require_complete=False).verify() == [str(shard)]  # `spechead verify`
    assert not (tmp_path / STAMP).exists()
    with caplog.at_level(logging.WARNING, logger="data.store"):
        w2 = _writer(tmp_path)
    assert f"{shard}: sha256" in caplog.text and not shard.exists()
    assert w2.done_ids == set(w.manifest["shards"][0]["sample_ids"]) and not w2.complete


# -------------------------------------------------------------------------------------- removing samples


@pytest.mark.unit
@pytest.mark.parametrize("dtype,aux", [("float32", 0), ("fp8", 2)])
def test_drop_samples_keeps_every_other_sample_and_survives_a_kill(tmp_path, monkeypatch, dtype, aux):
    samples = _samples(aux=aux)
    w = _writer(tmp_path, dtype, aux)
    for s in samples:
        w.add(s)
    w.close()
    shards = w.manifest["shards"]
    part = {shards[0]["sample_ids"][1]}  # a shard that keeps some samples...
    whole = set(shards[1]["sample_ids"])  # ...one emptied, and one untouched after them
    assert len(shards) == 3 and len(shards[0]["sample_ids"]) > 1
    raw = {}  # every stored tensor byte of each sample, fp8 codes and scales included
    for shard in shards:
        with store_mod.safe_open(tmp_path / shard["file"], framework="pt") as f:
            offs = f.get_tensor("offsets").tolist()
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != "offsets"}
        for j, sid in enumerate(shard["sample_ids"]):
            raw[sid] = {k: v[offs[j]:offs[j + 1]].view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}
    files = _files(tmp_path)

    # killed before the manifest switches: the store as it was, the new file removed by the next writer
    w2 = _writer(tmp_path, dtype, aux)
    monkeypatch.setattr(w2, "_write_manifest", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        w2.drop_samples(whole | part)
    assert {k: v for k, v in _files(tmp_path).items() if k in files} == files and len(_files(tmp_path)) > len(files)
    FeatureStore(tmp_path, verify="full")
    w3 = _writer(tmp_path, dtype, aux)
    assert _files(tmp_path) == files  # the unlisted file left by the kill is gone

    w3.drop_samples(whole | part)
    assert w3.done_ids == {s.sample_id for s in samples} - whole - part and not w3.complete
    for s in samples:  # added again, under names that collide with none listed
        if s.sample_id in whole | part:
            w3.add(s)
    w3.close()
    store = FeatureStore(tmp_path, verify="full")
    assert sorted(store.sample_ids()) == sorted(s.sample_id for s in samples) and store.verify() == []
    names = [s["file"] for s in store.manifest["shards"]]
    assert len(names) == len(set(names)) and sorted(p.name for p in (tmp_path / "shards").iterdir()) == sorted(
        Path(n).name for n in names)
    for shard in store.manifest["shards"]:
        with store_mod.safe_open(tmp_path / shard["file"], framework="pt") as f:
            offs = f.get_tensor("offsets").tolist()
            tensors = {k: f.get_tensor(k) for k in f.keys() if k != "offsets"}
        for j, sid in enumerate(shard["sample_ids"]):
            if sid not in whole | part:  # kept: the same bytes
                assert {k: v[offs[j]:offs[j + 1]].view(torch.uint8).numpy().tobytes()
                        for k, v in tensors.items()} == raw[sid], sid
            assert shard["sample_hashes"][j] == sample_hash(tensors["input_ids"][offs[j]:offs[j + 1]],
                                                            tensors["loss_mask"][offs[j]:offs[j + 1]])
