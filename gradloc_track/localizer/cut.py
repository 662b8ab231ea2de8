"""The culprits' gradient as the search already summed it, so spike surgery needs no probe of its own.

``auto`` confirms each culprit with its own probe and adds its gradient to ONE running sum (what is
explained: samples the levels reported, then tokens), which then becomes the remainder in place.
When surgery will follow (``spikes.response=surgery``), the caller passes a ``CulpritCut`` and the
search copies that sum, with the loss terms it covers, before it is spent. Surgery uses it only
when those terms are EXACTLY the result's culprit rows (``covers``): loss terms add up, so the sum
of their probes is the gradient of one probe of their mask (to float rounding); a row named later
(a micro-batch, a flagged unit, another sample), one dropped under the share floor, a span whose
sample was the explained unit, or a budget that ran out leaves it unused, and surgery probes.
"""
from __future__ import annotations

from typing import Sequence

import torch

Key = tuple[int, int, int]  # (micro_batch, b, t)


class CulpritCut:
    """A sink the search fills (``keep``): the summed gradient of ``keys``, in the probes' units."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] | None = None
        self.keys: frozenset[Key] = frozenset()

    def keep(self, grads: Sequence[torch.Tensor], keys: set[Key]) -> None:
        """A copy of the running sum (the search goes on to spend its buffer) and the terms it covers."""
        self.grads = [g.detach().clone() for g in grads]
        self.keys = frozenset(keys)

    def covers(self, masks: Sequence[torch.Tensor]) -> bool:
        """Are the kept terms exactly the nonzero entries of ``masks`` (the culprits' masks, one per
        micro-batch, ``LocateResult.culprit_masks``)?"""
        if self.grads is None:
            return False
        want: set[Key] = set()
        for i, m in enumerate(masks):
            idx = (m != 0).nonzero().tolist()  # host sync: once per operated spike
            want.update((i, b, t) for b, t in idx)
        return want == self.keys

    def release(self) -> None:
        self.grads, self.keys = None, frozenset()
