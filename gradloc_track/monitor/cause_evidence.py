"""The evidence a detected step's cause is named from (``spikes.cause``), gathered by the monitor.

- the learning rate now and at the previous step the detector saw (``LrHistory``: the optimizer's
  param groups, read when the detector reads the step; a learning rate kept as a tensor is cloned on
  the device and read on a spike step only);
- the localizer's result: its step check (the full-mask probes' sum against ``.grad``: does the step
  reproduce?) and its culprits' summed share of the squared gradient norm.

``name_step_cause`` returns the step's ``Cause``; the responder puts it on the step's ``SpikeOutcome`` and
its events before the artifacts are written, so the events table, the console block, the report and
the highlight page all say it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..norms import is_distributed
from ..spikes.cause import Cause, Evidence, name_cause

MAX_SCALES = 100  # replay scales kept per run (the usual ones show in the first few)


class LrHistory:
    """The largest learning-rate ratio over the param groups between two steps the detector saw."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.prev: list[Any] | None = None
        self.now: list[Any] | None = None

    def advance(self) -> None:
        """Read this step's learning rates (host numbers as they are; a tensor is cloned, not read)."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        lrs = [g.get("lr") for g in groups]
        self.prev, self.now = self.now, [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in lrs]

    def state(self) -> list[float | None] | None:
        """The last step's learning rates as plain numbers (a checkpoint's; one host read per save)."""
        return None if self.now is None else [None if v is None else float(v) for v in self.now]

    def load(self, lrs: list[float | None] | None) -> None:
        """Go on from a checkpoint's ``state``: the first step after it compares with the step before it."""
        self.prev, self.now = None, None if lrs is None else list(lrs)

    def pair(self) -> tuple[float | None, float | None]:
        """(lr now, lr at the previous step) of the group whose lr rose most; (None, None) when unknown."""
        if not self.now or not self.prev or len(self.now) != len(self.prev):
            return None, None
        best = (None, None)
        for now, prev in zip(self.now, self.prev):
            if now is None or prev is None:
                continue
            now, prev = float(now), float(prev)  # host sync for a tensor lr: on a spike step only
            if prev > 0 and (best[0] is None or now / prev > best[0] / best[1]):
                best = (now, prev)
        return best


def off_policy_reading(culprit: Any, view: Any) -> tuple[float, float | None, float | None] | None:
    """(importance ratio, log-prob, old log-prob) of the culprit's loss term farthest from on-policy, from the
    RL columns (``ratio``, or ``logprob`` and ``old_logprob``) of its ``CulpritView``; None without them.
    Only its loss terms: a completion's row also holds its prompt, whose RL columns are padding (0)."""
    if culprit.batch is None or not (view.has("extra_columns", "ratio") or (
            view.has("extra_columns", "logprob") and view.has("extra_columns", "old_logprob"))):
        return None
    mb, b = culprit.micro_batch, culprit.batch
    ratio, logp, old = (view.extra_row(n, mb, b) for n in ("ratio", "logprob", "old_logprob"))
    if ratio is None:
        ratio = [math.exp(x - y) for x, y in zip(logp, old)]
    terms = [t for t in view.terms(culprit) if t < len(ratio)]
    best = max(terms, key=lambda t: abs(math.log(ratio[t])) if ratio[t] > 0 else math.inf, default=None)
    if best is None:
        return None
    return ratio[best], None if logp is None else logp[best], None if old is None else old[best]




def leaked_rows(ctx: Any) -> str:
    """The rows whose labels leaked (``spikes.junk.LEAKED_COLUMN``), in words; "" when none is marked."""
    from ..spikes.junk import LEAKED_COLUMN, leaked_rows_of

    parts = leaked_rows_of((getattr(ctx, "sample_columns", None) or {}).get(LEAKED_COLUMN))
    words = []
    for k, rows in enumerate(parts):
        if rows:
            mb = f"micro-batch {k} " if len(parts) > 1 else ""
            words.append(f"{mb}sample{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}")
    return "; ".join(words)


def weights_precision(model: Any) -> str | None:
    """"float16 weights" / "bfloat16 weights" when the model trains in one (its first trainable tensor's
    dtype), else None."""
    p = next((p for p in model.parameters() if p.requires_grad), None)
    return f"{str(p.dtype).removeprefix('torch.')} weights" if p is not None and p.dtype in (
        torch.float16, torch.bfloat16) else None


