"""What the monitor feeds the spike detector beyond the norms: the update Adam is about to make (checked
against a plain per-tensor loop of Adam's equations), the losses, the weight norm, all in the step's
one transfer."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.monitor.detector_inputs import DetectorInputs, sample_max
from gradloc_track.spikes import SpikeContext, SpikeDetector

from .helpers import backward
from .test_packing import spy  # noqa: F401  (the sync-spy fixture)


def reference_update(opt, scale: float = 1.0) -> float:
    """Adam's next step at tensor granularity, written out: lr^2 ||m_hat'||^2 / (sqrt(mean(v_hat')) + eps)^2
    summed (Adam's step where a tensor's v is uniform), with the gradient times ``scale`` (a clip the
    optimizer's step applies); AMSGrad's max and maximize's sign as torch's Adam takes them."""
    total = 0.0
    for g in opt.param_groups:
        b1, b2 = g["betas"]
        for p in g["params"]:
            st = opt.state.get(p)
            if not st or p.grad is None:
                continue
            t = float(st["step"]) + 1
            grad = p.grad * scale * (-1 if g.get("maximize") else 1)  # torch's Adam: maximize steps along -g
            m = (b1 * st["exp_avg"] + (1 - b1) * grad).double() / (1 - b1 ** t)
            v = b2 * st["exp_avg_sq"] + (1 - b2) * grad ** 2
            if g.get("amsgrad"):  # the denominator is the running max, max_exp_avg_sq updated with this v
                v = torch.maximum(st["max_exp_avg_sq"], v)
            v = v.double() / (1 - b2 ** t)
            total += g["lr"] ** 2 * float(m.pow(2).sum()) / (math.sqrt(float(v.mean())) + g["eps"]) ** 2
    return math.sqrt(total)


@pytest.mark.parametrize("fused", [False, True])
def test_update_is_adams_next_step(tiny_gpt, fused):
    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW([{"params": params[:4], "lr": 1e-3},
                             {"params": params[4:], "lr": 3e-3, "betas": (0.8, 0.99)}], fused=fused)
    inputs = DetectorInputs(SpikeDetector(), opt, params)
    for step in range(4):
        backward(tiny_gpt, seed=step)
        grad_sq = torch.stack([p.grad.pow(2).sum() for p in params])
        u = inputs.update_norm(params, grad_sq)
        if step == 0:
            assert u is None  # no second moment yet
        else:
            assert float(u) == pytest.approx(reference_update(opt), rel=1e-5)
        opt.step()


def test_update_follows_the_learning_rate_and_skips_other_optimizers(tiny_gpt):
    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    backward(tiny_gpt)
    opt.step()
    backward(tiny_gpt, seed=1)
    grad_sq = torch.stack([p.grad.pow(2).sum() for p in params])
    inputs = DetectorInputs(SpikeDetector(), opt, params)
    u1 = float(inputs.update_norm(params, grad_sq))
    opt.param_groups[0]["lr"] = 1e-2
    assert float(inputs.update_norm(params, grad_sq)) == pytest.approx(10 * u1, rel=1e-6)
    sgd = torch.optim.SGD(params, lr=0.1)
    assert DetectorInputs(SpikeDetector(), sgd, params).adam is None
    assert DetectorInputs(SpikeDetector(update_signal=False), opt, params).adam is None


def test_sample_max_reads_every_form():
    dev = torch.device("cpu")
    assert float(sample_max(torch.tensor([1.0, 3.0, 2.0]), dev)) == 3.0
    assert float(sample_max([1.0, 4.0], dev)) == 4.0
    assert float(sample_max([torch.tensor([1.0]), torch.tensor([5.0, 2.0])], dev)) == 5.0  # micro-batches
    assert math.isnan(float(sample_max(torch.tensor([1.0, math.nan]), dev)))
    assert sample_max(None, dev) is None


class Recorder(SpikeDetector):
    """The library's detector, keeping what the monitor fed it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed = []

    def update(self, step, global_norm, layer_norms=None, n_tokens=None, n_micro_batches=1, **signals):
        self.fed.append(signals)
        return super().update(step, global_norm, layer_norms, n_tokens, n_micro_batches, **signals)


def test_the_detector_gets_every_input_in_the_one_transfer(tiny_gpt, spy):  # noqa: F811
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    det = Recorder(warmup_steps=2)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=100, optimizer=opt, detector=det)
    ctx = SpikeContext(lambda m: tiny_gpt.wte.weight.sum() * m.sum(), torch.ones(2, 16))
    w = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in tiny_gpt.parameters()))
    for step in range(1, 5):
        backward(tiny_gpt, seed=step)
        spy.calls.clear()
        with spy:
            mon.after_backward(step, spike_context=ctx, loss=torch.tensor(2.5), sample_losses=torch.tensor([2.0, 3.0]))
        assert spy.calls == ["tolist"]  # loss, largest sample loss, update and weight norm ride along
        opt.step()
    first, last = det.fed[0], det.fed[-1]
    assert first["loss"] == 2.5 and first["sample_losses"] == [3.0] and "update" not in first  # no Adam state yet
    assert first["weight_norm"] == pytest.approx(w, rel=1e-5)  # measured once, on the first armed step
    assert "update" in det.fed[1] and "update" not in det.fed[2]  # step 2 measured before its step (moments read)
    assert last["update"] > 0 and last["weight_norm"] == first["weight_norm"]  # step 3's, measured after it


def test_a_detector_without_the_new_inputs_is_fed_as_before(tiny_gpt):
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    det = Recorder(warmup_steps=2, mode="fixed", per_token_threshold=100.0)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), optimizer=opt, detector=det)
    backward(tiny_gpt)
    mon.after_backward(0, spike_context=SpikeContext(lambda m: m.sum(), torch.ones(2, 16)), loss=1.0)
    assert det.fed == [{}]  # GradLoc's fixed trigger reads the norm and the token count only


