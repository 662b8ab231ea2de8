"""locate()'s inputs are checked before any probe: each bad argument, mask, loss or micro-batch list
names what to fix."""
from __future__ import annotations

import pytest
import torch

import gradloc_track
from gradloc_track.spikes import SpikeContext

from .helpers import LM, data, sum_loss
from .test_driver import setup
from .test_entry import B, T, batch, make_loss_fn, make_model


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": True}, r"budget=True must be a positive int"),
    ({"budget": 0}, r"budget=0 must be a positive int"),
    ({"budget": 2.5}, r"budget=2.5 must be a positive int"),
    ({"threshold": -1.0}, r"threshold=-1.0 must be a positive finite number"),
    ({"threshold": float("nan")}, r"threshold=nan must be a positive finite number"),
    ({"threshold": float("inf")}, r"threshold=inf must be a positive finite number"),
    ({"threshold": "0.5"}, r"threshold='0.5' must be a positive finite number"),
    ({"threshold": True}, r"threshold=True must be a positive finite number"),
    ({"method": "gradloc"}, r"method='gradloc' needs an explicit threshold"),
    ({"rng_state": [torch.get_rng_state()] * 3}, r"rng_state: pass one state, or one per micro-batch"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
    model = LM()
    x, y, w, _ = data()
    with pytest.raises(ValueError, match=match):
        gradloc_track.locate(model, [sum_loss(model, x, y, w)] * 2, [torch.ones(B, T)] * 2, **kwargs)


@pytest.mark.parametrize("state,says", [("hello", "got a str"), ([1, 2], "got a int"), (7, "got a int")])
def test_an_rng_state_of_the_wrong_type_says_what_a_state_is(state, says):
    """Tester round 12: ``rng_state="hello"`` read "one per micro-batch (1); got 5", the string's length."""
    model = LM()
    x, y, w, _ = data()
    with pytest.raises(TypeError, match=r"rng_state: .*save_rng\(\)'s dict or torch.get_rng_state\(\)'s tensor") as err:
        gradloc_track.locate(model, [sum_loss(model, x, y, w)] * 2, [torch.ones(B, T)] * 2, rng_state=state)
    assert says in str(err.value)


def test_a_loss_fn_returning_a_python_float_or_a_vector_says_what_to_return():
    model = LM()
    x, y, w, _ = data()
    loss_fn = sum_loss(model, x, y, w)
    with pytest.raises(TypeError, match=r"returned float; it must return a scalar torch.Tensor .*\.item\(\)"):
        gradloc_track.locate(model, lambda m: float(loss_fn(m)), torch.ones(B, T))
    with pytest.raises(TypeError, match=r"returned a tensor of shape \(4,\); it must return a scalar"):
        gradloc_track.locate(model, lambda m: loss_fn(m) * torch.ones(4), torch.ones(B, T))
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads)  # nothing left behind by the failed calls


def test_bad_inputs_say_what_to_fix():
    model = make_model("tiny_gpt")
    x, y, w = batch([])
    loss_fn = make_loss_fn(model, x, y, w)
    with pytest.raises(ValueError, match="does not depend on the mask"):
        gradloc_track.locate(model, lambda m: model(x).logsumexp(-1).mean(), torch.ones(B, T))
    with pytest.raises(ValueError, match="shape"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T + 3))
    with pytest.raises(ValueError, match="2-D"):
        gradloc_track.locate(model, loss_fn, torch.ones(B * T))
    with pytest.raises(ValueError, match="floating point"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T, dtype=torch.long))
    with pytest.raises(ValueError, match="no loss terms"):
        gradloc_track.locate(model, loss_fn, torch.zeros(B, T))
    with pytest.raises(ValueError, match="method"):
        gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="magic")
    frozen = make_model("tiny_gpt").requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        gradloc_track.locate(frozen, loss_fn, torch.ones(B, T))
    nan_w = w.clone()
    nan_w[0, 0] = float("nan")  # a NaN step is no bad input: the non-finite search names its term
    found = gradloc_track.locate(model, make_loss_fn(model, x, y, nan_w), torch.ones(B, T)).nonfinite
    assert found.samples == (0,) and found.terms == ((0, 0),)


def test_mismatched_micro_batch_inputs_say_what_to_fix():
    model, x, y, loss_of = setup()
    with pytest.raises(ValueError, match="one loss_fn per micro-batch"):
        gradloc_track.locate(model, [loss_of(slice(0, 2))], [torch.ones(2, T)] * 2)
    with pytest.raises(TypeError, match="list of K callables"):
        gradloc_track.locate(model, loss_of(slice(0, 2)), [torch.ones(2, T)] * 2)
    with pytest.raises(ValueError, match="sequence of 2"):
        SpikeContext(loss_fn=[loss_of(slice(0, 2))] * 2, token_mask=[torch.ones(2, T)] * 2, input_ids=y)
