"""Evaluation on stub drafts with a known acceptance pattern: figures, per-category τ and the report files."""

import json
import statistics

import pytest

from evaluation.evaluate import write_report
from inference_eval.model import LlamaForCausalLM
from experiments.stages import run_evaluation
from tests.conftest import compose_config
from tests.helpers import StubHead
from tests.reference_decoding import evaluate_head
from tests.test_speculative import OracleHead


class SequentialOracle(StubHead):
    """An OracleHead per prompt: evaluate_head runs prompts in order, and each starts with a
    prefill call at position 0 (later calls start at the accepted length ≥ 1)."""


    def __init__(self, target, prompts, wrong):
        self.target, self.prompts, self.wrong, self.n, self.head = target, prompts, wrong, 0, None

    def new_cache(self, batch, max_len):
        return None

    def __call__(self, hidden, tokens, positions, cache=None, start=0, depth=1):
        if int(positions[0, 0]) == 0:
            self.head = OracleHead(self.target, self.prompts[self.n]["ids"][0], self.wrong)
            self.n += 1
        return self.head(hidden, tokens, positions, cache, start, depth)

    def logits(self, h, depth=1):
        return self.head.logits(h, depth)


@pytest.fixture(scope="module")
def target(tiny_target):
    return LlamaForCausalLM.from_pretrained(tiny_target)


PROMPTS = [{"ids": [5, 6, 7, 8], "category": "a"}, {"ids": [9, 10, 11], "category": "b"},
           {"ids": [30, 31], "category": "b"}]


@pytest.mark.unit
def test_known_acceptance_patterns_and_report(target, tmp_path):
    perfect = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: False), PROMPTS, k=3,
                            max_new_tokens=13, stop_ids=set(), label="perfect", progress=False)
    # 13 new tokens per prompt: 1 from prefill + 3 verification passes × 4 tokens
    assert perfect.tau == 4.0 and perfect.alpha == [1.0, 1.0, 1.0]
    assert perfect.target_passes == 9 and perfect.new_tokens == 39 and perfect.prompts == 3
    assert perfect.per_category_tau == {"a": 4.0, "b": 4.0}
    never = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: True), PROMPTS, k=3,
                          max_new_tokens=13, stop_ids=set(), label="never", progress=False)
    assert never.tau == 1.0 and never.alpha == [0.0, 0.0, 0.0] and never.target_passes == 36
    # k = 1 with a perfect draft: every pass emits 2 tokens
    half = evaluate_head(target, SequentialOracle(target, PROMPTS, lambda p: False), PROMPTS,
                         k=1, max_new_tokens=9, stop_ids=set(), label="k1", progress=False)
    assert half.tau == 2.0 and half.alpha == [1.0]

    report = {"target": "tiny", "target_dtype": "float32", "dataset": "stub", "turn": 1, "prompts": 3, "k": 3,
              "max_new_tokens": 13, "batch_size": 1, "results": {"perfect": vars(perfect), "never": vars(never)}}
    files = write_report(report, tmp_path / "eval.json")
    assert all(f.exists() for f in files) and len(files) == 4
    assert json.loads(files[0].read_text())["results"]["perfect"]["tau"] == 4.0
    md = files[1].read_text()
    assert "| perfect | head | 4.000 | – | 1.000 | 1.000 | 1.000 |" in md
    assert "| never | head | 1.000 | – | 0.000 | 0.000 | 0.000 |" in md
    assert "| perfect | 4.000 | 4.000 |" in md  # per-category row
    assert files[2].read_bytes()[:4] == b"\x89PNG" and files[3].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.unit
def test_mtbench_turn2_uses_the_models_own_answer(target, tiny_target):
    from transformers import AutoTokenizer

    from data.assets import load_mtbench
    from data.prompts import mtbench_prompts
    from tests.helpers import engine_plain

    tok = AutoTokenizer.from_pretrained(tiny_target)
    first = mtbench_prompts(tok, 2, turn=1)
    second = mtbench_prompts(tok, 2, turn=2, target=target, max_new_tokens=6)
    questions = {q["question_id"]: q for q in load_mtbench()}
    for p1, p2 in zip(first, second):
        q = questions[p2["id"]]
        answer = tok.decode(engine_plain(target, p1["ids"], 6), skip_special_tokens=True).strip()
        text = tok.decode(p2["ids"])
        assert p2["ids"][: len(p1["ids"]) - 3] == p1["ids"][: len(p1["ids"]) - 3]  # same turn-1 question
        assert answer in text and q["turns"][1] in text and text.index(answer) < text.index(q["turns"][1])
    assert [p["category"] for p in first] == [p["category"] for p in second] and len({p["category"] for p in first}) == 2