NOW, LAST = "now", "last"  # the update of this step (measured before it) / of the step before (after it)


def _fed_against_reference(model, opt, clipper=None, steps=24, between=None, reference=reference_update):
    """Train ``steps`` steps through a monitor. Per step from the second: (the update the detector was fed,
    or None; Adam's next step written out from the state and the gradient this step uses; the same for the
    step before, as it was then; the age of the ``sum v`` this step's optimizer step left, steps since read)."""
    det = Recorder(warmup_steps=1000)
    mon = GradMonitor(model, tracker=MemoryTracker(), log_every=10 ** 6, optimizer=opt, detector=det,
                      clipper=clipper)
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(2, 16))
    out, last = [], None
    for step in range(steps):
        backward(model, seed=step)
        mon.after_backward(step, spike_context=ctx)
        ref = None
        if step:
            ref = reference(opt)
            out.append([det.fed[-1].get("update"), ref, last, None])
        opt.step()
        if step:
            moments = mon.detector_inputs.adam._moments
            out[-1][3] = moments.age if moments else None
        last = ref
        if between is not None:
            between(step, opt)
    return [tuple(r) for r in out]


def when(rows) -> list:
    """Each row's fed update, checked against Adam's written out: NOW (this step's, measured before its
    optimizer step), LAST (the step before's, measured after it), or None (not fed). A fed value that is
    neither fails."""
    out = []
    for fed, ref, last, _ in rows:
        if fed is None:
            out.append(None)
        elif fed == pytest.approx(ref, rel=1e-4):
            out.append(NOW)
        else:
            assert last is not None and fed == pytest.approx(last, rel=1e-4), (fed, ref, last)
            out.append(LAST)
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_the_update_is_adams_step_measured_after_it_and_v_is_read_every_resync(tiny_gpt, fused):
    """Issue 38: on an ordinary step the detector reads the update of the step before, measured after that
    optimizer step from its state (no gradient read), equal to Adam's step written out before it; the first
    step with moments is measured before it (nothing carried yet), the next has nothing new to read."""
    from gradloc_track.monitor.adam_update import RESYNC

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, fused=fused)
    rows = _fed_against_reference(tiny_gpt, opt, steps=2 * RESYNC + 4)
    assert when(rows) == [NOW, None] + [LAST] * (len(rows) - 2)
    ages = [age for *_, age in rows]
    assert ages[:RESYNC + 2] == list(range(1, RESYNC)) + [0, 1, 2]  # sum(v) read every RESYNC steps


