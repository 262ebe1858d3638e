"""The engine's compiled static decode step (inference_eval/engine/static.py, `Engine(compile="on")`): the same
greedy tokens as the eager step on every model family, one graph per shape bucket and none more while a batch grows
over many steps, no graph break, no value read back to the host inside a step."""

from __future__ import annotations

import pytest
import torch

from inference_eval.engine import engine_generate
from inference_eval.engine.scheduler import forbid_host_reads
from inference_eval.engine.static import batch_bucket, compile_enabled, key_bucket
from inference_eval.model import LlamaForCausalLM
from tests.test_family_conformance import varied  # noqa: F401 (the family fixture)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.unit
def test_buckets_and_the_switch():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [key_bucket(b, 16) for b in (1, 2, 3, 5)] == [16, 32, 64, 128]
    assert compile_enabled("on", torch.device("cpu")) and not compile_enabled("off", torch.device("cuda"))
    assert not compile_enabled("auto", torch.device("cpu")) and compile_enabled("auto", torch.device("cuda"))
    with pytest.raises(ValueError, match="compile='yes': expected one of auto, on, off"):
        compile_enabled("yes", torch.device("cpu"))


def test_compiled_decoding_equals_eager_on_every_family(varied):  # noqa: F811
    """Requests arriving at different steps (the batch 1 → 8, padded to its bucket; sliding windows on Gemma 3, the
    latent pool on DeepSeek-V2): the compiled step's greedy tokens are the eager engine's, exactly."""
    fam, target, prompts, path, reference, hf = varied
    if not target.static_step:  # DeepSeek-V2: its MoE routing reads the chosen experts on the host
        with pytest.raises(ValueError, match="DeepseekV2ForCausalLM's decode step reads values on the host"):
            engine_generate(target, prompts, 16, compile="on")
        out, eng = engine_generate(target, prompts, 16, arrivals=[0, 0, 1, 2, 3, 5, 8, 13], block_size=4,
                                   compile="auto")
        assert out == reference and eng.static is None
        return
    out, eng = engine_generate(target, prompts, 16, arrivals=[0, 0, 1, 2, 3, 5, 8, 13], block_size=4, compile="on")
    assert out == reference
    assert eng.static is not None and eng.static.steps > 16 and len(eng.static.compiled) >= 2


def test_a_growing_batch_compiles_once_per_bucket_with_no_break_and_no_host_read(tiny_target):
    """64+ steps while requests keep arriving: one graph per (batch, key) bucket and no recompilation inside one
    (dynamo's graph count), whole graphs (`fullgraph`, and `torch._dynamo.explain` finds no break), and a compiled
    step reads no tensor value back to the host."""
    target = LlamaForCausalLM.from_pretrained(tiny_target)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (5 + i,), generator=g).tolist() for i in range(10)]
    arrivals = [6 * i for i in range(10)]
    reference, _ = engine_generate(target, prompts, 24, arrivals=arrivals, block_size=8)
    before = _graphs()
    out, eng = engine_generate(target, prompts, 24, arrivals=arrivals, block_size=8, num_blocks=64, compile="on")
    st = eng.static
    assert out == reference and st.steps >= 64
    assert _graphs() - before == len(st.compiled) and 3 <= len(st.compiled) <= 12, sorted(st.compiled)
    graphs = _graphs()  # a new engine of the same pool size reuses the graphs, writing and reading its own pool
    others = [p[::-1] for p in prompts[:4]]
    again, eng2 = engine_generate(target, others, 24, block_size=8, num_blocks=64, compile="on")
    assert again == engine_generate(target, others, 24, block_size=8)[0]
    assert _graphs() - graphs == len(set(eng2.static.compiled) - set(st.compiled))  # only its new buckets
    meta = st.pack([5, 6, 7], [9, 3, 12], [[0, 1], [2], [3, 4]])
    assert tuple(meta.shape) == (4, 4 + 16) and meta[3, 3] == st.scratch  # the padding row writes the scratch slot
    assert meta[:3, 2].tolist() == [9, 3, 12]  # each row sees up to its own position (causal)
    assert torch._dynamo.explain(st._step)(meta[:, 0], meta).graph_break_count == 0
    first = st.logits([5, 6, 7], [9, 3, 12], [[0, 1], [2], [3, 4]])  # compiled here if this bucket is new
    with forbid_host_reads():  # the step itself, compiled: no value read back
        again = st.logits([5, 6, 7], [9, 3, 12], [[0, 1], [2], [3, 4]])
    assert first.shape == (3, target.args.vocab_size) and torch.isfinite(again).all()


def test_compiled_decoding_of_bf16_stored_weights_equals_eager(tiny_target):
    """A target whose linear weights are stored in bf16 (W16A32): the compiled step (the kernel's operator reading
    bf16 weights in the graph) gives the eager engine's greedy tokens, batch 1 → 3."""
    target = LlamaForCausalLM.from_pretrained(tiny_target).store_weights(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 11, 3)]
    eager, _ = engine_generate(target, prompts, 12, arrivals=[0, 2, 4])
    out, eng = engine_generate(target, prompts, 12, arrivals=[0, 2, 4], compile="on")
    assert out == eager
    assert eng.static is not None and eng.static.steps > 10
