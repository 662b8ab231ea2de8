"""The spike-event table: one row per detected step, named by its lead signal, with why it was not localized."""
from __future__ import annotations

import pytest

from gradloc_track.artifacts.events import EVENT_COLUMNS, event_row
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes import SpikeEvent


def test_a_step_is_named_by_the_global_norm_and_lists_the_layers_that_fired_too():
    events = [SpikeEvent(100, "h.0", 2.0, 0.5, 7.2, 4.0), SpikeEvent(100, "global", 3.0, 1.0, 5.1, 3.0),
              SpikeEvent(100, "wpe", 1.0, 0.2, 9.6, 5.0)]
    row = dict(zip(EVENT_COLUMNS, event_row(100, events, "locate.enabled=false")))
    assert (row["step"], row["signal"], row["norm"], row["running_mean"], row["ratio"], row["z"]) == \
        (100, "global", 3.0, 1.0, 3.0, 5.1)
    assert row["layers"] == "wpe (z 10), h.0 (z 7)"  # furthest out first
    assert row["localization"] == "locate.enabled=false"
    assert row["culprits"] is None and row["micro_batch_norms"] is None  # no localization ran: not known
    assert row["cause"] is None and row["cause_detail"] is None  # no cause named


def test_the_row_carries_the_cause_the_step_was_given():
    events = [SpikeEvent(7, "update", 0.4, 0.01, 12.0, 40.0, cause="optimizer", cause_detail="the update is 40x")]
    row = dict(zip(EVENT_COLUMNS, event_row(7, events, "localized")))
    assert (row["cause"], row["cause_detail"]) == ("optimizer", "the update is 40x")


def test_without_a_global_event_the_layer_furthest_out_leads():
    events = [SpikeEvent(5, "h.0", 2.0, 0.5, 7.0, 4.0), SpikeEvent(5, "wpe", 1.0, 0.2, 9.0, 5.0)]
    row = dict(zip(EVENT_COLUMNS, event_row(5, events, "locate.max_events=1 reached")))
    assert row["signal"] == "wpe" and row["layers"] == "h.0 (z 7)"


def test_a_layer_leads_a_loss_signal_further_out_as_on_the_page_and_in_the_console():
    """Tester round 12: the demo's spike (wpe at z 6.5, the largest sample loss at z 36) read ``sample_loss``
    in the events table, its loss in nats in the ``norm`` column, and ``wpe`` on its page and in the console.
    A gradient norm leads whenever one fired; a step only loss signals fired is named by the first of them."""
    events = [SpikeEvent(100, "wpe", 0.992, 0.28, 6.5, 3.5), SpikeEvent(100, "sample_loss", 10.0, 4.6, 36.0, 2.2)]
    row = dict(zip(EVENT_COLUMNS, event_row(100, events, "localized")))
    assert (row["signal"], row["norm"]) == ("wpe", 0.992) and row["layers"] == "sample_loss (z 36)"
    only_losses = [SpikeEvent(3, "loss", 5.0, 4.0, 9.0, 1.25), SpikeEvent(3, "sample_loss", 9.0, 5.0, 12.0, 1.8)]
    assert dict(zip(EVENT_COLUMNS, event_row(3, only_losses, "localized")))["signal"] == "loss"


def test_a_localization_gives_its_culprit_count_and_micro_batch_norms():
    result = LocateResult([CulpritToken(0, 3, 1.0, {}, share=0.5)], probes=4, method="bisect", threshold=0.1,
                          total_norm=2.0, micro_batch_norms=[0.25, 1.5])
    row = dict(zip(EVENT_COLUMNS, event_row(9, [SpikeEvent(9, "global", 3.0, 1.0, 8.0, 3.0)], "localized", result)))
    assert row["culprits"] == 1 and row["micro_batch_norms"] == "0.25, 1.5" and row["layers"] == ""
    assert row["norm"] == pytest.approx(3.0)