@pytest.mark.parametrize("fused", [False, True])
def test_amsgrad_and_maximize_are_the_step_adam_takes(tiny_gpt, fused):
    """AMSGrad divides by the running max of v (a decayed v moves nothing there), maximize steps along -g;
    one group of each beside a plain one, carried across a fresh read, and clipped in place."""
    from gradloc_track.clip.simple import GlobalClip
    from gradloc_track.monitor.adam_update import RESYNC

    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW([{"params": params[:3], "amsgrad": True}, {"params": params[3:6], "maximize": True},
                             {"params": params[6:], "amsgrad": True, "maximize": True, "betas": (0.8, 0.9)}],
                            lr=1e-3, fused=fused)
    seen = []

    def decay(step, o):  # every 5th step, one AMSGrad tensor's v decays far below its running max
        if step % 5 == 4:
            o.state[params[0]]["exp_avg_sq"].mul_(1e-3)
            seen.append(step)

    def scale() -> float:  # fused: the clip rides on the step's grad_scale, .grad stays raw
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        return min(1.0, 0.05 / (norm + 1e-6)) if fused else 1.0

    rows = _fed_against_reference(tiny_gpt, opt, clipper=GlobalClip(tiny_gpt, max_norm=0.05), steps=RESYNC + 8,
                                  between=decay, reference=lambda o: reference_update(o, scale()))
    kinds = when(rows)  # every fed value is Adam's step, this one's or the last one's
    edited = [s + 1 for s in seen]  # the step after an edit is measured before it (the state changed)
    assert seen and all(kinds[s - 1] == NOW and kinds[s] is None for s in edited)
    assert kinds.count(LAST) >= len(rows) - 3 * len(seen) - 2  # the others after their step
    assert any(age and age > 1 for *_, age in rows)  # carried between the edits' fresh reads


def test_carried_moments_follow_a_clip_applied_in_place_and_a_fused_grad_scale(tiny_gpt):
    from gradloc_track.clip.simple import GlobalClip

    state = {k: v.clone() for k, v in tiny_gpt.state_dict().items()}
    for fused in (False, True):  # in place: .grad holds the clip; fused: the step's grad_scale applies it
        tiny_gpt.load_state_dict(state)
        opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, fused=fused)
        clip = GlobalClip(tiny_gpt, max_norm=1e-3)  # clips every step

        def scale() -> float:  # what the fused step's grad_scale does to the raw .grad
            norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in tiny_gpt.parameters()))
            return min(1.0, 1e-3 / (norm + 1e-6)) if fused else 1.0

        rows = _fed_against_reference(tiny_gpt, opt, clipper=clip, steps=12,
                                      reference=lambda o: reference_update(o, scale()))
        assert when(rows) == [NOW, None] + [LAST] * (len(rows) - 2)
        assert [age for *_, age in rows] == list(range(1, len(rows) + 1))  # the clip is known: sum(v) carried


def test_state_changed_outside_the_step_is_read_afresh(tiny_gpt):
    def edit(step, opt):
        if step == 6:  # a decayed second moment put in by hand, or a loaded checkpoint
            for st in opt.state.values():
                st["exp_avg_sq"].mul_(0.01)
        if step == 9:  # a step the monitor did not see
            backward(tiny_gpt, seed=99)
            opt.step()

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    rows = _fed_against_reference(tiny_gpt, opt, steps=14, between=edit)
    # the steps after the edit (7) and after the step the monitor did not see (10) are measured before
    # their optimizer step, reading the state afresh; the next ones have nothing new, then after again
    assert when(rows) == [NOW, None] + [LAST] * 4 + [NOW, None, LAST, NOW, None, LAST, LAST]
    assert [age for *_, age in rows][5:10] == [6, 1, 2, 3, 1]  # fresh reads after the edit and the extra step


