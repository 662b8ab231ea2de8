"""Layer grouping modes and custom groups: the monitor's layer norms against a plain loop."""
from __future__ import annotations

import math

import pytest

from gradloc_track import GradMonitor, MemoryTracker

from .monitor.helpers import backward, reference, weight_layers


@pytest.mark.parametrize("mode", ["module", "tensor"])
def test_grouping_modes_match_the_loop(tiny_gpt, mode):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, group_by=mode)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    _, layers = reference(tiny_gpt, mode)
    w = weight_layers(tiny_gpt, mode)
    logged = {k[len("grad_norm/"):] for k in m if k.startswith("grad_norm/")} - {"global", "nonfinite"}
    assert logged == set(layers)
    assert ("h.0.attn.qkv" if mode == "module" else "h.0.attn.qkv.weight") in logged
    for lay, v in layers.items():
        assert m[f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)
        assert m[f"weight_norm/{lay}"] == pytest.approx(w[lay], rel=1e-5)


def test_custom_groups_and_their_fallback(tiny_gpt):
    tracker = MemoryTracker()
    groups = {"attention": r"\.attn\.", "mlp": r"\.mlp\."}
    mon = GradMonitor(tiny_gpt, tracker=tracker, groups=groups)
    backward(tiny_gpt)
    mon.after_backward(0)
    m = tracker.metrics[0][1]
    per, layers = reference(tiny_gpt, "block", groups)
    attn = math.sqrt(sum(v * v for n, v in per.items() if ".attn." in n))
    assert m["grad_norm/attention"] == pytest.approx(attn, rel=1e-5)
    assert set(layers) == {"attention", "mlp", "wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"}
    for lay, v in layers.items():  # unmatched tensors (norms of the blocks, embeddings) fall back
        assert m[f"grad_norm/{lay}"] == pytest.approx(v, rel=1e-5)
