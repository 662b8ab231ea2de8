"""``integrations/calls``: a forward call read by the forward's own parameter names (checked against
the binding written out by hand), replayed the same way (a recording model shows the exact call),
and the logits found in whatever the forward returns, or a clear reason why not."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from gradloc_track.integrations.calls import (SET_LOSS_FN_HINT, arguments_by_name, call_model, find_key,
                                              forward_signature, logits_in, logits_of_call, unusable_output)


def sig(fn) -> inspect.Signature:
    return inspect.signature(fn)


def nanogpt_forward(idx, targets=None):
    pass


def hf_forward(input_ids=None, attention_mask=None, labels=None, **kwargs):
    pass


def odd_forward(a, /, b, *rest, flag=False, **extra):
    pass


@pytest.mark.parametrize("fn,args,kwargs,expected", [
    (nanogpt_forward, ("X", "Y"), {}, {"idx": "X", "targets": "Y"}),
    (nanogpt_forward, ("X",), {"targets": "Y"}, {"idx": "X", "targets": "Y"}),
    (hf_forward, (), {"input_ids": "X", "labels": "L"}, {"input_ids": "X", "labels": "L"}),  # keywords: as given
    (hf_forward, ("X",), {"num_items_in_batch": 4}, {"input_ids": "X", "num_items_in_batch": 4}),  # **kwargs opened
    (odd_forward, ("A", "B", "C", "D"), {"flag": True}, {0: "A", "b": "B", 2: "C", 3: "D", "flag": True}),
    (odd_forward, ("A", "B"), {"z": 1}, {0: "A", "b": "B", "z": 1}),
])
def test_arguments_are_keyed_by_the_forwards_names(fn, args, kwargs, expected):
    assert arguments_by_name(sig(fn), args, kwargs) == expected


def test_without_a_signature_or_a_call_it_takes_positions_keep_their_index():
    assert arguments_by_name(None, ("X", "Y"), {"m": 1}) == {0: "X", 1: "Y", "m": 1}
    assert arguments_by_name(sig(nanogpt_forward), ("X", "Y", "Z"), {}) == {0: "X", 1: "Y", 2: "Z"}  # too many
    assert arguments_by_name(sig(nanogpt_forward), ("X",), {"idx": "again"}) == {0: "X", "idx": "again"}


def test_find_key_is_the_first_name_whose_value_fits():
    named = {"x": 1, "tokens": "t", "idx": 2}
    assert find_key(named, ("input_ids", "idx", "x"), lambda v: isinstance(v, int)) == "idx"
    assert find_key(named, ("input_ids",), lambda v: v is not None) is None


class Wrapper(torch.nn.Module):
    """What ``torch.compile`` returns: the model under ``_orig_mod``, a ``forward(*args, **kwargs)``."""

    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


class Recorder(torch.nn.Module):
    def __init__(self, out=None):
        super().__init__()
        self.calls, self.out = [], out

    def forward(self, idx, targets=None, attention_mask=None, position_ids=None):
        self.calls.append((idx, targets, attention_mask, position_ids))
        return self.out if self.out is not None else torch.zeros(*idx.shape, 5)


def test_forward_signature_reads_through_a_compile_wrapper_and_gives_up_quietly():
    assert list(forward_signature(Wrapper(Recorder())).parameters) == ["idx", "targets", "attention_mask",
                                                                      "position_ids"]
    odd = torch.nn.Module()
    odd.forward = 5  # not callable: no signature
    assert forward_signature(odd) is None


def batch(**kw) -> SimpleNamespace:
    base = dict(style="kwargs", ids_name="idx", input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=None,
                position_ids=None, target_ids=None, targets_key=None)
    return SimpleNamespace(**{**base, **kw})


def test_call_model_replays_the_names_training_used():
    ids, tgt, mask, pos = (torch.full((2, 3), v, dtype=torch.long) for v in (1, 2, 3, 4))
    m = Recorder()
    call_model(m, batch(input_ids=ids))
    call_model(m, batch(input_ids=ids, target_ids=tgt, targets_key="targets", attention_mask=mask, position_ids=pos))
    call_model(m, batch(style="positional", input_ids=ids, target_ids=tgt, targets_key=1))
    got = [tuple(None if t is None else int(t[0, 0]) for t in call) for call in m.calls]
    assert got == [(1, None, None, None), (1, 2, 3, 4), (1, 2, None, None)]


def test_logits_are_found_in_each_kind_of_output():
    lg = torch.zeros(2, 3, 5)
    assert logits_in(SimpleNamespace(logits=lg)) is lg
    assert logits_in((lg, torch.tensor(1.0))) is lg
    assert logits_in((torch.tensor(1.0), lg)) is lg  # (loss, logits): the 3-D float tensor, wherever it is
    assert logits_in([torch.zeros(2, 3, dtype=torch.long)]).dtype == torch.long  # none fits: the first
    assert logits_in(()) is None and logits_in(lg) is lg


def test_an_output_without_logits_for_every_position_says_why():
    ids = torch.ones(2, 3, dtype=torch.long)
    assert unusable_output(torch.zeros(2, 3, 5), ids) is None
    assert "returned dict, not logits (B, T, V)" in unusable_output({"a": 1}, ids)
    assert "returned Tensor, not logits" in unusable_output(torch.zeros(2, 3), ids)
    assert "logits for 1 of the batch's 3 positions" in unusable_output(torch.zeros(2, 1, 5), ids)


def test_logits_of_call_gives_the_logits_or_names_set_loss_fn():
    lg = torch.randn(2, 3, 5)
    assert logits_of_call(Recorder(out=(lg, None)), batch()) is lg
    with pytest.raises(ValueError, match=r"logits for 1 of the batch's 3 positions") as info:
        logits_of_call(Recorder(out=torch.zeros(2, 1, 5)), batch())
    assert SET_LOSS_FN_HINT in str(info.value) and "handle.set_loss_fn" in SET_LOSS_FN_HINT
