"""The peer trainer's EAGLE-3 checkpoints (speculators 0.9.0 format, artifacts/formats/speculators.py) read into our
Eagle3Head: a checkpoint written here in that format gives our head's logits; one written by speculators' own
classes (in .venv-speculators, a subprocess) gives speculators' own forward's logits at every TTT step;
planted mismatches are clear errors. Also the export of a store for the peer (experiments/peer_data.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from artifacts.export import detect_format, load_any
from artifacts.formats.speculators import read_speculators_eagle3
from heads.registry import build_head
from heads.unroll import unroll
from inference_eval.model import tied_target

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venv-speculators" / "bin" / "python"
VD = 200
FLAGS = {"plain": {"norm_before_fc": False, "norm_before_residual": False, "norm_output": False},
         "eagle31": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}


def our_head(tiny_target, flags, seed=0):
    tied, args, parts = tied_target(tiny_target)
    head = build_head({"type": "eagle3", "aux_layers": [1], "draft_vocab_size": VD, "init": "random", **flags},
                      args, tied)
    counts = torch.zeros(args.vocab_size, dtype=torch.long)
    counts[torch.arange(0, args.vocab_size, 2)] = 5
    head.set_draft_vocab(counts)
    head.reset_parameters(seed, parts.first_input_norm)
    with torch.no_grad():  # norms away from 1 so a misplaced norm shows
        for n, p in head.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return head, tied, args


def write_speculators_format(head, tiny_target, out: Path) -> Path:
    """Our head's weights as speculators 0.9 saves an EAGLE-3 draft (docs/reference/export_formats.md §5)."""
    target_cfg = json.loads((Path(tiny_target) / "config.json").read_text())
    a, c = head.args, head.cfg
    layer = {"model_type": "llama", "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
             "intermediate_size": a.intermediate_size, "num_hidden_layers": 1,
             "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
             "head_dim": a.head_dim, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
             "max_position_embeddings": a.max_position_embeddings,
             "rope_parameters": {"rope_theta": a.rope_theta, "rope_type": "default"},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "layer_types": ["full_attention"], "sliding_window": 2048, "use_sliding_window": False}
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "draft_vocab_size": c.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
           "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc, "fc_norm": False,
           "norm_output": c.norm_output, "embed_requires_grad": False, "target_hidden_size": None,
           "tie_word_embeddings": False, "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": str(tiny_target),
                                               "architectures": target_cfg["architectures"]}}}
    state = {}
    for k, v in head.state_dict().items():
        name = k.replace("midlayer.", "layers.0.")
        state[name] = v.detach().clone().contiguous()
    state["embed_tokens.weight"] = head.tied.embed.detach().clone().to(torch.bfloat16)  # as speculators ships it
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def probe(head, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, t, head.args.hidden_size, generator=g)
    aux = torch.randn(1, t, head.state_size, generator=g)
    ids = torch.randint(0, head.args.vocab_size, (1, t), generator=g)
    return hidden, aux, ids


def depth_logits(head, hidden, aux, ids, depth=3):
    with torch.no_grad():
        return [head.logits(s) for s in unroll(head, hidden, ids, depth, aux)]


