"""Why a step fired: one cause per detected step, from the evidence the step already has (issue 26).

A cause is one of ``CAUSES``, with one sentence that carries the numbers (``Cause.detail``). The rules,
first match wins (docs/forensics.md#the-cause-of-a-spike):

0. ``precision``: as ``irreproducible`` below with a finite replay and a non-finite ``.grad``, while the
   step ran in reduced precision (``SpikeContext.precision``: a float16 autocast seen at the forward): a
   value beyond float16's range (the layers whose ``.grad`` holds it are named), not a hardware fault.
1. ``irreproducible``: the localizer replayed the step (the full-mask probes, whose sum must be
   ``.grad``) and it does not reproduce although the probes repeat (a replay that is finite where
   ``.grad`` is not counts): the gradient the optimizer holds is not the one the batch makes (silent
   data corruption, a hardware fault; a flipped exponent bit overflows the norm, so this comes first).
2. ``numeric``: a fired value is NaN/Inf (the gradient norm, a layer's, the loss or a sample's loss).
   ``Evidence.nonfinite_detail``, when the localizer's non-finite search ran, says which samples
   (or that the sum overflowed).
3. ``schedule``: the learning rate rose by ``LR_JUMP`` or more since the previous step (the gradient
   can be normal: the update is not); or tensors started training at this step (``Evidence.joined``:
   unfrozen, or added with ``add_param_group``), a planned change whose first optimizer steps are large.
4. ``optimizer``: the optimizer's update fired while no gradient norm did: the step's gradient is
   ordinary, the update Adam makes from it is not (a decayed second moment).
5. ``off_policy``: the culprits carry ``DATA_SHARE`` or more and the top one's importance ratio
   (``ratio``, or ``exp(logprob - old_logprob)``, from the RL columns) is ``OFF_POLICY_RATIO`` or more
   from 1 either way: the sampling and the training policy disagree on it (a stale log-prob, a
   sampler/trainer mismatch), which the surrogate multiplies into the gradient; not the data.
6. ``loss_scale``: the replay reproduces ``.grad`` up to one factor of ``LOSS_SCALE`` or more, the
   global gradient norm's jump over its running mean is that factor give or take ``SCALE_FIT``, and no
   per-sample signal fired: the batch's own gradient is ordinary, the loss was multiplied at this step
   (a loss weight, a changed normalizer or accumulation count, a loss scaler not undone). A loss scaled
   alike on every step (a sum reduction) is in the running mean too: its jumps do not track the factor; and
   a factor this run's earlier localized steps had too (``Evidence.usual_scales``) is its own normalization.
7. ``data``: the localizer named culprits carrying ``DATA_SHARE`` or more of the step's squared
   gradient norm; or a loss signal fired (the model is the same for every sample: a loss that jumps
   is the data's), with the culprits when there are some.
8. ``optimizer`` again when the update fired and no culprit stands out; else ``unexplained``.

A step in the recovery window of an explained incident reports that incident's cause
(``spikes/incidents.py``).

Pure: reads numbers (``Evidence``), no tensor, no host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

CAUSES = ("data", "numeric", "precision", "optimizer", "schedule", "off_policy", "loss_scale", "irreproducible",
          "unexplained")
LR_JUMP = 2.0  # a learning rate at least 2x the previous step's is a schedule change worth naming
DATA_SHARE = 0.5  # culprits carrying at least half the squared norm explain the step
LOSS_SIGNALS = ("loss", "sample_loss", "junk_span", "leaked_labels")
SAMPLE_SIGNALS = ("sample_loss", "junk_span", "leaked_labels")  # a loss scale moves none of these
OFF_POLICY_RATIO = 10.0  # an importance ratio this far from 1 (either way) is not on-policy noise
LOSS_SCALE = 2.0  # .grad this many times the replayed batch's gradient (or more): the loss was scaled up
SCALE_FIT = 2.0  # ... and the norm's jump is that factor within this ratio either way: the batch is ordinary


@dataclass(frozen=True)
class Cause:
    name: str  # one of CAUSES
    detail: str  # one sentence with the numbers
    aftermath_of: int | None = None  # the incident's first step, when this step is its aftermath (``incidents``)
    own: str | None = None  # an aftermath step's own cause (what its evidence alone named: ``data``, ...)

    @property
    def own_name(self) -> str:
        """What the step's own evidence named: its cause, or an aftermath step's ``own``."""
        return self.name if self.aftermath_of is None else (self.own or self.name)


@dataclass
class Evidence:
    """What one detected step offers: the events (``SpikeEvent``s) and, when known, the learning rate
    now and at the previous step, the localizer's replay check and its culprits' summed share."""

    events: Sequence[Any]
    lr: float | None = None
    prev_lr: float | None = None
    replayed: bool | None = None  # None: no replay ran; False: the probes' sum is not .grad
    residual: float | None = None  # ||probes' sum - .grad|| / ||probes' sum||
    norm_ratio: float | None = None  # ||.grad|| / ||probes' sum||
    scale: float | None = None  # the one factor with .grad = scale * probes' sum (``StepCheck.scale``), when it fits
    # the replay scales of this run's earlier localized steps named otherwise: the run's own normalization (a
    # loss_fn off by a constant factor), which a step at that scale again did not change
    usual_scales: tuple[float, ...] = ()
    repeatable: bool = True  # two identical probes agree (False: randomness the RNG does not replay)
    culprit_share: float | None = None  # the named culprits' summed share; None: not localized
    n_culprits: int = 0
    top_culprit: str = ""  # "sample 3", "sample 3, tokens 40-42": the largest culprit, in words
    nonfinite_detail: str = ""  # the non-finite search's sentence (``NonfiniteFinding.detail``) when it ran
    # the top culprit's (importance ratio, log-prob, old log-prob) from the RL columns, at its term farthest
    # from on-policy; None: not an RL step, or no culprit
    off_policy: tuple[float, float | None, float | None] | None = None
    advantage: float | None = None  # the top culprit's RL advantage (its reward's weight on its gradient), when known
    leaked_rows: str = ""  # the rows whose labels leaked, in words ("micro-batch 0 samples 1, 4, 6")
    precision: str | None = None  # the reduced precision the step ran in ("float16 autocast"), when known
    nonfinite_layers: tuple[str, ...] = ()  # the layers whose .grad holds a NaN/Inf
    joined: tuple[str, ...] = ()  # the tensors that started training at this step (unfrozen, an added group)


def name_cause(ev: Evidence) -> Cause:
    """The step's cause by the rules above."""
    for rule in (_precision, _irreproducible, _numeric, _schedule, _joined, _optimizer_alone, _off_policy,
                 _loss_scale, _data, _optimizer_no_culprit):
        cause = rule(ev)
        if cause is not None:
            return cause
    return Cause("unexplained", _unexplained(ev))


