"""GradStats: what one ``GradMonitor.after_backward`` call saw.

On steps that synced (logging steps, or every step when a detector is armed) every value is
already on the host. On other steps it holds device tensors and converts lazily, in ONE
transfer, only when a float property is read — so a training loop that ignores the stats on
non-logging steps never waits for the device.
"""
from __future__ import annotations

from typing import Any

import torch

from ..grouping import LayerGrouping
from ..spikes.event import SpikeEvent
from .outcome import SpikeOutcome


class GradStats:
    """Per-tensor / per-layer / global gradient norms (before clipping) of one step.

    ``grad_norms``: parameter name -> L2 norm; ``layer_norms``: layer -> L2 norm;
    ``global_norm``: float; ``metrics``: exactly what was logged (empty if nothing was);
    ``logged``: whether this was a logging step; ``clip``: the ``ClipResult`` or None;
    ``outcome``: on a step the detector fired, its ``SpikeOutcome`` (built once by the responder; the
    properties below read it): ``events``: the ``SpikeEvent``s fired this step, each carrying the step's
    cause; ``locate``: the ``LocateResult`` or None.
    ``locate_view``: ``(result, context)`` as the artifacts show them: under torch.distributed,
    rank 0's view with every culprit's sample gathered (``batch`` indexes ``context.input_ids``);
    in one process, ``(locate, the SpikeContext)``. ``not_localized``: on a step with events but
    no localization, why (``"locate.enabled=false"``, ``"locate.max_events=1 reached ..."``, ...).
    ``surgery``: with ``spikes.response=surgery``, what surgery did to this step's gradient (a
    ``SurgeryResult``, with ``reason`` when nothing). ``cause``, ``cause_detail``: the step's cause.
    """

    def __init__(self, step: int, grouping: LayerGrouping, grad_sq: torch.Tensor, *, logged: bool,
                 host: dict[str, float] | None = None, metrics: dict[str, float] | None = None,
                 clip: Any = None, outcome: SpikeOutcome | None = None) -> None:
        self.step = step
        self.logged = logged
        self.metrics: dict[str, float] = metrics if metrics is not None else {}
        self.clip = clip
        self.outcome = outcome
        self._grouping = grouping
        self._grad_sq = grad_sq  # (n_tensors,) device, globally reduced
        # host copies: {"global": float, "tensor": [n floats], "layer": [L floats]} once synced
        self._host = host

    def _synced(self) -> dict[str, Any]:
        if self._host is None:
            g = self._grad_sq
            layer = self._grouping.sum_by_layer(g)  # (L,)
            packed = torch.cat([g.sum().reshape(1), g, layer]).sqrt()  # (1 + n + L,)
            vals = packed.tolist()  # host sync: lazy, only because a float view was read
            n = g.numel()
            self._host = {"global": vals[0], "tensor": vals[1:1 + n], "layer": vals[1 + n:]}
        return self._host

    @property
    def events(self) -> list[SpikeEvent]:
        return list(self.outcome.events) if self.outcome is not None else []

    @property
    def locate(self) -> Any:
        return self.outcome.locate if self.outcome is not None else None

    @property
    def locate_view(self) -> tuple | None:
        return self.outcome.view if self.outcome is not None else None

    @property
    def blamed_rows(self) -> tuple | None:
        """``(result, context)`` of the rows a quarantine blames (``SpikeOutcome.blamed_rows``): every rank's
        culprits, on every rank; None when the step's rows are not the data's fault."""
        return self.outcome.blamed_rows if self.outcome is not None else None

    @property
    def not_localized(self) -> str | None:
        return self.outcome.not_localized if self.outcome is not None else None

    @property
    def surgery(self) -> Any:
        return self.outcome.surgery if self.outcome is not None else None

    @property
    def cause(self) -> str | None:
        return self.outcome.cause_name if self.outcome is not None else None

    @property
    def cause_detail(self) -> str | None:
        return self.outcome.cause_detail if self.outcome is not None else None

    @property
    def grad_norms(self) -> dict[str, float]:
        """Parameter name (as ``model.named_parameters()``) -> L2 norm of its gradient."""
        return dict(zip(self._grouping.names, self._synced()["tensor"]))

    @property
    def layer_norms(self) -> dict[str, float]:
        """Layer name -> L2 norm of the layer's gradients."""
        return dict(zip(self._grouping.layers, self._synced()["layer"]))

    @property
    def global_norm(self) -> float:
        """L2 norm of all gradients."""
        return self._synced()["global"]

    @property
    def sq_norms(self) -> torch.Tensor:
        """The per-tensor squared norms as a device tensor (no sync)."""
        return self._grad_sq

    def __repr__(self) -> str:
        state = "host" if self._host is not None else "device (not synced)"
        return f"GradStats(step={self.step}, logged={self.logged}, values on {state})"
