"""What a training run prints: a progress line, one block per spike, a summary at the end.

One console for every loop (the demo, ``examples/*``, the HF / TRL / Lightning callbacks):
``TrainConsole.spike(stats, run_dir)`` prints the block of a step's ``GradStats`` (the signal,
each culprit's text, level and share, surgery, the run's link, or why the spike was not
localized) and ``spike_summary(spikes, run_dir)`` the closing lines from the same stats, so the
summary always says what the blocks said. A culprit is named by what it is: ``sample 3``, an
RL ``completion 2 of group 1, reward 0.25`` (``sample_columns`` ``group``/``index``/``reward``),
a packed ``document 2`` (``document_ids``), and its text is that of its loss-bearing tokens
(an RL completion, not its padded prompt).

On a terminal a ``rich`` progress bar shows step, loss and grad norm; when the output is not a
terminal (CI logs, ``| tee``), or without ``rich``, a plain line every tenth of the run instead.
Spike blocks and the summary go through the same console so they never tear the bar.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .trackers.mlflow_links import mlflow_charts_url, mlflow_run_url, mlflow_ui_command
from .trackers.run_record import read_run_views

SHARE_OF = "of the batch's squared grad norm"
MAX_LINES = 6  # culprit lines per block; the rest are counted


def _pct(share: float | None) -> str:
    """A share as a percentage; a share below 0 (a row pulling against the spike) reads 0%."""
    return "?" if share is None else f"{max(share, 0.0):.0%}"


def _at(value: Any, mb: int | None) -> Any:
    """The micro-batch ``mb``'s entry of a per-micro-batch sequence (the value itself with one)."""
    return value[mb] if mb is not None and isinstance(value, (list, tuple)) else value


@dataclass
class SpikeView:
    """What one spike block shows: ``SpikeView.of(stats)`` from a ``GradStats``. ``context``: the
    ``SpikeContext`` the culprits index (rank 0's gathered view under torch.distributed);
    ``not_localized``: why there is no ``result``; ``surgery``: a ``SurgeryResult``."""

    step: int
    events: Sequence[Any]
    result: Any = None
    context: Any = None
    not_localized: str | None = None
    surgery: Any = None

    @classmethod
    def of(cls, stats: Any, not_localized: str | None = None) -> "SpikeView":
        """``not_localized``: a better reason than the monitor's, when the caller knows one (a trainer
        whose loss is not rebuilt)."""
        if isinstance(stats, SpikeView):
            return stats
        result, ctx = getattr(stats, "locate_view", None) or (getattr(stats, "locate", None), None)
        why = not_localized or getattr(stats, "not_localized", None) if result is None else None
        return cls(stats.step, list(stats.events), result, ctx, why, getattr(stats, "surgery", None))

    # -- the context's views of a culprit ---------------------------------------------------
    def _get(self, name: str, mb: int | None) -> Any:
        return _at(getattr(self.context, name, None), mb)

    def who(self, mb: int | None, sample: int, document: int | None = None) -> tuple[str, str]:
        """(label, unit): ``("completion 2 of group 1, reward 0.25 (sample 9)", "completion")``,
        ``("document 2 (sample 0)", "document")`` or ``("micro-batch 1, sample 3", "sample")``."""
        where = (f"micro-batch {mb}, " if mb is not None else "") + f"sample {sample}"
        cols = getattr(self.context, "sample_columns", None) or {}
        if "group" in cols and "index" in cols:  # an RL completion (TRL's GRPO, examples/rl_grpo.py)
            g, i = int(_at(cols["group"], mb)[sample]), int(_at(cols["index"], mb)[sample])
            reward = f", reward {float(_at(cols['reward'], mb)[sample]):.4g}" if "reward" in cols else ""
            return f"completion {i} of group {g}{reward} ({where})", "completion"
        if document is not None:
            return f"document {document} ({where})", "document"
        return where, "sample"

    def document_at(self, mb: int | None, sample: int, position: int) -> int | None:
        docs = self._get("document_ids", mb)
        return None if docs is None else int(docs[sample, position])

    def decode(self, ids: list[int]) -> str:
        tok = getattr(self.context, "tokenizer", None)
        return tok.decode(ids) if tok is not None else "".join(f"<{i}>" for i in ids)

    def text(self, mb: int | None, sample: int, start: int, end: int, document: int | None = None) -> str:
        """The loss-bearing tokens of ``[start, end)`` in ``sample`` (of ``document``), decoded."""
        ids = self._get("input_ids", mb)
        if ids is None:
            return ""
        keep = range(start, end)
        mask = self._get("token_mask", mb)
        if mask is not None:
            keep = [t for t in keep if float(mask[sample, t]) != 0.0]
        if document is not None:
            keep = [t for t in keep if self.document_at(mb, sample, t) == document]
        return self.decode([int(ids[sample, t]) for t in keep])


