"""One incident, one cause (issue 37): steps in the recovery window of an explained step report its cause,
a learning rate that stays raised is still the schedule, and a step's own hard evidence is never linked."""
from gradloc_track.spikes.cause import Cause
from gradloc_track.spikes.incidents import MAX_SPAN, WINDOW, Incidents

SCHEDULE = Cause("schedule", "the learning rate rose 50x at this step (0.001 -> 0.05): the update grows with it")


def test_the_steps_after_an_lr_jump_are_its_aftermath_not_new_causes():
    inc = Incidents()
    assert inc.link(250, SCHEDULE, lr=0.05, prev_lr=0.001) is SCHEDULE
    for step, own in ((251, "data"), (252, "optimizer"), (254, "unexplained")):
        got = inc.link(step, Cause(own, f"its own {own} reading"), lr=0.001, prev_lr=0.05)
        assert got.name == "schedule" and got.detail.startswith("aftermath of step 250 (schedule): ")
        assert (f"on its own this step would read: its own {own} reading" in got.detail) == (own != "optimizer")
        # the lr is back: the incident's words say which step they are about (round 9: "at this step")
        assert "the learning rate rose 50x at step 250 (0.001 -> 0.05)" in got.detail
        assert "this step (" not in got.detail
    late = 254 + WINDOW + 1  # past the window after the last linked step: a new, unrelated step
    assert inc.link(late, Cause("data", "x"), lr=0.001, prev_lr=0.001).name == "data"


def test_a_learning_rate_that_stays_raised_is_the_schedule_however_long():
    inc = Incidents()
    inc.link(100, SCHEDULE, lr=0.05, prev_lr=0.001)
    got = inc.link(100 + 5 * MAX_SPAN, Cause("optimizer", "a second moment decayed"), lr=0.04, prev_lr=0.04)
    assert got.name == "schedule" and "the learning rate is still 40x what it was before step 100" in got.detail
    # back down: the window counts from the last linked step again
    assert inc.link(100 + 5 * MAX_SPAN + WINDOW + 1, Cause("optimizer", "y"), lr=0.001).name == "optimizer"


def test_hard_evidence_of_the_step_itself_is_never_linked():
    inc = Incidents()
    inc.link(10, Cause("data", "sample 3 carries 90%"))
    for own in ("numeric", "precision", "irreproducible", "schedule", "off_policy", "loss_scale"):
        assert inc.link(11, Cause(own, "z"), lr=1.0, prev_lr=1.0).name == own
    fresh = Incidents()
    fresh.link(10, Cause("data", "sample 3 carries 90%"))
    same = Cause("data", "sample 5 carries 70%")
    assert fresh.link(12, same) is same  # the same cause keeps its own numbers
    assert fresh.link(12 + WINDOW, Cause("optimizer", "w")).name == "data"  # 12 extended the window


def test_an_unexplained_or_numeric_step_opens_no_incident():
    inc = Incidents()
    inc.link(5, Cause("unexplained", "no rule applies"))
    inc.link(6, Cause("numeric", "NaN loss"))
    assert inc.link(7, Cause("optimizer", "v decayed")).name == "optimizer"
    assert inc.link(8, Cause("data", "d")).name == "optimizer"  # 7 opened one


def test_a_loss_scaled_at_one_step_opens_an_incident():
    inc = Incidents()  # the gradient 100x went into Adam's moments: the updates after it are its aftermath
    inc.link(150, Cause("loss_scale", "the loss was multiplied by 100 at this step"))
    got = inc.link(152, Cause("optimizer", "the update is 4.8x its running mean"))
    assert got.name == "loss_scale" and got.detail.startswith("aftermath of step 150 (loss_scale): ")