def evidence_of(events: Sequence[Any], result: Any, shown: Any,
                lr_pair: tuple[float | None, float | None], precision: str | None = None,
                usual_scales: Sequence[float] = (), joined: Sequence[str] = ()) -> Evidence:
    """The step's ``Evidence``: its events, the learning rates, the tensors that started training at it
    (``joined``), and the localization (``result``, and ``shown``: rank 0's ``CulpritView`` of it) when one ran."""
    from ..localizer.culprit_view import CulpritView

    ctx = shown.context if shown is not None else None
    ev = Evidence(events, lr=lr_pair[0], prev_lr=lr_pair[1], usual_scales=tuple(usual_scales), joined=tuple(joined))
    if ctx is not None and any(e.signal == "leaked_labels" for e in events):
        ev.leaked_rows = leaked_rows(ctx)
    if result is None:
        return ev
    finding = result.nonfinite
    if finding is not None and finding.where != "replay":
        # the non-finite search replayed the step and the batch makes the NaN/Inf: numeric, with its sentence
        ev.nonfinite_detail = finding.detail
        return ev
    check = result.step_check
    # the norm search runs on a finite replay only: a step whose gradient norm was not finite (or a
    # non-finite residual, or the search's "replay" finding) means the replay is finite where the
    # step's gradient was not (checked first: a clipper that zeroed such a .grad makes the check
    # compare zero with zero, or leaves nothing to compare)
    if check is not None:
        ev.replayed, ev.repeatable = check.replayed, not str(check.reason).startswith("randomness")
        ev.residual = check.residual if math.isfinite(check.residual) else math.inf
        ev.norm_ratio = check.norm_ratio  # a flipped bit: .grad 2e9x the replay, whatever the residual
        ev.scale = check.scale if check.replayed else None
    if finding is not None or any(not math.isfinite(e.value) for e in events if e.is_norm):
        ev.replayed, ev.residual = False, math.inf
        ev.precision = getattr(ctx, "precision", None)  # a user's context may lack it
        ev.precision = ev.precision or precision
        ev.nonfinite_layers = tuple(e.signal for e in events if e.is_norm and e.signal != "global"
                                    and not math.isfinite(e.value))
    culprits = [c for c in (result.culprits or []) if c.share is not None]
    ev.n_culprits = len(result.culprits or [])
    ev.culprit_share = min(1.0, max(0.0, sum(c.share for c in culprits)))
    if culprits:
        top = max(culprits, key=lambda c: c.share)
        # the view's culprits index its context's rows: in one process (under torch.distributed the gathered
        # view holds its own result; rank 0's own batch, after a failed gather, does not hold other ranks' rows)
        indexes = shown is not None and shown.result is result and not is_distributed()
        ev.top_culprit = (shown if indexes else CulpritView(result, None)).words(top)
        if ctx is not None and indexes:
            try:
                ev.off_policy = off_policy_reading(top, shown)
            except Exception:  # a column of another shape: no reading, the other rules decide
                ev.off_policy = None
            try:
                ev.advantage = advantage_reading(top, shown)
            except Exception:  # a column of another shape: the cause reads without it
                ev.advantage = None
    return ev


def advantage_reading(culprit: Any, view: Any) -> float | None:
    """The culprit's advantage (the RL ``advantage`` column) at its largest loss term; None without one. In RL the
    reward is the data: an outlier reward reaches the gradient through this weight, whatever the text."""
    if culprit.batch is None or not view.has("extra_columns", "advantage"):
        return None
    adv = view.extra_row("advantage", culprit.micro_batch, culprit.batch)
    terms = [t for t in view.terms(culprit) if t < len(adv)]
    return max((float(adv[t]) for t in terms), key=abs, default=None)


def name_step_cause(step: int, events: Sequence[Any], result: Any, shown: Any,
                    lr_pair: tuple[float | None, float | None], incidents: Any = None,
                    precision: str | None = None, scales: list[float] | None = None,
                    joined: Sequence[str] = ()) -> Cause:
    """The cause of a detected step; with ``incidents`` (``spikes.incidents.Incidents``), a step in an
    incident's recovery reports the incident's. ``precision``: the model's reduced-precision weights
    (``weights_precision``), when the context names none. ``scales``: the run's list of replay scales of
    earlier localized steps not named ``loss_scale`` (read, and this step's appended). ``joined``: the tensors
    that started training at this step (``monitor.joined``)."""
    ev = evidence_of(events, result, shown, lr_pair, precision, scales or (), joined)
    cause = name_cause(ev)
    if scales is not None and ev.scale is not None and math.isfinite(ev.scale) and cause.name != "loss_scale" \
            and len(scales) < MAX_SCALES:
        scales.append(ev.scale)
    if incidents is not None:
        moved = any(getattr(e, "is_norm", False) or e.signal == "update" for e in events)
        cause = incidents.link(step, cause, lr=lr_pair[0], prev_lr=lr_pair[1], moved=moved)
    return cause
