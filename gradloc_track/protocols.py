"""The seams of the monitor, as ``typing.Protocol``s: what a clipper, a spike detector and an artifact
writer must offer for ``GradMonitor`` to drive them.

The library's own classes (``clip.Clipper``, ``spikes.SpikeDetector``,
``artifacts.SpikeArtifactWriter``) satisfy them; so can a user's. The tracker's seam is one class,
``trackers.Tracker`` (``trackers/interface.py``): a destination whose methods do nothing by default,
which a user's tracker subclasses to override only what it supports (no protocol beside it). The
monitor types its arguments against these and never probes an object with ``getattr``:
``GradMonitor`` checks each argument once, at construction (``monitor.arguments``), and the
error names the missing method.

Kept free of the package's other modules (floor 0): the protocols name what is passed across a
seam, not where it comes from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class ClipperLike(Protocol):
    """Clips ``p.grad`` in place. ``names``: the parameter names it clips, in the order of the
    squared norms it takes (``None``: it computes its own norms). ``on_nonfinite``: ``"skip"``
    asks the monitor to make a non-finite step a real optimizer skip (``clip.SkipStepGuard``)."""

    kind: str
    names: Sequence[str] | None
    on_nonfinite: str

    def clip(self, sq_norms: torch.Tensor | None = None) -> Any:
        """Clip; ``sq_norms``: the per-tensor squared norms when the caller has them. Returns a
        ``clip.ClipResult`` (device tensors, no host sync) or None."""


@runtime_checkable
class DetectorLike(Protocol):
    """Decides, from the step's norms, whether a spike happened.

    ``needs_token_count``: the detector reads ``n_tokens`` (GradLoc's fixed trigger divides by
    the step's loss-token count); the monitor then counts them on armed steps."""

    needs_token_count: bool

    def update(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None = None, *,
               n_tokens: int | None = None, n_micro_batches: int = 1, **signals: Any) -> list[Any]:
        """The spike events of this step (``spikes.SpikeEvent``), empty when none fired."""

    def metrics(self) -> dict[str, float]:
        """``spike/*`` metrics of the last update."""


@runtime_checkable
class ArtifactWriterLike(Protocol):
    """Turns a spike into artifacts (table, highlighted text, heatmap) and keeps the event record."""

    @property
    def run_dir(self) -> Path: ...

    def write(self, step: int, events: Sequence[Any], result: Any, ctx: Any) -> None:
        """A localized spike: its culprits (``localizer.LocateResult``) in the step's batch (``ctx``)."""

    def write_detection(self, step: int, events: Sequence[Any], why_not_localized: str) -> None:
        """A detected spike that was not localized, with the reason."""
