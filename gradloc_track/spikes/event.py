"""A detected spike: which signal fired, its value against its running baseline."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# the metric each non-norm signal reads (a norm signal reads ``grad_norm/<signal>``)
SIGNAL_KEYS = {"loss": "loss", "sample_loss": "loss/sample_max", "update": "update/global",
               "junk_span": "loss/junk_span", "leaked_labels": "loss/leaked_labels",
               "weight_norm": "weight_norm/global"}


@dataclass(frozen=True)
class SpikeEvent:
    """One signal that fired at a step. Immutable: the step's cause is given to a copy
    (``monitor.outcome.with_cause``), which the step's ``SpikeOutcome`` holds."""

    step: int
    signal: str  # "global", a layer name (grad_norm/<layer>), "loss", "sample_loss", "junk_span" or "update"
    value: float  # the signal's value at this step
    baseline: float  # the running mean it was compared with
    z: float  # (value - baseline) / running std, in log space
    ratio: float  # value / baseline
    cause: str | None = None  # why the step fired (spikes.cause.CAUSES), named once the step's evidence is in
    cause_detail: str = ""  # that cause in one sentence, with the numbers
    # localized: whether the step's culprit rows are the data's fault (``monitor.outcome.data_fault``), or only
    # carried a step the data did not make (a replay that is not the step, a schedule); None: not known
    data_fault: bool | None = None

    @property
    def key(self) -> str:
        """The metric this signal reads: ``grad_norm/global``, ``grad_norm/h.3``, ``loss``, ``loss/sample_max``
        (the largest per-sample loss), ``loss/junk_span`` (a run of terms below chance), ``update/global``
        (the update the optimizer is about to make)."""
        return SIGNAL_KEYS.get(self.signal, f"grad_norm/{self.signal}")

    @property
    def is_norm(self) -> bool:
        """A gradient-norm signal (global or a layer), as opposed to a loss or the optimizer's update."""
        return self.signal not in SIGNAL_KEYS

    def describe(self) -> str:
        """The signal against its reference, in words (the console block, the cause's sentence)."""
        if self.signal == "junk_span":
            return (f"{self.key} = {self.value:+.2f} nats a term above a random token's loss (the batch's terms: "
                    f"{self.baseline:+.2f}): a run the model rates below chance")
        if self.signal == "weight_norm":
            return (f"{self.key} = {self.value:.3g} (it was {self.baseline:.3g}): a weight is NaN, Inf or too large to "
                    "square in float32, while the gradient and the losses look ordinary")
        if self.signal == "leaked_labels":
            return (f"{self.key} = {self.value:.0%}: a row's targets are its own input tokens at {self.value:.0%} of "
                    "its terms (labels not shifted: the model copies its input, its loss falls too far)")
        return (f"{self.key} = {self.value:.3g}, {self.ratio:.1f}x its running mean {self.baseline:.3g} "
                f"(z = {self.z:.0f})")


def lead_event(events: Sequence[SpikeEvent]) -> SpikeEvent | None:
    """The event a step is named by, in every artifact and the console alike: the global norm when it fired,
    else the layer furthest out, else (no norm fired) the first other signal as the detector lists them.
    The events table took the largest z of any signal, so one spike read ``sample_loss`` there (its loss in
    the ``norm`` column) and ``wpe`` on its page and in the console (tester round 12)."""
    if not events:
        return None
    norms = [e for e in events if e.is_norm]
    if norms:
        return next((e for e in norms if e.signal == "global"), None) or max(norms, key=lambda e: e.z)
    return events[0]
