"""SpikeOutcome: what the monitor made of one detected step, built once by the responder.

Detection, localization (its result and rank 0's host-side view of the culprits, a ``CulpritView``), the reason a spike
was not localized, surgery, and the step's cause: one immutable object, made when all of it is known.
The events table, the highlight page, the console block, the report and the ledger read it (through
``GradStats``); nothing sets fields on it, or on its events, afterwards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..spikes.cause import Cause
from ..spikes.event import SpikeEvent

if TYPE_CHECKING:  # imported on a spike only at run time (the localizer is heavy)
    from ..localizer.culprit_view import CulpritView
    from ..localizer.result import LocateResult
    from ..localizer.surgery import SurgeryResult


@dataclass(frozen=True)
class SpikeOutcome:
    """One detected step. ``events`` carry the step's cause (``SpikeEvent.cause``); ``culprit_view`` is
    the localization as the artifacts show it, a ``CulpritView`` (under torch.distributed rank 0's, with
    every culprit's sample gathered; None on a rank that shows nothing): the cause's words read it, and
    the console, the table and the page read the same view of ``view``; ``not_localized`` says why
    ``locate`` is None; ``surgery`` is set with ``spikes.response=surgery``; ``culprit_rows`` is every rank's
    culprit rows as ``(result, context)`` on every rank (in one process the view's), what a quarantine blames."""

    step: int
    events: tuple[SpikeEvent, ...]
    cause: Cause | None = None
    locate: LocateResult | None = None
    culprit_view: CulpritView | None = None
    not_localized: str | None = None
    surgery: SurgeryResult | None = None
    culprit_rows: tuple[Any, Any] | None = None

    @property
    def view(self) -> tuple[Any, Any] | None:
        """``(result, context)`` the culprits index (``culprit_view``'s), or None."""
        return (self.culprit_view.result, self.culprit_view.context) if self.culprit_view is not None else None

    @property
    def blamed_rows(self) -> tuple[Any, Any] | None:
        """``culprit_rows`` when the step's rows are the data's fault: its own cause (an aftermath step's, what its
        evidence alone named: a garbage batch inside a recovery) is ``data``, or ``numeric`` with rows the
        non-finite search named (the batch made the NaN); else None. An ``irreproducible`` step's rows are the
        largest of a replay that is not the step (held-out tester, stop 56: a NaN multiplier on one rank had four
        clean rows quarantined, half the batch), a ``schedule``'s or ``loss_scale``'s carry a step the data did not
        make, an ``unexplained`` one's too little (in an incident or not)."""
        if self.culprit_rows is None or self.cause is None or data_fault(self.cause, self.locate) is not True:
            return None
        result, ctx = self.culprit_rows
        return fault_rows(self.cause, result), ctx

    @property
    def cause_name(self) -> str | None:
        return self.cause.name if self.cause is not None else None

    @property
    def cause_detail(self) -> str | None:
        return self.cause.detail if self.cause is not None else None


def data_fault(cause: Cause, result: Any) -> bool | None:
    """Did the step's data make it, so that its culprit rows are the data's fault (``SpikeOutcome.blamed_rows``,
    the table's ``data_fault``)? True when its own cause (an aftermath step's: what its evidence alone named) is
    ``data``, or ``numeric`` with samples the non-finite search named (only those rows: ``fault_rows``); None
    when it is ``unexplained`` (culprits that carry too little to name the data: weak evidence, which the ledger
    adds up across runs and the quarantine does not act on); False otherwise (a replay that is not the step, a
    schedule, the optimizer's state, a loss scale, an importance ratio, a precision overflow)."""
    own = cause.own_name
    if own == "numeric":
        found = getattr(result, "nonfinite", None)
        return found is not None and found.where != "replay" and bool(found.samples)
    if own == "unexplained":
        return None
    return own == "data"


def fault_rows(cause: Cause, result: Any) -> Any:
    """``result`` with the culprits a quarantine blames: all of a ``data`` step's, a ``numeric`` step's
    non-finite ones only (the norm search's finite largest rows beside them made no NaN: review of 5b633b9)."""
    own = cause.own_name
    if own != "numeric" or result is None:
        return result
    return dataclasses.replace(result, culprits=[c for c in result.culprits if getattr(c, "nonfinite", False)])


def with_cause(events: Sequence[SpikeEvent], cause: Cause | None, fault: bool | None = None
               ) -> tuple[SpikeEvent, ...]:
    """The events as the step reports them: each carrying its cause and, when localized, whether its culprit rows
    are the data's fault (``data_fault``) (new events; the detector's stay as made)."""
    if cause is None:
        return tuple(events)
    return tuple(dataclasses.replace(e, cause=cause.name, cause_detail=cause.detail, data_fault=fault)
                 for e in events)
