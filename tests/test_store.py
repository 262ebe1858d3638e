"""The feature store: round trip, checksums, fingerprint refusal, atomic resume."""

import json

import pytest
import torch

from data.store import FeatureStore, Sample, StoreError, StoreWriter
from safetensors import safe_open

FP = {"name": "tiny", "config_sha256": "c", "weights_sha256": "w", "tokenizer_sha256": "t"}


def _samples(n=7, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 3 + i * 2
        out.append(Sample(f"s{i}", torch.randint(0, 100, (t,), generator=g), torch.randint(0, 2, (t,), generator=g),
                          torch.randn(t, h, generator=g)))
    return out


@pytest.mark.unit
def test_round_trip_and_shards(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    samples = _samples()
    for s in samples:
        w.add(s)
    w.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1
    assert sum(s["num_tokens"] for s in manifest["shards"]) == sum(len(s.input_ids) for s in samples)
    store = FeatureStore(tmp_path, FP)
    assert len(store) == len(samples)
    assert store.lengths() == [len(s.input_ids) for s in samples]
    for i, s in enumerate(samples):
        got = store[i]
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask.bool())
        assert torch.equal(got["hidden"], s.hidden)
    assert store.verify() == []


@pytest.mark.unit
def test_bf16_storage_rounds_once(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="bfloat16")
    s = _samples(1)[0]
    w.add(s)
    w.close()
    got = FeatureStore(tmp_path)[0]["hidden"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, s.hidden.to(torch.bfloat16))


@pytest.mark.unit
def test_flipped_byte_is_named(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples():
        w.add(s)
    w.close()
    shard = sorted((tmp_path / "shards").glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert FeatureStore(tmp_path).verify() == [str(shard)]


@pytest.mark.unit
def test_refuses_other_target(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8)
    w.add(_samples(1)[0])
    w.close()
    with pytest.raises(StoreError, match="another target or tokenizer.*weights_sha256: stored 'w', configured 'other'"):
        FeatureStore(tmp_path, {**FP, "weights_sha256": "other"})
    with pytest.raises(StoreError, match="tokenizer_sha256"):
        FeatureStore(tmp_path, {**FP, "tokenizer_sha256": "other"})


@pytest.mark.unit
def test_incomplete_store_refused_then_resumed(tmp_path):
    samples = _samples()
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in samples[:4]:
        w.add(s)  # shards flushed for what crossed the budget; no close(): a killed run
    done = w.done_ids
    assert done and done < {s.sample_id for s in samples}
    with pytest.raises(StoreError, match="incomplete"):
        FeatureStore(tmp_path)
    w2 = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    assert w2.done_ids == done
    for s in samples:
        if s.sample_id not in w2.done_ids:
            w2.add(s)
    w2.close()
    store = FeatureStore(tmp_path)
    assert [store[i]["input_ids"].tolist() for i in range(len(store))] == [s.input_ids.tolist() for s in samples]
    with pytest.raises(StoreError, match="other settings"):
        StoreWriter(tmp_path, {**FP, "weights_sha256": "x"}, hidden_size=8, dtype="float32")


# ------------------------------------------------------------------------------------------- fp8


def _write(root, samples, dtype, fp=FP, shard_tokens=1 << 18, h=8):
    w = StoreWriter(root, fp, hidden_size=h, dtype=dtype, shard_tokens=shard_tokens)
    for s in samples:
        w.add(s)
    w.close()
    return FeatureStore(root)


@pytest.mark.unit
def test_fp8_round_trip_within_e4m3_precision(tmp_path):
    from safetensors import safe_open

    g = torch.Generator().manual_seed(1)
    h = 64
    # rows spanning magnitudes (pre-norm states have a few large channels), plus an all-zero row
    hidden = torch.randn(40, h, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    hidden[:, 3] *= 50
    hidden[7] = 0
    sample = Sample("a", torch.arange(40), torch.ones(40, dtype=torch.long), hidden)
    store = _write(tmp_path, [sample], "fp8", h=h)
    assert store.manifest["dtype"] == "float8_e4m3fn" and "hidden_scale" in store.manifest
    with safe_open(tmp_path / store.manifest["shards"][0]["file"], framework="pt") as f:
        assert f.get_tensor("hidden").dtype == torch.float8_e4m3fn
        scale = f.get_tensor("hidden_scale")
    assert scale.dtype == torch.float32 and scale.shape == (40,) and scale[7] == 1.0
    torch.testing.assert_close(scale[:7], hidden[:7].abs().amax(-1) / 448)
    got = store[0]["hidden"]
    assert got.dtype == torch.float32 and got.shape == hidden.shape  # no compute_dtype in FP: float32
    assert torch.equal(got[7], torch.zeros(h))
    err = (got - hidden).abs()
    normal = hidden.abs() >= (hidden.abs().amax(-1, keepdim=True) / (448 * 2**6))
    assert (err[normal] <= hidden.abs()[normal] / 16).all()  # 3 mantissa bits: half an ulp ≤ 2^-4
    assert (err[~normal] <= (scale[:, None] * 2**-10).expand_as(err)[~normal]).all()
    assert err[normal].max() > 0  # it was quantized, not stored exactly
    rel = err.norm() / hidden.norm()
    assert 1e-3 < rel < 0.04


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_a_subset_of_the_aux_layers_reads_as_a_store_capturing_only_them(tmp_path, dtype):
    """`select_aux_layers`: a store capturing layers [1, 3, 5, 6] returns, for [6, 3], what a store capturing
    [6, 3] alone holds — bit for bit, fp8 included (one scale per token and layer), also through a pickled copy
    (DataLoader workers); a layer it lacks, a repeated one or none at all is refused naming the store's layers."""
    import pickle

    g = torch.Generator().manual_seed(3)
    h, layers = 8, [1, 3, 5, 6]
    magnitudes = torch.tensor([1.0, 30.0, 0.01, 5.0]).repeat_interleave(h)  # per layer: fp8 scales them apart
    samples = [Sample(f"s{i}", torch.arange(t), torch.ones(t, dtype=torch.long), torch.randn(t, h, generator=g),
                      torch.randn(t, len(layers) * h, generator=g) * magnitudes) for i, t in enumerate((5, 9))]

    def write(root, keep):
        w = StoreWriter(root, FP, hidden_size=h, dtype=dtype, captured={"aux_layers": keep})
        for s in samples:
            cols = torch.cat([s.aux_hidden[:, layers.index(i) * h:(layers.index(i) + 1) * h] for i in keep], dim=1)
            w.add(Sample(s.sample_id, s.input_ids, s.loss_mask, s.hidden, cols))
        w.close()
        return FeatureStore(root)

    full, only = write(tmp_path / "full", layers), write(tmp_path / "only", [6, 3])
    assert full.read_aux_layers == layers and full[0]["aux_hidden"].shape == (5, 4 * h)
    full.select_aux_layers([6, 3])
    assert full.aux_layers == layers and full.read_aux_layers == [6, 3]
    for store in (full, pickle.loads(pickle.dumps(full))):
        for i in range(2):
            assert store[i]["aux_hidden"].shape[1] == 2 * h
            assert torch.equal(store[i]["aux_hidden"], only[i]["aux_hidden"])
            assert torch.equal(store[i]["hidden"], only[i]["hidden"])
    full.select_aux_layers(layers)
    assert torch.equal(full[1]["aux_hidden"], write(tmp_path / "again", layers)[1]["aux_hidden"])
    for bad, says in (([2, 3], r"\[2\] not among them"), ([3, 3], "distinct"), ([], "non-empty")):
        with pytest.raises(StoreError, match=r"holds aux layers \[1, 3, 5, 6\]; cannot read .*" + says):
            full.select_aux_layers(bad)


@pytest.mark.unit
def test_fp8_reads_back_in_compute_dtype(tmp_path):
    s = _samples(1, h=16)[0]
    store = _write(tmp_path, [s], "fp8", fp={**FP, "compute_dtype": "bfloat16"}, h=16)
    assert store.manifest["dequantized_dtype"] == "bfloat16"
    got = store[0]["hidden"]
    assert got.dtype == torch.bfloat16
    bound = s.hidden.abs() / 16 + 2**-7 * s.hidden.abs().amax(-1, keepdim=True)  # e4m3, then bf16 rounding
    assert ((got.float() - s.hidden).abs() <= bound).all()


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_bytes_per_token(tmp_path, dtype):
    """input_ids int32 (4) + loss_mask uint8 (1) (+ fp8 scale fp32 (4)) + header and offsets amortised."""
    h = 64
    g = torch.Generator().manual_seed(2)
    samples = [Sample(f"sample-{i}", torch.randint(0, 50000, (n,), generator=g), torch.ones(n, dtype=torch.long),
                      torch.randn(n, h, generator=g)) for i, n in enumerate(torch.randint(50, 400, (40,), generator=g))]
    store = _write(tmp_path, samples, dtype, shard_tokens=4096, h=h)
    tokens = sum(s["num_tokens"] for s in store.manifest["shards"])
    size = sum((tmp_path / s["file"]).stat().st_size for s in store.manifest["shards"])
    assert len(store.manifest["shards"]) > 1
    bound = 2 * h + 16 if dtype == "bfloat16" else h + 24
    assert size / tokens <= bound, f"{dtype}: {size / tokens:.2f} bytes/token"


@pytest.mark.unit
@pytest.mark.parametrize("first,second", [("bfloat16", "fp8"), ("fp8", "bfloat16"), ("fp8", "float32")])
def test_resume_refuses_other_dtype(tmp_path, first, second):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype=first, shard_tokens=20)
    for s in _samples():
        w.add(s)  # killed before close()
    assert w.done_ids
    with pytest.raises(StoreError, match="differs in dtype"):
        StoreWriter(tmp_path, FP, hidden_size=8, dtype=second, shard_tokens=20)
    StoreWriter(tmp_path, FP, hidden_size=8, dtype={"bfloat16": "bf16", "fp8": "float8_e4m3fn"}[first])  # aliases
    with pytest.raises(StoreError, match="not supported"):
        StoreWriter(tmp_path / "other", FP, hidden_size=8, dtype="int8")


# -------------------------------------------------------------------------------- robustness


@pytest.mark.unit
def test_stale_temp_files_do_not_break_resume(tmp_path):
    samples = _samples()
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in samples[:4]:
        w.add(s)
    # a kill mid-write leaves temp files, half-written
    (tmp_path / ".manifest.json.tmp").write_text('{"schema_vers')
    nxt = len(w.manifest["shards"])
    (tmp_path / "shards" / f".shard-{nxt:05d}.safetensors.tmp").write_bytes(b"\x00" * 10)
    w2 = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    assert not list(tmp_path.rglob(".*.tmp"))
    for s in samples:
        if s.sample_id not in w2.done_ids:
            w2.add(s)
    w2.close()
    assert not list(tmp_path.rglob(".*.tmp"))
    store = FeatureStore(tmp_path)
    assert store.verify() == [] and len(store) == len(samples)


def _corrupt_second_shard(tmp_path):
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples():
        w.add(s)
    w.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    shard = tmp_path / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # after the safetensors header
    data[(start + len(data)) // 2] ^= 0x01  # one bit, in the tensor data
    shard.write_bytes(bytes(data))
    return shard, manifest["shards"][0]["num_samples"]


@pytest.mark.unit
def test_verify_on_open_names_the_shard(tmp_path):
    shard, first = _corrupt_second_shard(tmp_path)
    with pytest.raises(StoreError, match=f"{shard}: sha256 .* does not match"):
        FeatureStore(tmp_path, verify_on_open=True)  # the older spelling of verify="full": checked at open
    with pytest.raises(StoreError, match=f"{shard}: sha256 .* does not match"):
        FeatureStore(tmp_path, verify="full")
    store = FeatureStore(tmp_path)  # verify="header": sizes and headers only, the flipped data bit passes
    assert store.verify() == [str(shard)]
    assert store[first]["input_ids"].numel() > 0


def test_cli_verify_exits_1_and_names_the_shard(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    shard, _ = _corrupt_second_shard(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", "verify", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"CORRUPT {shard}" in proc.stdout and "1 corrupt shard" in proc.stdout


@pytest.mark.unit
def test_verify_says_incomplete_and_what_resumes_it(tmp_path):
    """An interrupted store is not `ok`: its finished shards are checked and the report says it is incomplete, with
    the command that resumes it (exit 2); complete, it is `ok` (0); a rank layout not yet merged says which to run."""
    from scripts.cli import verify_store

    w = StoreWriter(tmp_path / "s", FP, hidden_size=8, dtype="float32", shard_tokens=20)
    for s in _samples():
        w.add(s)
    w._flush()  # a finished shard, the store not closed: what a killed precompute leaves
    lines, code = verify_store(str(tmp_path / "s"))
    assert code == 2 and lines[0].startswith(f"incomplete: {tmp_path / 's'}") and "rerun the same precompute" in lines[0]
    shards = w.manifest["shards"]
    assert f"({len(shards)} finished shard(s), {sum(sh['num_samples'] for sh in shards)} samples" in lines[0]
    w.close()
    assert verify_store(str(tmp_path / "s")) == (["ok"], 0)
    (tmp_path / "r" / "ranks" / "rank-0").mkdir(parents=True)
    lines, code = verify_store(str(tmp_path / "r"))
    assert code == 2 and "precompute-merge" in lines[0] and "ranks/" in lines[0]


def test_cli_verify_reports_a_truncated_shard(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    shard, _ = _corrupt_second_shard(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated: caught by the size check when the store opens
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", "verify", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("CORRUPT") and str(shard) in proc.stdout


def _write_all(root, samples, **kw):
    w = StoreWriter(root, FP, hidden_size=8, dtype="float32", shard_tokens=20, **kw)
    for s in samples:
        w.add(s)
    w.close()
    return w


@pytest.mark.unit
def test_the_background_writer_writes_the_same_store_byte_for_byte(tmp_path, monkeypatch):
    """`background=True` (precompute's): the shards, written on the writer's thread while samples are added, are
    the synchronous writer's byte for byte, manifest included; the caller never has more than the shard being
    written and one more handed over (memory bounded), and what it waited is counted."""
    import threading
    import time

    import data.store as store_mod

    samples = _samples(n=12)
    _write_all(tmp_path / "sync", samples)
    real, seen = store_mod.write_safetensors, []

    def slow(tensors, path, metadata=None):  # a slow disk: the caller gets ahead of the writer
        seen.append((threading.current_thread().name, len(w._writing)))
        time.sleep(0.05)
        return real(tensors, path, metadata)

    monkeypatch.setattr(store_mod, "write_safetensors", slow)
    w = StoreWriter(tmp_path / "bg", FP, hidden_size=8, dtype="float32", shard_tokens=20, background=True)
    for s in samples:
        w.add(s)
    w.close()
    names = sorted(p.relative_to(tmp_path / "sync") for p in (tmp_path / "sync").rglob("*") if p.is_file())
    assert len([n for n in names if n.suffix == ".safetensors"]) > 3
    assert names == sorted(p.relative_to(tmp_path / "bg") for p in (tmp_path / "bg").rglob("*") if p.is_file())
    for name in names:
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "bg" / name).read_bytes(), name
    assert all(thread.startswith("store-writer") for thread, _ in seen) and max(n for _, n in seen) <= 2
    assert w.wait_s > 0.05  # the last shard, at least, was waited for


@pytest.mark.unit
@pytest.mark.parametrize("failure", ["full_disk", "crash"])
def test_a_failed_background_write_names_its_shard_and_stops_the_later_ones(tmp_path, monkeypatch, failure):
    """A write that fails on the writer's thread is raised in the caller by the next `add` or by `close` — a full
    disk as DiskFull naming the shard, anything else as a StoreError naming it — and no later shard is written
    after it: the store lists the shards before it, incomplete, and a rerun resumes from there."""
    import errno

    import data.store as store_mod
    from core.files import DiskFull

    real, calls = store_mod.write_safetensors, []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            if failure == "full_disk":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            raise ValueError("a bug in the writer")
        return real(tensors, path, metadata)

    monkeypatch.setattr(store_mod, "write_safetensors", failing)
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20, background=True)
    expected = DiskFull if failure == "full_disk" else StoreError
    with pytest.raises(expected, match=r"shard-00001\.safetensors") as err:
        for s in _samples(n=12):
            w.add(s)
        w.close()
    if failure == "crash":
        assert "writing shard shards/shard-00001.safetensors failed: ValueError: a bug in the writer" in str(err.value)
    while w._writing:  # the shards queued behind the failed one refuse to write
        with pytest.raises(StoreError, match="an earlier shard's write failed"):
            w._writing.popleft().result()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shards/shard-00000.safetensors"] and not manifest["complete"]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["shard-00000.safetensors"]
    monkeypatch.setattr(store_mod, "write_safetensors", real)
    samples = _samples(n=12)
    again = StoreWriter(tmp_path, FP, hidden_size=8, dtype="float32", shard_tokens=20, background=True)
    for s in samples:
        if s.sample_id not in again.done_ids:
            again.add(s)
    again.close()
    _write_all(tmp_path / "whole", samples)
    for name in ("manifest.json", *(f"shards/{p.name}" for p in (tmp_path / "whole" / "shards").iterdir())):
        assert (tmp_path / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "fp8"])
def test_shards_are_hashed_as_written_and_are_save_files_bytes(tmp_path, monkeypatch, dtype):
    """A shard is written by core/safetensors_io.py `write_safetensors`, which hashes the bytes as it writes them: the
    manifest's sha256 is the file's, the file is never read back to hash it, and its bytes are what safetensors'
    own `save_file` writes for the same tensors (aux layers and fp8 scales included), so stores stay the same."""
    import hashlib

    from safetensors.torch import save_file

    import data.store as store_mod

    def no_reread(path, *a, **kw):
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(store_mod, "sha256_file", no_reread)
    g = torch.Generator().manual_seed(3)
    samples = [Sample(s.sample_id, s.input_ids, s.loss_mask, s.hidden, torch.randn(s.hidden.shape[0], 16, generator=g))
               for s in _samples(n=9)]
    w = StoreWriter(tmp_path, FP, hidden_size=8, dtype=dtype, shard_tokens=20,
                    captured={"hidden": "last_layer_pre_norm", "aux_layers": [1, 2]})
    for s in samples:
        w.add(s)
    w.close()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2
    for shard in manifest["shards"]:
        path = tmp_path / shard["file"]
        data = path.read_bytes()
        assert shard["sha256"] == hashlib.sha256(data).hexdigest() and shard["bytes"] == len(data)
        with safe_open(str(path), "pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
        assert {"aux_hidden", "hidden"} <= set(tensors) and (dtype != "fp8" or "aux_scale" in tensors)
        save_file(tensors, tmp_path / "ref.safetensors", metadata=metadata)
        assert (tmp_path / "ref.safetensors").read_bytes() == data, shard["file"]
    monkeypatch.undo()
    FeatureStore(tmp_path, FP, verify="full")  # and the reader's own sha256 check agrees


@pytest.mark.unit
def test_write_safetensors_writes_save_files_bytes_for_any_metadata(tmp_path):
    """The header as safetensors writes it: metadata with quotes, backslashes, control and non-ASCII characters,
    empty and 0-d tensors, every dtype a store or a head uses, the tensors ordered by dtype and then name."""
    import hashlib

    from safetensors.torch import save_file

    from core.safetensors_io import write_safetensors

    tensors = {"b": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a": torch.tensor(1.5), "z": torch.ones(0, 4),
               "m": torch.randn(3, 5).bfloat16(), "h": torch.randn(4).half(), "q": torch.randn(7).to(torch.float8_e4m3fn),
               "u": torch.arange(5, dtype=torch.uint8), "i": torch.arange(3, dtype=torch.int32), "t": torch.randn(2, 3).t()}
    # one metadata key, as a shard has: safetensors orders several keys by its hash map, differently per process
    for metadata in (None, {"sample_ids": json.dumps(["a\"b\\c", "é\n\t\x01", "/"])}, {"x": "é\x7f" * 5}, {"y": ""}):
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors", metadata=metadata)
        digest = write_safetensors(tensors, tmp_path / "ours.safetensors", metadata)
        ref = (tmp_path / "ref.safetensors").read_bytes()
        assert (tmp_path / "ours.safetensors").read_bytes() == ref and digest == hashlib.sha256(ref).hexdigest()
    with pytest.raises(ValueError, match="CPU tensors"):
        write_safetensors({"x": torch.ones(1, device="meta")}, tmp_path / "meta.safetensors")