def _fired(ev: Evidence, *signals: str) -> list[Any]:
    return [e for e in ev.events if e.signal in signals]


def _norm_events(ev: Evidence) -> list[Any]:
    return [e for e in ev.events if getattr(e, "is_norm", e.signal not in LOSS_SIGNALS + ("update",))]


def _numeric(ev: Evidence) -> Cause | None:
    bad = [e for e in ev.events if not math.isfinite(e.value)]
    if not bad:
        return None
    what = ", ".join(f"{e.key} = {e.value}" for e in bad[:3])
    who = f"; {ev.nonfinite_detail}" if ev.nonfinite_detail else "; the step is skipped"
    return Cause("numeric", f"the step's {what}: a non-finite value (overflow, log 0, a -inf logit){who}")


def _schedule(ev: Evidence) -> Cause | None:
    if not ev.lr or not ev.prev_lr or ev.lr < LR_JUMP * ev.prev_lr:
        return None
    return Cause("schedule", f"the learning rate rose {ev.lr / ev.prev_lr:.3g}x at this step ({ev.prev_lr:.3g} -> "
                             f"{ev.lr:.3g}): the update grows with it, whatever the data")


def _joined(ev: Evidence) -> Cause | None:
    if not ev.joined:
        return None
    n, shown = len(ev.joined), ", ".join(ev.joined[:3])
    more = f" and {n - 3} more" if n > 3 else ""
    its = "their" if n > 1 else "its"
    return Cause("schedule", f"{n} tensor{'s' if n > 1 else ''} started training at this step ({shown}{more}: "
                             f"requires_grad turned on, or added with add_param_group): {its} gradient"
                             f"{'s join' if n > 1 else ' joins'} the norms and the optimizer's update (Adam's first "
                             f"steps on a tensor new to it move each element by about the learning rate), a planned "
                             "change of what trains, whatever the data")


