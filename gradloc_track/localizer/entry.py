"""``locate()``: check the inputs, save what probes touch, search, restore."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..grouping import LayerGrouping
from ..norms import trainable_params
from .additivity import check_additive
from .driver import Search, find_culprits
from .inputs import as_document_ids, as_micro_batches, check_inputs, rng_states
from .probe import Prober
from .result import LocateResult
from .snapshot import Snapshot

LossFn = Callable[[torch.Tensor], torch.Tensor]


def locate(model: torch.nn.Module, loss_fn: LossFn | Sequence[LossFn],
           token_mask: torch.Tensor | Sequence[torch.Tensor], method: str = "auto", budget: int = 128,
           threshold: float | None = None, *, group_by: str = "block", rng_state=None,
           document_ids=None) -> LocateResult:
    """Explain the step's gradient: the samples, spans and loss terms that carry it.

    Culprit tokens are the terms whose own gradient is above ``threshold`` (per term; adaptive
    when None, from the ordinary terms); samples (rows, or the documents ``document_ids`` marks
    inside packed rows: a (B, T) integer id per position, K of them for K micro-batches), spans
    and micro-batches are named when they stand out and no few terms inside carry them
    (``result.culprits``, each with its ``level``; ``result.tokens`` the token rows).

    ``loss_fn(mask) -> scalar``: the loss restricted to the terms kept by ``mask`` (same shape as
    ``token_mask``) with a fixed normalizer. For K micro-batches pass K callables and K masks.
    Before any probe, three forward-only passes per micro-batch check that the loss is additive
    over the mask. ``budget`` caps the probes (forward+backward passes); with
    ``method="gradloc"`` it caps the token stage, as GradLoc's ``bisect_budget_steps`` does, and
    the micro-batch stage's one probe per micro-batch comes on top (``result.probes`` counts all).

    Every probe replays one RNG state so dropout masks agree across probes: ``rng_state`` (the
    state saved right before each micro-batch's training forward, one per micro-batch, replays
    that step's dropout exactly; one state for all is accepted), else the state at call time.
    The caller's RNG state is restored afterwards. When the model holds the step's gradient in
    ``.grad``, the probes' sum is checked against it (``result.step_check``; a warning and a
    note say why when they differ).

    Under ``torch.distributed`` (more than one rank) it is a collective: call it on every rank
    with that rank's own ``loss_fn``/``token_mask``; see ``localizer/distributed.py``.
    """
    from .distributed import is_distributed, locate_distributed

    if is_distributed():  # a collective: every rank calls it (see localizer/distributed.py)
        return locate_distributed(model, loss_fn, token_mask, method, budget, threshold, group_by=group_by,
                                  rng_state=rng_state)
    loss_fns, masks, labelled = as_micro_batches(loss_fn, token_mask)
    check_inputs(model, masks, method, budget, threshold)
    docs = as_document_ids(document_ids, masks)
    t0 = time.perf_counter()
    snap = Snapshot(model)
    try:
        named = trainable_params(model)
        grouping = LayerGrouping.build([n for n, _ in named], group_by)
        # gradloc: ``budget`` bounds the token stage as GradLoc's ``bisect_budget_steps`` does; its
        # micro-batch stage (one probe each) comes on top, as in the official code
        prober = Prober([p for _, p in named], loss_fns, masks, rng_states(rng_state, len(masks), snap.rng),
                        budget + (len(masks) if method == "gradloc" else 0), grouping)
        terms = [prober.terms(i) for i in range(prober.k)]
        if not any(terms):
            raise ValueError("token_mask selects no loss terms (all zeros): pass the batch's loss mask")
        for i in range(prober.k):
            if terms[i]:
                check_additive(prober, i, terms[i], prober.rng_states[i])
        result = find_culprits(prober, model, terms, Search(method, threshold, group_by, labelled, docs,
                                                            snap.grads_for(prober.params)))
        result.wall_time_s = time.perf_counter() - t0
        return result
    finally:
        snap.restore()
