"""The run page's story: a run's spikes and their culprit text in a few lines, for the MLflow run's
description and the W&B run's summary, so the culprit is on the run's first page, not three clicks in.

``SpikeStory`` is fed the tables the artifact writer logs through every front door (``spikes/events``:
one row per detected spike; ``spikes/tokens``: one row per culprit), in the tracker, so the demo,
``watch()`` and the callbacks all get it; ``markdown(link)`` / ``text()`` render it. Culprit text is
the table's (a token run's cells joined, ``\\xNN`` byte escapes of a byte tokenizer decoded back to
text); in Markdown it is escaped, never interpreted.
"""
from __future__ import annotations

import html
import re
from typing import Any, Callable, Iterable, Sequence

from ..text import quoted
from .naming import EVENTS_KEY, TABLE_KEY
from ..units import micro_batch_label, row_label

SHARE_OF = "of the batch's squared grad norm"  # the console's words (console/culprits.py)
MAX_STEPS = 10  # spikes told in full; the rest are counted
QUOTE = 60  # characters a culprit's text gets in its line
_BYTE = re.compile(r"\\x([0-9a-f]{2})")


def unescape_bytes(text: str) -> str:
    """``'\\xc3\\xa2\\xe2\\x82\\xac\\xe2\\x84\\xa2'`` (a byte tokenizer's cells, one byte each) -> ``'â€™'``;
    text without such escapes is returned as it is, bytes that stay invalid UTF-8 keep their escape."""
    if not _BYTE.search(text):
        return text
    raw = b"".join(bytes([int(p, 16)]) if i % 2 else p.encode("utf-8") for i, p in enumerate(_BYTE.split(text)))
    return raw.decode("utf-8", errors="backslashreplace")


class SpikeStory:
    """The spikes a tracker has seen (``add`` every table call; True when the story changed)."""

    def __init__(self) -> None:
        self.events: dict[int, dict[str, Any]] = {}  # step -> its spikes/events row
        self.culprits: dict[int, list[dict[str, Any]]] = {}  # step -> its spikes/tokens rows
        self._earlier: set[int] = set()  # steps whose culprit rows an earlier process of the run logged (``seed``)

    def add(self, key: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> bool:
        if key not in (EVENTS_KEY, TABLE_KEY):
            return False
        for r in rows:
            row = dict(zip(columns, r))
            step = int(row.get("step") or 0)
            if key == EVENTS_KEY:
                self.events[step] = row
            else:
                if step in self._earlier:  # a resume from an older checkpoint logs the step again: its rows now
                    self._earlier.discard(step)
                    self.culprits[step] = []
                self.culprits.setdefault(step, []).append(row)
        return True

    def seed(self, key: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """What an earlier process of this run logged (a resumed run's parts): told like the rest, replaced by
        rows this process logs for the same step."""
        rows = list(rows)
        self.add(key, columns, rows)
        if key == TABLE_KEY:
            self._earlier.update(int(dict(zip(columns, r)).get("step") or 0) for r in rows)

    def seed_step(self, step: int) -> None:
        """A spike an earlier process logged, known by its step alone (its row not read: past the ones told)."""
        self.events.setdefault(int(step), {"step": int(step)})

    def steps(self) -> list[int]:
        return sorted(set(self.events) | set(self.culprits))

    def culprit(self, step: int) -> str | None:
        """The step's largest culprit in words: ``sample 3, tokens 40-42: 'â€™'  (90% of ...)``."""
        units = _units(self.culprits.get(step, []))
        if not units:
            return None
        share, who, text = max(units, key=lambda u: u[0])
        what = "the whole micro-batch" if text is None else quoted(text, QUOTE)
        return f"{who}: {what}  ({max(share, 0.0):.0%} {SHARE_OF})"

    def _status(self, step: int) -> str:
        """Why a spike without a culprit has none (``not localized: locate.enabled=false``)."""
        how = (self.events.get(step) or {}).get("localization") or "localized"
        return "no culprit found (the spike is spread over the batch)" if how in ("localized", "no culprit found") \
            else f"not localized: {how}"

    def headline(self) -> str:
        steps = self.steps()
        if not steps:
            return "no gradient spike detected"
        shown = ", ".join(map(str, steps[:10])) + (" ..." if len(steps) > 10 else "")
        return f"{len(steps)} gradient spike(s) detected, at step {shown}"

    def text(self) -> str:
        """Plain lines (the W&B summary): the headline, then each spike's culprit."""
        lines = [self.headline()]
        for step in self.steps()[:MAX_STEPS]:
            lines.append(f"step {step}: {self.culprit(step) or self._status(step)}")
        if len(self.steps()) > MAX_STEPS:
            lines.append(f"... and {len(self.steps()) - MAX_STEPS} more (spikes/events lists them all)")
        return "\n".join(lines)

    def markdown(self, link: Callable[[int, bool], str | None] = lambda step, localized: None) -> str:
        """The MLflow description's lines: ``link(step, localized)`` is the address of the step's page
        (its highlighted text when localized, else its spikes/events row), None for no link."""
        lines = [f"**{_md(self.headline())}**", ""]
        for step in self.steps()[:MAX_STEPS]:
            words = self.culprit(step)
            url = link(step, words is not None)
            page = f" — [{'the highlighted text' if words else 'the event'}]({url})" if url else ""
            lines.append(f"- step {step}: {_md(words or self._status(step))}{page}")
        if len(self.steps()) > MAX_STEPS:
            lines.append(f"- ... and {len(self.steps()) - MAX_STEPS} more (`spikes/events` lists them all)")
        return "\n".join(lines)


def _md(text: str) -> str:
    """Text shown, never interpreted: HTML escaped, Markdown's special characters backslashed."""
    return re.sub(r"([\\`*_\[\]|~])", r"\\\1", html.escape(text, quote=False))


def _units(rows: list[dict[str, Any]]) -> list[tuple[float, str, str | None]]:
    """(share, who and where, text) per culprit unit: a sample / span / micro-batch row as it is, token
    rows merged into runs of contiguous positions (as the console's block merges them)."""
    out = []
    tokens: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("level") == "token":
            key = (row.get("rank"), row.get("micro_batch"), row.get("sample"), row.get("document"))
            tokens.setdefault(key, []).append(row)
        elif row.get("level") == "micro_batch":
            out.append((row.get("share") or 0.0, micro_batch_label(row.get("micro_batch")), None))
        else:
            what = f"span {row.get('position')}-{int(row.get('end') or 0) - 1}" if row.get("level") == "span" \
                else "the whole sample"
            text = unescape_bytes(str(row.get("token") or ""))
            out.append((row.get("share") or 0.0, f"{row_label(row)}, {what}", text))
    for group in tokens.values():
        group.sort(key=lambda r: int(r.get("position") or 0))
        runs = [[group[0]]]
        for row in group[1:]:
            (runs[-1].append(row) if int(row["position"]) == int(runs[-1][-1]["position"]) + 1 else runs.append([row]))
        for run in runs:
            first, last = run[0]["position"], run[-1]["position"]
            where = f"tokens {first}-{last}" if len(run) > 1 else f"token {first}"
            text = unescape_bytes("".join(str(r.get("token") or "") for r in run))
            out.append((sum(r.get("share") or 0.0 for r in run), f"{row_label(run[0])}, {where}", text))
    return out