def _quote(text: str, limit: int = 40) -> str:
    """``'text'`` with what a terminal would not show (NUL, bidi overrides, newlines) escaped, and the
    ``\\xNN`` that ``ByteTokenizer`` writes for invalid UTF-8 kept as one backslash."""
    return repr(text[:limit] + ("…" if len(text) > limit else "")).replace("\\\\", "\\")


def _unit_line(view: SpikeView, c: Any) -> str:
    """A span, a sample (completion, document) or a micro-batch: who, what, its text, its share."""
    share = f"  ({_pct(c.share)} {SHARE_OF})" if c.share is not None else ""
    if c.level == "micro_batch":
        mb = f"micro-batch {c.micro_batch}" if c.micro_batch is not None else "the batch"
        return f"{mb}: the whole micro-batch (no sample or token in it stands out){share}"
    label, unit = view.who(c.micro_batch, c.batch, c.document)
    what = f"span {c.start}-{c.end - 1}" if c.level == "span" else f"the whole {unit}"
    return f"{label}, {what}: {_quote(view.text(c.micro_batch, c.batch, c.start, c.end, c.document))}{share}"


def _token_runs(view: SpikeView) -> list[tuple[float, str]]:
    """Culprit tokens grouped into contiguous runs per sample: ``sample 3, tokens 40-42: 'â€™'``."""
    by_sample: dict[tuple, list] = {}
    for c in sorted(view.result.tokens, key=lambda c: (c.micro_batch or 0, c.batch, c.position)):
        by_sample.setdefault((c.micro_batch, c.batch), []).append(c)
    out = []
    for (mb, sample), cs in by_sample.items():
        runs: list[list] = [[cs[0]]]
        for c in cs[1:]:
            (runs[-1].append(c) if c.position == runs[-1][-1].position + 1 else runs.append([c]))
        ids = view._get("input_ids", mb)
        for run in runs:
            first, last = run[0].position, run[-1].position
            where = f"tokens {first}-{last}" if len(run) > 1 else f"token {first}"
            share = sum(c.share or 0.0 for c in run)
            label, _ = view.who(mb, sample, view.document_at(mb, sample, first))
            text = "" if ids is None else "".join(view.decode([int(ids[sample, c.position])]) for c in run)
            out.append((share, f"{label}, {where}: {_quote(text)}  ({_pct(share)} {SHARE_OF})"))
    return out


