"""The `draft_lm` head (heads/draft_lm.py): a small Llama draft LM sharing the target's frozen embedding
and lm_head. Its `init: target` equals the engine's layer-skip draft; greedy speculative decoding with it
through the engine equals plain decoding (batch 1 and 8); its chunked KL equals a naive full-logits
reference (values and gradients, padded and packed rows); training through the Lightning module lowers
the loss and raises agreement; the `draft-hf` export reloads (transformers, the engine's loader, spechead)
with the trained draft's logits; the native checkpoint round-trips."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from artifacts.checkpoint import TargetMismatchError, load_native, save_native
from heads.registry import build_head
from heads.draft_lm import DraftLMHead
from artifacts.draft_hf import read_target_layers
from inference_eval.engine import PagedDraftModelProposer, engine_generate, engine_run
from inference_eval.model import LlamaForCausalLM, tied_target
from inference_eval.speculative import DraftModelProposer
from tests.helpers import engine_plain, engine_speculative
from tests.conftest import compose_config, make_hf_model
from tests.helpers import train_on_batch
from tests.numerics import assert_matches_hf
from train.data import collate, collate_packed
from train.module import DraftHeadModule

ARRIVALS = [0, 0, 1, 2, 3, 5, 8, 13]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread here: on 2 shared cores the engine's skinny-matmul kernel (core/native.py) spins
    its threads against other processes' and decoding runs ~50x slower (measured: 8 s vs 0.13 s for the
    plain references below). No value tested depends on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _draft(path, num_layers=1, init="target", seed=0) -> DraftLMHead:
    tied, args, parts = tied_target(path)
    head = build_head({"type": "draft_lm", "num_layers": num_layers, "init": init}, args, tied)
    head.reset_parameters(seed, parts.first_input_norm)
    if init == "target":
        head.copy_target_layers(read_target_layers(path, num_layers))
    return head


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama whose greedy continuations do not repeat, its own continuations of 16 prompts
    as a training batch (with the target's states, as the store holds them), and a 1-layer draft LM
    (init: target) trained on it for a few steps: it drafts well but not perfectly."""
    path = tmp_path_factory.mktemp("draft_lm_target")
    make_hf_model("llama", seed=0, tie_word_embeddings=True, initializer_range=0.3).save_pretrained(path)
    target = LlamaForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(0)
    starts = [torch.randint(0, 512, (4,), generator=g).tolist() for _ in range(16)]
    ids = torch.tensor([s + c for s, c in zip(starts, engine_generate(target, starts, 40, max_batch=16)[0])])
    with torch.no_grad():
        hidden = target(ids, logits="none").hidden
    ones = torch.ones_like(ids, dtype=torch.bool)
    batch = {"input_ids": ids, "loss_mask": ones, "valid": ones, "hidden": hidden}
    untrained = _draft(path)
    head = _draft(path)
    torch.manual_seed(0)
    losses = train_on_batch(DraftHeadModule(head, kl_chunk_size=64), batch, 40, lr=3e-3)
    head.eval().requires_grad_(False)
    prompts = [ids[i, : 4 + 4 * i].tolist() for i in range(8)]  # 4..32 tokens, continuations seen in training
    reference = [engine_plain(target, p, 20) for p in prompts]  # the engine with one slot
    return {"path": path, "target": target, "batch": batch, "head": head, "untrained": untrained,
            "losses": losses, "prompts": prompts, "reference": reference}


