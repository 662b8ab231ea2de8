"""The culprits' gradient as the search already summed it, so spike surgery needs no probe of its own.

``auto`` confirms each culprit with its own probe and adds its gradient to ONE running sum (what is
explained: samples the levels reported, then tokens), which then becomes the remainder in place.
When surgery will follow (``spikes.response=surgery``), the caller passes a ``CulpritCut`` and the
search copies that sum, with the loss terms it covers, before it is spent. Surgery uses it only
when those terms are EXACTLY the result's culprit rows (``covers``): loss terms add up, so the sum
of their probes is the gradient of one probe of their mask (to float rounding); a row named later
(a micro-batch, a flagged unit, another sample), one dropped under the share floor, a span whose
sample was the explained unit, or a budget that ran out leaves it unused, and surgery probes. The sum's
share of the step must also equal the culprit rows' summed shares (``SHARE_TOL``): a term the running
sum held twice would otherwise be removed twice. Holding the copy costs one gradient size more until
surgery, with ``spikes.response=surgery`` only.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

Key = tuple[int, int, int]  # (micro_batch, b, t)
SHARE_TOL = 1e-3  # |the sum's share - the culprit rows' shares| allowed (of the larger of 1 and their sum)


class CulpritCut:
    """A sink the search fills (``keep``): the summed gradient of ``keys``, in the probes' units."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None
        self.keys: frozenset[Key] = frozenset()
        self.share: float | None = None

    def keep(self, grads: Sequence[torch.Tensor], keys: set[Key], share: float | None) -> None:
        """A copy of the running sum (the search goes on to spend its buffer), the terms it covers and its
        share of the step (``Hits.share``)."""
        self.grads = [g.detach().clone() for g in grads]
        self.keys, self.share = frozenset(keys), share

    def covers(self, masks: Sequence[torch.Tensor], culprits: Sequence[Any] = ()) -> bool:
        """Are the kept terms exactly the nonzero entries of ``masks`` (the culprits' masks, one per
        micro-batch, ``LocateResult.culprit_masks``), their sum's share that of the ``culprits`` rows?"""
        if self.grads is None or not self._adds_up(culprits):
            return False
        want: set[Key] = set()
        for i, m in enumerate(masks):
            idx = (m != 0).nonzero().tolist()  # host sync: once per operated spike
            want.update((i, b, t) for b, t in idx)
        return want == self.keys

    def _adds_up(self, culprits: Sequence[Any]) -> bool:
        """The sum's share equals the culprit rows' summed exact shares (rows never overlap, shares add)."""
        shares = [c.raw_share if c.raw_share is not None else c.share for c in culprits]
        if self.share is None or not shares or any(s is None for s in shares):
            return False
        return abs(self.share - sum(shares)) <= SHARE_TOL * max(1.0, abs(sum(shares)))
