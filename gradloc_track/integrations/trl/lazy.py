"""A mapping whose values are computed on first read: columns that cost a forward pass.

The RL table's log-probs, ratios and entropies need the policy's forward of the step's batch,
wanted only when a spike is written. The context carries this mapping every step; the artifact
writer reads it (on the training thread, before ``optimizer.step()``) only for a localized spike.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence


class LazyColumns(Mapping):
    """``keys`` known up front; ``compute()`` -> {key: value} runs once, at the first value read."""

    def __init__(self, keys: Sequence[str], compute: Callable[[], dict[str, Any]]) -> None:
        self._keys = list(keys)
        self._compute = compute
        self._values: dict[str, Any] | None = None

    def _all(self) -> dict[str, Any]:
        if self._values is None:
            self._values = self._compute()
            self._compute = None  # drop the batch and model references
        return self._values

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
