"""What the RL adapters (TRL's GRPO, verl's actor) share: the prompt/response layout of a sample
and per-token columns computed only when a spike is written (the console names the completion or
response from the context's ``sample_columns``: ``gradloc_track.console``).

An RL sample is shown as two parts, the prompt and the sampled response, each a block of its own
on the highlight page (``SpikeContext.segment_ids`` / ``segment_names``). ``prompt_response_segments``
builds that map from the two attention masks; ``LazyColumns`` holds the per-token columns that cost
a forward pass (log-probs, ratios, entropies), computed on first read.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch

PROMPT, COMPLETION = 0, 1  # segment ids of the display map


def prompt_response_segments(prompt_real: torch.Tensor, response_real: torch.Tensor) -> torch.Tensor:
    """(B, P+R) long: PROMPT over the prompt, COMPLETION over the response, -1 where a position
    shows padding (``*_real``: (B, P) and (B, R), non-zero where the shown token is real)."""
    seg = torch.cat([torch.full_like(prompt_real, PROMPT, dtype=torch.long),
                     torch.full_like(response_real, COMPLETION, dtype=torch.long)], 1)
    real = torch.cat([prompt_real, response_real], 1)
    return seg.masked_fill(real == 0, -1)


class LazyColumns(Mapping):
    """``keys`` known up front; ``compute()`` -> {key: value} runs once, at the first value read.

    The context carries this mapping every step; the artifact writer reads it (on the training
    thread, before ``optimizer.step()``) only for a localized spike."""

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
