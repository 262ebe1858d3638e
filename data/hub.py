"""A target named by its Hugging Face Hub id: `target.path=<org/name>` (optionally `target.revision=<branch, tag or
commit>`) resolved to a snapshot directory of the Hub's cache through `huggingface_hub.snapshot_download`, the way
transformers' `from_pretrained(<id>)` finds it — the same cache, so a model downloaded once with `hf download` or by
transformers is found again.

A `target.path` that exists on disk is a local directory, as before; one that does not and looks like a repo id
(`name` or `org/name` of letters, digits, `.`, `_`, `-`) is a Hub id (`hub_snapshot`). Only what a stage reads is
fetched (`HUB_FILES`: the config, the tokenizer files, the safetensors weights). The hub client's environment is
honoured — HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (cache only), HF_TOKEN (gated or private
repos) — read when a target is resolved, not when huggingface_hub was imported (its `constants` are fixed then), so
a test or a wrapper that sets them later is obeyed. The commit hash is the snapshot directory's name; TargetConfig
records it with the repo id as the fingerprint's `source` (provenance, not identity: core/fingerprint.py).

What the hub client raises becomes a `HubTargetError` that says what to do: offline (or the Hub unreachable) and
not in the cache, a gated repo, a missing or private repo, a missing revision; so does a `target.revision` set for a
local directory or a packaged source, which would otherwise be ignored without a word.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# what a stage reads from a checkpoint: the transformers config, every tokenizer format AutoTokenizer takes (and
# its chat template), the weights in safetensors (the engine and the fingerprint read no other format)
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "vocab.json", "merges.txt", "spiece.model", "special_tokens_map.json", "chat_template.jinja",
             "added_tokens.json", "*.safetensors", "model.safetensors.index.json"]
# `name` or `org/name`; neither part starts with `.` (a relative path such as `./x` or `../x` never reads as one)
REPO_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)?")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES


class HubTargetError(ValueError):
    """A Hub id target.path that cannot be resolved; the message starts `target.path=<id>:` and says what to do."""


@dataclass(frozen=True)
class HubSnapshot:
    """A resolved Hub target: the repo id, the revision as configured (None: the default branch), the commit it
    resolved to and that commit's snapshot directory in the cache."""

    repo_id: str
    revision: str | None
    commit: str
    dir: Path


def looks_like_repo_id(path: str) -> bool:
    return REPO_ID.fullmatch(path) is not None and ".." not in path


def is_hub_id(path: str | Path | None) -> bool:
    """`target.path` names a Hub repo: no such file or directory here, and shaped like a repo id."""
    return bool(path) and not Path(str(path)).expanduser().exists() and looks_like_repo_id(str(path))


def hub_cache_dir() -> Path:
    """The hub client's cache directory as its `constants` would compute it now: HF_HUB_CACHE (or the legacy
    HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set true now: the cache only, no request to the Hub."""
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def hub_snapshot(path: str | Path | None, revision: str | None = None) -> HubSnapshot | None:
    """The snapshot a Hub id `target.path` names at `revision` (None: not a Hub id — a local path, or a packaged
    `target.source` — where a revision is refused rather than ignored). Resolved once per (repo, revision, cache,
    offline) in a process: the checks before work and the stage share it."""
    if not is_hub_id(path):
        if revision is not None:
            what = f"target.path={path} is a local path" if path else "target.path is not set (a packaged source)"
            raise HubTargetError(f"target.revision={revision}: only a Hugging Face Hub id target.path has revisions, "
                                 f"and {what}: set target.revision=null")
        return None
    return _resolve(str(path), None if revision is None else str(revision), str(hub_cache_dir()), hub_offline())


def _error(repo_id: str, revision: str | None, what: str) -> HubTargetError:
    """`target.path=<id>: <what>`, naming target.revision too when it is set."""
    if revision is not None and "target.revision=" not in what:
        what += f" (target.revision={revision})"
    return HubTargetError(f"target.path={repo_id}: {what}")


@functools.lru_cache(maxsize=None)  # successes only: a failure is tried again (after `hf download`, say)
def _resolve(repo_id: str, revision: str | None, cache_dir: str, offline: bool) -> HubSnapshot:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at target.revision={revision}" if revision is not None else ""
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision is not None else "")
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                          allow_patterns=HUB_FILES))
    except IncompleteSnapshotError as e:  # before LocalEntryNotFoundError: a subclass of it
        raise _error(repo_id, revision, f"the cached snapshot of the Hugging Face Hub id in {cache_dir} is "
                     f"incomplete and the Hub cannot be reached to complete it ({e}): run `{download}` while "
                     "online") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub was unreachable ({type(e.__cause__ or e).__name__})"
        raise _error(repo_id, revision, f"no such local directory, and the Hugging Face Hub id {repo_id}{at} is not "
                     f"in the Hugging Face cache {cache_dir} (HF_HUB_CACHE, else $HF_HOME/hub) while {why}. "
                     f"Download it once while online (`{download}`, into that cache), or set target.path to a local "
                     "checkpoint directory") from e
    except GatedRepoError as e:  # before RepositoryNotFoundError: a subclass of it
        raise _error(repo_id, revision, f"a gated repository on the Hugging Face Hub: accept its licence on "
                     f"https://huggingface.co/{repo_id} and set HF_TOKEN to a token of that account") from e
    except RepositoryNotFoundError as e:
        raise _error(repo_id, revision, "no such local directory, nor a repository on the Hugging Face Hub (or a "
                     "private one: set HF_TOKEN to a token that can read it)") from e
    except RevisionNotFoundError as e:
        raise _error(repo_id, revision, f"the Hugging Face Hub repository has no such revision "
                     f"(target.revision={revision}): set target.revision to one of its branches, tags or commits "
                     "(null: the default branch)") from e
    except HfHubHTTPError as e:
        raise _error(repo_id, revision, f"the Hugging Face Hub refused it ({e}); a private repository needs "
                     "HF_TOKEN") from e
    except HFValidationError as e:
        raise _error(repo_id, revision, f"no such local directory, nor a valid Hugging Face Hub id ({e})") from e
    if not any(snapshot.glob("*.safetensors")):
        raise _error(repo_id, revision, f"the Hugging Face Hub snapshot {snapshot} holds no *.safetensors weights "
                     "(spechead reads no other format): set target.path to a local checkpoint directory with "
                     "safetensors weights")
    log.info("target.path=%s%s: the Hub snapshot %s (commit %s)", repo_id, at, snapshot, snapshot.name)
    return HubSnapshot(repo_id, revision, snapshot.name, snapshot)
