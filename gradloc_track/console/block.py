"""One spike block: when, which signal, which culprits (or why none), what surgery did, where to look."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..spikes.event import lead_event
from ..units import share_list
from .culprits import MAX_LINES, SpikeView, culprit_lines
from .links import event_page, highlight_page, spike_link, where_to_look


def surgery_line(op: Any) -> str:
    """What ``spikes.response=surgery`` did to the step (a ``SurgeryResult``)."""
    if not op.applied:
        return f"  surgery    nothing removed: {op.reason}"
    # with no clipper of ours a framework may still clip before the optimizer (Lightning's gradient_clip_val)
    then = "the clipper" if op.clipped_after else "the optimizer's step (no gradloc-track clipper)"
    return (f"  surgery    removed {op.removed_share:.0%} of the step's squared grad norm ({op.culprits} culprit "
            f"row(s), one probe): grad norm {op.grad_norm_pre:.3g} -> {op.grad_norm_post:.3g}, then to {then}")


def shown_order(events: Sequence[Any]) -> list[Any]:
    """The step's signals as its block lists them: the one it is named by first (``lead_event``), then the
    strongest (largest z). Listed as the detector found them, a step's largest-sample loss at z 18 and its batch
    loss at z 15 went under "... and 3 more layer(s)" behind three layers at z 9-12 (held-out tester, stop 57)."""
    lead = lead_event(list(events))
    rest = sorted((e for e in events if e is not lead), key=lambda e: -float(getattr(e, "z", 0.0) or 0.0))
    return ([lead] if lead is not None else []) + rest


def _more(hidden: Sequence[Any]) -> str:
    """``2 more layer(s), 1 more signal(s) (loss/junk_span)``: what the block's first lines leave out."""
    layers = sum(1 for e in hidden if getattr(e, "is_norm", False))
    others = [getattr(e, "key", str(getattr(e, "signal", "?"))) for e in hidden if not getattr(e, "is_norm", False)]
    parts = [f"{layers} more layer(s)"] if layers else []
    if others:
        parts.append(f"{len(others)} more signal(s) ({', '.join(others)})")
    return ", ".join(parts)


AFTERMATH = "aftermath of step "  # how an incident's later steps begin their cause (spikes/incidents, weight_check)


def spike_block(view: SpikeView, run_dir: Path) -> list[str]:
    """The lines of one spike block: when, which signal, which text, surgery, where to look. A later step of
    an incident that was not localized is one line (held-out tester, stop 52: a corrupt weight printed a full
    block on each of 150 skipped steps): its incident's block said the rest, its events row keeps it."""
    short = aftermath_line(view, run_dir)
    if short is not None:
        return [short]
    lines = [f"── spike at step {view.step} " + "─" * 40]
    events = shown_order(view.events)
    for e in events[:3]:
        if hasattr(e, "describe"):
            lines.append(f"  signal     {e.describe()}")
            continue
        key = getattr(e, "key", f"grad_norm/{e.signal}")  # a loss or the optimizer's update is no grad norm
        lines.append(f"  signal     {key} = {e.value:.3g}, {e.ratio:.1f}x its running mean "
                     f"{e.baseline:.3g} (z = {e.z:.0f})")
    if len(events) > 3:
        lines.append(f"             ... and {_more(events[3:])}")
    cause = view.events[0].cause if view.events else None
    if cause:  # why the step fired (spikes.cause), in words
        lines.append(f"  cause      {cause}: {view.events[0].cause_detail}")
    lines += _culprit_section(view)
    if view.surgery is not None:
        lines.append(surgery_line(view.surgery))
    # a localized spike with token ids to show has its highlight page (under torch.distributed rank 0 holds
    # the culprits' rows only: none found, no page); any detected one its row of spikes/events
    page = highlight_page(view.step) if view.result is not None and getattr(view.context, "input_ids", None) \
        is not None else event_page(view.step)
    lines += [("  artifacts  " if i == 0 else "             ") + w
              for i, w in enumerate(where_to_look(run_dir, view.step, page))]
    return lines


def aftermath_line(view: SpikeView, run_dir: Path) -> str | None:
    """The one line of a later step of an incident that was not localized (``spike_block``), else None. It
    points at the step's events row where one stays: a backend's link, else the kept run dir (a scratch one
    goes with the run: held-out tester, stop 54, the line named a file that was never kept)."""
    detail = (getattr(view.events[0], "cause_detail", "") or "") if view.events else ""
    if view.result is not None or view.surgery is not None or not detail.startswith(AFTERMATH):
        return None
    lead = lead_event(view.events) if all(hasattr(e, "is_norm") for e in view.events) else view.events[0]
    key = getattr(lead, "key", f"grad_norm/{lead.signal}")
    line = f"── spike at step {view.step}: {detail.split(':', 1)[0]}, {key} = {lead.value:.3g}; not localized"
    where = spike_link(run_dir, view.step, localized=False)
    if where is None:
        from ..trackers.join import is_scratch

        kept = not is_scratch(run_dir) and (run_dir / "spikes").is_dir()  # a backend without links keeps none here
        where = f"its row of spikes/events in {run_dir}" if kept else None
    return line if where is None else f"{line} ({where})"


def _culprit_section(view: SpikeView) -> list[str]:
    """The block's non-finite and culprit lines: which samples, or why none."""
    lines = []
    found = culprit_lines(view)
    nonfinite = view.result.nonfinite if view.result is not None else None
    if nonfinite is not None:  # a NaN/Inf step: which samples (or the sum) made it so, in words
        lines.append(f"  non-finite {nonfinite.detail}")
    if view.result is None:
        lines.append(f"  culprits   not localized: {view.not_localized or 'no localization ran'}")
    elif not found and nonfinite is None:  # (a non-finite step's line above says why no sample is named)
        lines.append("  culprits   none found: no sample, span or token stands out (the spike is spread over "
                     "the batch)")
        top = [r for r in getattr(view.result, "sample_shares", [])[:3] if r.get("share") is not None]
        if top:  # a replay that does not reproduce the step (a NaN multiplier on one rank): its shares are the replay's
            check = getattr(view.result, "step_check", None)
            whose = " of the replayed step" if check is not None and not check.replayed else ""
            lines.append(f"             largest per-sample shares{whose}: " + share_list(top))
    elif found:
        shown = found[:MAX_LINES]
        if len(found) > MAX_LINES:
            shown[-1] = f"... and {len(found) - MAX_LINES + 1} more culprit row(s) (spikes/tokens lists them all)"
        lines += [("  culprits   " if i == 0 else "             ") + line for i, line in enumerate(shown)]
    return lines
