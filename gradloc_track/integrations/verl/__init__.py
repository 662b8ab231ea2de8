"""verl: GradLoc inside verl's FSDP actor engine (verl 0.9), switched on from verl's own Hydra config.

```bash
pip install 'gradloc-track[verl]'
python -m verl.trainer.main_ppo ... +actor_rollout_ref.actor.gradloc.clip=adagc
```

``plugin`` (loaded by verl itself on ``import verl``, through the ``verl.plugins`` entry point)
lets verl's actor config carry a ``gradloc`` node and routes ``BaseEngine.train_batch`` through a
``GradLocSession`` when that node is there: per-layer norms and clip thresholds after
``forward_backward_batch``, our clipper in place of ``clip_grad_norm_`` when one is configured
(verl's skip of a non-finite step kept), and, on a spike, probes that replay the engine's own
``forward_step`` with verl's own loss function and the loss masks narrowed (``probe_loss``), the
step's global normalisers and RNG unchanged. ``attach(engine, cfg)`` does the same for an engine
you built yourself. Checked against verl 0.9.1 (``VERL_CHECKED``).

This package imports verl lazily: ``plugin`` runs inside ``import verl``.
"""
from __future__ import annotations

from typing import Any

from ..._optional import require

require("verl", "verl")

VERL_CHECKED = ("0.9.1",)

__all__ = ["attach", "GradLocSession", "VERL_CHECKED", "use_cpu_platform"]


def __getattr__(name: str) -> Any:  # the engine side imports verl's workers: only when asked for
    if name in ("attach", "GradLocSession"):
        from . import session

        return getattr(session, name)
    if name == "use_cpu_platform":
        from .cpu import use_cpu_platform

        return use_cpu_platform
    raise AttributeError(name)