@pytest.mark.unit
@pytest.mark.parametrize("flags", list(FLAGS))
def test_reads_a_speculators_checkpoint_as_the_same_head(tiny_target, tmp_path, flags):
    head, tied, args = our_head(tiny_target, FLAGS[flags])
    path = write_speculators_format(head, tiny_target, tmp_path / "spec")
    read = read_speculators_eagle3(path, tied, args)
    assert read.cfg == head.cfg
    assert torch.equal(read.d2t, head.d2t) and torch.equal(read.t2d, head.t2d)
    hidden, aux, ids = probe(head)
    for got, want in zip(depth_logits(read, hidden, aux, ids), depth_logits(head, hidden, aux, ids), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # the evaluator's loader (artifacts/export.py load_any) detects the format and reads it the same way
    assert detect_format(path) == "speculators-eagle3"
    for got, want in zip(depth_logits(load_any(path, tied, args), hidden, aux, ids), depth_logits(head, hidden, aux, ids)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _mutate(path: Path, config=None, tensors=None) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if config:
        config(cfg)
    if tensors:
        tensors(state)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    return path


def _set(d, key, value):
    d[key] = value


PLANTED = {
    "wrong shape": (None, lambda s: _set(s, "fc.weight", torch.zeros(64, 128)), r"model\.safetensors: fc\.weight: shape"),
    "missing tensor": (None, lambda s: s.pop("layers.0.mlp.up_proj.weight"), r"layers\.0\.mlp\.up_proj\.weight: missing"),
    "second layer": (None, lambda s: _set(s, "layers.1.mlp.up_proj.weight", torch.zeros(128, 64)), r"second draft layer"),
    "unknown tensor": (None, lambda s: _set(s, "fc_norm.0.weight", torch.ones(64)), r"fc_norm\.0\.weight: not understood"),
    "missing d2t": (None, lambda s: s.pop("d2t"), r"d2t: missing"),
    "bad t2d": (None, lambda s: _set(s, "t2d", torch.ones(512, dtype=torch.bool)), r"t2d: does not mark"),
    "trained embeddings": (None, lambda s: _set(s, "embed_tokens.weight", torch.randn(512, 64)),
                           r"embed_tokens\.weight: differs"),
    "unknown field": (lambda c: _set(c, "mystery_option", True), None, r"config\.json: mystery_option: not understood"),
    "fc_norm": (lambda c: _set(c, "fc_norm", True), None, r"config\.json: fc_norm"),
    "model type": (lambda c: _set(c, "speculators_model_type", "dflash"), None, r"speculators_model_type"),
    "qwen3 layer": (lambda c: _set(c["transformer_layer_config"], "model_type", "qwen3"), None,
                    r"transformer_layer_config\.model_type"),
    "two layers": (lambda c: _set(c["transformer_layer_config"], "num_hidden_layers", 2), None,
                   r"transformer_layer_config\.num_hidden_layers"),
    "sliding window": (lambda c: _set(c["transformer_layer_config"], "layer_types", ["sliding_attention"]), None,
                       r"transformer_layer_config\.layer_types"),
    "rope": (lambda c: _set(c["transformer_layer_config"], "rope_parameters", {"rope_theta": 5.0, "rope_type": "default"}),
             None, r"rope_theta"),
    "last-layer id": (lambda c: _set(c, "eagle_aux_hidden_state_layer_ids", [1, 2]), None,
                      r"eagle_aux_hidden_state_layer_ids"),
    "draft vocab": (lambda c: _set(c, "draft_vocab_size", 100), None, r"config\.json: draft_vocab_size"),
    "ambiguous residual norm": (lambda c: c.pop("norm_before_residual"), None, r"norm_before_residual: missing"),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", list(PLANTED))
def test_planted_mismatches_are_clear_errors(tiny_target, tmp_path, case):
    head, tied, args = our_head(tiny_target, FLAGS["eagle31"])
    path = write_speculators_format(head, tiny_target, tmp_path / "spec")
    config, tensors, match = PLANTED[case]
    _mutate(path, config, tensors)
    with pytest.raises(ValueError, match=match):
        read_speculators_eagle3(path, tied, args)


@pytest.mark.unit
def test_sliding_window_accepted_when_asked(tiny_target, tmp_path):
    head, tied, args = our_head(tiny_target, FLAGS["plain"])
    path = _mutate(write_speculators_format(head, tiny_target, tmp_path / "spec"),
                   lambda c: _set(c["transformer_layer_config"], "layer_types", ["sliding_attention"]))
    read = read_speculators_eagle3(path, tied, args, allow_sliding_window=True)
    hidden, aux, ids = probe(head)
    torch.testing.assert_close(depth_logits(read, hidden, aux, ids, 1)[0], depth_logits(head, hidden, aux, ids, 1)[0])


# ---- speculators' own classes (the stronger test) -------------------------------------------------------
SPECULATORS_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoConfig

verifier, out, flags, vd = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
vocab = AutoConfig.from_pretrained(verifier).vocab_size
d2t, t2d = build_vocab_mappings_from_distribution({t: 5 for t in range(0, vocab, 2)}, vd, vocab)
layer = create_transformer_layer_config(verifier, num_layers=1, draft_arch="llama", hidden_act=None,
                                        sliding_window=2048, full_attention_indices=[0])
model = Eagle3DraftModel.from_training_args(
    verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier, draft_vocab_size=vd,
    ttt_steps=3, target_layer_ids=[1], draft_attn_impl="sdpa", **flags)
with torch.no_grad():  # a trained-looking draft: every trainable tensor random, norms away from 1
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "verifier_")):
            continue
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0, 0.05)
model.eval()
model.save_pretrained(out / "ckpt")
g = torch.Generator().manual_seed(1)
t, h = 10, layer.hidden_size
aux = torch.randn(1, t, h, generator=g)
ids = torch.randint(0, vocab, (1, t), generator=g)
logits = []
hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o.detach().clone()))
with torch.no_grad():  # the training-time layout: g_i paired with t_{i+1} (speculators' shift_batch)
    model(hidden_states=aux[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros(1, t - 1, dtype=torch.long),
          ttt_steps=3)
save_file({"aux": aux, "ids": ids, **{f"logits_{s}": l[0] for s, l in enumerate(logits)}}, str(out / "probe.safetensors"))
print(json.dumps({"steps": len(logits)}))
"""


@pytest.fixture(scope="module")
def speculators_env():
    if not SPEC_PY.exists():
        pytest.skip(f"{SPEC_PY} is absent: `make speculators-env` builds the speculators 0.9.0 environment")
    return SPEC_PY


@pytest.mark.parametrize("flags", list(FLAGS))
def test_checkpoint_written_by_speculators_matches_its_forward(tiny_target, tmp_path, speculators_env, flags):
    run = subprocess.run([str(speculators_env), "-c", SPECULATORS_SCRIPT, str(tiny_target), str(tmp_path),
                          json.dumps(FLAGS[flags]), str(VD)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    tied, args, _ = tied_target(tiny_target)
    head = read_speculators_eagle3(tmp_path / "ckpt", tied, args)
    assert head.cfg.aux_layers == (1,) and head.cfg.draft_vocab_size == VD
    assert (head.cfg.norm_before_fc, head.cfg.norm_before_residual, head.cfg.norm_output) == tuple(
        FLAGS[flags][k] for k in ("norm_before_fc", "norm_before_residual", "norm_output"))
    assert head.draft_ids.tolist() == list(range(0, 2 * VD, 2))
    p = load_file(str(tmp_path / "probe.safetensors"))
    aux, ids = p["aux"], p["ids"]
    hidden = torch.zeros(1, aux.shape[1], args.hidden_size)  # EAGLE-3 reads the aux states only
    ours = depth_logits(head, hidden, aux, ids, 3)
    for step, got in enumerate(ours):  # TTT step s = our depth s + 1 (same rows, same zero padding)
        torch.testing.assert_close(got[0], p[f"logits_{step}"], atol=2e-5, rtol=1e-4,
                                   msg=lambda m, s=step: f"TTT step {s}: {m}")


# ---- the store export for the peer, and the shimmed peer training on it --------------------------------------
def tiny_store(root: Path, n=9, h=64, k=1, vocab=512):
    from data.store import Sample, StoreWriter

    writer = StoreWriter(root, {"name": "tiny"}, h, dtype="float32",
                         captured={"hidden": "last_layer_pre_norm", "aux_layers": [1]})
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        t = 5 + i
        writer.add(Sample(sample_id=f"s{i}", input_ids=torch.randint(0, vocab, (t,), generator=g),
                          loss_mask=(torch.arange(t) >= 2).to(torch.uint8), hidden=torch.randn(t, h, generator=g),
                          aux_hidden=torch.randn(t, k * h, generator=g)))
    writer.close()
    return root


@pytest.mark.unit
def test_peer_data_export_keeps_our_split(tiny_target, tmp_path):
    from datasets import load_from_disk

    from data.store import FeatureStore
    from experiments.peer_data import export, split_indices

    k = 1
    store = FeatureStore(tiny_store(tmp_path / "store"))
    info = export(tmp_path / "store", tmp_path / "peer", split_seed=0, val_fraction=0.25, verifier=str(tiny_target))
    train_idx, val_idx = split_indices(store, 0, 0.25)
    assert info["train_ids"] == [store.sample_ids()[i] for i in train_idx] and len(val_idx) == 2
    rows = train_idx + val_idx
    assert int(info["rows"] * info["train_data_ratio"]) == len(train_idx)
    ds = load_from_disk(str(tmp_path / "peer"))
    assert len(ds) == len(rows)
    for row, i in enumerate(rows):
        s = store[i]
        hs = load_file(str(tmp_path / "peer" / "hidden_states" / f"hs_{row}.safetensors"))
        assert torch.equal(hs["token_ids"], s["input_ids"]) and torch.equal(ds[row]["input_ids"], s["input_ids"])
        assert torch.equal(ds[row]["loss_mask"].bool(), s["loss_mask"]) and ds[row]["seq_len"] == len(s["input_ids"])
        assert torch.equal(hs["hidden_states"][:, :k].flatten(1), s["aux_hidden"])
        assert torch.equal(hs["hidden_states"][:, -1], s["hidden"])
    freq = torch.load(tmp_path / "peer" / "token_freq.pt")
    assert sum(freq.values()) == int(sum(store[i]["loss_mask"].sum() for i in train_idx))
    assert info["target_layer_ids"] == [1]
    with pytest.raises(FileExistsError):
        export(tmp_path / "store", tmp_path / "peer", verifier=str(tiny_target))


def test_shimmed_peer_training_writes_a_checkpoint_we_read(tiny_target, tmp_path, speculators_env):
    """experiments/peer_shims.py: speculators' own `train` on CPU, two steps on an exported tiny store."""
    from experiments.peer_data import export

    info = export(tiny_store(tmp_path / "store"), tmp_path / "peer", val_fraction=0.25, verifier=str(tiny_target))
    cmd = [str(speculators_env), "-m", "experiments.peer_shims", "--speculator-type", "eagle3",
           "--verifier-name-or-path", str(tiny_target), "--data-path", str(tmp_path / "peer"),
           "--save-path", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"), "--target-layer-ids", "1",
           "--train-data-ratio", repr(info["train_data_ratio"]), "--draft-vocab-size", str(VD), "--epochs", "1",
           "--max-steps", "2", "--total-seq-len", "64", "--full-attention-indices", "0", "--on-missing", "raise"]
    run = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "Muon Newton-Schulz in float32" in run.stderr
    tied, args, _ = tied_target(tiny_target)
    head = read_speculators_eagle3(tmp_path / "ckpt" / "0", tied, args)
    assert head.cfg.aux_layers == (1,) and head.cfg.draft_vocab_size == VD
    assert head.cfg.norm_before_fc and head.cfg.norm_before_residual and head.cfg.norm_output  # speculators' defaults
    freq = torch.load(tmp_path / "peer" / "token_freq.pt")
    top = sorted(freq, key=lambda t: (-freq[t], t))[:VD]
    assert set(head.draft_ids.tolist()) >= set(top[: min(len(top), VD)])  # the draft vocabulary of our training rows
    hidden, aux, ids = probe(head)
    assert all(torch.isfinite(x).all() for x in depth_logits(head, hidden, aux, ids, 2))


def test_peer_compare_scores_both_heads_with_one_harness(tiny_overrides, tiny_target, speculators_env, capsys):
    """experiments/peer_compare.py end to end on the tiny target: one store with the aux layers, our mtp head
    and the peer's EAGLE-3 (its own trainer, 2 steps) trained on its training split, both scored on the
    same held-out rows and prompts; a rerun reuses the peer's training."""
    from experiments.peer_compare import run_peer_compare
    from tests.conftest import compose_config

    cfg = compose_config(tiny_overrides + [
        "experiment=peer_compare", "data.max_length=512",
        "trainer.max_epochs=1", "peer_compare.epochs=1", "peer_compare.ks=[2]", "peer_compare.eval_depth=2",
        "peer_compare.heldout_conversations=2", "peer_compare.vllm=false", f"peer_compare.draft_vocab_size={VD}",
        "peer_compare.peer_args=[--max-steps,2]", "peer_compare.ours={mtp:{head:mtp}}", "evaluate.num_prompts=2",
        "evaluate.max_new_tokens=8", "evaluate.plain_baseline=false"])
    first = run_peer_compare(cfg)
    ours, peer = first["results"]["mtp"], first["results"]["peer"]
    assert ours["heldout"]["heldout_sha256"] == peer["heldout"]["heldout_sha256"]  # the same held-out rows
    assert ours["heldout"]["tokens"] == peer["heldout"]["tokens"] and len(peer["heldout"]["acc"]) == 2
    assert ours["engine"][2]["prompts"] == peer["engine"][2]["prompts"] == 2
    assert 1.0 <= peer["engine"][2]["tau"] <= 3.0 and len(peer["engine"][2]["alpha"]) == 2
    tied, args, _ = tied_target(tiny_target)
    from artifacts.checkpoint import load_native

    head = load_native(Path(cfg.run_dir) / "heads" / "peer", tied, args)
    assert head.kind == "eagle3" and head.cfg.norm_output and head.cfg.draft_vocab_size == VD
    assert "peer_compare report=" in capsys.readouterr().out
    second = run_peer_compare(cfg)  # cached: the peer is not trained again
    assert second["results"]["peer"]["train_seconds"] == peer["train_seconds"]
    assert second["results"]["peer"]["engine"][2]["tau"] == peer["engine"][2]["tau"]
    assert (Path(cfg.run_dir) / "peer_compare.md").read_text().count("| peer |") == 1


# ---- peer_compare.tokens: the same training tokens each side ------------------------------------------------
@pytest.mark.unit
def test_peer_schedule_gives_the_tokens_in_the_fewest_epochs():
    from experiments.peer_compare import peer_schedule

    # 300 training tokens in 4 packed batches (75 per step): 1,000 tokens are 13 steps, held by 3 epochs (4+5+4)
    assert peer_schedule(1000, 300, [4, 5, 4, 4]) == (13, 3)
    assert peer_schedule(100, 300, [4, 5]) == (1, 1)  # below one epoch: its first epoch only
    assert peer_schedule(300, 300, [4, 5]) == (4, 1)  # exactly one epoch
    with pytest.raises(ValueError, match="more than the 2 epochs"):
        peer_schedule(1000, 300, [4, 5])


@pytest.mark.unit
def test_peer_compare_tokens_set_our_steps_by_the_study_rule(tiny_overrides, tmp_path):
    from omegaconf import open_dict

    from experiments.peer_compare import our_config
    from experiments.study import mean_batch_tokens
    from tests.conftest import compose_config

    store = tiny_store(tmp_path / "store")
    cfg = compose_config(tiny_overrides + ["experiment=peer_compare", "train.data.batch_tokens=32",
                                           "peer_compare.tokens=200"])
    oc = our_config(cfg, "e3", {"head": "eagle3", "overrides": {"head.init": "random"}}, store)
    per_batch, epoch_tokens = mean_batch_tokens(oc, store, None)
    assert per_batch < 32 and epoch_tokens < 200  # several batches an epoch, more than one epoch of tokens
    assert oc.trainer.max_steps == round(200 / per_batch) > 1 and oc.trainer.max_epochs == -1
    assert oc.head.init == "random" and oc.head.type == "eagle3"
    with open_dict(cfg):
        cfg.peer_compare.tokens = None
    oc = our_config(cfg, "e3", {"head": "eagle3"}, store)
    assert oc.trainer.max_epochs == int(cfg.peer_compare.epochs) and oc.trainer.max_steps == -1


def test_peer_trains_the_token_budget_and_its_checkpoint_is_found(tiny_target, tmp_path, speculators_env,
                                                                   monkeypatch):
    """peer_compare.tokens: `--max-steps` from the peer's own sampler, the fewest epochs that hold them (one
    more would take an extra step), its last epoch's checkpoint read back with exactly that many steps."""
    from omegaconf import OmegaConf

    from experiments.peer_compare import train_peer

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    store = tiny_store(tmp_path / "store")
    cfg = OmegaConf.create({"run_dir": str(tmp_path / "run"), "data": {"max_length": 16},
                            "train": {"data": {"split_seed": 0, "val_fraction": 0.25}},
                            "peer_compare": {"epochs": 5, "tokens": 100, "draft_vocab_size": VD,
                                             "peer_args": ["--log-dir", str(tmp_path / "logs")]}})
    last, _, info = train_peer(cfg, store, Path(tiny_target))
    budget = info["budget"]
    assert budget["train_tokens"] == info["train_tokens"]  # rows of ≤ 13 tokens: none clipped at 16
    per_step = info["train_tokens"] / budget["epoch_batches"][0]
    assert per_step <= 16 and budget["max_steps"] == round(100 / per_step)
    assert sum(budget["epoch_batches"][: budget["epochs"] - 1]) < budget["max_steps"] <= sum(
        budget["epoch_batches"][: budget["epochs"]])
    assert budget["epochs"] >= 2  # more than one epoch of its rows: the epoch arithmetic matters
    key = json.loads((tmp_path / "run" / "peer" / "train.json.key.json").read_text())["key"]
    command = key["command"]
    assert key["budget"] == 100 and command[command.index("--max-steps") + 1] == str(budget["max_steps"])
    assert command[command.index("--epochs") + 1] == str(budget["epochs"])
    assert last == tmp_path / "run" / "peer" / "ckpt" / str(budget["epochs"] - 1)
    state = json.loads((last / "training_state.json").read_text())
    assert state["global_step"] == budget["max_steps"]
    tied, args, _ = tied_target(tiny_target)
    assert read_speculators_eagle3(last, tied, args).cfg.draft_vocab_size == VD


@pytest.mark.unit
@pytest.mark.parametrize("setting", ["target", "ones"])
def test_eagle3_norm_init_target_or_speculators_ones(tiny_target, setting):
    """`input_norm_init` / `norm_init`: `target` starts input_layernorm at the target's layer-0 input norm and
    norm at N_f; `ones` (the default since issue 28) starts both at 1, as speculators' fresh EAGLE-3 draft does (HF's norm init;
    experiments/peer_grad.py measured its norms at exactly 1). The rest of the init does not move with it."""
    tied, args, _ = tied_target(tiny_target)
    first = torch.full((args.hidden_size,), 0.25)
    assert not torch.allclose(tied.norm_scale, torch.ones_like(tied.norm_scale))  # else `target` = `ones` here

    def fresh(value):
        head = build_head({"type": "eagle3", "aux_layers": [1], "draft_vocab_size": VD, "init": "random",
                           "input_norm_init": value, "norm_init": value}, args, tied)
        head.reset_parameters(0, first)
        return head

    head, base = fresh(setting), fresh("target")
    want_in = first if setting == "target" else torch.ones_like(first)
    want_norm = tied.norm_scale if setting == "target" else torch.ones_like(first)
    assert torch.equal(head.midlayer.input_layernorm.weight.detach(), want_in.to(head.dtype))
    assert torch.equal(head.norm.weight.detach(), want_norm.to(head.dtype))
    for name, p in head.state_dict().items():
        if name not in ("midlayer.input_layernorm.weight", "norm.weight"):
            assert torch.equal(p, base.state_dict()[name]), name
    assert head.cfg.to_dict()["input_norm_init"] == setting
    default = build_head({"type": "eagle3", "aux_layers": [1], "draft_vocab_size": VD}, args, tied).cfg
    assert (default.input_norm_init, default.norm_init) == ("ones", "ones")
    with pytest.raises(ValueError, match="input_norm_init"):
        build_head({"type": "eagle3", "input_norm_init": "zeros"}, args, tied)


def test_peer_grad_our_step_equals_the_peers_on_the_same_weights_and_batch(tiny_target, tmp_path, speculators_env):
    """experiments/peer_grad.py on a tiny export: speculators' own forward, loss and backward on its first batch
    (every training conversation packed into one row) against our compute_loss on the same weights and
    conversations: with its loss mask the loss and every gradient agree; with ours (one token later) they do not
    quite. The last token of each conversation carries no loss, so the peer's extra last row weighs nothing."""
    from data.store import Sample, StoreWriter
    from experiments.peer_data import export
    from experiments.peer_grad import main as peer_grad

    h, vocab = 64, 512
    writer = StoreWriter(tmp_path / "store", {"name": "tiny"}, h, dtype="float32",
                         captured={"hidden": "last_layer_pre_norm", "aux_layers": [1]})
    g = torch.Generator().manual_seed(0)
    for i in range(9):
        t = 9 + i
        mask = torch.zeros(t, dtype=torch.uint8)
        mask[2:4] = 1
        mask[5:t - 1] = 1  # two assistant turns; the last token outside
        writer.add(Sample(sample_id=f"s{i}", input_ids=torch.randint(0, vocab, (t,), generator=g), loss_mask=mask,
                          hidden=torch.randn(t, h, generator=g), aux_hidden=torch.randn(t, h, generator=g)))
    writer.close()
    export(tmp_path / "store", tmp_path / "peer", val_fraction=0.25, verifier=str(tiny_target))
    peer_grad(["--data", str(tmp_path / "peer"), "--out", str(tmp_path / "out"), "--draft-vocab-size", str(VD),
               "--log-dir", str(tmp_path / "logs")])
    r = json.loads((tmp_path / "out" / "peer_grad.json").read_text())
    assert r["same_tokens"] and r["peer_batch"]["documents"] == 7 == len(r["conversations"])
    assert r["peer"]["frozen"] == sorted(["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                          "verifier_norm.weight"])
    same = r["ours"]["ours_peer_mask"]
    assert same["n_tokens"] == r["peer_batch"]["loss_tokens"]
    assert same["loss"] == pytest.approx(r["peer"]["loss"], rel=1e-5)
    assert same["total_norm"] == pytest.approx(r["peer"]["total_norm"], rel=1e-4)
    assert len(same["grads"]) == len(r["peer"]["trainable"]) == 13
    for row in same["grads"]:
        assert row["cos"] > 1 - 1e-6 and row["norm_ratio"] == pytest.approx(1.0, abs=1e-4), row
    ours = r["ours"]["ours"]  # our own mask: a different set of rows, a different loss
    assert ours["loss"] != pytest.approx(r["peer"]["loss"], rel=1e-3)
    init = {row["param"]: row for row in r["init"]}  # the peer's fresh norms are 1; ours copy the target's
    assert init["norm.weight"]["peer"]["std"] == 0.0 and init["norm.weight"]["peer"]["mean"] == 1.0


# ---- the peer's block drafters (speculators-dflash, speculators-dspark) ------------------------------------------
SPECULATORS_BLOCK_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
from speculators.train.cli import create_transformer_layer_config
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoConfig

verifier, out, kind, vd = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
vocab = AutoConfig.from_pretrained(verifier).vocab_size
d2t = t2d = None
if vd < vocab:
    d2t, t2d = build_vocab_mappings_from_distribution({t: 5 for t in range(0, vocab, 2)}, vd, vocab)
layer = create_transformer_layer_config(verifier, num_layers=2, draft_arch="qwen3", hidden_act="silu",
                                        sliding_window=2048, full_attention_indices=[0, 1])
mod = dspark_core if kind == "dspark" else dflash_core
cls = dspark_core.DSparkDraftModel if kind == "dspark" else dflash_core.DFlashDraftModel
model = cls.from_training_args(verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier,
                               draft_vocab_size=vd, block_size=4, target_layer_ids=[1], mask_token_id=vocab - 3,
                               draft_attn_impl="sdpa", **({"markov_rank": 8} if kind == "dspark" else {}))
with torch.no_grad():  # a trained-looking draft: every trainable tensor random, norms away from 1
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "verifier_")) or (name == "lm_head.weight" and vd == vocab):
            continue
        p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.05)
