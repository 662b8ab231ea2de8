"""The monitor's side of clipping beyond the norms it hands over: the optimizer guard that makes a
non-finite step a real skip, and what the step's one host transfer tells the clipper and the user.

- With ``optimizer=`` (``watch()`` and the HF/Lightning callbacks pass it) the optimizer gets a
  ``SkipStepGuard`` (``clip.skip_step``, default ``auto``), clipper or not: a non-finite step leaves
  parameters and optimizer state bitwise unchanged. A clipper with ``on_nonfinite="skip"`` sets the
  flag (and no longer zeroes that step's gradients: one pass less); without a clipper (or with one
  that sets no flag) the flag is ``NonfiniteFlag``'s, from the per-tensor norms the monitor computes
  every step anyway: no pass over the gradients, no host sync. A clipper with ``on_nonfinite="zero"``
  or ``"raise"``, or ``skip_step="off"``, keeps its own handling and gets no guard. Without
  ``optimizer=`` a skip clipper zeroes the gradients and warns once, naming ``SkipStepGuard``.
- On a step that moved its values to the host, the non-finite flag is handed over as a python bool,
  so a ``sync``-mode guard reads nothing more from the device.
- Once a clipper has scaled most steps hard for a long stretch, one warning says that clipping
  has become a learning-rate cut and which setting changes it (``gradloc_track.clip.saturation``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..clip.clipper import Clipper
from ..clip.handoff import NonfiniteFlag
from ..clip.saturation import KEYS as SATURATION_KEYS
from ..clip.saturation import saturation_warning
from ..clip.skip_step import guard_for
from ..protocols import ClipperLike


def install_guard(optimizer: Any, clipper: Any, device: torch.device) -> Any:
    """The ``SkipStepGuard`` on ``optimizer`` (None when there is nothing to guard). Its flag is the
    clipper's when it sets one, else a ``NonfiniteFlag`` the monitor updates (``note_norms``)."""
    if optimizer is None:
        return None
    if clipper is not None and (hasattr(clipper, "last_nonfinite") or getattr(clipper, "on_nonfinite", None) != "skip"):
        return guard_for(optimizer, clipper)  # the clipper's own flag, or its own non-finite handling
    return guard_for(optimizer, NonfiniteFlag(device))


def note_norms(guard: Any, grad_sq: torch.Tensor) -> None:
    """This step's non-finite flag for a guard whose flag the monitor sets (no clipper sets it)."""
    if guard is not None and isinstance(guard.clipper, NonfiniteFlag):
        guard.clipper.update(grad_sq)


def after_transfer(clipper: ClipperLike | None, host: dict[str, float], warn_once: Callable[[str, str], None],
                   guard: Any = None) -> None:
    """Hand the host values of this step back to the flag source; warn once about saturation. Only the
    library's ``Clipper`` keeps a host flag and saturation statistics; another ``ClipperLike`` gets nothing."""
    if guard is not None and isinstance(guard.clipper, NonfiniteFlag) and "grad_norm/nonfinite" in host:
        guard.clipper.last_nonfinite_host = host["grad_norm/nonfinite"] > 0  # a sync-mode guard reads nothing
    if not isinstance(clipper, Clipper):
        return
    if "clip/nonfinite" in host:
        clipper.last_nonfinite_host = host["clip/nonfinite"] > 0  # a sync-mode guard needs no device read
    if all(k in host for k in SATURATION_KEYS):
        msg = saturation_warning(clipper.kind, clipper.saturation.steps, *(host[k] for k in SATURATION_KEYS))
        if msg is not None:
            warn_once("saturation", msg)
