"""A target named by its Hugging Face Hub id (data/hub.py): `target.path=<org/name>` at `target.revision` resolves to
its snapshot in a Hub cache laid out as the hub client writes it (refs/, snapshots/ of relative symlinks, blobs/),
offline (HF_HUB_OFFLINE=1, HF_HUB_CACHE or HF_HOME set by the test); the fingerprint records the repo and commit as
provenance and equals the same files' at a local path; each way it can fail is named, with what to do; the checks
before work resolve it and check the snapshot; and precompute runs on it end to end."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.fingerprint import compare_fingerprints, same_target_but_method
from data.hub import HUB_FILES, HubTargetError, hub_cache_dir, hub_snapshot, is_hub_id
from data.sources import resolve_target_dir, target_config
from scripts.checks import TOKENIZER_FILES, ConfigError, check_before_work, check_target
from tests.conftest import CONVERSATIONS, ROOT, compose_config

REPO = "org/tiny"


def write_hub_cache(cache: Path, repo_id: str, files: Path, skip: tuple[str, ...] = (),
                    refs: tuple[str, ...] = ("main",)) -> str:
    """`files`' files as huggingface_hub's cache holds a snapshot of `repo_id`: each file's bytes in
    blobs/<sha256>, snapshots/<commit>/<name> a relative symlink to it, refs/<ref> the commit hash. The commit
    (40 hex digits, as the Hub's) is derived from the files' hashes: another set of files is another commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shas = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(files.iterdir())
            if f.is_file() and f.name not in skip}
    commit = hashlib.sha1(json.dumps(shas, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, sha in shas.items():
        (repo / "blobs" / sha).write_bytes((files / name).read_bytes())
        (snapshot / name).symlink_to(Path("..", "..", "blobs", sha))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


def snapshot_dir(cache: Path, repo_id: str, commit: str) -> Path:
    return cache.resolve() / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache in HF_HUB_CACHE, offline; the user's own HF_HOME and token out of the way."""
    cache = tmp_path / "hf_hub_cache"
    cache.mkdir()
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def cached_tiny(hub_cache, tiny_target) -> tuple[Path, str]:
    """The tiny target in the Hub cache as `org/tiny` (refs main and v1): (cache, commit)."""
    return hub_cache, write_hub_cache(hub_cache, REPO, tiny_target, refs=("main", "v1"))


@pytest.mark.unit
@pytest.mark.parametrize("path, hub", [("org/tiny", True), ("gpt2", True), ("Org-1/name_2.5", True),
                                       ("./tiny", False), ("../org/tiny", False), ("/org/tiny", False),
                                       ("~/tiny", False), (".tiny", False), ("org/.tiny", False), ("a/b/c", False),
                                       ("org/ti ny", False), ("org/..", False), ("", False), (None, False)])
def test_what_reads_as_a_hub_id(path, hub):
    assert is_hub_id(path) is hub


@pytest.mark.unit
def test_an_existing_local_path_is_a_directory_even_shaped_like_an_id(tmp_path, tiny_target, monkeypatch, hub_cache):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_target, tmp_path / "org" / "tiny")  # nothing of it in the Hub cache
    assert not is_hub_id(REPO) and hub_snapshot(REPO) is None
    assert resolve_target_dir(REPO, None) == Path(REPO)
    assert "source" not in target_config({"path": REPO, "name": "tiny", "dtype": "float32"}).fingerprint


@pytest.mark.unit
def test_the_cache_directory_is_read_from_the_environment_when_resolving(tmp_path, monkeypatch):
    """huggingface_hub's constants are fixed at its import; hub_cache_dir follows the environment as it is now."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache_dir() == tmp_path / "cache"


@pytest.mark.unit
def test_a_hub_id_resolves_to_its_snapshot_once(cached_tiny, tiny_target, monkeypatch):
    cache, commit = cached_tiny
    import huggingface_hub

    calls = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(k) or real(*a, **k))
    got = resolve_target_dir(REPO, None)
    assert got == snapshot_dir(cache, REPO, commit) and (got / "config.json").is_symlink()
    assert (got / "model.safetensors").read_bytes() == (tiny_target / "model.safetensors").read_bytes()
    # offline from the environment as it is now, in the cache it names, only the files a stage reads
    assert len(calls) == 1 and calls[0]["local_files_only"] is True and calls[0]["cache_dir"] == str(cache)
    assert calls[0]["allow_patterns"] == HUB_FILES
    # the checks before work and the stage share the resolution
    assert check_target({"path": REPO}) == got and resolve_target_dir(REPO, None) == got and len(calls) == 1


@pytest.mark.unit
def test_hf_home_places_the_cache_too(tmp_path, tiny_target, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = write_hub_cache(tmp_path / "hf_home" / "hub", REPO, tiny_target)
    assert resolve_target_dir(REPO, None) == snapshot_dir(tmp_path / "hf_home" / "hub", REPO, commit)


@pytest.mark.unit
def test_the_fingerprint_records_the_source_and_equals_the_local_targets(cached_tiny, tiny_overrides):
    cache, commit = cached_tiny
    local = target_config(compose_config(tiny_overrides).target)
    hub = target_config(compose_config([*tiny_overrides, f"target.path={REPO}"]).target)
    assert hub.dir == snapshot_dir(cache, REPO, commit) and (hub.hub_repo, hub.hub_commit) == (REPO, commit)
    assert hub.fingerprint["source"] == {"hub": REPO, "revision": commit}
    assert "source" not in local.fingerprint and local.hub_repo is None
    # the same files from the Hub or a local path: one target, both ways, and a store of one resumes from the other
    assert compare_fingerprints(hub.fingerprint, local.fingerprint) == ({}, [])
    assert compare_fingerprints(local.fingerprint, hub.fingerprint) == ({}, [])
    assert same_target_but_method(local.fingerprint, hub.fingerprint)
    assert same_target_but_method(hub.fingerprint, local.fingerprint)
    # the identity is still compared: another dtype is another target
    other = target_config(compose_config([*tiny_overrides, f"target.path={REPO}", "target.dtype=bfloat16"]).target)
    assert compare_fingerprints(other.fingerprint, local.fingerprint)[0].keys() == {"compute_dtype"}


@pytest.mark.unit
def test_a_revision_resolves_to_its_commit_and_a_missing_one_is_named(cached_tiny, tiny_overrides):
    cache, commit = cached_tiny
    for revision in (commit, "v1"):  # a commit, a tag: the fingerprint records the commit either way
        tc = target_config(compose_config([*tiny_overrides, f"target.path={REPO}", f"target.revision={revision}"])
                           .target)
        assert tc.dir == snapshot_dir(cache, REPO, commit) and tc.fingerprint["source"]["revision"] == commit
    with pytest.raises(HubTargetError) as err:
        target_config(compose_config([*tiny_overrides, f"target.path={REPO}", "target.revision=v9"]).target)
    message = str(err.value)
    assert message.startswith(f"target.path={REPO}: ") and "target.revision=v9" in message
    assert str(cache) in message and "HF_HUB_OFFLINE is set" in message
    assert f"`hf download {REPO} --revision v9`" in message


@pytest.mark.unit
def test_a_repo_not_in_the_cache_is_named_with_where_it_looked(cached_tiny):
    cache, _ = cached_tiny
    with pytest.raises(HubTargetError) as err:
        resolve_target_dir("org/absent", None)
    message = str(err.value)
    assert message.startswith("target.path=org/absent: no such local directory") and str(cache) in message
    assert "HF_HUB_OFFLINE is set" in message and "`hf download org/absent`" in message
    assert "set target.path to a local checkpoint directory" in message and "target.revision" not in message
    with pytest.raises(ConfigError) as refused:  # the checks before work: the same message
        check_target({"path": "org/absent"})
    assert str(refused.value) == message


def hub_http_error(cls: type[Exception]) -> Exception:
    """One of the hub client's HTTP errors, as it raises them (a response from the Hub's API)."""
    import huggingface_hub.errors as hub_errors

    http = importlib.import_module(hub_errors.Response.__module__.split(".")[0])  # the HTTP client the hub uses
    request = http.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    return cls("from the Hub", response=http.Response(404, request=request))


@pytest.mark.unit
@pytest.mark.parametrize("error, words", [
    ("GatedRepoError", ["a gated repository", f"https://huggingface.co/{REPO}", "set HF_TOKEN"]),
    ("RepositoryNotFoundError", ["nor a repository on the Hugging Face Hub", "private one: set HF_TOKEN"]),
    ("RevisionNotFoundError", ["no such revision (target.revision=v2)", "set target.revision to one of its"]),
])
def test_each_hub_error_is_named_with_what_to_do(error, words, hub_cache, monkeypatch):
    """Online, the Hub's own refusals (raised here by a stand-in for the client's download): each its message."""
    import huggingface_hub
    import huggingface_hub.errors as hub_errors

    def refuse(*a, **k):
        raise hub_http_error(getattr(hub_errors, error))

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HubTargetError) as err:
        hub_snapshot(REPO, "v2")
    message = str(err.value)
    assert message.startswith(f"target.path={REPO}: ") and "target.revision=v2" in message
    assert all(w in message for w in words), message
    assert isinstance(err.value.__cause__, getattr(hub_errors, error))


@pytest.mark.unit
def test_an_unreachable_hub_is_told_apart_from_offline(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*a, **k):
        try:
            raise ConnectionError("name resolution failed")
        except ConnectionError as e:
            raise LocalEntryNotFoundError("not in the cache") from e

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(HubTargetError, match=r"while the Hub was unreachable \(ConnectionError\)") as err:
        hub_snapshot(REPO)
    assert "HF_HUB_OFFLINE" not in str(err.value) and str(hub_cache) in str(err.value)


@pytest.mark.unit
def test_a_revision_without_a_hub_id_is_refused(tiny_target, hub_cache):
    for path in (str(tiny_target), None):
        with pytest.raises(HubTargetError, match=r"^target.revision=main: only a Hugging Face Hub id target.path"):
            resolve_target_dir(path, "smollm2_gguf", "main")
    with pytest.raises(ConfigError, match=rf"target.revision=main: .* target.path={tiny_target} is a local path"):
        check_target({"path": str(tiny_target), "revision": "main"})


@pytest.mark.unit
def test_a_snapshot_without_weights_is_refused_naming_it(hub_cache, tiny_target):
    commit = write_hub_cache(hub_cache, REPO, tiny_target, skip=("model.safetensors",))
    with pytest.raises(HubTargetError) as err:
        hub_snapshot(REPO)
    assert str(err.value).startswith(f"target.path={REPO}: the Hugging Face Hub snapshot "
                                     f"{snapshot_dir(hub_cache, REPO, commit)} holds no *.safetensors weights")


@pytest.mark.unit
def test_the_checks_before_work_resolve_the_id_and_check_the_snapshot(cached_tiny, tiny_overrides, tiny_target,
                                                                      caplog):
    cache, commit = cached_tiny
    assert set(TOKENIZER_FILES) <= set(HUB_FILES)  # every tokenizer file the checks look for is fetched
    snapshot = snapshot_dir(cache, REPO, commit)
    assert check_target({"path": REPO, "revision": "v1"}) == snapshot
    for stage in ("precompute", "train", "pipeline"):
        check_before_work(compose_config([*tiny_overrides, f"target.path={REPO}"]), stage)
    # a repo without tokenizer files: refused, naming the id and the snapshot
    bare = write_hub_cache(cache, "org/bare", tiny_target, skip=TOKENIZER_FILES)
    with pytest.raises(ConfigError) as err:
        check_target({"path": "org/bare"})
    assert str(err.value).startswith(f"target.path=org/bare (the Hub snapshot {snapshot_dir(cache, 'org/bare', bare)})"
                                     ": no tokenizer files")
    # the checkpoint's own code is warned of, in the snapshot's config.json
    config = json.loads((tiny_target / "config.json").read_text())
    remote = cache / "remote_files"
    remote.mkdir()
    for f in tiny_target.iterdir():
        (remote / f.name).write_bytes(f.read_bytes())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.XConfig"}}))
    remote_commit = write_hub_cache(cache, "org/remote", remote)
    with caplog.at_level("WARNING", logger="scripts.checks"):
        check_target({"path": "org/remote"})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(snapshot_dir(cache, "org/remote", remote_commit)) in said[0]


def test_precompute_runs_on_a_hub_id(cached_tiny, tiny_overrides, tiny_target, tmp_path):
    """`python -m scripts.precompute target.path=org/tiny data.source=hf 'data.path=<dir>/*.parquet'` offline (the
    README's "Your own model and data"): the store is complete, its manifest records the repo and commit, and it is
    the local target's store (it opens against that fingerprint and resumes from it)."""
    import datasets

    from data.store import FeatureStore
    from experiments.stages import run_precompute

    cache, commit = cached_tiny
    store_dir = tmp_path / "store"
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, part in enumerate((CONVERSATIONS[:5], CONVERSATIONS[5:])):
        datasets.Dataset.from_list(part).to_parquet(shards / f"train-{i}.parquet")
    data = ["data.source=hf", f"data.path={shards}/*.parquet"]
    local = [o for o in tiny_overrides if not o.startswith(("target.path=", "data.source=", "data.path="))] + data
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"), "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scripts.precompute", *local, f"target.path={REPO}", f"store_dir={store_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["target_fingerprint"]["source"] == {"hub": REPO, "revision": commit}
    local_fp = target_config(compose_config(tiny_overrides).target).fingerprint
    store = FeatureStore(store_dir, local_fp, verify_on_open=True)
    assert len(store) == len(CONVERSATIONS)
    # the same store, resumed from the local directory: nothing left to do, nothing refused
    run_precompute(compose_config([*tiny_overrides, *data, f"store_dir={store_dir}"]))
    after = json.loads((store_dir / "manifest.json").read_text())
    assert after["complete"] and after["shards"] == manifest["shards"]
    assert after["target_fingerprint"]["source"] == {"hub": REPO, "revision": commit}
