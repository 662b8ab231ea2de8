"""``TrainConsole``: the progress line and, through the same stream, the spike blocks and the summary.

On a terminal a ``rich`` progress bar shows step, loss and grad norm; when the output is not a
terminal (CI logs, ``| tee``), or without ``rich``, a plain line every tenth of the run instead.
Spike blocks and the summary go through the same console so they never tear the bar.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from .block import spike_block
from .culprits import SpikeView
from .flood import AftermathLines


class TrainConsole:
    """``start(total)``, ``step(step, loss, grad_norm)``, ``spike(stats, run_dir)``, ``summary(lines)``,
    ``close()``."""

    def __init__(self, stream=None, rich: bool | None = None) -> None:
        # "stderr" / "stdout": the process's stream at each print (``contextlib.redirect_stderr``, pytest's
        # capture: held-out tester, stop 56, a block went to the stream watch() had found); else the one given
        self._named = stream if stream in ("stderr", "stdout") else None
        # `> log.txt` keeps a run's console; a named stream: the one now (``_out`` reads it again at each print)
        self.stream = getattr(sys, self._named) if self._named is not None else (stream or sys.stdout)
        tty = hasattr(self._out, "isatty") and self._out.isatty()
        self._rich = tty if rich is None else rich
        self._progress = self._task = None
        self._total = 0
        self._aftermath = AftermathLines()  # an incident that fires on every step: a few of its lines (flood.py)
        if self._rich:
            try:
                from rich.console import Console
            except ImportError:
                self._rich = False
            else:
                self._console = Console(file=self._out, highlight=False)

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
            print(text, file=self._out, flush=True)

    @property
    def _out(self):
        return getattr(sys, self._named) if self._named is not None else self.stream

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
            # the step number every other line, table and tracker uses (from 0), after the count done: "step 104/130"
            # was step 103's loss, one off from MLflow (new-user tester round 12)
            w = len(str(self._total))
            self.print(f"[{step + 1:>{w}}/{self._total}] step {step:>{w}}  {stats}")

    def spike(self, stats: Any, run_dir: Path, not_localized: str | None = None) -> None:
        """The block of a step whose spike fired: ``stats`` a ``GradStats`` (or a ``SpikeView``);
        ``not_localized``: a better reason than ``stats.not_localized`` when the caller knows one.
        Printing never raises into training: a failure is a warning."""
        try:
            view = SpikeView.of(stats, not_localized)
            lines = spike_block(view, Path(run_dir))
        except Exception as exc:  # the console is a nicety: never kill training over it
            warnings.warn(f"gradloc-track: could not print the spike block of step {stats.step}: {exc!r}")
            return
        self.block(lines, view.aftermath_of)

    def block(self, lines: Sequence[str], aftermath_of: int | None = None) -> None:
        """Print a spike block; a one-line aftermath step of the incident begun at ``aftermath_of`` only when
        ``flood.AftermathLines`` says so (an incident that fires on every step prints a few of them)."""
        if aftermath_of is not None and len(lines) == 1:
            shown = self._aftermath.line(aftermath_of, lines[0])
            if shown is None:
                return
            lines = [shown]
        self.print("\n".join(lines))

    def summary(self, lines: Sequence[str]) -> None:
        self.close()
        self.print("\n".join(lines))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
