"""``integrations/verl/block.py``: the spike block in the words of the node's setup.

GradLoc's fixed trigger is called a fixed threshold (not "its running mean"), an explicit
``locate.threshold`` that finds nothing is named as the reason (not "spread over the batch"),
and the block is kept in the run dir."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

import math

from gradloc_track.console.culprits import SpikeView
from gradloc_track.integrations.verl.block import BLOCKS_FILE, keep_block, spike_lines
from gradloc_track.integrations.verl.options import gradloc_options
from gradloc_track.localizer.result import LocateResult
from gradloc_track.spikes.event import SpikeEvent

SHARES = [{"rank": 1, "micro_batch": 0, "sample": 1, "document": None, "share": 1.0, "raw_share": 1.0,
           "grad_norm": 2.0}, {"rank": 0, "micro_batch": 0, "sample": 0, "document": None, "share": 0.0,
                               "raw_share": 0.0, "grad_norm": 0.01}]


def _view(events, result=None) -> SpikeView:
    return SpikeView(step=4, events=events, result=result, not_localized=None if result else "locate.enabled=false")


def test_the_fixed_trigger_is_called_a_fixed_threshold(tmp_path):
    opts = gradloc_options({"grad_norm_threshold": 640})
    fixed = SpikeEvent(4, "global", 8.27, 0.224, 36.9, 36.9)  # the fixed detector's event: baseline = threshold
    text = "\n".join(spike_lines(_view([fixed]), tmp_path, None, opts))
    assert "grad_norm/global = 8.27, 36.9x the fixed threshold 0.224 (spikes.mode=fixed: per_token_threshold 640 " \
           "/ sqrt(loss tokens) x micro-batches, GradLoc's trigger)" in text, text
    assert "running mean" not in text
    nan = SpikeEvent(4, "global", math.nan, 0.224, math.nan, math.nan)
    assert "grad_norm/global = nan (not finite; the fixed threshold 0.224" in \
        "\n".join(spike_lines(_view([nan]), tmp_path, None, opts))
    adaptive = gradloc_options({})  # the adaptive detector keeps its own words
    assert "its running mean" in "\n".join(spike_lines(_view([fixed]), tmp_path, None, adaptive))


def test_a_threshold_set_too_high_is_named_as_the_reason(tmp_path):
    event = SpikeEvent(4, "global", 8.27, 0.224, 50.0, 36.9)
    result = LocateResult(tokens=[], probes=9, method="auto", threshold=5.0, total_norm=2.0, culprits=[],
                          sample_shares=SHARES)
    opts = gradloc_options({"locate": {"threshold": 10}})
    text = "\n".join(spike_lines(_view([event], result), tmp_path, None, opts))
    assert "culprits   none found: locate.threshold=10 is set too high: no loss term's own gradient reaches it " \
           "(per term, 5 in the optimizer's units), while rank 1, micro-batch 0, sample 1 holds 100% of the " \
           "step's squared grad norm" in text, text
    assert "spread over the batch" not in text
    adaptive = "\n".join(spike_lines(_view([event], result), tmp_path, None, gradloc_options({})))
    assert "spread over the batch" in adaptive and "too high" not in adaptive  # no threshold set: nothing to blame


def test_the_block_is_kept_in_the_run_dir(tmp_path):
    keep_block(tmp_path / "run", ["── spike at step 4", "  culprits   x"])
    keep_block(None, ["not kept"])
    assert (tmp_path / "run" / BLOCKS_FILE).read_text() == "── spike at step 4\n  culprits   x\n\n"
