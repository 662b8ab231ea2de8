"""GradMonitor: per-layer gradient observability, called after ``backward()``.

Rooms: ``grad_monitor`` (the coordinator: ``after_backward`` step by step), ``param_set`` (which
tensors are monitored, their layers, the clipper's index), ``packing`` (the one host transfer),
``optimizer_metrics`` (lr, weight decay, AdamC's ratio), ``responder`` (localize, back off,
gather to rank 0, artifacts), ``stats`` (``GradStats``, the result), ``arguments`` (constructor checks).
"""
from __future__ import annotations

from .grad_monitor import GradMonitor
from .stats import GradStats

__all__ = ["GradMonitor", "GradStats"]