model.eval()
model.save_pretrained(out / "ckpt")
g = torch.Generator().manual_seed(1)
t, h = 16, layer.hidden_size
aux, last = torch.randn(1, t, h, generator=g), torch.randn(1, t, h, generator=g)
ids = torch.randint(0, vocab, (1, t), generator=g)
loss_mask = torch.ones(1, t, dtype=torch.long)
loss_mask[:, :2] = 0  # anchors ≥ 2: every block has a context
seen = {}
select, metrics = dflash_core.select_anchors, mod.compute_metrics
def _select(*a, **k):  # record the anchors its forward draws
    seen["anchors"], seen["valid"] = select(*a, **k)
    return seen["anchors"], seen["valid"]
def _metrics(logits, *a, **k):  # and the block logits its loss reads (DSpark's with the Markov bias)
    seen["logits"] = logits.detach().clone()
    if kind == "dspark":  # and DSpark's confidence logits (its metrics' arguments: logits, targets, confidence, …)
        seen["conf"] = a[1].detach().clone()
    return metrics(logits, *a, **k)
dflash_core.select_anchors, mod.compute_metrics = _select, _metrics
kwargs = model.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")[0] | {"max_anchors": 3}
with torch.no_grad():  # speculators' own training forward
    model(hidden_states=aux, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=last,
          document_ids=torch.zeros(1, t, dtype=torch.long), **kwargs)