def _precision(ev: Evidence) -> Cause | None:
    if not ev.precision or ev.replayed is not False or ev.residual is None or not math.isinf(ev.residual):
        return None
    layers = f" in {', '.join(ev.nonfinite_layers[:3])}" if ev.nonfinite_layers else ""
    who = f"; {ev.top_culprit} carries {ev.culprit_share:.0%} of the finite replay's squared norm (the likeliest to " \
          "overflow)" if ev.top_culprit and ev.culprit_share else ""
    return Cause("precision", f"the gradient in .grad overflowed{layers} where the float32 replay is finite: the step "
                              f"ran under {ev.precision}, and a value went beyond its range{who}; a loss scaler "
                              "skips such a step (lower the scale, or train in bfloat16)")


def _irreproducible(ev: Evidence) -> Cause | None:
    if ev.replayed is not False or not ev.repeatable or ev.residual is None or math.isnan(ev.residual):
        return None  # a NaN residual: the replay itself is not finite, the batch makes the NaN (numeric)
    far = ev.norm_ratio is not None and math.isfinite(ev.norm_ratio) and not 0.5 <= ev.norm_ratio <= 2.0
    how = ("the replayed gradient is finite, the one in .grad is not" if math.isinf(ev.residual) else
           f"the gradient in .grad is {ev.norm_ratio:.3g}x the norm of the replayed one" if far else
           f"the replayed gradient differs from the one in .grad by {ev.residual * 100:.2g}% of its norm")
    if math.isinf(ev.residual):  # a finite batch, a non-finite .grad: a flipped bit, not a loss
        return Cause("irreproducible", f"the step does not reproduce: {how}, while the replay itself repeats. Either "
                                       "a factor the replay does not rebuild made it (a NaN or Inf multiplier on one "
                                       "rank or micro-batch, a loss_fn that is not the training loss: "
                                       "handle.set_loss_fn), or a hardware fault or silent data corruption (a "
                                       "flipped exponent bit)")
    return Cause("irreproducible", f"the step does not reproduce: {how}, while the replay itself repeats. Either the "
                                   "loss that made .grad is not the one the replay rebuilds (a multiplier on one rank "
                                   "or micro-batch, a loss_fn that is not the training loss: handle.set_loss_fn), or "
                                   "a hardware fault or silent data corruption")


# what an ``optimizer`` cause says after its update line: a guess at why the state made the step large (an incident's
# aftermath, where the reason is known, says that instead: ``incidents``)
STATE_REASON = (" while the gradient norms and losses are ordinary: the optimizer's state makes a normal gradient a "
                "large step (its second moment is small against this gradient: decayed over quieter steps, new "
                "parameters such as an unfreeze, or lost on a resume)")
STATE_NOT_SAMPLE = ": the optimizer's state, not one sample, made the step large"


def _update_line(ev: Evidence) -> str:
    u = _fired(ev, "update")[0]
    return f"the optimizer's update is {u.ratio:.3g}x its running mean (z = {u.z:.0f})"


def _optimizer_alone(ev: Evidence) -> Cause | None:
    if not _fired(ev, "update") or _norm_events(ev) or _fired(ev, *LOSS_SIGNALS):
        return None
    return Cause("optimizer", _update_line(ev) + STATE_REASON)


def _top(ev: Evidence) -> str:
    """`` (sample 3)`` for one culprit, `` (the largest: sample 3, token 42)`` for several (a new user, stop 55:
    "token 42 first" beside "tokens 40-42" read as a position), "" when none is named."""
    if not ev.top_culprit:
        return ""
    return f" ({ev.top_culprit})" if ev.n_culprits == 1 else f" (the largest: {ev.top_culprit})"


def _which(ev: Evidence) -> str:
    return "the largest " if ev.n_culprits > 1 else ""


def _off_policy(ev: Evidence) -> Cause | None:
    if ev.off_policy is None or ev.culprit_share is None or ev.culprit_share < DATA_SHARE:
        return None
    ratio, logp, old = ev.off_policy
    if not (math.isfinite(ratio) and ratio > 0) or abs(math.log(ratio)) < math.log(OFF_POLICY_RATIO):
        return None
    probs = f" (log-prob {logp:.3g} under the training policy, {old:.3g} when sampled)" if None not in (logp, old) \
        else ""
    return Cause("off_policy", f"{ev.n_culprits} culprit(s){_top(ev)} carry {ev.culprit_share:.0%} of the step's "
                               f"squared gradient norm, {_which(ev)}at an importance ratio of {ratio:.3g}{probs}: the "
                               "sampling and the training policy disagree on it (a stale or mismatched log-prob), "
                               "which the surrogate multiplies into the gradient; not the data")


