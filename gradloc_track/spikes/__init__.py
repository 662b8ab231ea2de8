"""Spike detection: the adaptive detector, the OLMo-style spike score, events and batch context."""
from .context import SpikeContext
from .detector import SpikeDetector
from .event import SpikeEvent
from .junk import JunkSpan, junk_span
from .sample_loss import sample_losses
from .score import is_spike, spike_score

__all__ = ["SpikeDetector", "SpikeEvent", "SpikeContext", "spike_score", "is_spike", "junk_span", "JunkSpan",
           "sample_losses"]
