"""The spike-response benchmark's smallest configuration, once, so it does not rot."""
from __future__ import annotations

import importlib.util
import sys

from ..conftest import ROOT


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_of_every_arm(capsys):
    bench = load_benchmark("bench_surgery")
    results = bench.main(["--quick", "--seeds", "0", "--threads", "1"])
    assert list(results) == list(bench.ARMS)
    out = capsys.readouterr().out
    assert all(f"| {arm} |" in out for arm in bench.ARMS)
    skip, surgery = results["skip"][0], results["surgery"][0]
    assert skip.detected >= 1 and skip.acted == skip.detected + skip.false_alarms
    # a skipped step leaves the weights as they were: the held-out loss right after it is the one before
    assert any(a == b for a, b in zip(skip.after, skip.before))
    assert surgery.detected >= 1 and surgery.acted >= 1  # the detected corrupted batches were operated on
    assert results["clean"][0].acted == 0