assert bool(seen["valid"].all())
save_file({"aux": aux, "ids": ids, "anchors": seen["anchors"], "logits": seen["logits"][0].contiguous()}
          | ({"conf": seen["conf"][0].contiguous()} if "conf" in seen else {}), str(out / "probe.safetensors"))
print(json.dumps({"anchors": seen["anchors"].tolist()}))
"""
BLOCK_CASES = {"dflash-full-vocab": ("dflash", 512), "dflash-draft-vocab": ("dflash", VD), "dspark": ("dspark", VD)}


def speculators_block_checkpoint(speculators_env, tiny_target, out: Path, kind: str, vd: int) -> Path:
    run = subprocess.run([str(speculators_env), "-c", SPECULATORS_BLOCK_SCRIPT, str(tiny_target), str(out), kind,
                          str(vd)], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_dflash_checkpoint_written_by_speculators_matches_its_forward(tiny_target, tmp_path, speculators_env, case):
    """speculators' own DFlashDraftModel / DSparkDraftModel, saved as it saves them, read through load_any: every
    block row's logits equal its training forward's at the anchors it drew (fp32)."""
    import warnings

    from heads.dflash import block_unroll

    kind, vd = BLOCK_CASES[case]
    out = speculators_block_checkpoint(speculators_env, tiny_target, tmp_path, kind, vd)
    tied, args, _ = tied_target(tiny_target)
    assert detect_format(out / "ckpt") == f"speculators-{kind}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        head = load_any(out / "ckpt", tied, args)
    assert head.kind == kind and head.cfg.target_layers == (1,) and head.cfg.mask_token_id == args.vocab_size - 3
    assert head.cfg.num_layers == 2 and head.block_size == 4 and head.cfg.draft_vocab_size == vd
    assert not any("confidence head" in str(w.message) for w in caught)  # DSpark's is read like the rest
    if vd < args.vocab_size:
        assert head.draft_ids.tolist() == list(range(0, 2 * vd, 2))
    p = load_file(str(out / "probe.safetensors"))
    anchors = p["anchors"][None]
    with torch.no_grad():
        h = block_unroll(head, p["aux"], p["ids"], anchors)[0]  # [n, B, H]
        prev = p["ids"][0, anchors[0, :, None] + torch.arange(head.block_size) - head.first_row]
        ours = head.row_logits(h, prev).reshape(p["logits"].shape)
        conf = head.confidence(h, prev)
    torch.testing.assert_close(ours, p["logits"], atol=2e-5, rtol=1e-4)
    if kind == "dspark":  # its confidence head reads [norm(h) ; W1[x]], as ours does
        torch.testing.assert_close(conf.reshape(p["conf"].shape), p["conf"], atol=2e-5, rtol=1e-4)


BLOCK_PLANTED = {
    "sliding window": (lambda c: _set(c["transformer_layer_config"], "layer_types", ["sliding_attention"] * 2),
                       r"transformer_layer_config\.layer_types"),
    "sample from anchor": (lambda c: _set(c, "sample_from_anchor", True), r"sample_from_anchor"),
    "last-layer id": (lambda c: _set(c, "aux_hidden_state_layer_ids", [1, 2]), r"aux_hidden_state_layer_ids"),
    "mask id": (lambda c: _set(c, "mask_token_id", 512), r"mask_token_id"),
    "draft width": (lambda c: _set(c["transformer_layer_config"], "intermediate_size", 96),
                    r"transformer_layer_config\.intermediate_size"),
    "unknown field": (lambda c: _set(c, "mystery_option", True), r"mystery_option: not understood"),
}


def test_dflash_planted_mismatches_are_clear_errors(tiny_target, tmp_path, speculators_env):
    import shutil

    from artifacts.formats.speculators_dflash import read_speculators_block

    base = speculators_block_checkpoint(speculators_env, tiny_target, tmp_path / "base", "dflash", VD) / "ckpt"
    tied, args, _ = tied_target(tiny_target)
    for case, (config, match) in BLOCK_PLANTED.items():
        path = tmp_path / case.replace(" ", "_")
        shutil.copytree(base, path)
        _mutate(path, config)
        with pytest.raises(ValueError, match=match):
            read_speculators_block(path, tied, args)
    path = tmp_path / "no_fc"
    shutil.copytree(base, path)
    _mutate(path, tensors=lambda s: s.pop("fc.weight"))
    with pytest.raises(ValueError, match=r"fc\.weight: missing"):
        read_speculators_block(path, tied, args)


def test_peer_compare_dflash_scores_both_block_heads(tiny_overrides, tiny_target, speculators_env, monkeypatch):
    """experiments/peer_compare.py with peer_type=dflash on the tiny target: one store with the dflash head's target
    layers, our dflash head and the peer's own DFlash (`speculators train --speculator-type dflash`, 2 steps, shaped
    as ours) trained on its training split and scored on the same held-out rows and prompts."""
    from experiments.peer_compare import run_peer_compare
    from tests.conftest import compose_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = compose_config(tiny_overrides + [
        "experiment=peer_compare_dflash", "data.max_length=512", "peer_compare.tokens=null",
        "trainer.max_epochs=1", "peer_compare.epochs=1", "peer_compare.ks=[2]", "peer_compare.eval_depth=3",
        "peer_compare.heldout_conversations=2", "peer_compare.peer_args=[--max-steps,2,--max-anchors,8]",
        "++peer_compare.ours.dflash.overrides={head.num_layers:2,head.block_size:4}",
        "evaluate.num_prompts=2", "evaluate.max_new_tokens=8", "evaluate.plain_baseline=false"])
    out = run_peer_compare(cfg)
    ours, peer = out["results"]["dflash"], out["results"]["peer"]
    assert out["peer_type"] == peer["peer_type"] == "dflash"
    assert ours["heldout"]["heldout_sha256"] == peer["heldout"]["heldout_sha256"]
    assert ours["heldout"]["tokens"] == peer["heldout"]["tokens"] and len(peer["heldout"]["acc"]) == 3
    assert ours["engine"][2]["prompts"] == peer["engine"][2]["prompts"] == 2 and 1.0 <= peer["engine"][2]["tau"] <= 3.0
    tied, args, _ = tied_target(tiny_target)
    from artifacts.checkpoint import load_native

    head = load_native(Path(cfg.run_dir) / "heads" / "peer", tied, args)
    assert head.kind == "dflash" and head.cfg.num_layers == 2 and head.block_size == 4
    assert head.cfg.mask_token_id == args.vocab_size - 1 and head.cfg.target_layers == (1,)
    command = json.loads((Path(cfg.run_dir) / "peer" / "train.json.key.json").read_text())["key"]["command"]
    assert command[command.index("--speculator-type") + 1] == "dflash" and "--draft-vocab-size" not in command
    assert command[command.index("--full-attention-indices") + 1: command.index("--full-attention-indices") + 3] == ["0", "1"]
