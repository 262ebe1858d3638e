"""The demo entry point end to end on the tiny target, through the real CLI and hydra config, with its
output sent to files as a new user running it under nohup would: progress lines from every stage, k=auto
with the speedup, no unservable export, the disk use, and the run's status file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_pipeline_cli_on_tiny_target(tiny_overrides, tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # the demo's own defaults for evaluation (k=auto, plain baseline), a progress line at every update
    overrides = [*tiny_overrides, "evaluate.k=auto", "evaluate.plain_baseline=true", "evaluate.auto_max_k=2",
                 "evaluate.auto_prompts=1", "progress_log_s=0", "train.engine_validation.every_n_steps=2"]
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.run([sys.executable, "-m", "scripts.pipeline", *overrides], cwd=ROOT, env=env,
                              stdout=fo, stderr=fe, text=True, timeout=600)
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    last = stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"demo tau_trained=([\d.]+) tau_untrained=([\d.]+) speedup=([\d.]+) speedup_min=([\d.]+) "
                     r"speedup_max=([\d.]+) verdict=(faster|not_faster|within_noise) predicted_speedup=([\d.]+) "
                     r"k=(\d) draft_vocab=(\w+) runtime_s=(\d+) disk_mb=(\d+)", last)
    assert m, last
    run = tmp_path / "run"
    report = json.loads((run / "eval.json").read_text())
    trained = report["results"]["trained"]
    assert float(m.group(1)) == round(trained["tau"], 3)
    assert float(m.group(2)) == round(report["results"]["untrained"]["tau"], 3)
    assert float(m.group(3)) == round(trained["speedup"], 2) and trained["speedup"] > 0
    assert float(m.group(4)) == round(trained["speedup_min"], 2) and float(m.group(5)) == round(trained["speedup_max"], 2)
    assert m.group(6) == trained["speed_verdict"].replace(" ", "_")
    assert float(m.group(7)) == round(trained["predicted_speedup"], 2)
    assert int(m.group(8)) == trained["k"] == trained["k_auto"]["chosen_k"]
    assert report["k"] == "auto" and [r["k"] for r in trained["k_auto"]["table"]] == [1, 2]
    for r in report["results"].values():
        assert r["prompts"] == 2 and 1.0 <= r["tau"] <= 3.0 and len(r["alpha"]) == r["k"]
        assert r["new_tokens"] == 2 * 8 or r["new_tokens"] < 16  # stops early only on an end-of-turn token
    # exports: native + what an engine serves for an mtp head on a Llama target; no mtp-stitched copy
    assert sorted(p.name for p in (run / "export").iterdir()) == ["mtp-vllm", "native"]
    assert "artifacts: store=" in stdout and re.search(r"disk: .* takes [\d.]+ MB \(.*features [\d.]+ MB", stdout)
    # progress lines from every stage in the output file (hydra logs to stdout)
    for pattern in (r"precompute: [\d,]+/[\d,]+ tok \(\d+%\)", r"\btrain: \d+/\d+ step \(\d+%\).*loss=",
                    r"engine validation: \d+/\d+ item", r"evaluate \(paired passes\): \d+/\d+ pass",
                    r"evaluate trained: k=auto: \d+/2 setting", r"speed: (faster|NOT faster|within)",
                    r"export 1/2: native", r"export 2/2: mtp-vllm written, validated and read back"):
        assert re.search(pattern, stdout), pattern
    assert re.search(r"ETA \d+", stdout)  # a line with the time left
    status = json.loads((run / "status.json").read_text())
    assert status["pipeline"]["state"] == "done"


def test_the_demo_plan_trains_module_one_of_the_default_head_on_a_cpu(tiny_overrides, tmp_path):
    """`pipeline.head_modules=auto` on a CPU trainer: the default head (`mtp3`) is trained as module 1 alone —
    whose weights are those module 1 ends with among the three (so τ at k = 1 is the same) — and left whole on a
    GPU trainer or with `all`; 1 trains module 1 anywhere; any other value is refused before work."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from scripts.checks import ConfigError, check_before_work
    from scripts.pipeline import plan_modules
    from experiments.stages import run_precompute, run_training
    from tests.conftest import compose_config

    base = [*tiny_overrides, "head=mtp3", f"store_dir={tmp_path / 'store'}", "trainer.max_steps=6",
            "train.engine_validation.enabled=false", "train.untrained_dir=null"]
    cpu = compose_config([*base, f"run_dir={tmp_path / 'one'}"])
    assert "training module 1 of the head's 3 per-depth modules, which drafts every depth (auto: training runs on " \
           "the CPU" in plan_modules(cpu)
    assert (cpu.head.num_modules, cpu.train.module.depth, cpu.evaluate.auto_max_k) == (1, 1, 3)
    for keep in (["trainer=gpu"], ["pipeline.head_modules=all"], ["head=eagle3"], ["head=mtp"]):
        cfg = compose_config([*base, *keep])
        assert plan_modules(cfg) is None and cfg.head.get("num_modules") in (3, 1, None), keep
        assert cfg.head.get("num_modules") != 1 or keep == ["head=mtp"]
    anywhere = compose_config([*base, "trainer=gpu", "pipeline.head_modules=1"])
    assert "as set" in plan_modules(anywhere) and anywhere.head.num_modules == 1
    for bad in ("2", "some"):  # two of three modules would refuse in-loop validation's k = 3
        with pytest.raises(ConfigError, match="pipeline.head_modules"):
            check_before_work(compose_config([*base, f"pipeline.head_modules={bad}"]), "pipeline")
        with pytest.raises(ValueError, match="pipeline.head_modules=.*auto, all or 1"):
            plan_modules(compose_config([*base, f"pipeline.head_modules={bad}"]))

    run_precompute(cpu)
    one_dir, _ = run_training(cpu)
    three_dir, _ = run_training(compose_config([*base, f"run_dir={tmp_path / 'three'}",
                                                f"train.untrained_dir={tmp_path / 'three' / 'init'}"]))
    one, three, init = (load_file(str(next(Path(d).glob("*.safetensors"))))
                        for d in (one_dir, three_dir, tmp_path / "three" / "init"))
    assert any(k.startswith("layers.2.") for k in three) and not any(k.startswith("layers.1.") for k in one)
    for key, value in one.items():
        torch.testing.assert_close(value, three[key], atol=1e-6, rtol=1e-5, msg=key)
        assert not torch.equal(value, init[key]) or "norm" in key, key  # module 1 trained
    for d in (1, 2):  # modules 2–3 started (from module 1) and trained in the same run
        w = f"layers.{d}.eh_proj.weight"
        assert not torch.equal(three[w], init[w]) and not torch.equal(three[w], three["layers.0.eh_proj.weight"])
