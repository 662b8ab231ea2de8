"""The closing lines of a run: its spikes as their blocks named them (counted by unit and level), the
clipper's behaviour after warm-up, the run dir and the commands to look at it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .culprits import SpikeView, culprit_count, culprit_lines
from .links import spike_link, view_commands


OFF = "spike detection was off (spikes=False, spikes.enabled=false): no spike was looked for"


def spike_summary(spikes: Sequence[Any], run_dir: Path, not_localized: str | None = None,
                  detecting: bool = True) -> list[str]:
    """The closing lines about the run's spikes (``GradStats`` or ``SpikeView``s, in step order): how
    many, where, and for the first three what their blocks named, counted the same way, with the
    link to each one's page (the run is surely open by now: a block printed before has none).
    ``detecting``: False when the run had no spike detector (it said "no gradient spike detected", as of a run
    checked and found clean: held-out tester, stop 63)."""
    views = [SpikeView.of(s, not_localized) for s in spikes]
    if not views:
        return ["no gradient spike detected" if detecting else OFF]
    steps = [v.step for v in views]
    shown = ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")
    # an incident's later steps are counted apart and not listed (a new user, stop 55: one bad batch read "2
    # gradient spike(s)", the second listed as "not localized (only the optimizer's update fired)")
    after = [v for v in views if v.aftermath_of is not None]
    firsts = ", ".join(str(s) for s in sorted({v.aftermath_of for v in after}))
    apart = f" ({len(after)} of them the aftermath of step {firsts})" if after else ""
    lines = [f"{len(steps)} gradient spike(s) detected, at step {shown}{apart}"]
    for v in [v for v in views if v.aftermath_of is None][:3]:
        found = culprit_lines(v)
        if v.result is None:
            lines.append(f"  step {v.step}: not localized ({v.not_localized or 'no localization ran'})")
        elif found:
            lines.append(f"  step {v.step}: {culprit_count(v)}: {found[0]}")
        else:
            lines.append(f"  step {v.step}: no culprit found (the spike is spread over the batch)")
        # a page only where there are token ids to show (rank 0's gathered view holds none when nothing was found)
        link = spike_link(Path(run_dir), v.step,
                          localized=v.result is not None and getattr(v.context, "input_ids", None) is not None)
        if link:
            lines.append(f"    {link}")
    return lines


def clip_saturation_line(clip_kind: str, summary: dict[str, float]) -> str | None:
    """How often and how hard the clipper scaled after its warm-up (``summarize``'s clip_* keys)."""
    from ..clip.saturation import saturation_line

    if "clip_steps_after_warmup" not in summary:
        return None
    return saturation_line(clip_kind, {"steps": int(summary["clip_steps_after_warmup"]),
                                       "clipped_fraction": summary["clip_clipped_fraction"],
                                       "mean_coef": summary["clip_mean_coef"]})


def closing_lines(head: str, spikes: Sequence[Any], run_dir: Path, middle: Sequence[str] = (),
                  not_localized: str | None = None, detecting: bool = True) -> list[str]:
    """The end of any run: ``head`` (``done: 80 steps in 41 s``), its spikes as their blocks named
    them (``detecting``: ``spike_summary``'s), ``middle`` (the clipper's lines), the run dir and the commands to
    look at it."""
    lines = [head, *spike_summary(spikes, run_dir, not_localized, detecting), *middle]
    from ..trackers.join import is_scratch

    if not is_scratch(Path(run_dir)):  # a scratch dir is gone by now: the links above are the way in
        look = view_commands(Path(run_dir), spikes=bool(spikes)) or _local_files(Path(run_dir))
        lines += [f"run dir: {run_dir}", *(["look at the results:", *look] if look else [])]
    return lines


def _local_files(run_dir: Path) -> list[str]:
    """No backend run and no spike (``tracker=none``, an unreachable tracker): the files the run dir holds,
    rather than a "look at the results:" header with nothing under it (new-user tester round 12)."""
    said = {"metrics.jsonl": "every logged step, one JSON line each", "summary.json": "the run's summary"}
    return [f"  {run_dir / name}    # {what}" for name, what in said.items() if (run_dir / name).exists()]


def summary_lines(steps: int, clip_kind: str, summary: dict[str, float], spikes: Sequence[Any],
                  run_dir: Path, detecting: bool = True) -> list[str]:
    """The few lines a person reads at the end of a run: what happened (``spikes``: the spiking
    steps' ``GradStats``), how the clipper behaved, and how to look at it."""
    clip = []
    if clip_kind != "none":
        largest = summary["max_post_clip_grad_norm"]
        # (the transient is spikes.warmup_steps and optim.warmup_steps; a run without a detector has no detector's
        # warm-up to name)
        window = "the detector's and the learning rate's warm-up" if detecting else \
            "the first spikes.warmup_steps or optim.warmup_steps steps, whichever is longer"
        clip.append(f"clip={clip_kind}: largest grad norm the optimizer saw after the start-up transient {largest:.3g}"
                    if largest == largest else f"clip={clip_kind}: the run ended inside the start-up transient "
                    f"({window}: no largest grad norm after it)")
        line = clip_saturation_line(clip_kind, summary)
        if line:
            clip.append(line)
    head = f"done: {steps} steps in {summary['seconds']:.0f} s, final loss {summary['final_loss']:.3f}"
    return closing_lines(head, spikes, run_dir, clip, detecting=detecting)