def test_a_lost_optimizer_state_after_an_incident_that_moved_no_gradient_is_its_own():
    """Held-out tester, stop 51: ``opt.state.clear()`` nine steps after a junk run (junk_span alone, on clean
    Latin-1 text) read "aftermath of step 111 (data)". An incident no gradient norm and no update fired in
    leaves nothing in Adam's moments; one that moved them does (a garbage batch's momentum)."""
    quiet = Incidents()
    quiet.link(111, Cause("data", "a run of its loss terms is rated below chance"), moved=False)
    own = Cause("optimizer", "the optimizer's update is 40x its running mean")
    assert quiet.link(120, own) is own
    assert quiet.link(121, Cause("data", "d")).name == "optimizer"  # the reset opened its own incident
    loud = Incidents()
    loud.link(111, Cause("data", "sample 3 carries 90%"), moved=True)
    assert loud.link(120, own).name == "data"
    later = Incidents()  # a step of the quiet incident that moved the gradient: its momentum is there after all
    later.link(111, Cause("data", "junk"), moved=False)
    later.link(113, Cause("data", "sample 2 carries 80%"), moved=True)
    assert later.link(120, own).name == "data"
    assert Incidents().link(5, SCHEDULE, moved=False) is SCHEDULE  # the schedule's aftermath is its lr: always
    saved = Incidents()  # a checkpoint keeps whether the incident moved anything
    saved.link(111, Cause("data", "junk"), moved=False)
    restored = Incidents()
    restored.load(saved.state())
    assert restored.open.moved is False and restored.link(120, own) is own


def test_the_same_cause_again_opens_the_incident_anew():
    """Held-out tester, stop 52: a second lr x50 at step 200 kept step 150's incident open, and step 201 read
    "aftermath of step 150 ... rose 50x at step 150"; a heavy token's data spike at 150 after a false alarm at
    135 left 152's update spike "aftermath of step 135", pointing at 135's clean sample. The nearer event is
    the explanation."""
    inc = Incidents()
    inc.link(150, SCHEDULE, lr=0.05, prev_lr=0.001)
    inc.link(151, Cause("data", "d"), lr=0.001, prev_lr=0.05)
    second = Cause("schedule", "the learning rate rose 50x at this step (0.001 -> 0.05)")
    assert inc.link(200, second, lr=0.05, prev_lr=0.001) is second
    got = inc.link(201, Cause("optimizer", "o"), lr=0.001, prev_lr=0.05)
    assert got.detail.startswith("aftermath of step 200 (schedule): the learning rate rose 50x at step 200")
    data = Incidents()
    data.link(135, Cause("data", "loss/sample_max jumped 1.80x (sample 0 first)"))
    data.link(150, Cause("data", "sample 3, token 70 carries 94%"))
    got = data.link(152, Cause("optimizer", "the update is 6x its running mean"))
    assert got.detail.startswith("aftermath of step 150 (data): sample 3, token 70")
    kept = Incidents()  # the momentum an earlier event of the same cause left is still there
    kept.link(111, Cause("data", "sample 3 carries 90%"), moved=True)
    kept.link(113, Cause("data", "a junk run"), moved=False)
    assert kept.link(120, Cause("optimizer", "o")).detail.startswith("aftermath of step 113 (data)")


def test_a_second_jump_keeps_the_learning_rate_before_the_first():
    """Review of b5baf6d: re-opened at a second jump, the incident took the raised lr as its base, and the lr
    back at the first plateau (still 50x the original) read as no incident at all."""
    inc = Incidents()
    inc.link(150, SCHEDULE, lr=0.05, prev_lr=0.001)
    inc.link(200, Cause("schedule", "the learning rate rose 2x at this step (0.05 -> 0.1)"), lr=0.1, prev_lr=0.05)
    got = inc.link(260 + MAX_SPAN, Cause("data", "d"), lr=0.05, prev_lr=0.05)
    assert got.name == "schedule" and "the learning rate is still 50x what it was before step 150" in got.detail
    restored = Incidents()  # a checkpoint keeps the first jump's step
    restored.load(inc.state())
    assert "before step 150" in restored.link(270 + MAX_SPAN, Cause("data", "d"), lr=0.05, prev_lr=0.05).detail


def test_a_schedule_named_for_tensors_that_started_training_closes_while_the_learning_rate_rises():
    """An unfreeze is ``schedule`` with the learning rate unchanged: no rate before a jump to stay "raised" above
    (review of 912853c: an unfreeze in a warm-up kept its incident open for the run as the lr passed 2x its
    value, and a garbage batch 900 steps on read "aftermath of step 50 (schedule)")."""
    inc = Incidents()
    unfreeze = Cause("schedule", "13 tensors started training at this step (h.1.w: requires_grad turned on, ...)")
    assert inc.link(50, unfreeze, lr=5.0e-4, prev_lr=4.9e-4) == unfreeze
    linked = inc.link(60, Cause("optimizer", "the update is 3x"), lr=6.0e-4, prev_lr=5.9e-4)
    assert linked.aftermath_of == 50 and linked.own == "optimizer"
    assert "13 tensors started training at step 50" in linked.detail
    garbage = Cause("data", "1 culprit(s) (sample 3) carry 90%")
    assert inc.link(950, garbage, lr=9.5e-3, prev_lr=9.49e-3) == garbage  # 19x the lr at step 50: not the schedule's