def test_evaluation_cli_any_checkpoint_draft_model_and_jsonl(tiny_overrides, tiny_target, tmp_path):
    """run_evaluation on a native head, its eagle1-sglang export and a draft-model baseline, over a
    prompts JSONL: the export scores exactly like the native checkpoint, simulated τ and speedups are
    reported, and the Markdown table has every row."""
    from heads.registry import build_head
    from artifacts.checkpoint import save_native
    from artifacts.export import detect_format, export_head
    from inference_eval.model import tied_target
    from experiments.stages import run_evaluation
    from tests.conftest import compose_config

    tied, args, parts = tied_target(tiny_target)
    head = build_head({"type": "eagle1", "init": "random"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    native = save_native(head, tmp_path / "native")
    exported = export_head(head, {"eagle1-sglang": tmp_path / "sglang"}, tiny_target)["eagle1-sglang"]
    assert detect_format(native) == "native" and detect_format(exported) == "eagle1-sglang"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "What is two plus two?", "category": "math"},
        {"messages": [{"role": "user", "content": "Name a colour."}], "id": "m1"},
        {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]}]) + "\n")
    cfg = compose_config(tiny_overrides + [
        "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}", "evaluate.num_prompts=null", "evaluate.k=2",
        "evaluate.max_new_tokens=10",
        f"+evaluate.heads.native={native}", f"+evaluate.heads.sglang={exported}", "evaluate.heads.trained=null",
        "evaluate.heads.untrained=null", "+evaluate.draft_models.layer1={layers: 1}", "evaluate.plain_baseline=true",
        "evaluate.repeats=2", f"evaluate.report={tmp_path / 'eval.json'}"])
    report = run_evaluation(cfg)
    res = report["results"]
    assert report["prompts"] == 3 and set(res) == {"native", "sglang", "layer1"}
    assert res["native"]["tau"] == res["sglang"]["tau"] and res["native"]["alpha"] == res["sglang"]["alpha"]
    assert res["layer1"]["proposer"] == "draft_model" and res["layer1"]["draft_layers"] == 1
    assert res["native"]["per_category_tau"].keys() == {"math", "jsonl"}
    a1, a2 = res["native"]["teacher_forced_acc"]
    assert res["native"]["simulated_tau"] == pytest.approx(1 + a1 + a1 * a2)
    for r in res.values():  # 3 prompts in 3 paired groups, 2 passes: 6 pairs; the speedup is their median
        assert len(r["speedup_pairs"]) == 6 and r["speedup"] == pytest.approx(statistics.median(r["speedup_pairs"]))
        assert r["speedup_min"] == min(r["speedup_pairs"]) and r["speed_verdict"] in ("faster", "not faster", "within noise")
    md = (tmp_path / "eval.md").read_text()
    assert "| layer1 | draft_model |" in md and "| sglang | eagle1 |" in md and "plain greedy decoding" in md
    base = [o for o in cfg_overrides(tiny_overrides, prompts, native, tmp_path)]
    batched = run_evaluation(compose_config(base + ["evaluate.batch_size=3", "+evaluate.draft_models.layer1={layers: 1}",
                                                    "evaluate.plain_baseline=true"]))
    assert batched["batch_size"] == 3
    for label in ("native", "layer1"):  # the batched engine accepts exactly what the batch-1 loop accepts
        assert batched["results"][label]["alpha"] == pytest.approx(res[label]["alpha"])
        assert batched["results"][label]["tau"] == pytest.approx(res[label]["tau"])
    assert batched["results"]["native"]["simulated_tau"] == pytest.approx(res["native"]["simulated_tau"])
    tree = run_evaluation(compose_config(base + ["evaluate.proposer=tree", "evaluate.tree={depth: 2, topk: 3, total: 6}"]))
    assert tree["proposer"] == "tree" and tree["results"]["native"]["k"] == 2
    assert tree["results"]["native"]["tau"] >= 1.0 and "simulated_tau" not in tree["results"]["native"]
    # the engine's target passes through its compiled static step: the same τ and α, the compile's seconds reported
    compiled = run_evaluation(compose_config(base + ["evaluate.compile=on"]))
    assert compiled["compile"] == "on" and res["native"]["compile_s"] == 0.0
    assert compiled["results"]["native"]["tau"] == res["native"]["tau"]
    assert compiled["results"]["native"]["alpha"] == res["native"]["alpha"]
    assert compiled["results"]["native"]["compile_s"] > 0
    with pytest.raises(ValueError, match="batch_size=0"):
        run_evaluation(compose_config(base + ["evaluate.batch_size=0"]))
    with pytest.raises(ValueError, match="verifies greedily"):
        run_evaluation(compose_config(base + ["evaluate.proposer=tree", "evaluate.temperature=0.5"]))
    sampled = run_evaluation(compose_config(tiny_overrides + [
        "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}", "evaluate.k=2", "evaluate.max_new_tokens=10",
        f"+evaluate.heads.native={native}", "evaluate.heads.trained=null", "evaluate.heads.untrained=null",
        "evaluate.temperature=0.7", "evaluate.top_k=20", f"evaluate.report={tmp_path / 'sampled.json'}"]))
    assert sampled["temperature"] == 0.7 and sampled["top_k"] == 20
    assert sampled["results"]["native"]["tau"] >= 1.0 and "simulated_tau" not in sampled["results"]["native"]
    assert "temperature 0.7" in (tmp_path / "sampled.md").read_text()


