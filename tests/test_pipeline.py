"""The demo entry point end to end on the tiny target, through the real CLI and hydra config."""

import json
import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_pipeline_cli_on_tiny_target(tiny_overrides, tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "scripts.pipeline", *tiny_overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"demo tau_trained=([\d.]+) tau_untrained=([\d.]+) runtime_s=(\d+)", last)
    assert m, last
    run = tmp_path / "run"
    report = json.loads((run / "eval.json").read_text())
    assert float(m.group(1)) == round(report["results"]["trained"]["tau"], 3)
    assert float(m.group(2)) == round(report["results"]["untrained"]["tau"], 3)
    for r in report["results"].values():
        assert r["prompts"] == 2 and r["k"] == 3 and 1.0 <= r["tau"] <= 4.0 and len(r["alpha"]) == 3
        assert r["new_tokens"] == 2 * 8 or r["new_tokens"] < 16  # stops early only on an end-of-turn token
    assert (run / "export" / "native" / "model.safetensors").exists()
    assert "artifacts: store=" in proc.stdout
