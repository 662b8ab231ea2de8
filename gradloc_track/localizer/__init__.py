"""Localize a gradient spike to the loss terms (tokens) that caused it.

``locate(model, loss_fn, token_mask)`` runs exact forward+backward probes of the loss restricted
to subsets of loss terms (``loss_fn(mask)`` with a FIXED normalizer, so subset gradients add up):

- ``auto`` (default): a ghost ranking of every term, each candidate confirmed exactly, a
  remainder check, bisection only where the ranking missed: about ``m + 2`` probes for ``m``
  culprits;
- ``bisect``: our depth-first halving (2 probes per split), ~``2 m log2 N`` probes;
- ``ghost``: one backward with hooks ranks every term (no exact confirmation);
- ``gradloc``: GradLoc's own procedure, faithful to the official code (``gradloc.py``): its
  micro-batch stage, then 2-probe bisection pruned at ``threshold * sqrt(size)``; needs an
  explicit ``threshold`` (GradLoc's per-token knob) and spends no ghost pass.

A step of K micro-batches (gradient accumulation) is given as K loss functions and K masks: the
step's gradient is the sum of the micro-batches' gradients. Each micro-batch is probed once with
its full mask (the ghost pass for ``auto``/``bisect``/``ghost``); their sum is the step's total,
and tokens are searched only inside micro-batches that can hold a culprit. Culprits then carry
``micro_batch``.

It leaves no trace: gradients, module buffers, RNG state, train/eval modes and requires_grad
flags are restored.

Rooms: ``entry`` (``locate()``), ``inputs`` (argument checks shared with the distributed entry),
``additivity`` (the fixed-normaliser check), ``driver`` (one process's stages), ``search`` (our
bisection, ``auto``), ``gradloc`` (GradLoc's procedure), ``ghost`` (the one-backward ranking),
``probe`` (the only place probes run the model), ``snapshot`` (leave no trace), ``result``,
``memory``; under ``torch.distributed``: ``distributed``, ``dist_probe``, ``dist_context``.
"""
from __future__ import annotations

from .entry import locate
from .inputs import METHODS
from .result import CulpritToken, LocateResult

__all__ = ["locate", "LocateResult", "CulpritToken", "METHODS"]
