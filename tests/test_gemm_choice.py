"""core/gemm_choice.py: the faster of torch's two GEMM forms for a row bucket, measured once per CPU, torch and
thread count, kept on disk; the first process to write a bucket's answer wins, an unreadable answer is measured
again, an unwritable cache leaves the process its own answer."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from core import gemm_choice

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    gemm_choice.reset()
    measured = []

    def fake(rows):  # F.linear faster from 64 rows, (W·xᵀ)ᵀ below
        measured.append(rows)
        return {"F": 1.0, "mm": 2.0} if rows >= 64 else {"F": 2.0, "mm": 1.0}

    monkeypatch.setattr(gemm_choice, "measure", fake)
    yield measured
    gemm_choice.reset()


def test_measured_once_per_bucket_and_read_back_by_a_new_process(fresh):
    assert [gemm_choice.bucket(r) for r in (1, 2, 3, 49, 64, 65, 256)] == [1, 2, 4, 64, 64, 128, 256]
    assert gemm_choice.form(49) == "F" and gemm_choice.form(64) == "F" and gemm_choice.form(5) == "mm"
    assert fresh == [64, 8]  # one measurement per bucket, at the bucket's rows
    file = gemm_choice.path(64)
    saved = json.loads(file.read_text())
    assert saved == {"form": "F", "ms": {"F": 1000.0, "mm": 2000.0}}
    gemm_choice.reset()  # as a new process: the answer is read, not measured
    assert gemm_choice.form(60) == "F" and fresh == [64, 8]
    assert gemm_choice.known(60) == "F" and gemm_choice.known(200) == "mm"  # unmeasured: the default, no measuring
    assert fresh == [64, 8]
    torch.set_num_threads(torch.get_num_threads() + 1)  # another thread count: its own answer
    try:
        assert gemm_choice.path(64) != file
        gemm_choice.form(64)
        assert fresh == [64, 8, 64]
    finally:
        torch.set_num_threads(torch.get_num_threads() - 1)


def test_the_first_writer_wins(fresh, monkeypatch):
    """Two processes measuring the same bucket at once: the one that writes second adopts the first one's
    answer, so both compute the rows the same way."""
    file = gemm_choice.path(128)

    def racing(rows):
        fresh.append(rows)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"form": "mm"}))  # the other process's answer lands first
        return {"F": 1.0, "mm": 2.0}

    monkeypatch.setattr(gemm_choice, "measure", racing)
    assert gemm_choice.form(100) == "mm" and json.loads(file.read_text()) == {"form": "mm"}


@pytest.mark.parametrize("text", ["{not json", json.dumps({"form": "gemv"}), json.dumps(["F"])])
def test_an_unreadable_answer_is_measured_again_and_replaced(fresh, caplog, text):
    file = gemm_choice.path(64)
    file.parent.mkdir(parents=True)
    file.write_text(text)
    with caplog.at_level(logging.WARNING, logger="core.gemm_choice"):
        assert gemm_choice.form(64) == "F"
    assert fresh == [64] and json.loads(file.read_text())["form"] == "F"
    assert str(file) in caplog.text and "measuring again" in caplog.text
    assert not list(file.parent.glob("*.tmp"))


def test_an_unwritable_cache_keeps_this_processes_answer(fresh, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECHEAD_CACHE", str(blocker))  # its native/ cannot be made
    with caplog.at_level(logging.WARNING, logger="core.gemm_choice"):
        assert gemm_choice.form(70) == "F" and gemm_choice.form(80) == "F"
    assert fresh == [128] and "cannot write" in caplog.text


def test_measure_times_both_forms(monkeypatch):
    """The real measurement (on 2 MB of weights here): both forms timed, positive; and each form gives F.linear's
    values (the one-row form padded)."""
    monkeypatch.setattr(gemm_choice, "WEIGHT_BYTES", 2 << 20)
    for rows in (1, 64):
        seconds = gemm_choice.measure(rows)
        assert set(seconds) == {"F", "mm"} and all(0 < s < 5 for s in seconds.values()), seconds
        x, w = torch.randn(rows, 64), torch.randn(96, 64)
        for f in gemm_choice.FORMS:
            got = gemm_choice.apply(f, x, w)
            assert got.shape == (rows, 96) and got.is_contiguous()
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chosen", ["F", "mm"])
def test_a_traced_linear_takes_the_eager_answer_in_one_graph(fresh, monkeypatch, chosen):
    """heads.layers.linear above the native kernel's rows inside a fullgraph compile (the compiled engine step at
    ≥ 13 sequences of k = 3): the graph traces without a break and computes the form the eager pass measured."""
    from heads.layers import linear

    monkeypatch.setattr(gemm_choice, "measure", lambda rows: {"F": 1.0, "mm": 2.0} if chosen == "F" else
                        {"F": 2.0, "mm": 1.0})
    w, x = torch.randn(96, 64), torch.randn(64, 64)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm.code)
        return gm.forward

    with torch.inference_mode():
        eager = linear(x, w)  # measures the 64-row bucket
        torch._dynamo.reset()
        out = torch.compile(lambda t: linear(t, w), backend=backend, fullgraph=True, dynamic=False)(x)
    assert torch.equal(out, eager) and len(graphs) == 1
    assert ("torch.mm" in graphs[0]) == (chosen == "mm") and ("linear" in graphs[0]) == (chosen == "F"), graphs[0]
