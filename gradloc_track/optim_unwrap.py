"""The torch optimizer behind a wrapper, found one way for every caller (the step hook, the skip
guard, the update signal): a wrapper without torch's hook tables (Accelerate's
``AcceleratedOptimizer``, which HF Trainer hands to callbacks and whose ``step()`` calls the inner
one, where hooks, state and ``found_inf`` act) is unwrapped through its ``optimizer`` attribute.

Some torch optimizers step another one inside their own ``step()``: ``ZeroRedundancyOptimizer``
runs ``self.optim.step()`` on this rank's shard. ``stepped_optimizers`` lists that chain, so the
skip guard reaches the optimizer whose step really moves the weights (emptying ZeRO's own param
groups left its inner optimizer stepping on an Inf-loss step)."""
from __future__ import annotations

from typing import Any

MAX_DEPTH = 4  # wrappers of wrappers; a cycle stops here
INNER = ("optim", "base_optimizer", "inner_optimizer", "optimizer")  # where an optimizer keeps one it steps


def _inner(optimizer: Any, name: str) -> Any:
    """``optimizer.<name>``, or None; a property that raises is an error naming the fix, not a traceback
    from deep inside ``watch()``."""
    try:
        return getattr(optimizer, name, None)
    except Exception as exc:
        raise TypeError(f"gradloc-track: reading {type(optimizer).__name__}.{name} (to find the torch optimizer it "
                        f"wraps) raised {type(exc).__name__}: {exc}. Pass the torch optimizer itself (e.g. "
                        f"watch(model, {type(optimizer).__name__.lower()}.{name})), or no optimizer and call "
                        "handle.step() after backward()") from exc


def unwrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` itself when it is a torch optimizer (or None, or nothing wraps it), else the
    optimizer it wraps."""
    for _ in range(MAX_DEPTH):
        if optimizer is None or hasattr(optimizer, "_optimizer_step_pre_hooks"):
            break
        inner = _inner(optimizer, "optimizer")
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def stepped_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers one ``step()`` of ``optimizer`` runs: it (unwrapped), then any torch optimizer
    it keeps and steps (ZeRO's ``optim``), and so on. ``[]`` for None."""
    import torch

    first = unwrap_optimizer(optimizer)
    chain = [] if first is None else [first]
    while chain and len(chain) <= MAX_DEPTH:
        inner = next((o for o in (_inner(chain[-1], n) for n in INNER)
                      if isinstance(o, torch.optim.Optimizer) and all(o is not c for c in chain)), None)
        if inner is None:
            break
        chain.append(inner)
    return chain
