"""The spike block rank 0 prints for a verl step, in the words a GradLoc user set up.

The shared block (``gradloc_track.console``) with two things said as they are:

- ``spikes.mode=fixed`` (``gradloc.grad_norm_threshold``, GradLoc's trigger): the event's reference
  is the fixed threshold ``per_token_threshold / sqrt(loss tokens) * micro-batches``, not a running
  mean (``FixedThresholdEvent``);
- an explicit ``locate.threshold`` that no loss term's gradient reaches is named as the reason
  nothing was localized, with the share the largest sample holds (the block would otherwise say
  the spike is spread over the batch).

With the user's ``run_dir`` the block is also appended to ``<run_dir>/spike_blocks.txt``: under
Ray the workers' stdout reaches the driver's log only.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...console.block import spike_block
from ...console.culprits import SpikeView
from ...trackers.files import append_line
from ...units import row_label

BLOCKS_FILE = "spike_blocks.txt"
NONE_FOUND = "  culprits   none found:"


@dataclass
class FixedThresholdEvent:
    """A ``SpikeEvent`` of the fixed detector, described against its threshold (``baseline``)."""

    event: Any
    per_token_threshold: float

    def __getattr__(self, name: str) -> Any:  # cause, cause_detail, signal, ...: the event's own
        return getattr(self.event, name)

    def describe(self) -> str:
        e = self.event
        rule = (f"spikes.mode=fixed: per_token_threshold {self.per_token_threshold:g} / sqrt(loss tokens) x "
                "micro-batches, GradLoc's trigger")
        if not math.isfinite(e.value):
            return f"{e.key} = {e.value} (not finite; the fixed threshold {e.baseline:.3g}, {rule})"
        return f"{e.key} = {e.value:.3g}, {e.ratio:.1f}x the fixed threshold {e.baseline:.3g} ({rule})"


def threshold_too_high(result: Any, threshold: float | None) -> str | None:
    """Why an explicit ``locate.threshold`` found nothing (None: it found something, or none was set)."""
    if result is None or threshold is None or result.culprits or result.nonfinite is not None:
        return None
    shares = [r for r in result.sample_shares or [] if r.get("share") is not None]
    top = max(shares, key=lambda r: r["share"]) if shares else None
    held = f", while {row_label(top)} holds {max(top['share'], 0.0):.0%} of the step's squared grad norm" if top else ""
    return (f"locate.threshold={threshold:g} is set too high: no loss term's own gradient reaches it (per term, "
            f"{result.threshold:.3g} in the optimizer's units){held}; lower locate.threshold, or leave it unset for "
            "the adaptive threshold")


def spike_lines(stats: Any, run_dir: Path, not_localized: str | None, opts: Any) -> list[str]:
    """The block's lines (module doc)."""
    view = SpikeView.of(stats, not_localized)
    if opts.spikes.mode == "fixed":
        view = replace(view, events=[FixedThresholdEvent(e, opts.spikes.per_token_threshold) for e in view.events])
    lines = spike_block(view, Path(run_dir))
    reason = threshold_too_high(view.result, opts.locate.threshold)
    if reason is not None:
        lines = [f"{NONE_FOUND} {reason}" if line.startswith(NONE_FOUND) else line for line in lines]
    return lines


def keep_block(run_dir: str | Path | None, lines: list[str]) -> None:
    """Append the block to ``<run_dir>/spike_blocks.txt`` (never raises into training)."""
    if run_dir is None:
        return
    try:
        append_line(Path(run_dir) / BLOCKS_FILE, "\n".join(lines) + "\n")  # whole, or nothing of it
    except OSError as exc:
        warnings.warn(f"gradloc-track: could not write the spike block to {run_dir}/{BLOCKS_FILE}: {exc!r}")
