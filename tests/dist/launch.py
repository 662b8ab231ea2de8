"""Start one Python process per rank on a fresh gloo rendezvous; a hang fails within ``timeout``."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_ranks(script: Path, world: int, args: list[str], timeout: float = 240.0, env: dict | None = None) -> None:
    """Run ``script RANK WORLD PORT *args`` on ``world`` processes; raise with every rank's output
    tail if any rank fails or the group does not finish within ``timeout`` seconds (all killed)."""
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), port, *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
             for r in range(world)]
    logs, hung = [], False
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            hung = True
            for q in procs:  # our own children, by handle
                q.kill()
            logs.append(p.communicate()[0])
    report = "\n".join(f"--- rank {r} exited {p.returncode} ---\n{(log or '')[-3000:]}"
                       for r, (p, log) in enumerate(zip(procs, logs)))
    if hung:
        raise AssertionError(f"ranks did not finish within {timeout} s (deadlock?)\n{report}")
    if any(p.returncode != 0 for p in procs):
        raise AssertionError(report)
