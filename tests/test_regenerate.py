"""Regeneration on tiny targets: batched left-padded greedy replies are plain HF greedy replies, the
JSONL is a data source precompute reads, a killed run resumes into the same file, sampling with
a seed is reproducible, and the cache (`regenerate.out=auto`) is reused only with the same settings."""

import hashlib
import json

import pytest
import torch

from data.regenerate import GenerationSettings, finished_ids, generate_replies
from experiments.stages import regenerate
from tests.conftest import CONVERSATIONS, compose_config
from tests.helpers import patch_everywhere, regenerated_path

MAX_NEW = 12


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _plain_greedy(model, prompt, stops):
    """A plain batch-1 HF greedy generate (no padding, no mask), cut at the first stop token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=sorted(stops), pad_token_id=min(stops))[0, len(prompt):].tolist()
    return out[:next((j for j, t in enumerate(out) if t in stops), len(out))]


def _overrides(tiny_overrides, target, out, *extra):
    return compose_config([*tiny_overrides, f"target.path={target}", f"regenerate.out={out}",
                           f"regenerate.max_new_tokens={MAX_NEW}", "regenerate.batch_size=5", *extra])


@pytest.mark.unit
def test_left_padded_batch_equals_plain_greedy_generate(text_target):
    from data.conversations import normalize_record, tokenize_prompt
    from data.prompts import stop_token_ids

    model, tok = _load(text_target)
    stops = stop_token_ids(tok)
    convs = [normalize_record(CONVERSATIONS[i])[0] for i in (0, 5, 10, 11)]
    prompts = [tokenize_prompt(tok, convs[0][:1]), tokenize_prompt(tok, convs[1][:3]),
               tokenize_prompt(tok, convs[2][:1]), tokenize_prompt(tok, convs[3][:3])]
    assert len({len(p) for p in prompts}) == len(prompts)  # every row but the longest is left-padded
    settings = GenerationSettings(max_new_tokens=MAX_NEW)
    batched = generate_replies(model, prompts, settings, stops, tok.pad_token_id)
    alone = [generate_replies(model, [p], settings, stops, tok.pad_token_id)[0] for p in prompts]
    plain = [_plain_greedy(model, p, stops) for p in prompts]
    assert [r.ids for r in batched] == [r.ids for r in alone] == plain
    from inference_eval.model import LlamaForCausalLM

    engine = generate_replies(LlamaForCausalLM.from_pretrained(text_target), prompts, settings, stops, tok.pad_token_id)
    assert [r.ids for r in engine] == plain and [r.stopped for r in engine] == [r.stopped for r in batched]
    assert len({tuple(p) for p in plain}) == len(plain)  # replies differ by prompt: a row mix-up would show


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["auto", "hf"])
def test_every_reply_is_the_targets_greedy_reply(tiny_overrides, text_target, tmp_path, backend):
    """Each regenerated turn of conversations batched 5 at a time (through the engine — `auto` on a
    Llama target — or HF generate) is what plain batch-1 HF greedy generation gives for the
    conversation so far (earlier turns regenerated)."""
    from data.conversations import ROLE_MAP, tokenize_prompt
    from data.prompts import stop_token_ids

    out, stats = regenerate(_overrides(tiny_overrides, text_target, tmp_path / "regen.jsonl",
                                       f"regenerate.backend={backend}"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [c["id"] for c in CONVERSATIONS] and stats.conversations == len(records)

    model, tok = _load(text_target)
    stops = stop_token_ids(tok)
    replies = 0
    for record, source in zip(records, CONVERSATIONS):
        turns = record["conversations"]
        humans = [t for t in turns if t["from"] == "human"]
        assert humans == [t for t in source["conversations"] if t["from"] == "human"][:len(humans)]
        messages = [{"role": ROLE_MAP[t["from"]], "content": t["value"]} for t in turns]
        for j, m in enumerate(messages):
            if m["role"] == "assistant":
                expected = _plain_greedy(model, tokenize_prompt(tok, messages[:j]), stops)
                assert m["content"] == tok.decode(expected, skip_special_tokens=True)
                assert m["content"] != source["conversations"][j]["value"]  # the target's, not the dataset's
                replies += 1
        assert record["regenerated"]["stopped"] is None and len(turns) == len(source["conversations"])
        assert record["regenerated"]["temperature"] == 0.0 and record["regenerated"]["max_new_tokens"] == MAX_NEW
        assert record["regenerated"]["backend"] == {"auto": "engine", "hf": "hf"}[backend]
    assert replies == stats.replies == 2 * len(records)
    assert 0 < stats.cut < replies  # some replies ended at the end-of-turn token, others at max_new_tokens


@pytest.mark.unit
def test_early_stops_are_recorded_and_dropped_on_load(tiny_overrides, text_target, tiny_target, tmp_path):
    """A prompt of max_prompt_tokens ends its conversation before the reply (`prompt_too_long`); an
    empty reply ends it too (`empty_reply`), and a conversation left without any reply is counted as
    `no_assistant_turn` when the file is read back."""
    from transformers import AutoTokenizer

    from data.conversations import normalize_record, tokenize_prompt
    from data.sources import DataConfig, load_conversations

    tok = AutoTokenizer.from_pretrained(text_target)
    first_turn = max(len(tokenize_prompt(tok, normalize_record(c)[0][:1])) for c in CONVERSATIONS)
    out, stats = regenerate(_overrides(tiny_overrides, text_target, tmp_path / "short.jsonl",
                                       f"regenerate.max_prompt_tokens={first_turn + 1}"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["regenerated"]["stopped"] == "prompt_too_long" for r in records)
    assert [[t["from"] for t in r["conversations"]] for r in records] == [["human", "gpt", "human"]] * len(records)
    convs = load_conversations(DataConfig.of(compose_config([*tiny_overrides, f"data.path={out}"]).data))
    assert [len(m) for _, m in convs.items] == [2] * len(records)  # the unanswered user turn is dropped

    # tiny_target's greedy replies repeat ChatML's newline (see text_target): blank, each conversation ends there
    out, stats = regenerate(_overrides(tiny_overrides, tiny_target, tmp_path / "empty.jsonl"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["regenerated"]["stopped"] == "empty_reply" for r in records)
    assert [r["conversations"] for r in records] == [c["conversations"][:1] for c in CONVERSATIONS]
    assert stats.replies == 0 and stats.tokens > 0
    convs = load_conversations(DataConfig.of(compose_config([*tiny_overrides, f"data.path={out}"]).data))
    assert convs.items == [] and convs.rejected == {"no_assistant_turn": len(records)}


@pytest.mark.unit
def test_output_is_a_data_source_that_precompute_reads(tiny_overrides, text_target, tmp_path):
    from data.sources import DataConfig, load_conversations
    from data.store import FeatureStore
    from experiments.stages import run_precompute

    out, _ = regenerate(_overrides(tiny_overrides, text_target, tmp_path / "regen.jsonl"))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    cfg = compose_config([*tiny_overrides, f"target.path={text_target}", f"data.path={out}",
                          f"store_dir={tmp_path / 'store'}"])
    convs = load_conversations(DataConfig.of(cfg.data))
    answered = [sid for sid, r in records.items() if any(t["from"] == "gpt" for t in r["conversations"])]
    assert [sid for sid, _ in convs.items] == answered and len(answered) >= len(CONVERSATIONS) - 2
    for sid, messages in convs.items:
        replies = [t["value"] for t in records[sid]["conversations"] if t["from"] == "gpt"]
        assert [m["content"] for m in messages if m["role"] == "assistant"] == replies
    store_dir, stats = run_precompute(cfg)
    assert stats.samples == len(answered)
    store = FeatureStore(store_dir)
    assert sorted(sid for s in store.manifest["shards"] for sid in s["sample_ids"]) == sorted(answered)

    # the file is a dataset `datasets` reads back (its `regenerated` settings and counts a struct column), and as
    # data.source=hf the same conversations
    import datasets

    rows = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "ds_cache"))
    assert rows["id"] == list(records) and [r["regenerated"]["stopped"] for r in rows] == [
        r["regenerated"]["stopped"] for r in records.values()]
    assert load_conversations(DataConfig.of({"source": "hf", "path": str(out)})).items == convs.items


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_resume_after_a_kill_gives_the_same_file(tiny_overrides, text_target, tmp_path, mode):
    """A kill after 7 lines and half of the 8th (inside the second group of 5): the rerun drops the
    half line, regenerates that group whole, writes only its missing records and the rest."""
    sampling = ["regenerate.temperature=1.0", "regenerate.top_k=50", "regenerate.seed=7"] if mode == "sampled" else []
    ref, _ = regenerate(_overrides(tiny_overrides, text_target, tmp_path / "ref.jsonl", *sampling))
    lines = ref.read_bytes().splitlines(keepends=True)
    assert len(lines) == len(CONVERSATIONS)
    killed = tmp_path / "killed.jsonl"
    killed.write_bytes(b"".join(lines[:7]) + lines[7][:len(lines[7]) // 2])
    out, stats = regenerate(_overrides(tiny_overrides, text_target, killed, *sampling))
    assert stats.skipped_done == 7 and stats.conversations == len(CONVERSATIONS) - 7
    assert out.read_bytes() == ref.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))
    _, again = regenerate(_overrides(tiny_overrides, text_target, killed, *sampling))  # complete: nothing to do
    assert again.conversations == 0 and again.tokens == 0 and out.read_bytes() == ref.read_bytes()
    with pytest.raises(ValueError, match=rf"{killed}:1: record 'c0' was regenerated with other settings "
                                         r"\(max_new_tokens: stored 12, now 5"):
        regenerate(_overrides(tiny_overrides, text_target, killed, *sampling, "regenerate.max_new_tokens=5"))


@pytest.mark.unit
def test_sampling_with_a_seed_is_reproducible(tiny_overrides, text_target, tmp_path):
    def run(name, seed):
        out, _ = regenerate(_overrides(tiny_overrides, text_target, tmp_path / name, "regenerate.temperature=1.0",
                                       "regenerate.top_p=0.95", f"regenerate.seed={seed}"))
        return [json.loads(line) for line in out.read_text().splitlines()]

    first, again, other = run("a.jsonl", 3), run("b.jsonl", 3), run("c.jsonl", 4)
    assert first == again
    assert [r["conversations"] for r in first] != [r["conversations"] for r in other]  # the seed matters
    assert {k: first[0]["regenerated"][k] for k in ("temperature", "top_p", "top_k", "seed")} == \
        {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 3}


def test_script_prints_its_summary(tiny_overrides, text_target, tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "cli.jsonl"
    proc = subprocess.run([sys.executable, "-m", "scripts.cli", "regenerate", *tiny_overrides,
                           f"target.path={text_target}", f"regenerate.out={out}", "regenerate.max_new_tokens=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"regenerate conversations={len(CONVERSATIONS)} tokens=") and last.endswith(f" out={out}")
    assert " cached=0 " in last
    tokens = int(last.split("tokens=")[1].split()[0])
    assert 0 < tokens <= 4 * 2 * len(CONVERSATIONS)
    assert len(out.read_text().splitlines()) == len(CONVERSATIONS)


@pytest.mark.unit
def test_regeneration_logs_progress_lines(tiny_overrides, text_target, tmp_path, caplog):
    """With a 0 s interval every finished group of conversations gives a progress line (done/total,
    rate, tok/s) and the stage ends with a closing line: what a run sent to a file shows."""
    import logging

    with caplog.at_level(logging.INFO, logger="spechead.progress"):
        _, stats = regenerate(_overrides(tiny_overrides, text_target, tmp_path / "regen.jsonl", "progress_log_s=0",
                                         "progress=false"))
    lines = [r.getMessage() for r in caplog.records if r.name == "spechead.progress"]
    n = len(CONVERSATIONS)
    groups = -(-n // 5)  # regenerate.batch_size=5
    assert len(lines) == groups + 1, lines
    assert lines[0].startswith(f"regenerate: 5/{n} conv (") and " tok_s=" in lines[0]
    assert lines[-2].startswith(f"regenerate: {n}/{n} conv (100%)")
    assert lines[-1].startswith("regenerate: done after ") and stats.conversations == n



# ---- the cache: regenerate.out=auto ------------------------------------------------------------------
@pytest.fixture
def cache(monkeypatch, tmp_path):
    """$SPECHEAD_CACHE in the test's directory: the machine's real cache is never touched."""
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _auto(tiny_overrides, target, *extra):
    """The config with the default `regenerate.out` (auto)."""
    return compose_config([*tiny_overrides, f"target.path={target}", f"regenerate.max_new_tokens={MAX_NEW}",
                           "regenerate.batch_size=5", *extra])


def _forbid_target(monkeypatch):
    """From here on, loading the target (model or tokenizer) or generating anything fails the test."""
    import transformers

    import data.conversations
    import data.regenerate
    from inference_eval.model import LlamaForCausalLM

    def never(*a, **k):
        raise AssertionError("the target was loaded or run")

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(never))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    patch_everywhere(monkeypatch, data.conversations.load_tokenizer, never)
    patch_everywhere(monkeypatch, data.regenerate.regenerate_conversations, never)
    patch_everywhere(monkeypatch, data.regenerate.generate_replies, never)


@pytest.mark.unit
def test_the_same_settings_reuse_the_cached_file_without_loading_the_target(tiny_overrides, text_target, cache,
                                                                            monkeypatch, caplog):
    """The default `regenerate.out=auto` writes `<cache>/regenerated/<target>-<key[:16]>.jsonl` with the
    key and its settings beside it; the same settings again find every conversation there and return
    the file as it is, with no model loaded."""
    import logging

    cfg = _auto(tiny_overrides, text_target)
    out, stats = regenerate(cfg)
    assert not stats.cached and stats.conversations == len(CONVERSATIONS) and stats.tokens > 0
    assert out.parent == cache / "regenerated" and out.suffix == ".jsonl"
    assert regenerated_path(cfg) == out  # known without the target
    sidecar = json.loads(out.with_suffix(".key.json").read_text())
    settings = sidecar["settings"]
    assert sidecar["key"] == hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
                                            ).hexdigest() and out.stem == f"tiny-{sidecar['key'][:16]}"
    assert {k: settings[k] for k in ("target", "temperature", "max_new_tokens", "batch_size", "backend")} == \
        {"target": "tiny", "temperature": 0.0, "max_new_tokens": MAX_NEW, "batch_size": 5, "backend": "engine"}
    assert {"target_sha256", "dtype", "max_prompt_tokens", "prompts_sha256"} <= set(settings)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all({k: r["regenerated"][k] for k in settings} == settings for r in records)  # each record carries them
    written = out.read_bytes()

    _forbid_target(monkeypatch)
    with caplog.at_level(logging.INFO, logger="data.regenerate"):
        again, stats = regenerate(_auto(tiny_overrides, text_target))
    assert again == out and stats.cached and stats.conversations == stats.tokens == 0
    assert stats.skipped_done == len(CONVERSATIONS) and out.read_bytes() == written
    assert any(r.getMessage().startswith(f"regenerate: reused {out}") for r in caplog.records)


@pytest.mark.unit
def test_a_changed_setting_regenerates_into_a_new_file(tiny_overrides, text_target, tiny_target, cache):
    """Sampling instead of greedy decoding is another key: another file, regenerated from scratch, the
    first left as it was; so is another prompt set or another target. A path the user named keeps
    refusing a file written with other settings."""
    greedy, _ = regenerate(_auto(tiny_overrides, text_target))
    written = greedy.read_bytes()
    sampled_cfg = _auto(tiny_overrides, text_target, "regenerate.temperature=0.7", "regenerate.seed=1")
    sampled, stats = regenerate(sampled_cfg)
    assert sampled != greedy and sampled.parent == greedy.parent
    assert not stats.cached and stats.skipped_done == 0 and stats.conversations == len(CONVERSATIONS)
    assert greedy.read_bytes() == written
    assert {json.loads(line)["regenerated"]["temperature"] for line in sampled.read_text().splitlines()} == {0.7}
    assert regenerated_path(sampled_cfg) == sampled

    fewer = regenerated_path(_auto(tiny_overrides, text_target, "data.max_samples=6"))  # another prompt set
    other_target = regenerated_path(_auto(tiny_overrides, tiny_target))
    greedy_again = regenerated_path(_auto(tiny_overrides, text_target, "regenerate.seed=5"))  # greedy: no seed
    assert len({greedy, sampled, fewer, other_target}) == 4 and greedy_again == greedy
    assert sorted(p.name for p in cache.rglob("*") if not p.name.startswith(".")) == \
        sorted(p.name for p in (greedy, greedy.with_suffix(".key.json"), sampled, sampled.with_suffix(".key.json"),
                                greedy.parent))

    with pytest.raises(ValueError, match=rf"{greedy}:1: record 'c0' was regenerated with other settings "
                                         r"\(temperature: stored 0\.0, now 0\.7"):
        regenerate(_auto(tiny_overrides, text_target, f"regenerate.out={greedy}", "regenerate.temperature=0.7",
                         "regenerate.seed=1"))
    assert greedy.read_bytes() == written


@pytest.mark.unit
def test_a_second_run_with_the_same_settings_waits_then_skips(tiny_overrides, tiny_target, cache, tmp_path, caplog):
    """While another process holds the file's lock (regenerating the same settings), a run waits for it,
    then finds every record written and appends none: never the same records twice."""
    import fcntl
    import logging
    import threading
    import time

    reference, _ = regenerate(_auto(tiny_overrides, tiny_target, f"regenerate.out={tmp_path / 'ref.jsonl'}"))
    cfg = _auto(tiny_overrides, tiny_target)
    out = regenerated_path(cfg)
    out.parent.mkdir(parents=True)
    result = {}
    with caplog.at_level(logging.INFO, logger="data.regenerate"), \
            open(out.with_name(f".{out.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other process
        worker = threading.Thread(target=lambda: result.update(zip(("out", "stats"), regenerate(cfg))))
        worker.start()
        deadline = time.monotonic() + 60
        while not any("waiting for it to finish" in r.getMessage() for r in caplog.records):
            assert worker.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        out.write_bytes(reference.read_bytes())  # what the other process wrote meanwhile
    worker.join(60)  # the lock is released with its file
    assert result["out"] == out and result["stats"].conversations == result["stats"].tokens == 0
    assert out.read_bytes() == reference.read_bytes()


def test_pipeline_regenerate_trains_on_the_targets_replies(tiny_overrides, text_target, cache, tmp_path, capsys):
    """`pipeline.regenerate=true`: the demo regenerates first (into the per-machine cache) and precomputes
    the target's replies, not the data's; a second run reuses the cached regeneration."""
    from data.store import FeatureStore
    from scripts.pipeline import run_pipeline

    overrides = [*tiny_overrides, f"target.path={text_target}", f"regenerate.max_new_tokens={MAX_NEW}",
                 "pipeline.regenerate=true", "evaluate.heads={trained:${head_dir}}", "trainer.max_epochs=1",
                 "train.engine_validation.enabled=false"]
    expected = regenerated_path(compose_config(overrides))
    run_pipeline(compose_config(overrides))
    out = capsys.readouterr().out
    assert "[0/4] regenerate: " in out and f"→ {expected}" in out and "reused" not in out
    records = {r["id"]: r for r in map(json.loads, expected.read_text().splitlines())}
    store = FeatureStore(tmp_path / "run" / "features")
    assert store.manifest["source"]["path"] == str(expected)
    stored = {sid for s in store.manifest["shards"] for sid in s["sample_ids"]}
    assert stored and stored <= set(records)

    run_pipeline(compose_config(overrides + ["train.resume=null"]))
    assert "(cached per machine: reused)" in capsys.readouterr().out


@pytest.mark.unit
def test_resume_reads_the_output_with_the_one_jsonl_reader(tmp_path):
    """`finished_ids` reads what it resumes from through core/jsonio.py: a line that is not JSON, or a JSON
    value that is not a regenerated record, is an error naming the file and line; a last line cut midway is
    dropped only with `repair` (left in place and not counted without it); a byte-order mark is read past."""
    meta = {"max_new_tokens": 12}
    good = [json.dumps({"id": f"c{i}", "regenerated": {**meta, "turns": 1}}).encode() + b"\n" for i in range(3)]
    f = tmp_path / "out.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b"".join(good))
    assert finished_ids(f, meta) == {"c0", "c1", "c2"}
    f.write_bytes(good[0] + b"{not json\n" + good[1])
    with pytest.raises(ValueError, match=rf"{f}:2: not JSON .*delete it"):
        finished_ids(f, meta)
    f.write_bytes(good[0] + good[1] + b'["c9"]\n')
    with pytest.raises(ValueError, match=rf"{f}:3: not a regenerated record"):
        finished_ids(f, meta)
    f.write_bytes(good[0] + b'{"id": "c5", "regenerated": 3}\n')
    with pytest.raises(ValueError, match=rf"{f}:2: not a regenerated record"):
        finished_ids(f, meta)
    cut = good[0] + good[1] + good[2][:10]
    f.write_bytes(cut)
    assert finished_ids(f, meta, repair=False) == {"c0", "c1"} and f.read_bytes() == cut  # another writer's line
    assert finished_ids(f, meta) == {"c0", "c1"} and f.read_bytes() == good[0] + good[1]


@pytest.mark.unit
@pytest.mark.parametrize("flag", [None, "true"])
def test_the_hf_backend_loads_the_target_with_trust_remote_code_only_when_set(tiny_overrides, text_target, tmp_path,
                                                                              monkeypatch, flag):
    """`+target.trust_remote_code=true` reaches HF transformers' loader in regeneration's `hf` backend, as it
    does in precompute's; unset, remote code stays off."""
    import transformers

    seen, real = [], transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    extra = ["regenerate.backend=hf", "data.max_samples=2", *([f"+target.trust_remote_code={flag}"] if flag else [])]
    regenerate(_overrides(tiny_overrides, text_target, tmp_path / "regen.jsonl", *extra))
    assert seen == [flag == "true"]
