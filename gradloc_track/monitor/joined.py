"""Which tensors started training at this step: an unfreeze or an added param group, told to the cause.

Unfreezing layers mid-run (``requires_grad_(True)``, ``add_param_group``) changes what trains: their
gradients join the norms and Adam's first steps on them move each element by about the learning rate.
The detector fires on that (held-out tester, stop 55: the update signal fired at the unfreeze and twice
after it), and named on the step's own evidence it read ``optimizer`` ("a second moment decayed") and
opened a new incident at every firing step. A change the user made on purpose is the schedule's.

``JoinedTensors`` follows the optimizer's param groups step by step (their identities and sizes: O(groups)
a step, the tensors listed only when they change) and is told the names the monitored set adopted at a
rescan (a ``requires_grad`` flip, a parameter registered). ``names(step)`` is what joined at that step and
has a gradient now. A tensor routed to for the first time (a mixture-of-experts expert) is neither: it is
in its group from the start and always required grad.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..optim_unwrap import unwrap_optimizer


class JoinedTensors:
    """The tensors that joined training at a step (module doc)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self._key = self._groups_key()
        self._in_groups: set[int] = self._group_ids()
        self._added: tuple[int, set[int]] | None = None  # (step, ids) the groups gained at that step
        self._adopted: tuple[int, tuple[str, ...]] | None = None  # (step, names) the monitored set took in

    def _groups(self) -> list[dict]:
        return list(getattr(self.optimizer, "param_groups", None) or [])

    def _groups_key(self) -> tuple:
        return tuple((id(g), len(g.get("params", ()))) for g in self._groups())

    def _group_ids(self) -> set[int]:
        return {id(p) for g in self._groups() for p in g.get("params", ())}

    def advance(self, step: int) -> None:
        """This step's param groups, against the last step's (one tuple of the groups' sizes a step)."""
        key = self._groups_key()
        if key == self._key:
            return
        ids = self._group_ids()
        self._key, self._added = key, (step, ids - self._in_groups)
        self._in_groups = ids

    def adopted(self, step: int, names: Sequence[str]) -> None:
        """The monitored set took these parameters in at ``step`` (``ParamSet.rescan``)."""
        if names:
            self._adopted = (step, tuple(names))

    def names(self, step: int, named: Sequence[tuple[str, torch.nn.Parameter]]) -> tuple[str, ...]:
        """The monitored tensors (``named``: (name, parameter) pairs) that joined training at ``step`` and
        have a gradient now, in ``named``'s order. Host only, read on a detected step."""
        added = self._added[1] if self._added is not None and self._added[0] == step else set()
        adopted = set(self._adopted[1]) if self._adopted is not None and self._adopted[0] == step else set()
        if not (added or adopted):
            return ()
        return tuple(n for n, p in named if (id(p) in added or n in adopted) and p.grad is not None)