@pytest.mark.unit
def test_target_init_is_the_layer_skip_draft(setup):
    """init: target with the final norm still N_f computes exactly the engine's truncated target."""
    target, path = setup["target"], setup["path"]
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    for n in (1, 2):
        head = _draft(path, num_layers=n)
        with torch.no_grad():
            torch.testing.assert_close(head(ids).logits, target.truncated(n)(ids).logits, atol=1e-5, rtol=1e-5)
    random = _draft(path, num_layers=1, init="random")
    with torch.no_grad():
        assert not torch.allclose(random(ids).logits, target.truncated(1)(ids).logits, atol=1e-2)
    # the frozen parts are the target's and are no parameters; only layers and the final norm train
    head = setup["head"]
    assert head.tied.embed.data_ptr() != 0 and not any("embed" in k or "lm_head" in k for k in head.state_dict())
    assert sorted({k.split(".")[1] for k in head.state_dict()}) == ["layers", "norm"]


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_batch1_and_batch8(setup, k):
    target, head, prompts, reference = setup["target"], setup["head"], setup["prompts"], setup["reference"]
    out1, eng1 = engine_generate(target, prompts, 20, proposer=head, k=k, max_batch=1)
    assert isinstance(eng1.proposer, PagedDraftModelProposer)  # served by the engine's draft-model proposer
    assert out1 == reference
    assert 0 < eng1.stats.alpha[0] < 1 and eng1.stats.tau > 1.2  # rounds both accept and reject
    out8, eng8 = engine_generate(target, prompts, 20, proposer=head, k=k, max_batch=8, arrivals=ARRIVALS)
    assert out8 == reference and 0 < eng8.stats.alpha[0] < 1
    # the batch-1 reference loop (contiguous KV cache) is lossless too (its acceptance counts differ: the
    # engine's draft-model schedule decodes the step of a prefill plainly)
    ref = [engine_speculative(target, DraftModelProposer(head), p, k, 20) for p in prompts]
    assert [o for o, _ in ref] == reference and sum(s.accepted[0] for _, s in ref) > 0


@torch.inference_mode()
def _every_step_reference(target, draft, prompt: list[int], k: int, n: int) -> tuple[list[int], dict]:
    """Greedy speculative decoding of one prompt by full recomputation (no KV cache, no scheduler) on vLLM's
    draft-model schedule: the first token from the prompt, then a round in every step — the draft's k greedy
    tokens after all committed tokens, the target's argmax over them, the longest matching prefix and the
    target's token after it. New tokens and the counts vLLM's metrics give."""
    toks = list(prompt)
    toks.append(int(target(torch.tensor([toks])).logits[0, -1].argmax()))
    out, accepted, reached, steps = [toks[-1]], [0] * k, [0] * k, 0
    while len(out) < n:
        drafts: list[int] = []
        for _ in range(k):
            drafts.append(int(draft(torch.tensor([toks + drafts])).logits[0, -1].argmax()))
        g = target(torch.tensor([toks + drafts])).logits[0, -k - 1:].argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == g[a]:
            a += 1
        for d in range(min(a + 1, k)):
            reached[d] += 1
            accepted[d] += int(d < a)
        steps += 1
        toks += drafts[:a] + [g[a]]
        out += drafts[:a] + [g[a]]
    return out[:n], {"accepted": accepted, "reached": reached, "steps": steps}


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 3])
def test_vllm_schedule_drafts_in_every_step(setup, k):
    """The draft-model proposer's default schedule is vLLM's `draft_model` one (inference_eval/engine/draft_model.py
    PagedDraftModelProposer): the step that prefills a request drafts for it too, so in a batch joining at
    different steps each request's acceptance counts and verification passes equal a cache-free loop that
    drafts in every step — the figures vLLM's metrics give. The seed's schedule
    (`speculate_beside_prefill=False`) decodes the token after the first plainly: fewer first-position
    drafts, and on these prompts fewer accepted."""
    target, head, prompts, reference = setup["target"], setup["head"], setup["prompts"], setup["reference"]
    ref = [_every_step_reference(target, head, p, k, 20) for p in prompts]
    assert [o for o, _ in ref] == reference
    results, eng = engine_run(target, prompts, 20, proposer=head, k=k, max_batch=8, arrivals=ARRIVALS)
    assert [r.tokens for r in results] == reference
    for r, (_, want) in zip(results, ref):
        assert {"accepted": r.stats.accepted, "reached": r.stats.reached, "steps": r.stats.steps} == want
    # the seed's schedule (batch 1): one plain pass per request, and other counts (the test tells them apart)
    seed, _ = engine_run(target, prompts, 20, proposer=PagedDraftModelProposer(head, speculate_beside_prefill=False),
                         k=k, max_batch=1)
    assert [r.stats.steps - r.stats.reached[0] for r in seed] == [1] * len(prompts)
    assert [(r.stats.accepted, r.stats.steps) for r in seed] != [(w["accepted"], w["steps"]) for _, w in ref]
    # the target drafting for itself: every draft accepted from the prefill's step on (no plain step)
    full = PagedDraftModelProposer(target.truncated(target.args.num_hidden_layers))
    out, eng = engine_generate(target, prompts[:1], 4 * (k + 1) + 1, proposer=full, k=k)
    assert out == [reference[0][: 4 * (k + 1) + 1]]
    assert eng.stats.accepted == eng.stats.reached == [4] * k and eng.stats.steps == 4


