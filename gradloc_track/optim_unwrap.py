"""The torch optimizer behind a wrapper, found one way for every caller (the step hook, the skip
guard, the update signal): a wrapper without torch's hook tables (Accelerate's
``AcceleratedOptimizer``, which HF Trainer hands to callbacks and whose ``step()`` calls the inner
one, where hooks, state and ``found_inf`` act) is unwrapped through its ``optimizer`` attribute."""
from __future__ import annotations

from typing import Any

MAX_DEPTH = 4  # wrappers of wrappers; a cycle stops here


def unwrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` itself when it is a torch optimizer (or None, or nothing wraps it), else the
    optimizer it wraps."""
    for _ in range(MAX_DEPTH):
        if optimizer is None or hasattr(optimizer, "_optimizer_step_pre_hooks"):
            break
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer
