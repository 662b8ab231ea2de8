"""The order of ``after_backward`` calls (once per optimizer step, with a step that increases) and the
monitor's warnings about its use, each given once."""
from __future__ import annotations

import operator
import warnings
from typing import Any, Callable


def checked_step(step: Any) -> int:
    """The step as an int (a numpy or 0-d tensor integer is one); anything else is said by name (a string step
    failed in a warning's formatting, with a message about something else)."""
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    try:
        if not isinstance(step, bool):
            return operator.index(step)
    except TypeError:
        pass
    raise TypeError(f"GradMonitor.after_backward(step=...): step must be an int, the optimizer step count; got "
                    f"a {type(step).__name__} ({step!r})")


class WarnOnce:
    """``warn_once(key, message)``: each kind of misuse is warned about once per monitor, not every step."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, key: str, message: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            warnings.warn(f"gradloc-track: {message}", stacklevel=3)


class StepOrder:
    """A repeated step is ignored (clip and detector state advance once per step); a step that goes
    backwards is processed, with a warning (trackers keep one value per step)."""

    def __init__(self, warn_once: Callable[[str, str], None]) -> None:
        self._warn_once = warn_once
        self._last: int | None = None

    def repeated(self, step: int) -> bool:
        """True for a second call with the step just processed (it must change nothing)."""
        last, self._last = self._last, step
        if last is not None and step == last:
            self._warn_once("repeat", f"GradMonitor.after_backward was called again for step {step}; the repeated "
                            "call is ignored (no clipping, spike detection or logging: their state advances once "
                            "per step). Call it once per optimizer step, after the last micro-batch's backward, "
                            "with a step that increases.")
            return True
        if last is not None and step < last:
            self._warn_once("backwards", f"GradMonitor.after_backward: the step went backwards ({last} -> {step}). "
                            "Its gradients are clipped and checked as a new step, but trackers keep one value per "
                            "step (W&B drops steps below its current one): pass a step that increases, e.g. the "
                            "global optimizer step rather than a per-epoch counter.")
        return False
