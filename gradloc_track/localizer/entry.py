"""``locate()``: take the step (``step.LocateStep``), check it, save what probes touch, search, restore.

One process runs ``driver.find_culprits``; under ``torch.distributed`` the same step goes to the
collective localizer (``distributed.py``): both read every field of the one step object.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch

from ..grouping import LayerGrouping
from ..norms import trainable_params
from .additivity import check_additive
from . import nonfinite
from .driver import Search, find_culprits
from .eager import eager_models
from .inputs import SearchOptions, check_inputs
from .nonfinite import NonfiniteStep
from .probe import Prober
from .result import LocateResult
from .snapshot import Snapshot
from .step import LocateStep
from .step_check import Reference

LossFn = Callable[[torch.Tensor], torch.Tensor]


def locate(model: torch.nn.Module, loss_fn: LossFn | Sequence[LossFn] | LocateStep,
           token_mask: torch.Tensor | Sequence[torch.Tensor] | None = None, method: str = "auto", budget: int = 128,
           threshold: float | None = None, *, group_by: str = "block", reuse_forward: bool = False,
           cut: Any = None, **step_fields: Any) -> LocateResult:
    """Explain the step's gradient: the samples, spans and loss terms that carry it.

    The step is ``loss_fn`` and ``token_mask`` with the step's other fields by name, or one
    ``LocateStep`` (``gradloc_track.localizer.step``) holding them all:

    - ``loss_fn(mask) -> scalar``: the loss restricted to the terms kept by ``mask`` (same shape
      as ``token_mask``) with a fixed normalizer. For K micro-batches pass K callables and K masks.
    - ``rng_state=``: the state saved right before each micro-batch's training forward (one per
      micro-batch; one for all is accepted), replayed by every probe so dropout masks agree;
      else the state at call time. The caller's RNG state is restored afterwards.
    - ``document_ids=``: a (B, T) integer id per position (K of them for K micro-batches) for
      rows that pack several documents: samples are then the documents.
    - ``grad_scale=``: what the step did to ``.grad`` after backward (a clipper's per-tensor
      coefficients, in ``trainable_params(model)`` order), so the step check compares like with like.
    - ``sample_columns=``, ``normaliser=``: carried (see ``LocateStep``).

    ``reuse_forward=True``: one forward per micro-batch serves its later probes (each then a
    backward only, exact: ``kept_forward.py``), for more peak memory (the kept activations under each
    probe's backward: 3-5 gradient sizes on long rows of a small model); one
    process only (ignored under ``torch.distributed``). ``cut=``: a ``cut.CulpritCut`` that ``auto``
    fills with the culprits' summed gradient, for ``surgery.operate`` (one process only).

    Culprit tokens are the terms whose own gradient is above ``threshold`` (per term; adaptive
    when None, from the ordinary terms); samples (rows, or packed documents), spans and
    micro-batches are named when they stand out and no few terms inside carry them
    (``result.culprits``, each with its ``level``; ``result.tokens`` the token rows).

    Before any probe, three forward-only passes per micro-batch check that the loss is additive
    over the mask. ``budget`` caps the probes (forward+backward passes); with
    ``method="gradloc"`` it caps the token stage, as GradLoc's ``bisect_budget_steps`` does, and
    the micro-batch stage's one probe per micro-batch comes on top (``result.probes`` counts all).
    When the model holds the step's gradient in ``.grad``, the probes' sum is checked against it
    (``result.step_check``; a warning and a note say why when they differ).

    Under ``torch.distributed`` (more than one rank) it is a collective: call it on every rank
    with that rank's own step; see ``localizer/distributed.py``.
    """
    from ..norms import is_distributed
    from .distributed import locate_distributed

    step = LocateStep.of(loss_fn, token_mask, step_fields)
    options = SearchOptions(method, budget, threshold, group_by, reuse_forward)
    with eager_models():  # a compiled model's hooks run (localizer/eager.py)
        if is_distributed():  # a collective: every rank calls it (see localizer/distributed.py)
            return locate_distributed(model, step, options)
        return locate_one(model, step, options, cut)


def locate_one(model: torch.nn.Module, step: LocateStep, options: SearchOptions, cut: Any = None) -> LocateResult:
    """One process: every field of ``step`` checked, then ``driver.find_culprits``, restored."""
    loss_fns, masks, labelled = step.micro_batches()
    check_inputs(model, masks, options.method, options.budget, options.threshold)
    docs = step.documents(masks)
    normaliser = step.note()
    t0 = time.perf_counter()
    snap = Snapshot(model)
    prober = None
    try:
        named = trainable_params(model)
        scale = step.scale_for(len(named))
        grouping = LayerGrouping.build([n for n, _ in named], options.group_by)
        # gradloc: ``budget`` bounds the token stage as GradLoc's ``bisect_budget_steps`` does; its
        # micro-batch stage (one probe each) comes on top, as in the official code
        extra = len(masks) if options.method == "gradloc" else 0
        prober = Prober([p for _, p in named], loss_fns, masks, step.rng_states(len(masks), snap.rng),
                        options.budget + extra, grouping, options.reuse_forward)
        terms = [prober.terms(i) for i in range(prober.k)]
        if not any(terms):
            raise ValueError("token_mask selects no loss terms (all zeros): pass the batch's loss mask")
        for i in range(prober.k):
            if terms[i]:  # armed here, run by the micro-batch's first probes (additivity.py)
                check_additive(prober, i, terms[i], prober.rng_states[i])
        reference = Reference(snap.grads_for(prober.params), scale,  # .grad as the step left it
                              reduced=step.precision is not None)
        try:
            search = Search(options.method, options.threshold, options.group_by, labelled, docs, reference,
                            tuple(step.flagged), cut)
            result = find_culprits(prober, model, terms, search)
        except NonfiniteStep as step_nf:  # NaN/Inf: which samples, by isfinite instead of norms
            result = nonfinite.as_result(prober, step_nf, options.method, labelled, docs, grouping.names)
        else:
            bad_losses = [i for i, v in sorted(prober.full_losses.items()) if not math.isfinite(v)]
            nonfinite.attach_losses(result, prober, bad_losses, labelled, docs)
            nonfinite.attach_replay(result, reference.grads, grouping.names, step.precision)
        result.wall_time_s = time.perf_counter() - t0
        if normaliser:
            result.notes.append(normaliser)
        return result
    finally:
        if prober is not None:
            prober.forget()  # a kept forward's activations go before the step goes on
        snap.restore()
