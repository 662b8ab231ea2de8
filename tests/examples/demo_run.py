"""The README's demo, run once per test session as a user runs it (a subprocess, Hydra overrides), for
every test that reads it: tests/examples/test_train_lm.py checks what it logged, tests/docs what the
docs quote from it (one ~2 minute run instead of one per reader)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..conftest import ROOT, once_per_session

SCRIPT = ROOT / "examples" / "train_lm.py"


def run_example(tmp_path: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python examples/train_lm.py <overrides>`` in ``tmp_path`` (runs under ``tmp_path/runs``, MLflow in
    ``tmp_path/mlflow.db``, W&B offline there)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           # this checkout's package, not whichever one is installed
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants -m before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags, f"out_dir={tmp_path / 'runs'}", *rest],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"train_lm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_dirs(tmp_path: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp_path / "runs").rglob("summary.json"))


@dataclass
class DemoRun:
    root: Path  # cwd of the run: runs/, mlflow.db, wandb/
    proc: subprocess.CompletedProcess
    run_dir: Path

    @property
    def console(self) -> str:
        return self.proc.stdout + self.proc.stderr


_RUNS: dict[str, DemoRun] = {}


def demo_run(tmp_path_factory) -> DemoRun:
    """``python examples/train_lm.py experiment=spike_demo`` (the README's command; ``tracker=both`` so the
    W&B side is checked too: the console's MLflow lines are the same), once per session (per test run,
    whichever pytest-xdist worker asks first; its readers only read it)."""
    if "demo" not in _RUNS:
        def make(root: Path) -> dict:
            proc = run_example(root, "experiment=spike_demo", "tracker=both",
                               f"tracker.mlflow.tracking_uri=sqlite:///{root / 'mlflow.db'}")
            (run_dir,) = run_dirs(root)
            return {"root": str(root), "args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr,
                    "run_dir": str(run_dir)}

        done = once_per_session(tmp_path_factory, "spike_demo", make)
        proc = subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"])
        _RUNS["demo"] = DemoRun(Path(done["root"]), proc, Path(done["run_dir"]))
    return _RUNS["demo"]