def _jumped(e: Any, ev: Evidence) -> str:
    if e.signal == "junk_span":
        return f"a run of its loss terms is rated below chance ({e.value:+.2f} nats a term above a random token's loss)"
    return f"{e.key} jumped {e.ratio:.2f}x"


def _data(ev: Evidence) -> Cause | None:
    losses = _fired(ev, *LOSS_SIGNALS)
    named = ev.culprit_share is not None and ev.n_culprits > 0
    leak = _fired(ev, "leaked_labels")
    if leak:  # structural: the rows are known whatever the gradient says (their rows are culprits too)
        rows = f"; {ev.leaked_rows}" if ev.leaked_rows else ""
        carry = (f" ({ev.n_culprits} culprit row(s) carry {ev.culprit_share:.0%} of the step's squared gradient "
                 "norm)") if named else ""
        return Cause("data", f"{leak[0].describe()}: a label bug in the data{rows}{carry}")
    if named and losses and not _norm_events(ev):  # no gradient norm jumped: the loss named them, not the share
        return Cause("data", f"{_jumped(max(losses, key=lambda x: x.z), ev)} while the gradient norm stayed "
                             f"ordinary; {ev.n_culprits} culprit(s){_top(ev)} carry {ev.culprit_share:.0%} of the "
                             "step's squared gradient norm: the batch's data")
    if named and (ev.culprit_share >= DATA_SHARE or losses):
        why = f", and {_jumped(max(losses, key=lambda x: x.z), ev)}" if losses else ""
        whose = "the largest culprit's" if ev.n_culprits > 1 else "its"
        adv = (f"; {whose} advantage is {ev.advantage:.4g} (in RL the reward is data: an outlier reward weighs its "
               "gradient whatever the text)") if ev.advantage is not None else ""
        return Cause("data", f"{ev.n_culprits} culprit(s){_top(ev)} carry {ev.culprit_share:.0%} of the step's squared "
                             f"gradient norm{why}: the batch's data made the step{adv}")
    if losses:  # the model is the same for every sample: a loss that jumps is the data's
        e = max(losses, key=lambda x: x.z)
        which = ("not localized, so which one is not known" if ev.culprit_share is None else
                 "no single culprit carries the gradient")
        if e.signal == "junk_span":
            return Cause("data", f"{e.describe()}: junk in the data ({which})")
        return Cause("data", f"{e.key} = {e.value:.3g}, {e.ratio:.2f}x its running mean (z = {e.z:.0f}): the data's "
                             f"loss jumped ({which})")
    return None


def _loss_scale(ev: Evidence) -> Cause | None:
    s = ev.scale
    glob = [e for e in ev.events if e.signal == "global" and math.isfinite(e.ratio) and e.ratio > 0]
    if ev.replayed is not True or s is None or not math.isfinite(s) or s < LOSS_SCALE or not glob or _fired(
            ev, *SAMPLE_SIGNALS):
        return None
    own = glob[0].ratio / s  # the batch's own gradient against the running mean, at the usual scale
    if not 1 / SCALE_FIT <= own <= SCALE_FIT or any(1 / SCALE_FIT <= s / u <= SCALE_FIT for u in ev.usual_scales):
        return None
    return Cause("loss_scale", f"the gradient in .grad is {s:.3g}x the one the batch's own loss gives (the replay "
                               f"reproduces it up to that one factor), and that gradient is ordinary ({own:.2f}x "
                               f"the running mean, where .grad is {glob[0].ratio:.3g}x): the loss was multiplied "
                               f"by {s:.3g} at this step (a loss weight or multiplier, a changed normalizer or "
                               "accumulation count, a loss scaler not undone); not the data")


def _optimizer_no_culprit(ev: Evidence) -> Cause | None:
    if not _fired(ev, "update"):
        return None
    return Cause("optimizer", f"{_update_line(ev)} and no culprit stands out{STATE_NOT_SAMPLE}")


def _unexplained(ev: Evidence) -> str:
    if ev.culprit_share is None:
        return "no rule applies: the step was not localized, the learning rate and the optimizer's update are ordinary"
    if not ev.n_culprits:
        return ("no culprit stands out (the spike is spread over the batch), the step reproduces, the learning "
                "rate and the optimizer's update are ordinary")
    return (f"the culprits carry only {ev.culprit_share:.0%} of the squared gradient norm; the step reproduces, the "
            "learning rate and the optimizer's update are ordinary")