def test_a_tensor_whose_state_was_reset_takes_adams_first_step(tiny_gpt):
    """A layer unfrozen, re-initialised or its state dropped: Adam's first step on it moves every element
    with a gradient by lr (m_hat = g, v_hat = g^2). The signal counts it, and the tensor's own step counter
    (not its group's) gives its bias corrections on the steps after."""
    head = tiny_gpt.lm_head.weight
    lr = 1e-3

    def reset(step, opt):
        if step == 5:
            del opt.state[head]

    firsts = []

    def reference(opt) -> float:
        stateful = reference_update(opt) ** 2
        if head in opt.state:
            return math.sqrt(stateful)
        first = float((lr * head.grad / (head.grad.abs() + 1e-8)).double().pow(2).sum())  # Adam's first step
        firsts.append(first / (stateful + first))
        return math.sqrt(stateful + first)

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=lr, weight_decay=0.0)
    rows = _fed_against_reference(tiny_gpt, opt, steps=12, between=reset, reference=reference)
    # step 6 takes the reset tensor's first step, step 7 its state's second: both measured before them
    assert when(rows) == [NOW, None] + [LAST] * 3 + [NOW, NOW, None] + [LAST] * 3
    assert len(firsts) == 1 and firsts[0] > 0.1  # the reset tensor's first step: a visible part of the update


def test_a_lost_optimizer_state_is_adams_first_step_on_every_tensor(tiny_gpt):
    """A resume that loads the weights but not the optimizer: every tensor takes Adam's first step. Training's
    own first step reports nothing (nothing to compare it with)."""
    lr = 1e-3

    def lose(step, opt):
        if step == 4:
            opt.state.clear()

    def reference(opt) -> float:
        if opt.state:
            return reference_update(opt)
        return math.sqrt(sum(float((lr * p.grad / (p.grad.abs() + 1e-8)).double().pow(2).sum())
                             for p in tiny_gpt.parameters()))

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=lr, weight_decay=0.0)
    rows = _fed_against_reference(tiny_gpt, opt, steps=8, between=lose, reference=reference)
    assert when(rows) == [NOW, None, LAST, LAST, NOW, NOW, None]  # the lost state's step: measured before it
    assert rows[4][0] > 1.2 * rows[4][2]  # every element moves by lr (early steps are near that already)


def test_each_groups_eps_is_adams(tiny_gpt):
    """eps=1e-5 (PPO's default) or 1e-6: where gradients are near eps, Adam's step is far below lr; the signal
    divides by sqrt(mean v_hat) + the group's eps, as the step does."""
    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW([{"params": params[:4], "eps": 1e-5}, {"params": params[4:], "eps": 1e-6}], lr=1e-3)
    rows = _fed_against_reference(tiny_gpt, opt, steps=6)
    assert when(rows) == [NOW, None, LAST, LAST, LAST]
    # gradients far below eps from the first step: Adam's step is lr * m_hat / eps, far below lr
    for p in params:
        p.grad = None
    opt = torch.optim.AdamW([{"params": params[:4], "eps": 1e-5}, {"params": params[4:], "eps": 1e-6}], lr=1e-3)
    det = Recorder(warmup_steps=1000)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=10 ** 6, optimizer=opt, detector=det)
    refs = []
    for step in range(5):
        backward(tiny_gpt, seed=99 + step)
        for p in params:
            p.grad.mul_(1e-6)
        mon.after_backward(step, spike_context=SpikeContext(lambda m: m.sum(), torch.ones(2, 16)))
        refs.append(reference_update(opt))
        opt.step()
    fed = [f.get("update") for f in det.fed]  # step 1 measured before its step, 3 and 4 after the one before
    assert fed[0] is None and fed[2] is None
    assert fed[1] == pytest.approx(refs[1], rel=1e-4)
    assert fed[3:] == pytest.approx(refs[2:4], rel=1e-4)
    grad_sq = torch.stack([p.grad.pow(2).sum() for p in params])
    with_eps = float(DetectorInputs(SpikeDetector(), opt, params).update_norm(params, grad_sq))
    for g in opt.param_groups:
        g["eps"] = 1e-8  # what the signal assumed before
    assert float(DetectorInputs(SpikeDetector(), opt, params).update_norm(params, grad_sq)) > 3 * with_eps


