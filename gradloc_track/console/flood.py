"""An incident that fires on every step prints a few of its one-line aftermath steps, not all of them.

A weight that stays corrupt makes every later step non-finite: each is skipped, fires, and is that incident's
aftermath. One line per step buried the progress line and any other spike (held-out zoo, stop 58: 100 lines
after one flipped bit on GPT-2; issue 37 asks for one incident, not one event per step). The console prints an
incident's first ``SHOWN`` aftermath lines, then only its 8th, 16th, 32nd, ..., each with the count so far. Nothing is
lost: every step keeps its row of spikes/events and the closing lines count them all.
"""
from __future__ import annotations

SHOWN = 5  # an incident's first aftermath lines, all printed (a learning-rate jump's recovery is a few steps)


def shown(n: int) -> bool:
    """Is an incident's ``n``-th aftermath line (from 1) printed? The first ``SHOWN``, then powers of two."""
    return n <= SHOWN or n & (n - 1) == 0


class AftermathLines:
    """``line(incident, text)``: the text to print for the next one-line aftermath step of the incident that
    began at step ``incident``, or None to print nothing for it (module doc). Only one-line steps count: a
    localized aftermath step prints its whole block, always."""

    def __init__(self) -> None:
        self.incident: int | None = None
        self.n = 0

    def line(self, incident: int, text: str) -> str | None:
        if incident != self.incident:
            self.incident, self.n = incident, 0
        self.n += 1
        if not shown(self.n):
            return None
        if self.n <= SHOWN:
            return text
        return (f"{text} [its {ordinal(self.n)} one-line aftermath step; shown next: the {ordinal(2 * self.n)}; "
                "each is a row of spikes/events]")


def ordinal(n: int) -> str:
    """``8th``, ``32nd``, ``8192nd``."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