def culprit_lines(view: SpikeView) -> list[str]:
    """Every culprit row of a localized spike, largest share first (token runs merged)."""
    if view.result is None:
        return []
    rows = [(c.share or 0.0, _unit_line(view, c)) for c in view.result.culprits if c.level != "token"]
    rows += _token_runs(view)
    return [line for _, line in sorted(rows, key=lambda r: -r[0])]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def culprit_count(view: SpikeView) -> str:
    """``1 sample (3 tokens)``, ``1 completion (whole)``, ``2 documents (1 whole, 5 tokens)``: the
    units the rows name and the rows by level, counted as the block lists them."""
    found = view.result.culprits if view.result is not None else []
    units, levels, noun = set(), {}, "sample"
    for c in found:
        levels[c.level] = levels.get(c.level, 0) + 1
        if c.level == "micro_batch":
            continue
        doc = c.document if c.level != "token" else view.document_at(c.micro_batch, c.batch, c.position)
        units.add((c.micro_batch, c.batch, doc))
        noun = view.who(c.micro_batch, c.batch, doc)[1]
    rows = [f"{levels['sample']} whole" if "sample" in levels else None,
            _plural(levels["span"], "span") if "span" in levels else None,
            _plural(levels["token"], "token") if "token" in levels else None]
    rows = [r for r in rows if r]
    whole_only = rows == [f"{len(units)} whole"]  # "1 completion", not "1 completion (1 whole)"
    out = [_plural(len(units), noun) + ("" if whole_only else f" ({', '.join(rows)})")] if units else []
    if "micro_batch" in levels:
        out.append(_plural(levels["micro_batch"], "micro-batch", "micro-batches"))
    return ", ".join(out)


def surgery_line(op: Any) -> str:
    """What ``spikes.response=surgery`` did to the step (a ``SurgeryResult``)."""
    if not op.applied:
        return f"  surgery    nothing removed: {op.reason}"
    return (f"  surgery    removed {op.removed_share:.0%} of the step's squared grad norm ({op.culprits} culprit "
            f"row(s), one probe): grad norm {op.grad_norm_pre:.3g} -> {op.grad_norm_post:.3g}, then to the clipper")


def spike_block(view: SpikeView, run_dir: Path) -> list[str]:
    """The lines of one spike block: when, which signal, which text, surgery, where to look."""
    lines = [f"── spike at step {view.step} " + "─" * 40]
    for e in view.events[:3]:
        lines.append(f"  signal     grad_norm/{e.signal} = {e.value:.3g}, {e.ratio:.1f}x its running mean "
                     f"{e.baseline:.3g} (z = {e.z:.0f})")
    if len(view.events) > 3:
        lines.append(f"             ... and {len(view.events) - 3} more layer(s)")
    found = culprit_lines(view)
    if view.result is None:
        lines.append(f"  culprits   not localized: {view.not_localized or 'no localization ran'}")
    elif not found:
        lines.append("  culprits   none found: no sample, span or token stands out (the spike is spread over "
                     "the batch)")
        top = [r for r in getattr(view.result, "sample_shares", [])[:3] if r.get("share") is not None]
        if top:
            lines.append("             largest per-sample shares: " + ", ".join(
                (f"micro-batch {r['micro_batch']}, " if r["micro_batch"] is not None else "")
                + f"sample {r['sample']} {_pct(r['share'])}" for r in top))
    else:
        shown = found[:MAX_LINES]
        if len(found) > MAX_LINES:
            shown[-1] = f"... and {len(found) - MAX_LINES + 1} more culprit row(s) (spikes/tokens lists them all)"
        lines += [("  culprits   " if i == 0 else "             ") + line for i, line in enumerate(shown)]
    if view.surgery is not None:
        lines.append(surgery_line(view.surgery))
    # a localized spike has its highlight page; any detected one its row of spikes/events
    page = highlight_page(view.step) if view.result is not None and view.context is not None \
        else event_page(view.step)
    lines += [("  artifacts  " if i == 0 else "             ") + w
              for i, w in enumerate(where_to_look(run_dir, view.step, page))]
    return lines


