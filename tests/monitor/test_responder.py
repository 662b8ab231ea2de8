"""The monitor's response to a spike: detector -> localizer -> artifact writer on a real model and real
batches, the max_events cap, and faults that only warn."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.config import LocateConfig
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.spikes import SpikeContext, SpikeDetector

B, T = 2, 8


def train(model, steps, writer_of, max_events=2):
    """Every step spikes (fixed mode, a tiny per-token threshold) and holds a culprit term: the cap
    decides what is localized."""
    tracker = MemoryTracker()
    mon = GradMonitor(model, tracker=tracker, log_every=100,
                      detector=SpikeDetector(mode="fixed", per_token_threshold=1e-6, warmup_steps=0),
                      locate_config=LocateConfig(method="bisect", budget=16, max_events=max_events),
                      artifact_writer=writer_of(tracker))
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(1, steps + 1):
        x, y = torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)

        w = torch.ones(B, T)
        w[step % B, step % T] = 500.0  # one culprit term per batch: every localization finds it

        def loss_fn(mask, x=x, y=y, w=w):
            per = F.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1), reduction="none").view(B, T)
            return (per * w * mask).sum() / (B * T)  # fixed normaliser

        mask = torch.ones(B, T)
        model.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
        out.append(mon.after_backward(step, spike_context=SpikeContext(loss_fn, mask, input_ids=y)))
    return tracker, out


def test_localization_is_capped_by_max_events(tiny_gpt):
    tracker, stats = train(tiny_gpt, 3, lambda t: SpikeArtifactWriter(t, images=False))
    assert all(s.events for s in stats) and not any(s.logged for s in stats)
    assert [s.locate is not None for s in stats] == [True, True, False]
    mine = [(step, m) for step, m in tracker.metrics if "grad_norm/global" in m]  # the writer logs too
    assert [step for step, _ in mine] == [1, 2, 3]  # spike steps log at their own step
    assert [("locate/probes" in m) for _, m in mine] == [True, True, False]
    for s, (_, m) in zip(stats[:2], mine):
        assert m["locate/probes"] == s.locate.probes <= 16
        assert m["locate/culprits"] == len(s.locate.tokens) >= 1
    assert [step for _, step, _ in tracker.html] == [1, 2]  # the writer got exactly the localized ones
    # the third spike is detected, recorded and counted, and says which limit stopped its localization
    assert stats[2].not_localized == "locate.max_events=2 reached (raise it to localize more spikes)"
    events = tracker.tables["spikes/events"]
    assert [dict(zip(events["columns"], r))["localization"] for r in events["rows"]] == [
        "localized", "localized", stats[2].not_localized]
    assert tracker.tags["spike_count"] == "3"


def test_a_failing_artifact_writer_warns_and_training_goes_on(tiny_gpt):
    class BrokenWriter:  # fault injection: a writer that raises
        def __init__(self, tracker):
            self.calls = 0

        def write(self, step, events, result, ctx):
            self.calls += 1
            raise OSError("disk full")

        def write_detection(self, step, events, why_not_localized):
            raise OSError("disk full")

    with pytest.warns(UserWarning, match="disk full"):
        tracker, stats = train(tiny_gpt, 2, BrokenWriter, max_events=5)
    assert all(s.locate is not None for s in stats) and len(tracker.metrics) == 2


def run(model, locate_enabled=True, steps=16, spike_at=14):
    """A real batch per step; one loss term blows up at ``spike_at``."""
    B, T = 4, 16
    tracker = MemoryTracker()
    monitor = GradMonitor(model, tracker=tracker, log_every=4, detector=SpikeDetector(warmup_steps=6),
                          locate_config=LocateConfig(enabled=locate_enabled),
                          artifact_writer=SpikeArtifactWriter(tracker, images=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    seen = {}
    for step in range(steps):
        x = torch.randint(0, 64, (B, T), generator=g)
        y = torch.randint(33, 64, (B, T), generator=g)  # printable ids
        w = torch.ones(B, T)
        if step == spike_at:
            w[2, 7] = 500.0  # one loss term blows up

        def loss_fn(mask, x=x, y=y, w=w):
            per = F.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1), reduction="none").view(B, T)
            return (per * w * mask).sum() / (B * T)

        mask = torch.ones(B, T)
        opt.zero_grad()
        loss_fn(mask).backward()
        before = [p.grad.clone() for p in model.parameters()]
        stats = monitor.after_backward(step, spike_context=SpikeContext(loss_fn, mask, y, ByteTokenizer()))
        assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "localizing left a trace"
        seen[step] = stats
        opt.step()
    return tracker, seen


def test_spike_on_a_non_logging_step_is_detected_localized_and_written(tiny_gpt):
    tracker, seen = run(tiny_gpt)
    assert [s for s, st in seen.items() if st.events] == [14]  # 14 % log_every != 0
    loc = seen[14].locate
    assert [(c.batch, c.position) for c in loc.tokens] == [(2, 7)]
    table = tracker.tables["spikes/tokens"]
    rows = [dict(zip(table["columns"], r)) for r in table["rows"]]
    assert [(r["step"], r["sample"], r["position"]) for r in rows] == [(14, 2, 7)]
    assert tracker.html and "step 14" in tracker.html[0][2]
    logged = dict(tracker.metrics)[14]
    assert logged["locate/culprits"] == 1.0 and logged["spike/detected"] == 1.0
    assert tracker.tags["spike_count"] == "1"


def test_locate_disabled_still_detects(tiny_gpt):
    tracker, seen = run(tiny_gpt, locate_enabled=False)
    assert seen[14].events and seen[14].locate is None
    assert "spikes/tokens" not in tracker.tables
    # detection alone is a first-class result: counted, recorded with the reason, nothing rendered
    assert seen[14].not_localized == "locate.enabled=false" and not tracker.html
    assert tracker.tags["spike_count"] == "1"
    events = tracker.tables["spikes/events"]
    (row,) = [dict(zip(events["columns"], r)) for r in events["rows"]]
    assert (row["step"], row["localization"]) == (14, "locate.enabled=false")
    assert row["z"] == pytest.approx(max(e.z for e in seen[14].events if e.signal == row["signal"]))


def test_a_failing_localizer_warns_and_training_goes_on(tiny_gpt, monkeypatch):
    import gradloc_track.localizer as loc

    def broken(*a, **k):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(loc, "locate", broken)
    with pytest.warns(UserWarning, match="probe exploded"):
        tracker, seen = run(tiny_gpt)
    assert dict(tracker.metrics)[14]["locate/failed"] == 1.0 and 15 in seen
    # the reason is kept with the run (the events row, the report), not only said on the console
    assert seen[14].not_localized == "localizing failed: probe exploded" and tracker.tags["spike_count"] == "1"
    events = tracker.tables["spikes/events"]
    (row,) = [dict(zip(events["columns"], r)) for r in events["rows"]]
    assert row["localization"] == "localizing failed: probe exploded"


def test_a_spike_without_a_spike_context_is_recorded_as_not_localized(tiny_gpt):
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, log_every=1, detector=SpikeDetector(warmup_steps=6),
                      artifact_writer=SpikeArtifactWriter(tracker, images=False))
    g = torch.Generator().manual_seed(0)
    seen = {}
    for step in range(16):
        x = torch.randint(0, 64, (4, 16), generator=g)
        tiny_gpt.zero_grad(set_to_none=True)
        (tiny_gpt(x).logsumexp(-1).mean() * (40.0 if step == 14 else 1.0)).backward()
        seen[step] = mon.after_backward(step)  # no spike_context: the detector sees logging steps only
    assert [s for s, st in seen.items() if st.events] == [14]
    assert seen[14].not_localized == "no spike_context passed to after_backward"
    assert tracker.tags["spike_count"] == "1" and len(tracker.tables["spikes/events"]["rows"]) == 1