def test_a_resumed_optimizer_and_an_added_group_are_followed(tiny_gpt):
    """``load_state_dict`` puts new param-group dicts in (a resume with another lr); ``add_param_group``
    adds tensors (a layer unfrozen): the signal reads the groups the optimizer steps with."""
    params = list(tiny_gpt.parameters())
    head = [p for p in params if p is tiny_gpt.lm_head.weight]
    body = [p for p in params if p is not tiny_gpt.lm_head.weight]
    opt = torch.optim.AdamW(body, lr=1e-3)

    def between(step, o):
        if step == 3:
            saved = o.state_dict()
            saved["param_groups"][0]["lr"] = 1e-2  # the resumed run's lr
            o.load_state_dict(saved)
        if step == 6:
            o.add_param_group({"params": head, "lr": 5e-3})

    firsts = []

    def reference(o) -> float:  # the added tensor's first step: lr per element (Adam with m_hat = g, v_hat = g^2)
        (w,) = head
        first, stateful = 0.0, reference_update(o) ** 2
        if len(o.param_groups) > 1 and w not in o.state:
            first = float((5e-3 * w.grad / (w.grad.abs() + 1e-8)).double().pow(2).sum())
            firsts.append(first / (stateful + first))
        return math.sqrt(stateful + first)

    rows = _fed_against_reference(tiny_gpt, opt, steps=10, between=between, reference=reference)
    # the resumed groups (step 4), the added one (step 7) and its state's second step: measured before them
    assert when(rows) == [NOW, None, LAST, NOW, None, LAST, NOW, NOW, None]
    assert rows[3][0] > 5 * rows[3][2]  # the lr rose 10x: the update with it
    assert len(firsts) == 1 and firsts[0] > 0.05  # the added tensor's first step: a visible part of the update


def test_an_optimizer_with_betas_but_other_moments_gets_no_update_signal(tiny_gpt):
    """bitsandbytes' Adam keeps its moments as state1/state2: unknown here, so no update (before: every tensor
    read as Adam's first step each step, a constant lr * sqrt(n))."""

    class OtherMoments(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8))

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    if not st:
                        st.update(step=0, state1=torch.zeros_like(p), state2=torch.zeros_like(p))
                    st["step"] += 1
                    st["state1"].mul_(0.9).add_(p.grad, alpha=0.1)
                    p.sub_(g["lr"] * st["state1"])

    opt = OtherMoments(tiny_gpt.parameters())
    params = list(tiny_gpt.parameters())
    inputs = DetectorInputs(SpikeDetector(), opt, params)
    for step in range(3):
        backward(tiny_gpt, seed=step)
        assert inputs.update_norm(params, torch.stack([p.grad.pow(2).sum() for p in params])) is None
        opt.step()


def test_an_accelerate_wrapped_optimizer_is_read_through_its_wrapper(tiny_gpt):
    """``GradMonitor(optimizer=accelerator.prepare(opt))``: the wrapper has no hook tables (it raised
    AttributeError); the signal reads and hooks the torch optimizer inside."""
    accelerate = pytest.importorskip("accelerate")

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    wrapped = accelerate.Accelerator(cpu=True).prepare(opt)
    assert wrapped is not opt and not hasattr(wrapped, "_optimizer_step_post_hooks")
    rows = _fed_against_reference(tiny_gpt, wrapped, steps=2 * 16 + 2, reference=lambda o: reference_update(opt))
    assert when(rows) == [NOW, None] + [LAST] * (len(rows) - 2)  # the inner optimizer's step hook measures
    assert any(age and age > 1 for *_, age in rows)