@pytest.mark.unit
def test_training_raises_acceptance(setup):
    """40 steps on the target's own continuations: the KL falls and the engine accepts more drafts."""
    losses = setup["losses"]
    assert losses[-1] < 0.7 * losses[0]
    target, prompts, reference = setup["target"], setup["prompts"], setup["reference"]
    _, before = engine_generate(target, prompts, 20, proposer=setup["untrained"], k=3)
    _, after = engine_generate(target, prompts, 20, proposer=setup["head"], k=3)
    assert after.stats.tau > before.stats.tau + 0.1, (before.stats.tau, after.stats.tau)


def _naive_loss(head, batch, depth, gamma=0.8):
    """Σ_d γ^(d-1) KL_d / n_d with full [N, V] logits, no chunking: the draft's state at position j
    (consuming t_0..t_j) against the target's logits W_lm N_f(H_j), on the loss tokens t_{j+1}, j ≥ d."""
    h = head(batch["input_ids"], logits="none").hidden  # [B, T, H]
    t = h.shape[1]
    total = 0.0
    for d in range(1, depth + 1):
        mask = (batch["loss_mask"] & batch["valid"])[:, d + 1:]  # token t_{j+1} for j = d..T-2
        student = head.lm_head(head.model.norm(h[:, d:t - 1]))[mask]
        teacher = head.tied.teacher_logits(batch["hidden"][:, d:t - 1])[mask]
        kl = F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="sum")
        total = total + gamma ** (d - 1) * kl / mask.sum()
    return total


