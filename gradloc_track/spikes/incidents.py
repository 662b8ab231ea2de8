"""One incident, one cause: a detected step in the recovery window of an explained one is its aftermath.

A learning rate raised 50x for one step is rightly ``schedule``; the steps after it fire too (the model
was thrown off, Adam's moments hold the jump), and named on their own evidence they read as ``data``
(every sample's loss jumped), ``optimizer`` or ``unexplained``: new, wrong causes of one incident
(issue 37). ``Incidents.link`` takes a step's own cause and returns the cause it reports:

- an incident opens at a step whose cause is ``schedule``, ``optimizer``, ``data``, ``off_policy`` or
  ``loss_scale``,
  and stays open ``WINDOW`` steps past its last detected step (each linked step extends it, up to
  ``MAX_SPAN`` steps from its start);
- a ``schedule`` incident also stays open while the learning rate stays ``LR_JUMP`` times or more above
  what it was before the incident (a restart to the peak that stays there is still the schedule);
- a step inside an open incident whose own cause is ``data``, ``optimizer`` or ``unexplained`` and differs
  from the incident's is linked: its cause is the incident's, its sentence "aftermath of step N (cause):
  ..." followed by what the step itself showed. The other causes are facts of the step itself and are
  never linked: a learning rate that jumped at this step (``schedule``), an importance ratio measured on
  the culprit (``off_policy``), a non-finite value (``numeric``, ``precision``), a replay that differs
  (``irreproducible``). The non-finite ones open no incident either: the step is skipped, nothing it
  did lingers.
A step whose own cause is the incident's keeps its own sentence (the same cause, with its own numbers) and
opens the incident anew from there: the steps after it are the aftermath of the nearer event (held-out
tester, stop 52: after a second lr jump at step 200, step 201 read "aftermath of step 150"; after a
false alarm at 135 named ``data``, a heavy token's step 150 kept it open, and its update spike at 152 read
"aftermath of step 135", naming the clean sample of 135).
An ``optimizer`` step is linked to an incident that is not the schedule's only when the incident moved the
gradient or the update (a norm or the update signal fired in it): Adam's moments then still carry it. An
incident only the losses or the junk signal fired on left nothing in them, so a lost optimizer state nine
steps after it is its own (held-out tester, stop 51: an ``opt.state.clear()`` read "aftermath of step 111
(data)" after a junk run on clean Latin-1 text).

Pure: reads causes and learning rates, no tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cause import LR_JUMP, STATE_NOT_SAMPLE, STATE_REASON, Cause

WINDOW = 20  # steps past an incident's last detected step that are still its recovery
MAX_SPAN = 200  # steps an incident links at most, however often it fires (the schedule's raised lr aside)
OPENS = frozenset({"schedule", "optimizer", "data", "off_policy", "loss_scale"})
LINKED = frozenset({"data", "optimizer", "unexplained"})  # what a step's own evidence may misname after an incident


@dataclass
class Incident:
    step: int  # its first detected step
    cause: Cause
    last: int  # its last detected step
    base_lr: float | None = None  # the learning rate before a schedule incident
    moved: bool = True  # a gradient norm or the update fired in it (module doc: what an optimizer step links to)
    base_step: int | None = None  # the step ``base_lr`` was the learning rate before (None: ``step``)

    def lr_raised(self, lr: float | None) -> bool:
        return (self.cause.name == "schedule" and self.base_lr is not None and lr is not None
                and lr >= LR_JUMP * self.base_lr)

    def covers(self, step: int, lr: float | None) -> bool:
        if self.lr_raised(lr):
            return True
        return step <= min(self.last + WINDOW, self.step + MAX_SPAN)


class Incidents:
    """The run's open incident, across detected steps (``link``)."""

    def __init__(self) -> None:
        self.open: Incident | None = None

    def link(self, step: int, cause: Cause, lr: float | None = None, prev_lr: float | None = None,
             moved: bool = True) -> Cause:
        """The cause ``step`` reports: its own, or the open incident's when it is its aftermath (module
        doc). ``lr`` / ``prev_lr``: the learning rate now and at the previous step (None: unknown);
        ``moved``: a gradient norm or the update fired at this step."""
        inc = self.open
        live = inc is not None and step > inc.step and inc.covers(step, lr)
        if live and cause.name != inc.cause.name and cause.name in LINKED and not (
                cause.name == "optimizer" and inc.cause.name != "schedule" and not inc.moved):
            inc.last = step
            inc.moved = inc.moved or moved
            return Cause(inc.cause.name, f"aftermath of step {inc.step} ({inc.cause.name}): "
                                         f"{_still(inc, lr)}; {_own(cause, inc, lr)}",
                         aftermath_of=inc.step, own=cause.name)
        if cause.name in OPENS:  # a new incident; one of the open one's cause is the newer, nearer explanation
            again = live and cause.name == inc.cause.name
            # the learning rate before a jump (a schedule named for tensors that started training, the lr
            # unchanged, has none: review of 912853c, an unfreeze in a warm-up stayed "open" while the lr rose)
            jumped = cause.name == "schedule" and lr is not None and prev_lr and lr >= LR_JUMP * prev_lr
            base, since = (prev_lr if jumped else None), None
            # a second jump keeps the lr before the first; so does an unfreeze while the first is still raised
            # (review of 5b633b9: its incident lost the base, and the plateau's later steps read on their own)
            earlier = again and inc.base_lr is not None and (inc.base_lr < base if base is not None
                                                              else inc.lr_raised(lr))
            if earlier:
                base, since = inc.base_lr, inc.base_step or inc.step
            self.open = Incident(step, cause, step, base_lr=base, moved=moved or (again and inc.moved),
                                 base_step=since)
        return cause

    def state(self) -> dict | None:
        """The open incident as plain values (a checkpoint's), None when none is open."""
        inc = self.open
        return None if inc is None else {"step": inc.step, "cause": [inc.cause.name, inc.cause.detail],
                                         "last": inc.last, "base_lr": inc.base_lr, "moved": inc.moved,
                                         "base_step": inc.base_step}

    def load(self, state: dict | None) -> None:
        self.open = None if state is None else Incident(int(state["step"]), Cause(*state["cause"]),
                                                        int(state["last"]), state.get("base_lr"),
                                                        bool(state.get("moved", True)), state.get("base_step"))


