"""The monitor's side of clipping beyond the norms it hands over: the optimizer guard that makes
``on_nonfinite="skip"`` exact, and what the step's one host transfer tells the clipper and the user.

- With ``optimizer=`` (``watch()`` and the HF/Lightning callbacks pass it), a clipper with
  ``on_nonfinite="skip"`` gets a ``SkipStepGuard`` (``clip.skip_step``, default ``auto``): a
  non-finite step leaves parameters and optimizer state bitwise unchanged, and the clipper no
  longer zeroes that step's gradients (one pass less). Without ``optimizer=`` the clipper zeroes
  them and warns once, naming ``SkipStepGuard``.
- On a step that moved its values to the host, the clipper's non-finite flag is handed over as a
  python bool, so a ``sync``-mode guard reads nothing more from the device.
- Once a clipper has scaled most steps hard for a long stretch, one warning says that clipping
  has become a learning-rate cut and which setting changes it (``gradloc_track.clip.saturation``).
"""
from __future__ import annotations

from typing import Any, Callable

from ..clip.clipper import Clipper
from ..clip.saturation import KEYS as SATURATION_KEYS
from ..clip.saturation import saturation_warning
from ..clip.skip_step import guard_for
from ..protocols import ClipperLike


def install_guard(optimizer: Any, clipper: Any) -> Any:
    """The clipper's ``SkipStepGuard`` on ``optimizer`` (None when there is nothing to guard)."""
    return guard_for(optimizer, clipper)


def after_transfer(clipper: ClipperLike | None, host: dict[str, float], warn_once: Callable[[str, str], None]) -> None:
    """Hand the host values of this step back to the clipper; warn once about saturation. Only the
    library's ``Clipper`` keeps a host flag and saturation statistics; another ``ClipperLike`` gets nothing."""
    if not isinstance(clipper, Clipper):
        return
    if "clip/nonfinite" in host:
        clipper.last_nonfinite_host = host["clip/nonfinite"] > 0  # a sync-mode guard needs no device read
    if all(k in host for k in SATURATION_KEYS):
        msg = saturation_warning(clipper.kind, clipper.saturation.steps, *(host[k] for k in SATURATION_KEYS))
        if msg is not None:
            warn_once("saturation", msg)
