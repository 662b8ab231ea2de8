"""What the demo apps print: a progress line, one block per spike, a short summary at the end.

On a terminal a ``rich`` progress bar shows step, loss and grad norm; when the output is not a
terminal (CI logs, ``| tee``), or without ``rich``, a plain line every tenth of the run instead.
Spike blocks and the summary go through the same console so they never tear the bar.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from .trackers.mlflow_links import mlflow_charts_url, mlflow_run_url, mlflow_ui_command
from .trackers.run_record import read_run_views


def _fmt_tokens(tokens: Sequence[str], limit: int = 12) -> str:
    text = "".join(tokens[:limit]) + ("…" if len(tokens) > limit else "")
    return repr(text)


def culprit_spans(result: Any, decode, describe=None) -> list[str]:
    """Culprits grouped into contiguous runs per sample: ``sample 3, positions 24-31: '&nbsp;&nbsp;'``.

    ``describe(micro_batch, sample, position)``, when given, names the sample instead (an RL
    completion's group and reward, a packed row's document)."""
    by_sample: dict[tuple, list] = {}
    for c in sorted(result.tokens, key=lambda c: (getattr(c, "micro_batch", None) or 0, c.batch, c.position)):
        by_sample.setdefault((getattr(c, "micro_batch", None), c.batch), []).append(c)
    lines = []
    for (mb, sample), cs in by_sample.items():
        runs: list[list] = [[cs[0]]]
        for c in cs[1:]:
            (runs[-1].append(c) if c.position == runs[-1][-1].position + 1 else runs.append([c]))
        for run in runs:
            where = f"positions {run[0].position}-{run[-1].position}" if len(run) > 1 else f"position {run[0].position}"
            share = sum(c.share or 0.0 for c in run)
            mb_txt = f"micro-batch {mb}, " if mb is not None else ""
            label = describe(mb, sample, run[0].position) if describe is not None else None
            lines.append(f"{label or mb_txt + f'sample {sample}'}, {where}: {_fmt_tokens([decode(c) for c in run])}"
                         f"  ({share:.0%} of the batch's squared grad norm)")
    return lines


def unit_lines(result: Any, text_of) -> list[str]:
    """Culprit spans, samples (documents) and micro-batches: where, their text, their share.
    ``text_of(c)`` gives a unit's text (its tokens ``c.start..c.end-1``)."""
    lines = []
    for c in result.culprits:
        if c.level == "token":
            continue
        share = f"  ({c.share:.0%} of the batch's squared grad norm)" if c.share is not None else ""
        mb_txt = f"micro-batch {c.micro_batch}" if c.micro_batch is not None else ""
        if c.level == "micro_batch":
            lines.append(f"{mb_txt}: the whole micro-batch (no sample or token in it stands out){share}")
            continue
        doc = f", document {c.document}" if c.document is not None else ""
        what = f"positions {c.start}-{c.end - 1}" if c.level == "span" else \
            ("the whole document" if c.document is not None else "the whole sample")
        text = text_of(c)
        text = repr(text[:40] + ("…" if len(text) > 40 else ""))
        lines.append(f"{mb_txt + ', ' if mb_txt else ''}sample {c.batch}{doc}, {what}: {text}{share}")
    return lines


def surgery_line(op: Any) -> str:
    """What ``spikes.response=surgery`` did to the step (a ``SurgeryResult``)."""
    if not op.applied:
        return f"  surgery    nothing removed: {op.reason}"
    return (f"  surgery    removed {op.removed_share:.0%} of the step's squared grad norm ({op.culprits} culprit "
            f"row(s), one probe): grad norm {op.grad_norm_pre:.3g} -> {op.grad_norm_post:.3g}, then to the clipper")


