"""``integrations/rl_columns.py``: what the RL adapters (TRL's GRPO, verl's actor) share (the console's
naming of a completion or response: tests/console/test_culprits.py)."""
from __future__ import annotations

import torch

from gradloc_track.integrations.rl_columns import COMPLETION, PROMPT, LazyColumns, prompt_response_segments


def test_lazy_columns_compute_once_on_first_read():
    calls = []
    cols = LazyColumns(["a", "b"], lambda: calls.append(1) or {"a": 1, "b": 2})
    assert list(cols) == ["a", "b"] and len(cols) == 2 and not calls
    assert cols["a"] == 1 and cols["b"] == 2 and calls == [1]


def test_segments_mark_prompt_response_and_padding():
    seg = prompt_response_segments(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 0]]))
    assert seg.tolist() == [[-1, PROMPT, PROMPT, COMPLETION, COMPLETION, -1]]
