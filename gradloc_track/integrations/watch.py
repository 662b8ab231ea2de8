"""``gradloc_track.watch(model, optimizer)``: everything on, in one call, with no other change.

```python
handle = gradloc_track.watch(model, optimizer, clip="adagc")  # joins wandb.run / mlflow.active_run()
for batch in data:
    model(**batch).loss.backward()   # HF-style call: the micro-batch is captured for localization
    optimizer.step()                 # the step pre-hook runs norms, clipping, detection, localization
    optimizer.zero_grad()
handle.finish()                      # flushes, takes every hook off; leaves a run it did not open open
```

The handle (``integrations.handle.WatchHandle``, the one every front door builds) is a thin
adapter over ``GradMonitor``: it builds what the Hydra app builds (tracker, clipper, detector,
artifact writer, monitor) from Hydra-named options, installs an optimizer step pre-hook (so
``step()`` uses the clipped gradient) and forward hooks that capture the step's token ids
(``batches.MicroBatchCapture``), and rebuilds the per-term loss on a spike. The run is joined or
opened by ``trackers.join``.

A wrapped optimizer (Accelerate's ``AcceleratedOptimizer``, whose ``step()`` runs the real one
only when ``accelerator.sync_gradients``) is hooked on the optimizer inside it, so the hook fires
once per real step under ``accelerator.accumulate``. A run joined without ``run_dir`` keeps its
files in a scratch directory that ``finish()`` removes (kept, and named, only if records the
backend did not take are spooled there for ``gradloc-track replay``); the joined run's link is
printed once instead. The clipper's skip guard goes on the optimizer: a non-finite step leaves
weights and optimizer state bitwise unchanged (``clip.skip_step``). The spike context is built
only when a spike fires.
"""
from __future__ import annotations

from typing import Any

import torch

from .batches import MicroBatchCapture
from .handle import Door, WatchHandle, open_handle
from .options import resolve_options

__all__ = ["watch", "WatchHandle"]


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, cfg: Any = None,
          **options: Any) -> WatchHandle:
    """Turn on norms, clipping, spike detection and localization for ``model``.

    ``options`` are the Hydra config's names: ``tracker`` ("mlflow", "wandb", "both", "none", a
    ``Tracker``; default: the run already open, ``wandb.run`` / ``mlflow.active_run()``), ``clip``
    ("adagc", "zclip", ..., ``{"kind": "adagc", "beta": 0.98}`` or a schema such as
    ``AdaGCConfig``), ``spikes``, ``locate``, ``monitor`` and the monitor's fields
    (``log_every=10``), or ``cfg=`` a Hydra node holding those groups; plus
    ``tokenizer`` (decoded culprit text), ``run_dir``, ``run_name``, ``console`` (False: no spike block on
    stderr; by default each detected spike prints it on rank 0, as the callbacks do), ``scaler`` (the loop's
    ``torch.amp.GradScaler``: a step it skips is seen with a non-fused optimizer too). Bad values raise the
    errors the Hydra app raises. With ``optimizer`` an optimizer step pre-hook runs everything; without it,
    call ``handle.step()`` after ``backward()``. ``handle.finish()`` takes every hook off again.
    """
    if not isinstance(model, torch.nn.Module):
        swapped = isinstance(optimizer, torch.nn.Module) and hasattr(model, "param_groups")
        raise TypeError(f"watch(model, optimizer): model is a {type(model).__name__}, not a torch.nn.Module; "
                        + ("the model comes first: watch(model, optimizer)" if swapped else
                           "pass the model being trained, e.g. watch(model, optimizer)"))
    opts = resolve_options(cfg, **options)
    return open_handle(model, optimizer, opts, Door(spike_console=True), capture=MicroBatchCapture(model))
