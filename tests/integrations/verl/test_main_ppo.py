"""``examples/verl_main_ppo.sh``: verl's trainer path with the node, from a fresh directory.

On a machine without a GPU and vLLM the script runs verl's actor workers under Ray on CPU with the
trainer's own old-log-prob, advantage and update methods (docs/verl.md says what runs where); it
must exit 0 and leave a spike table that names the injected response first. About 100 s on 2
cores (Ray's start-up, two workers): slow."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_script_exits_0_with_a_table_naming_the_injected_response(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # this venv's python, as the script's
    out = tmp_path / "run"
    proc = subprocess.run(["bash", str(ROOT / "examples" / "verl_main_ppo.sh"), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reward 40.0 (the injected one)" in proc.stdout, proc.stdout[-3000:]
    (table,) = sorted((out / "run" / "spikes" / "tokens").glob("step_*.json"))
    doc = json.loads(table.read_text())
    rows = [dict(zip(doc["columns"], r)) for r in doc["data"]]
    top = max(rows, key=lambda r: r["share"] or 0.0)
    assert (top["reward"], top["index"], top["group"]) == (40.0, 0, "step3-prompt13"), top
    assert "x the fixed threshold" in (out / "run" / "spike_blocks.txt").read_text()