class TrainConsole:
    """``start(total)``, ``step(step, loss, grad_norm)``, ``spike(stats, run_dir)``, ``summary(lines)``,
    ``close()``."""

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

    def spike(self, stats: Any, run_dir: Path, not_localized: str | None = None) -> None:
        """The block of a step whose spike fired: ``stats`` a ``GradStats`` (or a ``SpikeView``);
        ``not_localized``: a better reason than ``stats.not_localized`` when the caller knows one.
        Printing never raises into training: a failure is a warning."""
        try:
            text = "\n".join(spike_block(SpikeView.of(stats, not_localized), Path(run_dir)))
        except Exception as exc:  # the console is a nicety: never kill training over it
            warnings.warn(f"gradloc-track: could not print the spike block of step {stats.step}: {exc!r}")
            return
        self.print(text)

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
    from .trackers.join import is_scratch

    if is_scratch(run_dir):  # removed when the run ends: never shown as a place to look
        return out or ["no run dir: pass run_dir= to keep this run's files"]
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


def spike_summary(spikes: Sequence[Any], run_dir: Path, not_localized: str | None = None) -> list[str]:
    """The closing lines about the run's spikes (``GradStats`` or ``SpikeView``s, in step order): how
    many, where, and for the first three what their blocks named, counted the same way, with the
    link to each one's page (the run is surely open by now: a block printed before has none)."""
    views = [SpikeView.of(s, not_localized) for s in spikes]
    if not views:
        return ["no gradient spike detected"]
    steps = [v.step for v in views]
    shown = ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")
    lines = [f"{len(steps)} gradient spike(s) detected, at step {shown}"]
    for v in views[:3]:
        found = culprit_lines(v)
        if v.result is None:
            lines.append(f"  step {v.step}: not localized ({v.not_localized or 'no localization ran'})")
        elif found:
            lines.append(f"  step {v.step}: {culprit_count(v)}: {found[0]}")
        else:
            lines.append(f"  step {v.step}: no culprit found (the spike is spread over the batch)")
        link = spike_link(Path(run_dir), v.step, localized=v.result is not None and v.context is not None)
        if link:
            lines.append(f"    {link}")
    return lines


def clip_saturation_line(clip_kind: str, summary: dict[str, float]) -> str | None:
    """How often and how hard the clipper scaled after its warm-up (``summarize``'s clip_* keys)."""
    from .clip.saturation import saturation_line

    if "clip_steps_after_warmup" not in summary:
        return None
    return saturation_line(clip_kind, {"steps": int(summary["clip_steps_after_warmup"]),
                                       "clipped_fraction": summary["clip_clipped_fraction"],
                                       "mean_coef": summary["clip_mean_coef"]})


def closing_lines(head: str, spikes: Sequence[Any], run_dir: Path, middle: Sequence[str] = (),
                  not_localized: str | None = None) -> list[str]:
    """The end of any run: ``head`` (``done: 80 steps in 41 s``), its spikes as their blocks named
    them, ``middle`` (the clipper's lines), the run dir and the commands to look at it."""
    lines = [head, *spike_summary(spikes, run_dir, not_localized), *middle]
    from .trackers.join import is_scratch

    if not is_scratch(Path(run_dir)):  # a scratch dir is gone by now: the links above are the way in
        lines += [f"run dir: {run_dir}", "look at the results:", *view_commands(Path(run_dir))]
    return lines


def summary_lines(steps: int, clip_kind: str, summary: dict[str, float], spikes: Sequence[Any],
                  run_dir: Path) -> list[str]:
    """The few lines a person reads at the end of a run: what happened (``spikes``: the spiking
    steps' ``GradStats``), how the clipper behaved, and how to look at it."""
    clip = []
    if clip_kind != "none":
        clip.append(f"clip={clip_kind}: largest grad norm the optimizer saw after warm-up "
                    f"{summary['max_post_clip_grad_norm']:.3g}")
        line = clip_saturation_line(clip_kind, summary)
        if line:
            clip.append(line)
    head = f"done: {steps} steps in {summary['seconds']:.0f} s, final loss {summary['final_loss']:.3f}"
    return closing_lines(head, spikes, run_dir, clip)