class TrainConsole:
    """``start(total)``, ``step(step, loss, grad_norm)``, ``spike(...)``, ``summary(...)``, ``close()``."""

    def __init__(self, stream=None, rich: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._rich = tty if rich is None else rich
        self._progress = self._task = None
        self._total = 0
        if self._rich:
            try:
                from rich.console import Console
            except ImportError:
                self._rich = False
            else:
                self._console = Console(file=self.stream, highlight=False)

    def start(self, total: int, description: str = "train") -> None:
        self._total = total
        if not self._rich:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                  console=self._console, transient=False)
        self._task = self._progress.add_task(description, total=total, stats="")
        self._progress.start()

    def print(self, text: str = "") -> None:
        if self._rich:
            self._console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def step(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        """After each step; ``loss``/``grad_norm`` are None on steps that did not log (no host sync)."""
        stats = "" if loss is None else f"loss {loss:.3f}  grad norm {grad_norm:.3g}"
        if self._progress is not None:
            if stats:
                self._progress.update(self._task, completed=step + 1, stats=stats)
            else:
                self._progress.update(self._task, completed=step + 1)
            return
        every = max(1, self._total // 10)
        if stats and ((step + 1) % every == 0 or step + 1 == self._total or step == 0):
            self.print(f"step {step + 1:>{len(str(self._total))}}/{self._total}  {stats}")

    def spike(self, step: int, events: Sequence[Any], result: Any, tokenizer: Any, input_ids: Any,
              run_dir: Path, describe=None, not_localized: str | None = None, surgery: Any = None) -> None:
        """One block: when, which signal, which text, what surgery removed (``spikes.response=surgery``),
        where to look (``describe``: see ``culprit_spans``; ``not_localized``: why there is no
        ``result``, ``GradStats.not_localized``)."""
        lines = [f"── spike at step {step} " + "─" * 40]
        for e in events[:3]:
            key = getattr(e, "key", f"grad_norm/{e.signal}")  # a loss or the optimizer's update is no grad norm
            lines.append(f"  signal     {key} = {e.value:.3g}, {e.ratio:.1f}x its running mean "
                         f"{e.baseline:.3g} (z = {e.z:.0f})")
        if len(events) > 3:
            lines.append(f"             ... and {len(events) - 3} more layer(s)")
        if result is None:
            lines.append(f"  culprits   not localized: {not_localized or 'no localization ran'}")
        elif not result.culprits:
            lines.append("  culprits   none found: no sample, span or token stands out (the spike is spread over "
                         "the batch)")
            top = [r for r in getattr(result, "sample_shares", [])[:3] if r.get("share") is not None]
            if top:
                lines.append("             largest per-sample shares: " + ", ".join(
                    (f"micro-batch {r['micro_batch']}, " if r["micro_batch"] is not None else "")
                    + f"sample {r['sample']} {r['share']:.0%}" for r in top))
        else:
            def row_ids(c):
                return input_ids[c.micro_batch] if getattr(c, "micro_batch", None) is not None else input_ids

            def decode(c):
                tid = int(row_ids(c)[c.batch, c.position])
                return tokenizer.decode([tid]) if tokenizer is not None else f"<{tid}>"

            def text_of(c):
                ids = [int(i) for i in row_ids(c)[c.batch, c.start:c.end]]
                return tokenizer.decode(ids) if tokenizer is not None else "".join(f"<{i}>" for i in ids)

            found = unit_lines(result, text_of) + culprit_spans(result, decode, describe)
            for i, line in enumerate(found[:6]):
                lines.append(("  culprits   " if i == 0 else "             ") + line)
        if surgery is not None:
            lines.append(surgery_line(surgery))
        # a localized spike has its highlight page; any detected one its row of spikes/events
        page = highlight_page(step) if result is not None and input_ids is not None else event_page(step)
        lines += ["  artifacts  " + w if i == 0 else "             " + w
                  for i, w in enumerate(where_to_look(run_dir, step, page))]
        self.print("\n".join(lines))

    def summary(self, lines: Sequence[str]) -> None:
        self.close()
        self.print("\n".join(lines))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def highlight_page(step: int) -> str:
    return f"spikes/highlight/step_{step:06d}.html"


def event_page(step: int) -> str:
    """The spike's row of ``spikes/events`` as MLflow's UI shows it (a table; see ``trackers.csv_view``)."""
    return f"spikes/events/step_{step:06d}.csv"


def where_to_look(run_dir: Path, step: int | None = None, page: str | None = None) -> list[str]:
    """MLflow run link (to artifact ``page`` of the run; default: the step's highlight page), W&B run,
    local files: whatever this run has."""
    record = read_run_views(run_dir)
    out = []
    if step is not None and page is None:
        page = highlight_page(step)
    if "mlflow" in record:
        m = record["mlflow"]
        url = mlflow_run_url(m, f"artifacts/{page}" if page else "")
        out.append(f"MLflow run {m.get('run_name', '')} ({m.get('run_id')}): {url}")
    if "wandb" in record:
        w = record["wandb"]
        where = f" (offline: {w.get('dir')})" if w.get("offline") else f": {w.get('url')}"
        out.append(f"W&B run {w.get('path')}{where}")
    local = run_dir / "spikes"
    if local.is_dir():
        out.append(f"local files: {local}")
    elif (run_dir / "rendered").is_dir():
        out.append(f"local files: {run_dir / 'rendered'}")
    if not out:
        out.append(f"run dir: {run_dir}")
    return out


def spike_link(run_dir: Path, step: int, localized: bool) -> str | None:
    """The MLflow link to a spike's page: its highlight when localized, else its ``spikes/events`` row."""
    m = read_run_views(run_dir).get("mlflow")
    if m is None:
        return None
    return mlflow_run_url(m, f"artifacts/{highlight_page(step) if localized else event_page(step)}")


def view_commands(run_dir: Path) -> list[str]:
    """The exact commands to look at the results."""
    record = read_run_views(run_dir)
    out = []
    if "mlflow" in record:
        m = record["mlflow"]
        cmd = mlflow_ui_command(str(m.get("tracking_uri", "")))
        if cmd:
            out.append(f"  {cmd}    # the UI takes ~30-60 s to start; then open")
        out.append(f"  {mlflow_run_url(m)}")
        out.append(f"  {mlflow_charts_url(m)}    # every run of the experiment, charts overlaid")
    if "wandb" in record and record["wandb"].get("offline"):
        out.append(f"  wandb sync {record['wandb'].get('dir')}    # upload the offline W&B run")
    out.append(f"  gradloc-track report {run_dir} -o spike_report.html    # one HTML page, no server needed")
    return out


def clip_saturation_line(clip_kind: str, summary: dict[str, float]) -> str | None:
    """How often and how hard the clipper scaled after its warm-up (``summarize``'s clip_* keys)."""
    from .clip.saturation import saturation_line

    if "clip_steps_after_warmup" not in summary:
        return None
    return saturation_line(clip_kind, {"steps": int(summary["clip_steps_after_warmup"]),
                                       "clipped_fraction": summary["clip_clipped_fraction"],
                                       "mean_coef": summary["clip_mean_coef"]})


def summary_lines(steps: int, clip_kind: str, summary: dict[str, float], events_at: list[int],
                  culprit_text: dict[int, list[str]], run_dir: Path,
                  not_localized: dict[int, str] | None = None) -> list[str]:
    """The few lines a person reads at the end: what happened, and how to look at it
    (``not_localized``: step -> why a detected spike was not localized)."""
    lines = [f"done: {steps} steps in {summary['seconds']:.0f} s, final loss {summary['final_loss']:.3f}"]
    if not events_at:
        lines.append("no gradient spike detected")
    else:
        shown = ", ".join(map(str, events_at[:10])) + (" ..." if len(events_at) > 10 else "")
        lines.append(f"{len(events_at)} gradient spike(s) detected, at step {shown}")
        for step in [s for s in events_at if s in culprit_text or s in (not_localized or {})][:3]:
            toks = culprit_text.get(step)
            if toks is None:
                lines.append(f"  step {step}: not localized ({not_localized[step]})")
            else:
                text = "".join(toks[:16]) + ("…" if len(toks) > 16 else "")
                lines.append(f"  step {step}: {len(toks)} culprit token(s) {text!r}")
            link = spike_link(run_dir, step, localized=toks is not None)
            if link:  # the run is open by now (a spike block printed before it was has no link)
                lines.append(f"    {link}")
    if clip_kind != "none":
        lines.append(f"clip={clip_kind}: largest grad norm the optimizer saw after warm-up "
                     f"{summary['max_post_clip_grad_norm']:.3g}")
        line = clip_saturation_line(clip_kind, summary)
        if line:
            lines.append(line)
    lines.append(f"run dir: {run_dir}")
    lines.append("look at the results:")
    lines += view_commands(run_dir)
    return lines
