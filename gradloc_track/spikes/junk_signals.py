"""The detector's two structural signals on the step's loss terms (``spikes/junk.py``): a run of terms
the model rates below chance (``junk_span``), and rows whose targets are their own inputs
(``leaked_labels``). Neither is a z-score: chance and the leak share are fixed references."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from .event import SpikeEvent
from .junk import LEAKED, LEARNED
from .signal import MAX_LOG
from .text_check import WindowText, clean_text

RECENT = 0.9  # EMA decay of the recent steps' mean excess (about 10 steps)


class JunkSignals:
    """``events(step, junk_span, junk_text, metrics)``: the junk and leak events of one step.
    ``excused``: (text, why) of the last junk run that decoded to plainly clean text (``spikes.text_check``)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.seen = 0  # steps the junk signal has seen (its warm-up)
        self.excused: tuple[str, str] | None = None
        # the recent steps' mean excess (an EMA over ~10 steps, this one not in it): has the model learned?
        self.recent = math.inf

    def events(self, step: int, junk: Sequence[float] | None, junk_text: Callable[[], str | WindowText | None] | None,
               metrics: dict[str, float]) -> list[SpikeEvent]:
        if junk is None:
            return []
        run = self._junk_event(step, junk, metrics) if self.config.junk_signal else None
        excused = run is not None and self._clean_text(junk_text)
        metrics["spike/junk_excused"] = float(excused)
        leak = self._leak_event(step, junk, metrics) if self.config.junk_signal else None
        return [e for e in (None if excused else run, leak) if e is not None]

    def _junk_event(self, step: int, junk: Sequence[float], metrics: dict[str, float]) -> SpikeEvent | None:
        """A run of terms below chance: value = the run's excess, baseline = the batch's mean excess (nats a
        term), z = their gap, ratio = ``exp(gap)`` (how many times less likely a term of the run is than
        the batch's typical term)."""
        cfg = self.config
        span, mean = float(junk[0]), float(junk[1])
        if not (math.isfinite(span) and math.isfinite(mean)):
            return None  # no run that long (-inf), or a non-finite loss: the loss signals' case
        self.seen += 1
        metrics["spike/junk_span"], metrics["spike/junk_mean"] = span, mean
        # the model has learned when the batch's terms average below chance, or the recent batches' did: a
        # batch that is mostly junk (both rows of a packed pair) averages near chance itself
        learned = min(mean, self.recent) < LEARNED
        self.recent = mean if not math.isfinite(self.recent) else RECENT * self.recent + (1 - RECENT) * mean
        if self.seen <= cfg.warmup_steps or span <= cfg.junk_margin or not learned:
            return None
        gap = span - mean
        return SpikeEvent(step, "junk_span", span, mean, gap, math.exp(min(MAX_LOG, gap)))

    def _clean_text(self, junk_text: Callable[[], str | WindowText | None] | None) -> bool:
        """Is the run the junk rule would fire on plainly clean text (``spikes.text_check``)?"""
        text = junk_text() if junk_text is not None else None  # a str, or a WindowText (text, tokenized)
        reason = clean_text(text) if text is not None else None
        if reason is not None:
            self.excused = (text if isinstance(text, str) else str(text[0]), reason)
        return reason is not None

    @staticmethod
    def _leak_event(step: int, junk: Sequence[float], metrics: dict[str, float]) -> SpikeEvent | None:
        """Rows whose targets are their own input tokens (``spikes.junk.leaked``): labels that leaked into
        the inputs, a loss that falls too far. Structural, so no warm-up: value = the largest row's share
        of such terms, against ``LEAKED``."""
        if len(junk) < 3 or junk[2] is None:
            return None
        leak = float(junk[2])
        metrics["spike/leaked_labels"] = leak
        if not (math.isfinite(leak) and leak >= LEAKED):
            return None
        return SpikeEvent(step, "leaked_labels", leak, LEAKED, math.inf, leak / LEAKED)
