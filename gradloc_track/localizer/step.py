"""``LocateStep``: one training step as every localizer takes it.

``locate()`` (one process), the distributed localizer (``distributed.py``) and spike surgery
(``surgery.py``) take the same object, so a field cannot exist on one path only: what the step
computed its loss from (one or K micro-batches), how to replay it (RNG states), where its samples
are (packed documents), and what happened to its gradient after backward (a clipper's
coefficients). ``LocateStep.from_context`` is the one place a ``SpikeContext`` (what the monitor
and the front doors capture) becomes a step; adapters that build their own step (verl's engine)
construct it directly.

Fields are checked when a localizer reads them (``inputs.py``), each error naming the field and
the fix; under ``torch.distributed`` every rank passes ITS OWN step (its own micro-batches and
masks), and the checks are collective.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from .inputs import as_document_ids, as_micro_batches, rng_states

LossFn = Callable[[torch.Tensor], torch.Tensor]
STEP_FIELDS = ("rng_state", "document_ids", "sample_columns", "normaliser", "grad_scale", "flagged", "precision")


@dataclass
class LocateStep:
    """One optimizer step's loss, as the localizer replays it.

    ``loss_fn(mask) -> scalar`` is the training loss restricted to the loss terms ``mask`` keeps
    (same shape as ``token_mask``; 1.0 = keep) with a FIXED normaliser counted once from the full
    mask, so the gradients of disjoint subsets add up to the step's. A step of K micro-batches
    (gradient accumulation) gives K of each: ``loss_fn`` a sequence of K callables, ``token_mask``
    K ``(B_k, T_k)`` tensors; the step's gradient is the sum of the K losses' gradients, and
    culprits then carry ``micro_batch`` (an index into these sequences).
    """

    loss_fn: LossFn | Sequence[LossFn]
    token_mask: torch.Tensor | Sequence[torch.Tensor]  # (B, T) loss-term weights, or K of them
    # the RNG state saved right before the training forward (``save_rng()``'s dict or a CPU
    # ``torch.get_rng_state()`` tensor): every probe replays it, so dropout masks are the step's.
    # With K micro-batches: K states, each saved right before ITS forward (one for all is accepted
    # but replays micro-batch k > 0 wrong). None: the state at call time.
    rng_state: Any = None
    # (B, T) integer id of the document each position belongs to, for rows that pack several
    # documents (K of them, or None entries, with micro-batches): samples are then the documents,
    # not the rows, and culprit rows carry ``document``. None: one sample per row.
    document_ids: torch.Tensor | Sequence[torch.Tensor | None] | None = None
    # per-sample facts about the batch, name -> (B,) tensor or list (K of them with micro-batches):
    # a dataset index, a source, an RL reward or group. Not read by the search; carried so every
    # consumer of the step (the artifacts, rank 0's gathered view, an adapter) sees the same ones.
    sample_columns: Mapping[str, Any] = field(default_factory=dict)
    # what ``loss_fn`` divides by (its fixed normaliser: a token count such as verl's
    # ``batch_num_tokens`` or HF's ``num_items_in_batch``), when the caller knows it: a number or
    # a 0-d tensor. Stated in the result's notes so norms can be read in per-token units.
    normaliser: Any = None
    # what the step did to ``.grad`` after backward and before the localizer runs: one number, or
    # one per trainable tensor in ``trainable_params(model)`` order, on any device (a clipper's
    # ``ClipResult.coef_t``: the monitor clips before it localizes). The step check then compares
    # ``grad_scale * (the probes' sum)`` with ``.grad``, so a clipped step is the step; spike
    # surgery subtracts the culprits' gradient times it. None: ``.grad`` is backward's own.
    grad_scale: torch.Tensor | float | None = None
    # units a data signal points at (``localizer.flagged.Flag``: leaked labels, a junk run; the monitor's
    # ``data_flags`` builds them from the signals that fired): named as culprits whatever their share
    flagged: Sequence[Any] = ()
    # the reduced precision the training forward ran in ("bfloat16 autocast"), when known: the probes replay in
    # the parameters' precision, so the step check allows that precision's rounding (not "does not reproduce")
    precision: str | None = None

    @classmethod
    def from_context(cls, ctx: Any, grad_scale: torch.Tensor | float | None = None,
                     flagged: Sequence[Any] = ()) -> "LocateStep":
        """The step a ``SpikeContext`` describes (its loss, masks, RNG, documents, sample columns,
        normaliser); ``grad_scale``: the clipper's coefficients of this step, when it already clipped;
        ``flagged``: the units the step's data signals point at."""
        return cls(loss_fn=ctx.loss_fn, token_mask=ctx.token_mask, rng_state=getattr(ctx, "rng_state", None),
                   document_ids=getattr(ctx, "document_ids", None),
                   sample_columns=dict(getattr(ctx, "sample_columns", None) or {}),
                   normaliser=getattr(ctx, "normaliser", None), grad_scale=grad_scale, flagged=tuple(flagged),
                   precision=getattr(ctx, "precision", None))

    @classmethod
    def of(cls, loss_fn: Any, token_mask: Any = None, fields: Mapping[str, Any] | None = None) -> "LocateStep":
        """``locate``'s arguments as a step: a ``LocateStep`` as it is, else ``loss_fn``,
        ``token_mask`` and the step's other fields by name (``rng_state=``, ``document_ids=``, ...)."""
        fields = dict(fields or {})
        unknown = sorted(set(fields) - set(STEP_FIELDS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}: the step's fields are {list(STEP_FIELDS)}")
        if isinstance(loss_fn, LocateStep):
            if token_mask is not None or fields:
                raise TypeError("pass either a LocateStep, or loss_fn and token_mask (with rng_state=, "
                                "document_ids=, ...), not both: set the fields on the LocateStep")
            return loss_fn
        if token_mask is None:
            raise TypeError("token_mask is missing: pass the (B, T) loss-term mask with loss_fn (K of them for K "
                            "micro-batches), or a LocateStep")
        return cls(loss_fn, token_mask, **fields)

    def micro_batches(self) -> tuple[list, list, bool]:
        """``(loss_fns, masks, given_as_sequences)``: one micro-batch as lists of one, K as given."""
        return as_micro_batches(self.loss_fn, self.token_mask)

    def rng_states(self, k: int, now: dict) -> list[dict]:
        """One RNG state per micro-batch (``now``, the state at call time, when none was saved)."""
        return rng_states(self.rng_state, k, now)

    def documents(self, masks: list) -> list[torch.Tensor | None] | None:
        """Per micro-batch document ids, checked against the masks (None: one sample per row)."""
        return as_document_ids(self.document_ids, masks)

    def scale_for(self, n: int) -> torch.Tensor | float | None:
        """``grad_scale`` checked against the ``n`` trainable tensors it scales: a number, or ``(n,)``."""
        s = self.grad_scale
        if s is None:
            return None
        if isinstance(s, torch.Tensor):
            if s.dim() == 0 or (s.dim() == 1 and s.numel() == n and s.is_floating_point()):
                return s.detach()
            got = f"a {s.dtype} tensor of shape {tuple(s.shape)}"
        elif isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s):
            return float(s)
        else:
            got = repr(s)
        raise ValueError(f"grad_scale: got {got}; pass one number, or a float tensor of {n} coefficients, one per "
                         "trainable tensor in trainable_params(model) order (a clipper's ClipResult.coef_t)")

    def note(self) -> str | None:
        """The normaliser, checked, as the result's note (None when unknown)."""
        value = self.normaliser
        if value is None:
            return None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()  # host sync: once per localization, on a spike
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ValueError(f"normaliser={self.normaliser!r} must be a positive finite number (what loss_fn divides "
                             "by, e.g. the step's loss-token count), or None when unknown")
        return f"loss_fn's fixed normaliser: {value:g} (norms are in loss_fn's units)"

    def but(self, **changes: Any) -> "LocateStep":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return replace(self, **changes)
