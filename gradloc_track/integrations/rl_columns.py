"""What the RL adapters (TRL's GRPO, verl's actor) share: the prompt/response layout of a sample,
per-token columns computed only when a spike is written, and the console line naming a completion.

An RL sample is shown as two parts, the prompt and the sampled response, each a block of its own
on the highlight page (``SpikeContext.segment_ids`` / ``segment_names``). ``prompt_response_segments``
builds that map from the two attention masks; ``LazyColumns`` holds the per-token columns that cost
a forward pass (log-probs, ratios, entropies), computed on first read; ``describer`` names a culprit
sample by its group, index in the group and reward; ``print_spike`` prints the console block.
"""
from __future__ import annotations

import sys
import warnings
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


def _at(value: Any, mb: int | None) -> Any:
    return value[mb] if mb is not None else value


def describer(ctx: Any, noun: str = "completion") -> Callable[[int | None, int, int], str | None]:
    """``describe(micro_batch, sample, position)`` for the console: an RL ``noun`` (its group,
    index and reward), a packed document, else None (the console's default)."""
    sc = getattr(ctx, "sample_columns", None) or {}
    docs = getattr(ctx, "document_ids", None)
    # columns hold K micro-batches only in a step's own context; a gathered view (torch.distributed)
    # is one flat batch whose culprits still name their micro-batch
    per_mb = isinstance(getattr(ctx, "token_mask", None), (list, tuple))

    def describe(mb: int | None, sample: int, position: int) -> str | None:
        at = mb if per_mb else None
        own = int(_at(sc["rank_sample"], at)[sample]) if "rank_sample" in sc else sample  # index in its rank
        where = (f"micro-batch {mb}, " if mb is not None else "") + f"sample {own}"
        if "rank" in sc:  # torch.distributed: the rank the sample lives on
            where = f"rank {int(_at(sc['rank'], at)[sample])}, " + where
        if "group" in sc and "index" in sc:
            g, i = _at(sc["group"], at)[sample], int(_at(sc["index"], at)[sample])
            reward = f", reward {float(_at(sc['reward'], at)[sample]):.4g}" if "reward" in sc else ""
            return f"{noun} {i} of group {g}{reward} ({where})"
        d = _at(docs, at)
        if d is not None:
            return f"document {int(d[sample, position])} ({where})"
        return None

    return describe


def print_spike(stats: Any, ctx: Any, run_dir: Any, stream: Any = None, noun: str = "completion") -> None:
    """One console block per localized spike: which completion / document, which tokens (``ctx``:
    the step's context, shown when there is no gathered view)."""
    if stats is None or not stats.events or stats.locate is None or ctx is None:
        return
    from ..console import TrainConsole

    result, shown = stats.locate_view or (stats.locate, ctx)
    try:
        TrainConsole(stream=stream or sys.stderr, rich=False).spike(
            stats.step, stats.events, result, shown.tokenizer, shown.input_ids, run_dir,
            describe=describer(shown, noun))
    except Exception as exc:  # printing never kills training
        warnings.warn(f"gradloc-track: could not print the spike block: {exc!r}")
