"""tracker=wandb with no W&B login, from a terminal: W&B's init prompted for an API key on the tracker's thread
(the prompt competing with the user's input), the open waited out its 120 s bound with no login hint, and the
thread still reading stdin at exit aborted the finished run (exit 134; held-out tester round 6). The
credentials are now looked up without a prompt: the run says `wandb login` at once, as without a terminal.
A real pseudo-terminal (``script``), the W&B SDK untouched, no key anywhere (a fresh HOME)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ..conftest import ROOT

LOOP = """
import torch, gradloc_track
m = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
h = gradloc_track.watch(m, opt, tracker="wandb", run_dir={run_dir!r}, spikes=False, locate=False)
for s in range(5):
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
h.finish()
print("LOOP DONE")
"""


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` for a pseudo-terminal")
def test_no_login_on_a_terminal_is_said_at_once_not_prompted(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(run_dir=str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    (tmp_path / "home").mkdir()
    typed, keyboard = os.pipe()  # a terminal whose user types nothing (never an end of input, as a real one)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(["script", "-qec", f"{sys.executable} {script}", "/dev/null"], env=env, cwd=tmp_path,
                              stdin=typed, capture_output=True, text=True, timeout=300)
    finally:
        os.close(keyboard)
        os.close(typed)
    waited = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "LOOP DONE" in out, out[-3000:]
    assert "No API key configured" in out and "wandb login" in out and "WANDB_MODE=offline" in out, out[-3000:]
    assert "Enter your choice" not in out  # never W&B's interactive menu
    assert waited < 100, f"{waited:.0f} s: the open waited out its bound"  # before: 116 s, then exit 134
    assert (tmp_path / "run" / "spool" / "wandb.jsonl").is_file()  # the records kept for `replay`


def test_wandb_offline_in_the_settings_file_needs_no_login(tmp_path):
    """``wandb offline`` writes ``mode = offline`` to ``./wandb/settings`` (no environment variable); W&B's init
    honours it, so the run needs no key and is logged offline (before: refused with 'No API key configured',
    reviewer round 8). The real CLI writes the file; no key anywhere (a fresh HOME)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    (tmp_path / "home").mkdir()
    wandb_cli = [sys.executable, "-c", "import sys; from wandb.cli.cli import cli; sys.exit(cli())", "offline"]
    subprocess.run(wandb_cli, env=env, cwd=tmp_path, check=True, capture_output=True, timeout=120)
    assert "offline" in (tmp_path / "wandb" / "settings").read_text()
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(run_dir=str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "LOOP DONE" in out, out[-3000:]
    assert "No API key" not in out, out[-3000:]
    assert list((tmp_path / "run").rglob("offline-run-*")), out[-3000:]  # logged offline, as W&B's setting says