def cfg_overrides(tiny_overrides, prompts, native, tmp_path):
    return tiny_overrides + [
        "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}", "evaluate.num_prompts=null", "evaluate.k=2",
        "evaluate.max_new_tokens=10", f"+evaluate.heads.native={native}", "evaluate.heads.trained=null",
        "evaluate.heads.untrained=null", f"evaluate.report={tmp_path / 'batched.json'}"]


@pytest.mark.unit
def test_sharegpt_prompts_are_held_out(tiny_overrides, tiny_target):
    from transformers import AutoTokenizer

    from data.conversations import tokenize_prompt
    from data.prompts import sharegpt_prompts
    from data.sources import DataConfig, load_conversations
    from tests.conftest import CONVERSATIONS, compose_config

    data = DataConfig.of(compose_config(tiny_overrides + ["data.max_samples=8"]).data)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    got = sharegpt_prompts(tok, data, 3)
    trained = {sid for sid, _ in load_conversations(data).items}
    assert [p["id"] for p in got] == ["c8", "c9", "c10"] and not trained & {p["id"] for p in got}
    first_user = [{"role": "user", "content": CONVERSATIONS[8]["conversations"][0]["value"]}]
    assert got[0]["ids"] == tokenize_prompt(tok, first_user)


@pytest.mark.unit
def test_prompt_sources_refuse_or_normalise(tiny_overrides, tiny_target, tmp_path):
    from transformers import AutoTokenizer

    from data.conversations import tokenize_prompt
    from data.prompts import jsonl_prompts, sharegpt_prompts
    from data.sources import DataConfig
    from tests.conftest import compose_config

    tok = AutoTokenizer.from_pretrained(tiny_target)
    with pytest.raises(ValueError, match="nothing is held out"):
        sharegpt_prompts(tok, DataConfig.of(compose_config(tiny_overrides + ["data.max_samples=null"]).data), 3)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "there"}]})
                 + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: .*unknown_role"):
        jsonl_prompts(tok, f, None)
    f.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "there"}]}) + "\n")
    (got,) = jsonl_prompts(tok, f, None)  # a prompt-only record, its two user turns merged as for training
    assert got["ids"] == tokenize_prompt(tok, [{"role": "user", "content": "hi\n\nthere"}])


