"""What ``locate`` accepts, checked once for the single-process and the distributed entry points.

A step (``step.LocateStep``) is one ``loss_fn`` and one ``(B, T)`` mask, or K of each (gradient
accumulation), with its RNG states and document ids; ``SearchOptions`` says how to search. The
checks raise ``TypeError``/``ValueError`` naming the argument and the fix; the distributed entry
point turns them into one message per rank and raises the same error on every rank.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..norms import trainable_params

METHODS = ("auto", "ghost", "bisect", "gradloc")


@dataclass(frozen=True)
class SearchOptions:
    """How to search, as ``locate`` takes it (``method``, ``budget``, ``threshold``, ``group_by``):
    one value handed from the entry points to the searches, next to the step (``step.LocateStep``)."""

    method: str = "auto"
    budget: int = 128
    threshold: float | None = None
    group_by: str = "block"
    reuse_forward: bool = False  # later probes of a micro-batch replay its kept forward (``kept_forward.py``)


def as_micro_batches(loss_fn: Any, token_mask: Any) -> tuple[list, list, bool]:
    """``(loss_fns, masks, given_as_sequences)``: one micro-batch as lists of one, K as given."""
    if callable(loss_fn) and isinstance(token_mask, torch.Tensor):
        return [loss_fn], [token_mask], False
    if callable(loss_fn) or isinstance(token_mask, torch.Tensor) or not isinstance(loss_fn, Sequence) \
            or not isinstance(token_mask, Sequence):
        raise TypeError("pass loss_fn as a callable and token_mask as a 2-D tensor, or, for a step of K "
                        "micro-batches, loss_fn as a list of K callables and token_mask as a list of K 2-D "
                        f"tensors; got {type(loss_fn).__name__} and {type(token_mask).__name__}")
    if len(loss_fn) != len(token_mask) or not loss_fn:
        raise ValueError(f"one loss_fn per micro-batch mask: got {len(loss_fn)} loss_fns and {len(token_mask)} "
                         "token masks (pass lists of equal, non-zero length)")
    for i, f in enumerate(loss_fn):
        if not callable(f):
            raise TypeError(f"loss_fn[{i}] must be callable: loss_fn[{i}](mask) -> scalar loss over the kept terms")
    return list(loss_fn), list(token_mask), True


def check_inputs(model: torch.nn.Module, masks: list, method: str, budget: Any, threshold: Any) -> None:
    """Method, budget, threshold, masks and the model, each with the fix in the message."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: use one of {METHODS}")
    if method == "gradloc" and threshold is None:
        raise ValueError("method='gradloc' needs an explicit threshold: GradLoc's per-token knob T, as a per-term "
                         "gradient norm in your loss_fn's units (from the official T with verl's token-mean loss: "
                         "threshold = T * micro_batches / n_norm, n_norm being loss_fn's fixed normalizer); or use "
                         "method='auto' for an adaptive threshold")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
        raise ValueError(f"budget={budget!r} must be a positive int number of probes (e.g. budget=128)")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or not 0 < threshold < math.inf):
        raise ValueError(f"threshold={threshold!r} must be a positive finite number (the per-term gradient "
                         "norm above which a term is a culprit), or None for an adaptive threshold")
    for i, m in enumerate(masks):
        name = "token_mask" if len(masks) == 1 else f"token_mask[{i}]"
        if not isinstance(m, torch.Tensor) or m.dim() != 2:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{name} must be a 2-D (batch, position) tensor of loss-term weights; got {shape}")
        if not m.is_floating_point():
            raise ValueError(f"{name} must be floating point (1.0 = keep); got {m.dtype}: pass {name}.float()")
    if not trainable_params(model):
        raise ValueError("the model has no parameters with requires_grad=True: nothing to localize")


def rng_states(rng_state: Any, k: int, now: dict) -> list[dict]:
    """One RNG state per micro-batch: ``None`` (the state now), one state for all, or one each.

    A state is ``save_rng()``'s dict or a bare CPU ``torch.get_rng_state()`` tensor."""
    if rng_state is None:
        return [now] * k
    if isinstance(rng_state, torch.Tensor):
        return [{"cpu": rng_state}] * k
    if isinstance(rng_state, dict):
        return [rng_state] * k
    if not isinstance(rng_state, (list, tuple)):
        raise TypeError(f"rng_state: a state is gradloc_track.localizer.probe.save_rng()'s dict or "
                        f"torch.get_rng_state()'s tensor (or a list of them, one per micro-batch); got a "
                        f"{type(rng_state).__name__}")
    states = list(rng_state)
    if len(states) != k:
        raise ValueError(f"rng_state: pass one state, or one per micro-batch ({k}); got {len(states)}")
    bad = next((s for s in states if not isinstance(s, (dict, torch.Tensor))), None)
    if bad is not None:
        raise TypeError(f"rng_state: each micro-batch's state is save_rng()'s dict or torch.get_rng_state()'s "
                        f"tensor; got a {type(bad).__name__}")
    return [{"cpu": s} if isinstance(s, torch.Tensor) else s for s in states]


def as_document_ids(document_ids: Any, masks: list) -> list[torch.Tensor | None] | None:
    """Per micro-batch ``(B, T)`` integer ids of the documents packed in each row, or None.

    One tensor for one micro-batch, K (or None entries) for K; each must have its mask's shape."""
    if document_ids is None:
        return None
    given = [document_ids] if isinstance(document_ids, torch.Tensor) else list(document_ids)
    if len(given) != len(masks):
        raise ValueError(f"document_ids: pass one (B, T) tensor per micro-batch ({len(masks)}); got {len(given)}")
    for i, (d, m) in enumerate(zip(given, masks)):
        name = "document_ids" if len(masks) == 1 else f"document_ids[{i}]"
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or d.shape != m.shape or d.is_floating_point():
            got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
            raise ValueError(f"{name} must be an integer tensor of the token mask's shape {tuple(m.shape)} "
                             f"(the id of the document each position belongs to); got {got}")
    return given
