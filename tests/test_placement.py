"""Where the target runs (`target.device`) and how it gets there: every stage places the target by one
rule, weights stream onto the device tensor by tensor, and the heads evaluated against a target share
its vocabulary-sized tensors instead of holding a copy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inference_eval import model as model_mod
from inference_eval.model import LlamaForCausalLM, resolve_device, tied_from_model
from tests.conftest import ROOT, compose_config


# ---- the rule ----------------------------------------------------------------------------------------
@pytest.mark.unit
def test_resolve_device_rule(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_device("gpu0")
    # with CUDA: each rank of a launch takes the GPU of its LOCAL_RANK
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


# ---- every stage honours it --------------------------------------------------------------------------
class _Placed(Exception):
    pass


@pytest.fixture
def record_placement(monkeypatch):
    """Every engine-model load records the device it was asked for, then stops the stage."""
    seen: list[torch.device] = []

    def fake(cls, path, dtype=torch.float32, device="cpu"):
        seen.append(torch.device(device))
        raise _Placed

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", classmethod(fake))
    return seen


@pytest.mark.unit
@pytest.mark.parametrize("stage", ["precompute", "evaluate", "regenerate", "validation"])
def test_every_stage_places_the_target_by_target_device(stage, tiny_overrides, record_placement, tmp_path):
    """`meta` stands in for a device this machine lacks: the point is that the configured device
    reaches the loader in each stage, not the CPU default."""
    cfg = compose_config([*tiny_overrides, "target.device=meta", f"evaluate.heads.trained={tmp_path}",
                          "evaluate.heads.untrained=null"])  # evaluation checks the head path exists first
    with pytest.raises(_Placed):
        if stage == "precompute":
            from experiments.stages import run_precompute
            run_precompute(cfg)
        elif stage == "evaluate":
            from experiments.stages import run_evaluation
            run_evaluation(cfg)
        elif stage == "regenerate":
            from experiments.stages import regenerate
            regenerate(cfg)
        else:
            from train.validation import EngineValidation, EngineValidationSettings
            EngineValidation(EngineValidationSettings(cfg.target.path, "float32", device=cfg.target.device))._load()
    assert record_placement == [torch.device("meta")]


# ---- streaming load ----------------------------------------------------------------------------------
def _write_sharded_checkpoint(path: Path, vocab: int = 8000, hidden: int = 1024, layers: int = 8) -> dict:
    """An untied random Llama checkpoint, fp32, one shard per layer (+ one for E, one for W_lm)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                   tie_word_embeddings=False, max_position_embeddings=256)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    shards = {"embed": {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": 1 + rnd(hidden)},
              "head": {"lm_head.weight": rnd(vocab, hidden)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        shards[f"layer{i}"] = {
            **{p + f"self_attn.{n}_proj.weight": rnd(hidden, hidden) for n in "qkvo"},
            **{p + f"mlp.{n}_proj.weight": rnd(hidden, hidden) for n in ("gate", "up", "down")},
            p + "input_layernorm.weight": 1 + rnd(hidden), p + "post_attention_layernorm.weight": 1 + rnd(hidden)}
    for name, tensors in shards.items():
        save_file(tensors, path / f"model-{name}.safetensors")
    n_params = sum(t.numel() for ts in shards.values() for t in ts.values())
    shard_bytes = max(sum(t.numel() * 4 for t in ts.values()) for ts in shards.values())
    return {"params": n_params, "max_shard_bytes": shard_bytes}


_PEAK = textwrap.dedent("""
    import sys, torch
    def hwm():  # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's peak over exec)
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
    sys.path.insert(0, {root!r})
    from core.safetensors_io import load_safetensors_dir
    from inference_eval.model import LlamaForCausalLM
    from heads.layers import LlamaArgs
    torch.set_num_threads(1)
    with torch.device("meta"):  # what building a model loads once (~70 MB of code), before the baseline
        LlamaForCausalLM(LlamaArgs(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=8))
    torch.ones(4).to(torch.bfloat16)
    before = hwm()
    if {naive!r}:  # the whole state dict in host memory first, then the cast copy
        state = load_safetensors_dir({path!r})
        model = {{k: v.to(torch.bfloat16) for k, v in state.items()}}
    else:
        model = LlamaForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16)
    print("peak_growth", hwm() - before)
""")


def test_weights_stream_without_a_host_copy_of_the_state_dict(tmp_path):
    """Loading an fp32 checkpoint as bf16: the peak RSS growth stays within the bf16 model plus about
    one shard in flight. The naive load (state dict, then cast) is run as the control: it must
    exceed the same bound, or the bound proves nothing."""
    info = _write_sharded_checkpoint(tmp_path / "ckpt")
    bound = 2 * info["params"] + 2 * info["max_shard_bytes"]
    peaks = {}
    for naive in (False, True):
        code = _PEAK.format(root=str(ROOT), naive=naive, path=str(tmp_path / "ckpt"))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        peaks[naive] = int(out.stdout.split("peak_growth")[-1])
    assert peaks[False] < bound, f"streaming load grew RSS by {peaks[False] / 2**20:.0f} MiB (bound {bound / 2**20:.0f})"
    assert peaks[True] > bound, f"control: naive load grew RSS by {peaks[True] / 2**20:.0f} MiB only"


@pytest.mark.unit
def test_streamed_model_equals_the_checkpoint(tiny_target):
    from safetensors.torch import load_file

    model = LlamaForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    state = {}
    for f in sorted(Path(tiny_target).glob("*.safetensors")):
        state |= load_file(f)
    own = model.state_dict()
    for name, value in state.items():
        assert torch.equal(own[name], value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, like the checkpoint
    assert not any(p.requires_grad for p in model.parameters())
    assert all(t.device.type == "cpu" for t in own.values())


@pytest.mark.unit
def test_evaluation_heads_share_the_targets_tensors(tiny_target):
    target = LlamaForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    tied = tied_from_model(target)
    assert tied.embed.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert tied.lm_head.data_ptr() == target.lm_head.weight.data_ptr()
    assert tied.norm_weight.data_ptr() == target.model.norm.weight.data_ptr()
    h = torch.randn(3, target.args.hidden_size)
    assert torch.allclose(tied.teacher_logits(h), target.lm_head(target.model.norm(h)), atol=1e-5)


def test_evaluation_does_not_copy_the_shared_tensors(tiny_overrides, monkeypatch):
    """With head_dtype unset (the target's dtype), evaluation never reads E / W_lm a second time — also with
    `evaluate.weight_dtype=bfloat16`, which stores the target's linear weights in bf16 (reported), a setting of
    spechead's engine that evaluate.engine=vllm refuses."""
    from experiments.stages import run_evaluation, run_precompute, run_training

    cfg = compose_config([*tiny_overrides, "trainer.max_epochs=1", "train.engine_validation.enabled=false",
                          "evaluate.heads.untrained=null"])
    run_precompute(cfg)
    run_training(cfg)
    copies = []
    real = model_mod.load_frozen_parts
    monkeypatch.setattr(model_mod, "load_frozen_parts", lambda *a, **k: copies.append(a) or real(*a, **k))
    report = run_evaluation(cfg)
    assert copies == [] and report["head_dtype"] == "float32" and report["results"]["trained"]["tau"] >= 1.0
    assert report["weight_dtype"] == "float32"
    # the target's linear weights stored in bf16 (W16A32): the heads still share the target's exact E / W_lm
    stored = []
    real_store = model_mod.LlamaForCausalLM.store_weights
    monkeypatch.setattr(model_mod.LlamaForCausalLM, "store_weights",
                        lambda self, dtype: stored.append(dtype) or real_store(self, dtype))
    w16 = run_evaluation(compose_config([*tiny_overrides, "trainer.max_epochs=1", "evaluate.heads.untrained=null",
                                         "train.engine_validation.enabled=false", "evaluate.weight_dtype=bfloat16"]))
    assert stored == [torch.bfloat16] and copies == [] and w16["weight_dtype"] == "bfloat16"
    assert w16["results"]["trained"]["tau"] >= 1.0
    with pytest.raises(ValueError, match="evaluate.weight_dtype=bfloat16: it sets how spechead's engine"):
        run_evaluation(compose_config([*tiny_overrides, "evaluate.weight_dtype=bfloat16", "evaluate.engine=vllm"]))


@pytest.mark.unit
def test_hf_backend_with_a_device_map_stores_the_same_states(tiny_overrides, tmp_path):
    """`target.device_map` goes to accelerate's dispatch (here everything on the CPU): the store must
    equal the plain HF backend's, bit for bit."""
    from safetensors.torch import load_file

    from experiments.stages import run_precompute

    stores = {}
    for label, extra in (("plain", []), ("mapped", ["target.device_map=cpu"])):
        cfg = compose_config([*tiny_overrides, "precompute.backend=hf", f"store_dir={tmp_path / label}", *extra])
        store, stats = run_precompute(cfg)
        assert stats.samples > 0
        stores[label] = {f.name: load_file(f) for f in sorted((store / "shards").glob("*.safetensors"))}
    assert stores["plain"].keys() == stores["mapped"].keys() and stores["plain"]
    for name, tensors in stores["plain"].items():
        for key, value in tensors.items():
            assert torch.equal(value, stores["mapped"][name][key]), (name, key)


@pytest.mark.unit
def test_vllm_replicas_take_their_own_gpus():
    """precompute.backend=vllm over a node: rank r's worker sees GPUs [r·tp, (r+1)·tp)."""
    from inference_eval.vllm_backend import replica_devices

    assert replica_devices(4, {"LOCAL_RANK": "1"}, 8) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert replica_devices(2, {"LOCAL_RANK": "0"}, 8) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert replica_devices(1, {"LOCAL_RANK": "3"}, 8) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert replica_devices(4, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2"}, 8) == {}  # the user's choice stands
    assert replica_devices(4, {}, 8) == {} and replica_devices(4, {"LOCAL_RANK": "1"}, 0) == {}
    with pytest.raises(ValueError, match="needs GPUs 8..11"):
        replica_devices(4, {"LOCAL_RANK": "2"}, 8)