def _own(cause: Cause, inc: Incident, lr: float | None) -> str:
    """What the linked step showed itself. An ``optimizer`` reading guesses why Adam's state makes a normal gradient a
    large step (a second moment decayed, an unfreeze, a resume); inside an incident that moved the gradient or the
    learning rate the reason is known (held-out tester, stop 58: two steps after a garbage row the console blamed a
    decayed second moment). Tensors that joined (a ``schedule`` with no learning-rate jump) keep the guess: their
    young state is one of its reasons."""
    if cause.name != "optimizer" or (inc.cause.name == "schedule" and inc.base_lr is None):
        return f"on its own this step would read: {cause.detail}"
    update = cause.detail.removesuffix(STATE_REASON).removesuffix(STATE_NOT_SAMPLE)  # the reading's own guess off
    update = update.replace("the optimizer", "this step", 1)
    if inc.lr_raised(lr):
        return f"{update}, at the raised learning rate"
    held = f"the gradients since the learning-rate jump at step {inc.base_step or inc.step}" \
        if inc.cause.name == "schedule" else f"step {inc.step}'s gradient"
    return f"{update}: the optimizer's moments still carry {held}"


def _still(inc: Incident, lr: float | None) -> str:
    if inc.lr_raised(lr):
        since = inc.base_step or inc.step
        return (f"the learning rate is still {lr / inc.base_lr:.3g}x what it was before step {since} "
                f"({inc.base_lr:.3g} -> {lr:.3g})")
    # the incident's own sentence speaks of "this step": here it is the incident's (round 9: step 103's block said
    # "the learning rate rose 30x at this step" after the learning rate was back)
    return f"{inc.cause.detail.rstrip('.').replace('at this step', f'at step {inc.step}')}; the run is still recovering"
