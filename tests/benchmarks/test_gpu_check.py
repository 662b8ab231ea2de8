"""The GPU check (``benchmarks/gpu_check.py``) on the CPU at tiny sizes, so it is ready the day a GPU is lent:
every section runs, the localization section localizes its two injected spikes, and without CUDA the real run says
how to get one instead of failing somewhere inside."""
from __future__ import annotations

import pytest
import torch

from .test_bench_surgery import load_benchmark


def test_the_dry_run_reaches_every_section(capsys):
    bench = load_benchmark("gpu_check")
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for n in range(1, 8):
        assert f"\n{n}. " in out
    assert "from the loss's saved log-probs" in out and "detected at steps [12, 23]" in out
    assert "ours / yardstick = " in out  # section 3 prints its yardstick beside its distance
    assert "back to back" in out  # section 2's pipelined measure beside its synchronized one
    probes = out.split("(probes [", 1)[1].split("]", 1)[0]
    assert probes and "0" not in probes.split(", ")  # both injected spikes were localized, not failed
    assert "per-token signals off" in out and "host enqueue" in out  # sections 7 and 6 ran


def test_without_cuda_it_says_where_to_run(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the real run is the check")
    assert load_benchmark("gpu_check").main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().out
