"""The spike-event table: one row per step the detector fired, localized or not.

Detection is useful on its own (``locate.enabled=false``, or ``locate.max_events`` used up): every
detected step gets a row in table ``spikes/events`` (one part per event, like ``spikes/tokens``),
so the run's ``spike_count``, the console and ``gradloc-track report`` agree on what was detected,
and the row says why a step was not localized.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..spikes.event import SpikeEvent, lead_event
from ..units import share_list

# when, on which norm and how far out; the layers that fired too; what the localizer made of it
EVENT_COLUMNS = ["step", "signal", "norm", "running_mean", "ratio", "z", "layers", "localization",
                 "culprits", "micro_batch_norms", "sample_shares", "cause", "cause_detail"]


def other_layers(events: Sequence[SpikeEvent], lead: SpikeEvent, k: int = 5) -> str:
    """``"h.1 (z 9), wpe (z 7)"``: the other signals that fired, furthest out first."""
    rest = sorted((e for e in events if e is not lead), key=lambda e: -e.z)
    text = ", ".join(f"{e.signal} (z {e.z:.0f})" for e in rest[:k])
    return text + (f", +{len(rest) - k} more" if len(rest) > k else "")


def known_norms(result: Any) -> tuple[str | None, str | None]:
    """(micro-batch norms, largest per-sample shares) as text, when a localization measured them."""
    if result is None:
        return None, None
    mb = result.micro_batch_norms or []
    mb_text = ", ".join(f"{v:.3g}" for v in mb) or None
    shares = [r for r in (result.sample_shares or []) if r.get("share") is not None][:3]
    share_text = share_list(shares) or None
    return mb_text, share_text


def event_row(step: int, events: Sequence[SpikeEvent], localization: str, result: Any = None) -> list[Any]:
    """The ``spikes/events`` row of one detected step (columns ``EVENT_COLUMNS``; ``cause`` and
    ``cause_detail``: why the step fired, ``spikes.cause``).

    ``localization``: ``"localized"``, or why not (``"locate.enabled=false"``, ...); ``result``:
    the ``LocateResult`` when the localizer ran (its culprit count and the norms it measured)."""
    lead = lead_event(events)
    culprits = None if result is None else len(result.culprits)
    mb_norms, shares = known_norms(result)
    return [int(step), lead.signal, float(lead.value), float(lead.baseline), float(lead.ratio), float(lead.z),
            other_layers(events, lead), localization, culprits, mb_norms, shares, lead.cause,
            lead.cause_detail or None]
