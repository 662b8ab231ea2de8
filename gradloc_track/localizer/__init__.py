"""Localize a gradient spike to what caused it: loss terms (tokens), a span, a sample (or a
document of a packed row), a micro-batch — the finest level that carries it (``levels.py``).

``locate(model, loss_fn, token_mask)`` (or ``locate(model, step)`` with a ``LocateStep``, the one
step object every localizer takes: loss function(s), masks, RNG states, document ids, sample
columns, normaliser, ``grad_scale``) runs exact forward+backward probes of the loss restricted
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

Samples that stand out of the others (their exact norms come free with the ghost pass) and are
not carried by a few tokens are confirmed and reported whole, or as a span; the token threshold is
a statistic of the ordinary terms (``threshold.py``); the probes' sum is checked against the
step's ``.grad`` (``step_check.py``). It leaves no trace: gradients, module buffers, RNG state,
train/eval modes and requires_grad flags are restored. ``remove_culprits`` (``surgery``) then takes
the culprits' exact gradient out of the step's (``spikes.response=surgery``).

Rooms: ``step`` (``LocateStep``, what every localizer takes), ``entry`` (``locate()``), ``inputs``
(argument checks shared with the distributed entry),
``additivity`` (the fixed-normaliser check), ``driver`` (one process's stages), ``levels``
(samples, spans, micro-batches), ``threshold`` (outliers of the ordinary values), ``search`` (our
bisection, ``auto``), ``gradloc`` (GradLoc's procedure), ``ghost`` (the one-backward ranking),
``segments`` (exact per-sample norms from it), ``probe`` (the only place probes run the model),
``step_check`` (the probes against the step), ``snapshot`` (leave no trace), ``result``,
``surgery`` (remove the culprits' gradient);
under ``torch.distributed``: ``distributed`` (the same levels, by the same rules, over every
rank's terms), ``dist_terms`` (every rank's terms, samples and micro-batch pieces numbered
globally), ``dist_probe``, ``dist_failure`` (one rank's failure stops every rank together:
``LocateAborted``), ``dist_context``.
"""
from __future__ import annotations

from .dist_failure import LocateAborted
from .entry import locate
from .inputs import METHODS
from .probe import save_rng
from .result import LEVELS, Culprit, CulpritToken, LocateResult, StepCheck
from .step import LocateStep
from .surgery import SurgeryResult, operate, remove_culprits

__all__ = ["locate", "LocateStep", "LocateAborted", "LocateResult", "CulpritToken", "Culprit", "StepCheck", "LEVELS",
           "METHODS", "save_rng", "remove_culprits", "operate", "SurgeryResult"]