@pytest.mark.unit
@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_kl_equals_naive_reference(setup, depth):
    """Padded rows of different lengths with partial loss masks, chunk size 7 (not a divisor)."""
    head = _draft(setup["path"], num_layers=2)
    with torch.no_grad():  # move away from the target's layers so the KL is far from zero
        for p in head.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    b = setup["batch"]
    g = torch.Generator().manual_seed(2)
    samples = []
    for i, n in enumerate((30, 19, 44)):
        mask = torch.rand(n, generator=g) < 0.7
        samples.append({"input_ids": b["input_ids"][i, :n], "loss_mask": mask, "hidden": b["hidden"][i, :n]})
    batch = collate(samples)
    module = DraftHeadModule(head, kl_chunk_size=7, depth=depth)
    out = module.compute_loss(batch)
    grads = torch.autograd.grad(out["loss"], list(head.parameters()))
    ref = _naive_loss(head, batch, depth)
    ref_grads = torch.autograd.grad(ref, list(head.parameters()))
    assert float(out["reg_d1"]) == 0.0  # KL only
    torch.testing.assert_close(out["loss"], ref, atol=1e-5, rtol=1e-5)
    assert float(ref) > 0.05
    for (name, _), gv, rv in zip(head.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(gv, rv, atol=1e-6, rtol=1e-4, msg=name)
    assert any(float(gv.abs().max()) > 1e-4 for gv in grads)
    # recomputing each layer in backward (train.module.gradient_checkpointing) changes nothing
    ckpt = DraftHeadModule(head, kl_chunk_size=7, depth=depth, gradient_checkpointing=True).compute_loss(batch)
    assert head.gradient_checkpointing
    for gv, cv in zip(grads, torch.autograd.grad(ckpt["loss"], list(head.parameters()))):
        torch.testing.assert_close(cv, gv, atol=1e-7, rtol=1e-5)


@pytest.mark.unit
def test_packed_rows_equal_separate_rows(setup):
    """Packed samples attend within themselves: the summed KL and agreement equal those of the samples
    scored one by one."""
    head = _draft(setup["path"], num_layers=2, init="random")
    b = setup["batch"]
    samples = [{"input_ids": b["input_ids"][i, :n], "loss_mask": b["loss_mask"][i, :n], "hidden": b["hidden"][i, :n]}
               for i, n in enumerate((17, 25, 12))]
    module = DraftHeadModule(head, kl_chunk_size=16)
    with torch.no_grad():
        packed = module.compute_loss(collate_packed(samples))
        alone = [module.compute_loss(collate([s])) for s in samples]
    assert int(packed["n_count_d1"]) == sum(int(a["n_count_d1"]) for a in alone)
    assert int(packed["agree_count_d1"]) == sum(int(a["agree_count_d1"]) for a in alone)
    torch.testing.assert_close(packed["kl_d1"] * packed["n_count_d1"],
                               sum(a["kl_d1"] * a["n_count_d1"] for a in alone), atol=1e-4, rtol=1e-5)


def test_export_reloads_with_identical_logits(setup, tmp_path):
    import transformers

    from artifacts.export import detect_format, export_head, load_any
    from artifacts.validate import validate_export

    head, path, target = setup["head"], setup["path"], setup["target"]
    dirs = {"native": tmp_path / "native", "draft-hf": tmp_path / "draft-hf"}
    written = export_head(head, dirs, path)  # validates and reads each format back (probe logits, bit for bit)
    hf_dir = written["draft-hf"]
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 512
    assert detect_format(hf_dir) == "draft-hf" and detect_format(written["native"]) == "native"
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = head(ids).logits
        hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
        engine_model = LlamaForCausalLM.from_pretrained(hf_dir)
        assert torch.equal(engine_model(ids).logits, want)  # the same blocks: bit for bit
        # transformers' Llama reads the export as the same function: two float32 implementations (the
        # kernel path decides the summation order: an AVX-512 CPU erred by 1.1e-5 where 1e-5 was allowed)
        assert_matches_hf(hf(ids).logits, want, engine_model.args, ids.shape[1])
        tied, args, _ = tied_target(path)
        assert torch.equal(load_any(hf_dir, tied, args)(ids).logits, want)
    # served from the export as a plain draft model: the same tokens and the same acceptance
    prompts = setup["prompts"]
    out_h, eng_h = engine_generate(target, prompts, 20, proposer=head, k=3, max_batch=8)
    out_x, eng_x = engine_generate(target, prompts, 20, proposer=engine_model, k=3, max_batch=8)
    assert out_x == out_h == setup["reference"] and eng_x.stats.accepted == eng_h.stats.accepted
    # the validator catches a draft whose embedding is not the target's
    from safetensors.torch import load_file, save_file

    state = load_file(hf_dir / "model.safetensors")
    state["model.embed_tokens.weight"][3, 0] += 1.0
    save_file(state, hf_dir / "model.safetensors")
    problems = validate_export(hf_dir, "draft-hf", path)
    assert any("model.embed_tokens.weight" in p for p in problems), problems
    # ... and so does the validator's command line
    import subprocess
    import sys

    from tests.conftest import ROOT

    cli = subprocess.run([sys.executable, "-m", "artifacts.validate", str(hf_dir), "--format", "draft-hf",
                          "--target", str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 1 and "model.embed_tokens.weight" in cli.stderr, cli.stderr[-2000:]


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_export_of_other_families(family, tmp_path):
    """A Qwen2 (q/k/v bias, untied lm_head) or Qwen3 (q/k norms) target: the draft is of the target's own
    class, its export ships the untied lm_head, and transformers reloads it with the draft's logits."""
    import transformers

    from artifacts.export import export_head

    path = tmp_path / "target"
    make_hf_model(family, seed=2, tie_word_embeddings=False).save_pretrained(path)
    head = _draft(path, num_layers=1)
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(head(ids).logits, LlamaForCausalLM.from_pretrained(path).truncated(1)(ids).logits)
        out = export_head(head, {"draft-hf": tmp_path / "draft"}, path)["draft-hf"]
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["model_type"] == family and cfg["num_hidden_layers"] == 1
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert_matches_hf(hf(ids).logits, head(ids).logits, head.args, ids.shape[1])


@pytest.mark.unit
def test_native_round_trip(setup, tmp_path):
    head, path = setup["head"], setup["path"]
    tied, args, _ = tied_target(path)
    fp = {"name": "tiny", "config_sha256": "abc"}
    save_native(head, tmp_path / "h", fp)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["head"] == {"type": "draft_lm", "num_layers": 1, "init": "target", "init_std": 0.02}
    back = load_native(tmp_path / "h", tied, args, expected_fingerprint=fp)
    assert isinstance(back, DraftLMHead) and back.args.num_hidden_layers == 1
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, head(ids).logits)
    assert not torch.equal(back.model.norm.weight, tied.norm_weight)  # the trained norm, not N_f
    with pytest.raises(TargetMismatchError):
        load_native(tmp_path / "h", tied, args, expected_fingerprint={**fp, "config_sha256": "other"})


def test_hydra_training_run(tiny_overrides, tiny_target):
    """conf/head/draft_lm.yaml through the real train entry: init from the target's first layer, trained
    by the Lightning trainer (engine validation on: teacher-forced scores and lossless speculative decoding
    with the draft-model proposer), saved natively; the trained draft differs from its initialisation."""
    from experiments.stages import run_precompute, run_training

    cfg = compose_config(tiny_overrides + ["head=draft_lm", "head.num_layers=1", "trainer.max_epochs=2",
                                           "train.engine_validation.every_n_steps=null"])
    assert cfg.head.type == "draft_lm" and cfg.head.init == "target"
    run_precompute(cfg)
    head_dir, metrics = run_training(cfg)
    assert metrics["train/loss"] > 0 and metrics["train/reg_d1"] == 0.0
    assert 0 <= metrics["engine_val/acc_d1"] <= 1 and metrics["engine_val/lossless_mismatch"] == 0
    assert abs(metrics["engine_val/acc_d1"] - metrics["engine_val/train_acc_d1"]) < 1e-6  # one computation
    tied, args, _ = tied_target(tiny_target)
    trained, untrained = load_native(head_dir, tied, args), load_native(cfg.train.untrained_dir, tied, args)
    target_layer0 = read_target_layers(tiny_target, 1)
    for k, v in untrained.state_dict().items():
        if k.startswith("model.layers."):
            assert torch.equal(v, target_layer0[k])
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, untrained.model.layers[0].mlp.up_proj.weight)


@pytest.mark.unit
def test_evaluation_native_export_and_draft_model_path(tiny_overrides, tiny_target, tmp_path):
    """scripts.evaluate serves the draft LM by every route: its native checkpoint and its draft-hf export
    as `evaluate.heads`, the export as `evaluate.draft_models.<label>.path`. Untrained with init: target
    it is the layer-skip draft `{layers: 1}`, so all four rows have the same τ and α."""
    from artifacts.export import export_head
    from experiments.stages import run_evaluation

    head = _draft(tiny_target, num_layers=1)
    written = export_head(head, {"native": tmp_path / "native", "draft-hf": tmp_path / "draft-hf"}, tiny_target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("What is two plus two?", "Name a colour.")) + "\n")
    cfg = compose_config(tiny_overrides + [
        "evaluate.dataset=jsonl", f"evaluate.prompts_path={prompts}", "evaluate.num_prompts=null", "evaluate.k=2",
        "evaluate.max_new_tokens=10", "evaluate.warmup=0", "evaluate.heads.trained=null", "evaluate.heads.untrained=null",
        f"+evaluate.heads.native={written['native']}", f"+evaluate.heads.export={written['draft-hf']}",
        f"+evaluate.draft_models.path={{path: {written['draft-hf']}}}", "+evaluate.draft_models.layer1={layers: 1}",
        f"evaluate.report={tmp_path / 'eval.json'}"])
    res = run_evaluation(cfg)["results"]
    assert res["native"]["proposer"] == res["export"]["proposer"] == "draft_lm"
    assert res["path"]["proposer"] == res["layer1"]["proposer"] == "draft_model"
    taus = {label: (r["tau"], r["alpha"], r["target_passes"]) for label, r in res.items()}
    assert len(set(map(str, taus.values()))) == 1, taus
    assert res["native"]["tau"] > 1.0
    a1, a2 = res["native"]["teacher_forced_acc"]
    assert res["native"]["simulated_tau"] == pytest.approx(1 + a1 + a1 * a2) and a1 > 0
