"""``LocateStep``: the one step object every localizer takes (issue 30, item 3).

``locate(model, step)`` is ``locate(model, loss_fn, mask, ...)``; a ``SpikeContext`` becomes a
step in one place; the fields are checked with the fix in the message; spike surgery takes the same
object and, on a step already clipped, cuts the culprits out in ``.grad``'s (clipped) units.
"""
from __future__ import annotations

import pytest
import torch

import gradloc_track
from gradloc_track.localizer import LocateStep, operate, remove_culprits
from gradloc_track.localizer.step import STEP_FIELDS
from gradloc_track.spikes.context import SpikeContext

from .oracles import grads_of, term_mask
from .test_levels import step_grad, weighted

B, T = 4, 32


def packed_case():
    """Row 1 packs three documents; document 1 is bad (each term below the threshold)."""
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[1, 10:22], docs[1, 22:] = 1, 2
    model, loss_fn = weighted(B, T, {(1, t): 25.0 for t in range(10, 22)})
    step_grad(model, loss_fn, (B, T))
    return model, loss_fn, docs


def rows(res):
    return [(c.level, c.micro_batch, c.batch, c.document, c.start, c.end, round(c.share, 6)) for c in res.culprits]


def test_a_step_object_is_the_same_call_as_its_arguments():
    model, loss_fn, docs = packed_case()
    state = torch.get_rng_state()
    plain = gradloc_track.locate(model, loss_fn, torch.ones(B, T), threshold=5.0, rng_state=state,
                                 document_ids=docs)
    step = LocateStep(loss_fn, torch.ones(B, T), rng_state=state, document_ids=docs)
    stepped = gradloc_track.locate(model, step, threshold=5.0)
    assert rows(stepped) == rows(plain) and stepped.probes == plain.probes
    assert [c.document for c in stepped.culprits if c.level == "sample"] == [1]  # the packed document, named


def test_a_spike_context_becomes_a_step_in_one_place():
    fn = lambda m: m.sum()  # noqa: E731
    mask, docs, rng = torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.get_rng_state()
    ctx = SpikeContext(loss_fn=fn, token_mask=mask, rng_state=rng, document_ids=docs,
                       sample_columns={"reward": torch.tensor([1.0, 2.0])}, normaliser=6)
    coef = torch.tensor([0.5, 1.0])
    step = LocateStep.from_context(ctx, grad_scale=coef)
    assert (step.loss_fn, step.token_mask, step.rng_state, step.document_ids) == (fn, mask, rng, docs)
    assert step.sample_columns["reward"] is ctx.sample_columns["reward"] and step.normaliser == 6
    assert step.grad_scale is coef
    # every field of the step is one a context can carry (the two paths cannot drift apart), but what the
    # monitor adds at the spike: the clipper's coefficients and the units its data signals flagged
    assert set(STEP_FIELDS) <= set(vars(step))
    assert all(f in vars(ctx) for f in STEP_FIELDS if f not in ("grad_scale", "flagged")) and step.flagged == ()


def test_arguments_that_do_not_make_a_step_say_so():
    model, loss_fn = weighted(2, 8, {})
    step = LocateStep(loss_fn, torch.ones(2, 8))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['rng'\].*rng_state"):
        gradloc_track.locate(model, loss_fn, torch.ones(2, 8), rng=None)
    with pytest.raises(TypeError, match="either a LocateStep, or loss_fn and token_mask"):
        gradloc_track.locate(model, step, torch.ones(2, 8))
    with pytest.raises(TypeError, match="token_mask is missing"):
        gradloc_track.locate(model, loss_fn)
    with pytest.raises(ValueError, match=r"grad_scale: got a torch.float32 tensor of shape \(3,\).*one per trainable"):
        gradloc_track.locate(model, step.but(grad_scale=torch.ones(3)))
    with pytest.raises(ValueError, match="normaliser='n' must be a positive finite number"):
        gradloc_track.locate(model, step.but(normaliser="n"))


def test_the_normaliser_is_said_in_the_notes():
    model, loss_fn = weighted(2, 8, {})
    step_grad(model, loss_fn, (2, 8))
    res = gradloc_track.locate(model, LocateStep(loss_fn, torch.ones(2, 8), normaliser=torch.tensor(16.0)))
    assert "loss_fn's fixed normaliser: 16 (norms are in loss_fn's units)" in res.notes


@pytest.mark.parametrize("per_tensor", [True, False], ids=["per-tensor", "one-number"])
def test_surgery_on_a_clipped_step_cuts_the_culprits_in_clipped_units(per_tensor):
    """``.grad = c * g`` (clipped before the localizer ran) becomes ``c * (g - g_culprits)``: what
    clipping the operated gradient with the same coefficients gives."""
    model, loss_fn, docs = packed_case()
    params = list(model.parameters())
    g = [p.grad.clone() for p in params]
    coef = torch.linspace(0.2, 0.9, len(params)) if per_tensor else torch.tensor(0.3)
    with torch.no_grad():
        for j, p in enumerate(params):
            p.grad.mul_(coef[j] if per_tensor else coef)
    step = LocateStep(loss_fn, torch.ones(B, T), document_ids=docs, grad_scale=coef)
    res = gradloc_track.locate(model, step, threshold=5.0)
    assert res.step_check.replayed and res.step_check.scale == pytest.approx(1.0, abs=1e-6)
    out = operate(model, step, res)
    assert out.applied
    (mask,) = res.culprit_masks(torch.ones(B, T), docs)
    g_c = grads_of(model, loss_fn(mask))
    for j, (p, full, cut) in enumerate(zip(params, g, g_c)):
        want = (full - cut) * (coef[j] if per_tensor else coef)
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)


def test_remove_culprits_takes_its_arguments_one_by_one_as_before():
    model, loss_fn, docs = packed_case()
    g = [p.grad.clone() for p in model.parameters()]
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), threshold=5.0, document_ids=docs)
    out = remove_culprits(model, loss_fn, torch.ones(B, T), res, document_ids=docs)
    cells = [(1, t) for t in range(10, 22)]
    g_c = grads_of(model, loss_fn(term_mask((B, T), cells)))
    assert out.applied and out.scale == 1.0
    for p, full, cut in zip(model.parameters(), g, g_c):
        torch.testing.assert_close(p.grad, full - cut, rtol=1e-5, atol=1e-7)
