"""``integrations/rl_columns.py``: what the RL adapters (TRL's GRPO, verl's actor) share."""
from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from gradloc_track.integrations.rl_columns import (COMPLETION, PROMPT, LazyColumns, describer, print_spike,
                                                   prompt_response_segments)


def test_lazy_columns_compute_once_on_first_read():
    calls = []
    cols = LazyColumns(["a", "b"], lambda: calls.append(1) or {"a": 1, "b": 2})
    assert list(cols) == ["a", "b"] and len(cols) == 2 and not calls
    assert cols["a"] == 1 and cols["b"] == 2 and calls == [1]


def test_segments_mark_prompt_response_and_padding():
    seg = prompt_response_segments(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 0]]))
    assert seg.tolist() == [[-1, PROMPT, PROMPT, COMPLETION, COMPLETION, -1]]


def test_describer_indexes_a_steps_micro_batches():
    ctx = SimpleNamespace(sample_columns={"group": [["a"], ["b", "c"]], "index": [torch.tensor([0]),
                                                                               torch.tensor([0, 1])]},
                          document_ids=None, token_mask=[torch.ones(1, 4), torch.ones(2, 4)])
    assert describer(ctx)(1, 1, 0) == "completion 1 of group c (micro-batch 1, sample 1)"


def test_describer_names_the_completion_its_group_and_reward():
    ctx = SimpleNamespace(sample_columns={"group": ["g0", "g1"], "index": torch.tensor([0, 3]),
                                          "reward": torch.tensor([0.5, 40.0])}, document_ids=None)
    assert describer(ctx, "response")(None, 1, 4) == "response 3 of group g1, reward 40 (sample 1)"


def test_describer_in_a_gathered_view_names_the_rank_and_the_sample_there():
    ctx = SimpleNamespace(sample_columns={"rank": torch.tensor([1]), "rank_sample": torch.tensor([6])},
                          document_ids=None, token_mask=torch.ones(1, 8))
    assert describer(ctx)(2, 0, 3) is None  # no group: the console's default line...
    ctx.sample_columns.update(group=["u"], index=torch.tensor([2]))
    assert describer(ctx)(2, 0, 3) == "completion 2 of group u (rank 1, micro-batch 2, sample 6)"


def test_nothing_is_printed_without_a_localized_spike():
    out = io.StringIO()
    print_spike(SimpleNamespace(events=[1], locate=None, locate_view=None), object(), "run", out)
    print_spike(None, None, "run", out)
    assert out.getvalue() == ""