def test_an_unfreeze_on_a_raised_plateau_keeps_the_first_jumps_base():
    """An lr x30 at step 100 that stays, an unfreeze at 110 (``schedule``, no jump of its own): step 200, the lr
    still 30x, is the plateau's aftermath (review of 5b633b9: the unfreeze's incident lost the base and step 200
    read its own cause); and a warm-up from 0 has no base to stay raised above."""
    inc = Incidents()
    inc.link(100, Cause("schedule", "the learning rate rose 30x at this step (0.003 -> 0.09)"), lr=0.09, prev_lr=0.003)
    inc.link(110, Cause("schedule", "13 tensors started training at this step (...)"), lr=0.09, prev_lr=0.09)
    late = inc.link(200, Cause("optimizer", "the update is 3x"), lr=0.09, prev_lr=0.09)
    assert late.aftermath_of == 110 and "the learning rate is still 30x what it was before step 100" in late.detail
    warm = Incidents()
    warm.link(1, Cause("schedule", "the learning rate rose at this step"), lr=1e-4, prev_lr=0.0)
    assert warm.open.base_lr is None and warm.link(500, Cause("data", "x"), lr=3e-3, prev_lr=3e-3).aftermath_of is None


def test_an_update_spike_after_a_garbage_step_is_its_momentum_not_a_decayed_second_moment():
    """Held-out tester, stop 58: two steps after a garbage row (``data``), the update fired alone and its sentence
    read "its second moment is small against this gradient: decayed over quieter steps, new parameters such as an
    unfreeze, or lost on a resume". Inside an incident the reason is known: the moments hold the incident's step."""
    from gradloc_track.spikes.cause import Evidence, name_cause
    from gradloc_track.spikes.event import SpikeEvent

    own = name_cause(Evidence(events=[SpikeEvent(242, "update", 3.1, 1.0, 6.0, 3.1)]))
    assert own.name == "optimizer" and "second moment" in own.detail  # the reading alone, as before
    inc = Incidents()
    inc.link(240, Cause("data", "sample 1 carries 95%"), moved=True)
    got = inc.link(242, own)
    assert got.name == "data" and got.detail.startswith("aftermath of step 240 (data): sample 1 carries 95%")
    assert got.detail.endswith("this step's update is 3.1x its running mean (z = 6): the optimizer's moments still "
                               "carry step 240's gradient")
    assert "second moment" not in got.detail and "decayed" not in got.detail
    lr = Incidents()
    lr.link(250, SCHEDULE, lr=0.05, prev_lr=0.001)
    after = lr.link(252, own, lr=0.001, prev_lr=0.05)
    assert after.detail.endswith("still carry the gradients since the learning-rate jump at step 250")
    raised = lr.link(253, own, lr=0.05, prev_lr=0.05)  # still raised: the lr, not old moments (review, stop 58)
    assert raised.detail.endswith("this step's update is 3.1x its running mean (z = 6), at the raised learning rate")
    # tensors that joined at an unchanged lr: the young state is the reason, the reading's own words keep it
    joined = Incidents()
    joined.link(300, Cause("schedule", "2 tensors started training at step 300"), lr=0.001, prev_lr=0.001)
    assert joined.link(302, own, lr=0.001, prev_lr=0.001).detail.endswith(f"on its own this step would read: "
                                                                           f"{own.detail}")
    # the update and the global norm fired, no culprit: that much of the reading stays
    both = name_cause(Evidence(events=[SpikeEvent(242, "update", 3.1, 1.0, 6.0, 3.1),
                                       SpikeEvent(242, "global", 4.0, 1.0, 9.0, 4.0)]))
    assert both.name == "optimizer" and "and no culprit stands out" in both.detail
    got = Incidents()
    got.link(240, Cause("data", "sample 1 carries 95%"), moved=True)
    assert got.link(242, both).detail.endswith("this step's update is 3.1x its running mean (z = 6) and no culprit "
                                               "stands out: the optimizer's moments still carry step 240's gradient")