def test_report_goes_to_wandb_offline(tiny_overrides, tiny_target, tmp_path, monkeypatch):
    from experiments.stages import run_evaluation
    from tests.conftest import compose_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    overrides = [o for o in tiny_overrides if not o.startswith("logger=")]
    cfg = compose_config(overrides + ["logger=wandb", "evaluate.heads.trained=null", "evaluate.heads.untrained=null",
                                      "+evaluate.draft_models.layer1={layers: 1}", "evaluate.k=2",
                                      f"evaluate.report={tmp_path / 'eval.json'}"])
    report = run_evaluation(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    (table,) = (runs[0] / "files" / "media" / "table").rglob("*.table.json")
    rows = json.loads(table.read_text())
    assert rows["columns"][:3] == ["head", "proposer", "tau"]
    assert rows["data"][0][:3] == ["layer1", "draft_model", pytest.approx(report["results"]["layer1"]["tau"])]
    images = sorted(p.name for p in (runs[0] / "files" / "media" / "images").rglob("*.png"))
    assert len(images) == 2 and images[0].startswith("eval_alpha")


@pytest.mark.parametrize("override, error, words", [
    (["evaluate.dataset=humaneval"], ValueError, "evaluate.dataset=jsonl evaluate.prompts_path"),
    (["evaluate.dataset=jsonl"], ValueError, "needs evaluate.prompts_path"),
    (["evaluate.dataset=jsonl", "evaluate.prompts_path=/nonexistent/p.jsonl"], FileNotFoundError, "no such file"),
    (["evaluate.heads.trained=/nonexistent/head"], FileNotFoundError, "train it first"),
    (["evaluate.heads.trained=null", "evaluate.heads.untrained=null"], ValueError, "nothing to evaluate"),
    (["+evaluate.draft_models.small={path: /nonexistent/lm}", "evaluate.heads.trained=null",
      "evaluate.heads.untrained=null"], FileNotFoundError, "draft_models.small"),
    (["evaluate.engine=tensorrt"], ValueError, "evaluate.engine='tensorrt': expected spechead"),
    (["evaluate.engine=vllm", "evaluate.temperature=0.7"], ValueError, "set evaluate.temperature=0"),
    (["evaluate.engine=vllm", "evaluate.turns=[1,2]"], ValueError, "turn 2 needs the target's own turn-1 answers"),
    (["evaluate.engine=vllm", "+evaluate.draft_models.small={layers: 1}"], ValueError, "set evaluate.draft_models={}"),
    (["evaluate.engine=vllm", "evaluate.vllm.python=/nonexistent/python"], FileNotFoundError,
     "evaluate.engine=vllm: no vLLM environment at /nonexistent/python"),
])
def test_config_errors_come_before_the_target_loads(override, error, words, tiny_overrides, monkeypatch):
    from inference_eval.model import LlamaForCausalLM

    def never(*a, **k):
        raise AssertionError("the target was loaded before the configuration was checked")

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(never))
    from scripts.runtime import run_checked

    cfg = compose_config([*tiny_overrides, *override])
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        run_checked("evaluate", run_evaluation, cfg)  # as `python -m scripts.evaluate` runs it


@pytest.mark.unit
def test_k_auto_picks_the_fastest_measured_setting():
    """A proposer whose costs are known: each draft token costs 0.1 of a plain step and is accepted with
    probability 0.6, so tokens per unit time are (1 + Σ_{j≤k} 0.6^j) / (1 + 0.1 k): k = 3 is best."""
    from core.timing import Paired
    from evaluation.evaluate import choose_k

    speed = {k: (1 + sum(0.6 ** j for j in range(1, k + 1))) / (1 + 0.1 * k) for k in range(1, 6)}
    measured = []

    def measure(k):
        measured.append(k)
        return Paired((speed[k] * 0.98, speed[k] * 1.02))  # two pairs, 4 % apart

    k, auto = choose_k(range(1, 6), measure)
    assert k == max(speed, key=speed.get) == 3 and auto["chosen_speedup"] == pytest.approx(speed[3])
    assert [row["k"] for row in auto["table"]] == [1, 2, 3, 4, 5] == measured  # k = 4 slower, not beyond the spread
    assert auto["chosen_speedup_min"] == pytest.approx(speed[3] * 0.98) and auto["chosen_verdict"] == "faster"
    slow = {k: 0.9 - 0.1 * k for k in range(1, 4)}  # nothing beats plain decoding: it says so
    k, auto = choose_k(range(1, 4), lambda k: Paired((slow[k], slow[k] + 0.01)))
    assert k == 1 and auto["chosen_speedup"] < 1 and not auto["faster_than_plain"]
    assert auto["chosen_verdict"] == "not faster"
    # once a k is slower than the one before beyond both spreads, the larger k of that vocabulary are not
    # probed; another vocabulary's settings still are, and one pair (no spread) never stops the probe
    pairs = {(1, None): (1.20, 1.25), (2, None): (1.05, 1.10), (3, None): (1.5, 1.6),
             (1, 64): (1.1, 1.15), (2, 64): (1.12, 1.18), (3, 64): (1.0,), (4, 64): (0.9,)}
    settings = [{"k": kk, "draft_vocab": v} for v in (None, 64) for kk in (1, 2, 3, 4) if (kk, v) in pairs]
    seen = []

    def by_pairs(s):
        seen.append((s["k"], s["draft_vocab"]))
        return Paired(pairs[(s["k"], s["draft_vocab"])])

    chosen, auto = choose_k(settings, by_pairs)
    assert seen == [(1, None), (2, None), (1, 64), (2, 64), (3, 64), (4, 64)]
    assert [(r["k"], r["draft_vocab"]) for r in auto["skipped"]] == [(3, None)]
    assert chosen == {"k": 1, "draft_vocab": None} and auto["chosen_speedup"] == pytest.approx(1.225)
    assert auto["table"][0]["pairs"] == [1.20, 1.25] and auto["table"][0]["speedup_max"] == 1.25


