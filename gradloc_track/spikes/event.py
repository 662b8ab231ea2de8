"""A detected spike: which signal fired, its value against its running baseline."""
from __future__ import annotations

from dataclasses import dataclass

# the metric each non-norm signal reads (a norm signal reads ``grad_norm/<signal>``)
SIGNAL_KEYS = {"loss": "loss", "sample_loss": "loss/sample_max", "update": "update/global"}


@dataclass
class SpikeEvent:
    step: int
    signal: str  # "global", a layer name (as in grad_norm/<layer>), "loss", "sample_loss" or "update"
    value: float  # the signal's value at this step
    baseline: float  # the running mean it was compared with
    z: float  # (value - baseline) / running std, in log space
    ratio: float  # value / baseline
    cause: str | None = None  # why the step fired (spikes.cause.CAUSES), named once the step's evidence is in
    cause_detail: str = ""  # that cause in one sentence, with the numbers

    @property
    def key(self) -> str:
        """The metric this signal reads: ``grad_norm/global``, ``grad_norm/h.3``, ``loss``, ``loss/sample_max``
        (the largest per-sample loss), ``update/global`` (the update the optimizer is about to make)."""
        return SIGNAL_KEYS.get(self.signal, f"grad_norm/{self.signal}")

    @property
    def is_norm(self) -> bool:
        """A gradient-norm signal (global or a layer), as opposed to a loss or the optimizer's update."""
        return self.signal not in SIGNAL_KEYS