def test_k_auto_in_the_evaluation(tiny_overrides, tmp_path):
    from experiments.stages import run_precompute, run_training

    cfg = compose_config([*tiny_overrides, "trainer.max_epochs=1", "train.engine_validation.enabled=false",
                          "evaluate.heads.untrained=null", "evaluate.k=auto", "evaluate.auto_max_k=2"])
    run_precompute(cfg)
    run_training(cfg)
    report = run_evaluation(cfg)
    entry = report["results"]["trained"]
    assert report["k"] == "auto" and [r["k"] for r in entry["k_auto"]["table"]] == [1, 2]
    assert entry["k"] == entry["k_auto"]["chosen_k"] and entry["tau"] >= 1.0


@pytest.mark.unit
def test_vllm_counters_give_the_engines_figures():
    """τ and the conditional α_d from vLLM's counters (evaluation/vllm_eval.py spec_figures), against the
    engine's own definitions (SpecStats) on the same acceptance record."""
    from evaluation.vllm_eval import spec_figures
    from inference_eval.speculative import SpecStats

    # 10 verification passes at k=3: accepted prefixes 0,1,2,3,0,1,1,2,0,0 (23 tokens emitted)
    prefixes = [0, 1, 2, 3, 0, 1, 1, 2, 0, 0]
    st = SpecStats(k=3, steps=len(prefixes), emitted=sum(prefixes) + len(prefixes),
                   reached=[10, sum(p >= 1 for p in prefixes), sum(p >= 2 for p in prefixes)],
                   accepted=[sum(p >= d for p in prefixes) for d in (1, 2, 3)])
    vllm = {"num_drafts": 10, "num_accepted_tokens": sum(prefixes), "accepted_per_pos": st.accepted}
    got = spec_figures(vllm, 3)
    assert got["tau"] == pytest.approx(st.tau) == 2.0
    assert got["alpha"] == pytest.approx(st.alpha) == [0.6, 0.5, 1 / 3]
    assert got["target_passes"] == 10 and got["accepted_per_pos"] == [6, 3, 1]
    assert spec_figures({"num_drafts": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}, 2)["alpha"] == [0.0, 0.0]


@pytest.mark.unit
def test_vllm_versions_are_checked_and_medusa_refused_on_033(monkeypatch, tmp_path):
    """An unsupported vLLM release names the supported ones; a Medusa head on vLLM 0.33 (which removed
    Medusa) is refused with the reason, on 0.32 it is served."""
    from evaluation import vllm_eval
    from inference_eval.vllm_backend import check_vllm_version

    for ok in ("0.32.0", "0.33.0", "0.33.1"):
        check_vllm_version(ok, "evaluate.engine=vllm")
    with pytest.raises(ValueError, match=r"vLLM 0.31.2 is not supported; spechead runs on vLLM 0.32.x and 0.33.x"):
        check_vllm_version("0.31.2", "evaluate.engine=vllm")

    class Medusa:
        kind = "medusa"

    monkeypatch.setattr(vllm_eval, "load_any", lambda *a, **k: Medusa())
    monkeypatch.setattr(vllm_eval, "detect_format", lambda path: "medusa-vllm")
    served, method, _ = vllm_eval.served_export("m", tmp_path, None, None, tmp_path, {}, tmp_path, "0.32.0")
    assert (served, method) == (tmp_path, "medusa")
    with pytest.raises(ValueError, match="vLLM 0.33 removed Medusa"):
        vllm_eval.served_export("m", tmp_path, None, None, tmp_path, {}, tmp_path, "0.33.0")
