"""What the monitor does when the detector fires: localize, back off, gather to rank 0, render,
and (``spikes.response=surgery``) take the culprits' gradient out of the step.

Also owns what the detector needs from the spike context: the step's loss-token count (GradLoc's
fixed trigger divides by it), counted on the device so it rides along in the step's one transfer.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..norms import is_distributed
from ..spikes.cause import Cause
from ..spikes.event import SpikeEvent
from ..spikes.incidents import Incidents
from . import weight_check
from .data_flags import data_flags, flag_rule
from .outcome import SpikeOutcome, data_fault, with_cause
from .packing import N_TOKENS, HostPack
from .rank_inputs import world_of

log = logging.getLogger(__name__)


def resolve(ctx: Any) -> Any:
    """The ``SpikeContext``: ``spike_context`` may also be a zero-argument callable that builds it
    (``watch()`` passes one: the step's targets and masks are built only when a spike needs them)."""
    return ctx() if callable(ctx) else ctx


class SpikeResponder:
    """Localization of detected spikes, with ``locate.max_events`` and the back-off after empty results.

    Only a localization that names a culprit uses up ``locate.max_events``. Ones that find nothing
    are free up to ``max_events``; beyond that the localizer backs off (it skips 1, 3, 7, ... steps
    after each further empty result: O(log steps) attempts), so a detector firing on noise neither
    runs the localizer on every step nor stops a later, real spike from being localized.
    """

    def __init__(self, model: torch.nn.Module, locate_config: Any, group_by: str, artifact_writer: Any,
                 rank: int, process_group: Any, warn_once: Callable[[str, str], None], surgery: bool = False,
                 clips: bool = True) -> None:
        self.model, self.config, self.group_by = model, locate_config, group_by
        self.surgery = surgery  # spikes.response=surgery: the monitor clips after respond()
        self.clips = clips  # a clipper gets the operated gradient (else the optimizer does: what surgery says)
        self.artifact_writer, self.rank, self.process_group = artifact_writer, rank, process_group
        self._warn_once = warn_once
        self._failure = ""  # why localizing this step raised (``_failed``)
        self.replay_scales: list[float] = []  # the run's usual replay scales (``spikes.cause``'s loss_scale)
        self.events_localized = 0  # localizations that found a culprit (these use up locate.max_events)
        self.events_unconfirmed = 0  # localizations that found nothing (they back off instead)
        self._retry_step = -(2 ** 62)  # no localization before this step (back-off after empty results)
        self.lr_history: Any = None  # the monitor's LrHistory: a learning-rate jump names a cause
        self.joined: tuple[str, ...] = ()  # the tensors that started training at the step responded to (an unfreeze)
        self.incidents = Incidents()  # a step in an explained incident's recovery reports its cause
        self.corrupt: Any = None  # a weight found corrupt (weight_check.CorruptWeight) while it stays so
        # the detector's (junk_terms, junk_margin, sample_min_ratio, sample_min_rise), for data_flags
        self.flag_rule = flag_rule(None)
        self.no_context: str | None = None  # why a front door had no context this step (watch(): its reason)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run's diagnosis goes on from: the open incident (its aftermath keeps its cause),
        the run's usual replay scales, ``locate.max_events``' count with the back-off after empty results,
        and the last step's learning rates (a jump at the first step after the resume is still ``schedule``)."""
        return {"incident": self.incidents.state(), "replay_scales": list(self.replay_scales),
                "events_localized": self.events_localized, "events_unconfirmed": self.events_unconfirmed,
                "retry_step": self._retry_step,
                "lr": self.lr_history.state() if self.lr_history is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.incidents.load(state.get("incident"))
        self.replay_scales = [float(x) for x in state.get("replay_scales", ())]
        self.events_localized = int(state.get("events_localized", 0))
        self.events_unconfirmed = int(state.get("events_unconfirmed", 0))
        self._retry_step = int(state.get("retry_step", -(2 ** 62)))
        if self.lr_history is not None:
            self.lr_history.load(state.get("lr"))

    # -- the token count the fixed detector needs ------------------------------------------
    @staticmethod
    def count_tokens(pack: HostPack, ctx: Any) -> tuple[int | None, int | None]:
        """(host token count or None when it rides in ``pack``, number of micro-batches or None)."""
        masks = resolve(ctx).token_mask
        n_micro = None
        if not isinstance(masks, torch.Tensor):  # one mask per micro-batch (gradient accumulation)
            masks = list(masks)
            n_micro = len(masks)
        else:
            masks = [masks]
        if all(m.device == pack.device for m in masks):
            pack.add_slot(N_TOKENS, torch.stack([m.sum() for m in masks]).sum())  # rides along in the one transfer
            return None, n_micro
        # host-side masks with device gradients: summing them on the host waits for nothing
        return int(sum(float(m.sum()) for m in masks)), n_micro

    def global_count(self, n: int, device: torch.device) -> int:
        """The global batch's loss-token count: every rank must reach the same spike decision,
        since localizing is a collective."""
        if not is_distributed(self.process_group):
            return n
        t = torch.tensor([float(n)], device=device)
        dist.all_reduce(t, group=self.process_group)  # only on armed steps of the fixed detector
        return int(t.item())  # host sync: the detector needs the count now

    # -- the response ------------------------------------------------------------------------
    def respond(self, step: int, events: Sequence[SpikeEvent], ctx: Any, grad_scale: Any = None,
                junk: Any = None) -> tuple[SpikeOutcome, dict[str, float]]:
        """The step's ``SpikeOutcome`` and its ``locate/*`` / ``surgery/*`` metrics: the localizer run on the
        spiking batch (its result handed to the artifact writer), or the reason it was not; the step's cause;
        with ``spikes.response=surgery``, the culprits' gradient taken out of the step's.
        ``grad_scale``: the clipper's per-tensor coefficients when it already clipped this step's
        ``.grad`` (in the model's trainable-tensor order; a device tensor): the localizer's step
        check compares like with like (``LocateStep.grad_scale``); ``junk``: the step's junk statistics, whose
        runs are named when the junk signal fired (``monitor.data_flags``)."""
        self.check_weights(step)  # every detected step, before localizing (``weight_check``'s module doc)
        held = self._while_corrupt(step, events)
        if held is not None:
            return held, {}
        why_not = self.why_not_localized(step, ctx, events)
        tried, located, result, shown, rows = why_not is None, None, None, None, None
        cut = None
        self._failure = ""
        if tried:
            try:
                ctx = resolve(ctx)
            except Exception as exc:  # a context factory that raised: said, and training goes on
                self._failed(step, exc)
                ctx = None
            located = self._step(step, ctx, grad_scale, events, junk) if ctx is not None else None
            cut = self._cut() if self.surgery else None
            result = self._localize(step, located, cut) if located is not None else None
        if result is not None:
            shown, rows = self._view(step, result, ctx)
        elif tried:  # the reason goes with the run (events row, report), not only in a warning on the console
            why_not = f"localizing failed: {self._failure}" if self._failure else "localizing failed"
        cause = self._name_cause(step, events, result, shown)
        dropped = result is not None and cause.aftermath_of is not None and _most_rows(result, located,
                                                                                       self.process_group)
        if dropped:
            # a recovering model moves every row: the rows carrying such a step are not its cause. Named, they went
            # to the table and the ledger's blocklist (held-out tester, stop 52: 6-8 clean rows of 8 at 3-14% each
            # after an lr x50 step). A few rows that carry it (a garbage batch in a long lr plateau) stay named.
            result, shown, rows = None, None, None
            why_not = (f"aftermath of step {cause.aftermath_of} ({cause.name}): the rows that carry a step of its "
                       "recovery, most of the batch's, are not its cause")
        if result is not None:
            self._count(step, bool(result.culprits))  # a culprit at any level: token, span, sample, micro-batch
        # before the artifacts: the events table and the page say it, the culprit table whose fault its rows are
        events = with_cause(events, cause, data_fault(cause, result) if result is not None else None)
        if result is not None:
            self._write_artifacts(step, events, shown)
        else:
            self._record_detection(step, events, why_not)
        surgery = self._operate(step, result, located, f"not localized ({why_not})", cut) if self.surgery else None
        outcome = SpikeOutcome(step, events, cause, result, shown, why_not, surgery, rows)
        return outcome, _metrics(result, tried and not dropped, surgery)

    def _step(self, step: int, ctx: Any, grad_scale: Any, events: Sequence[SpikeEvent], junk: Any) -> Any:
        """The context as the localizer's step object, with the units the data signals point at (None, with
        a warning, when it cannot be read)."""
        from ..localizer.step import LocateStep

        try:
            flags = data_flags(events, ctx, junk, *self.flag_rule)
        except Exception as exc:  # a context of another shape: the spike is localized by its gradient alone
            warnings.warn(f"gradloc-track: reading which units the data signals flagged at step {step} failed: "
                          f"{exc!r}; the spike is localized without them")
            flags = ()
        try:
            return LocateStep.from_context(ctx, grad_scale=grad_scale, flagged=flags)
        except Exception as exc:  # forensics must never kill training
            self._failed(step, exc)
            return None

    def _write_artifacts(self, step: int, events: tuple[SpikeEvent, ...], shown: Any) -> None:
        """The localized spike's table and page (rank 0, which holds the gathered view, ``shown``)."""
        if self.artifact_writer is None or self.rank != 0:
            return
        try:
            self.artifact_writer.write(step, list(events), *((shown.result, shown.context) if shown else (None, None)))
        except Exception as exc:
            warnings.warn(f"gradloc-track: writing spike artifacts at step {step} failed: {exc!r}")

    @staticmethod
    def _cut() -> Any:
        """The sink ``locate`` fills with the culprits' summed gradient, so surgery needs no probe of its own."""
        from ..localizer.cut import CulpritCut

        return CulpritCut()

    def _operate(self, step: int, result: Any, located: Any, why: str, cut: Any = None) -> Any:
        """Spike surgery on this step's ``.grad`` (a collective under torch.distributed, like locating),
        with the step object the localizer took and the ``cut`` it filled; ``why``: the reason nothing is
        removed when ``result`` is None."""
        from ..localizer.surgery import SurgeryResult, operate

        if result is None:
            out = SurgeryResult(False, why)
        else:
            try:
                out = operate(self.model, located, result, cut)
            except Exception as exc:  # the step goes on as the clipper leaves it: never kill training
                warnings.warn(f"gradloc-track: spike surgery at step {step} failed: {exc!r}; the step is not operated")
                out = SurgeryResult(False, f"surgery failed: {exc!r}")
        if not out.applied:
            log.info("gradloc-track: step %d: spike surgery removed nothing: %s", step, out.reason)
        out.clipped_after = self.clips
        return out

    def _name_cause(self, step: int, events: Sequence[SpikeEvent], result: Any, shown: Any) -> Cause:
        """The step's cause (``monitor.cause_evidence``)."""
        from .cause_evidence import name_step_cause, weights_precision

        return name_step_cause(step, events, result, shown,
                               self.lr_history.pair() if self.lr_history is not None else (None, None),
                               self.incidents, weights_precision(self.model), self.replay_scales, self.joined)

    def check_weights(self, step: int) -> None:
        """A detected step whose weights hold a corrupt value is that weight's incident (``weight_check``: one
        read of the weights per detected step; an RMSNorm keeps a 4e36 weight's outputs finite, so not only
        numeric steps), said once; a weight found corrupt before and restored since (a checkpoint loaded) ends
        its incident first, so a new corruption is found. Collectives under torch.distributed: every rank."""
        if self.corrupt is not None and step != self.corrupt.step and \
                not weight_check.still_all(self.model, self.corrupt, self.process_group):
            self.corrupt = None  # restored: the incident is over
        if self.corrupt is None:
            self.corrupt = weight_check.scan_all(self.model, step, self.process_group)
            if self.corrupt is not None:
                warnings.warn(f"gradloc-track: step {step}: {self.corrupt.detail}", stacklevel=3)

    def _while_corrupt(self, step: int, events: Sequence[SpikeEvent]) -> SpikeOutcome | None:
        """A step while a weight found corrupt stays so: that incident's outcome, not localized again
        (None: no such incident, or the weight was restored, e.g. a checkpoint loaded into the model)."""
        if self.corrupt is None:  # (``check_weights`` ends a restored weight's incident first)
            return None
        cause = Cause("numeric", weight_check.corrupt_cause_words(self.corrupt, step),
                      aftermath_of=self.corrupt.step if step != self.corrupt.step else None)
        why = weight_check.why_not_localized(self.corrupt)
        events = with_cause(events, cause)
        self._record_detection(step, events, why)
        return SpikeOutcome(step, events, cause, not_localized=why)

    def why_not_localized(self, step: int, ctx: Any, events: Sequence[SpikeEvent] = ()) -> str | None:
        """Which setting, or which signal, keeps this spike from being localized (None: it is localized).
        A step only the optimizer's update fired on has an ordinary gradient (and, where watched, ordinary
        losses): a learning rate or an optimizer state made it, and the rows that carry most of an ordinary
        gradient are no culprits of it (held-out tester: clean rows named at such steps, for quarantine and
        surgery to act on). The events are the detector's verdict on reduced values, the same on every rank."""
        cfg = self.config
        if not cfg.enabled:
            return "locate.enabled=false"
        if events and all(e.signal == "update" for e in events):
            return ("only the optimizer's update fired (no gradient norm and no loss signal did): no sample "
                    "carries the step")
        if self.events_localized >= cfg.max_events:
            return ("locate.max_events=0" if cfg.max_events == 0 else
                    f"locate.max_events={cfg.max_events} reached (raise it to localize more spikes)")
        if step < self._retry_step:  # the detector keeps firing on batches without a culprit: back off
            return (f"backing off after {self.events_unconfirmed} spikes without a culprit "
                    f"(next try at step {self._retry_step})")
        if ctx is None:
            return self.no_context or "no spike_context passed to after_backward"
        return None

    def _record_detection(self, step: int, events: tuple[SpikeEvent, ...], why_not: str | None) -> None:
        """The detected spike's record (spikes/events row, spike_count) for a writer that keeps one."""
        if self.rank != 0 or self.artifact_writer is None:
            return
        try:
            self.artifact_writer.write_detection(step, list(events), why_not)
        except Exception as exc:  # forensics must never kill training
            warnings.warn(f"gradloc-track: recording the spike at step {step} failed: {exc!r}")

    def _localize(self, step: int, located: Any, cut: Any = None) -> Any:
        from .. import localizer  # imported here: the localizer is only needed on a spike

        cfg = self.config
        try:
            with torch.enable_grad():
                return localizer.locate(self.model, located, method=cfg.method, budget=cfg.budget,
                                        threshold=cfg.threshold, group_by=self.group_by,
                                        reuse_forward=cfg.reuse_forward, cut=cut)
        except Exception as exc:  # forensics must never kill training
            self._failed(step, exc)
            return None

    def _failed(self, step: int, exc: Exception) -> None:
        """Localizing raised: said now, and kept for the step's record (``respond``'s ``why_not``)."""
        self._failure = str(exc) or type(exc).__name__
        warnings.warn(f"gradloc-track: localizing the spike at step {step} failed: {exc!r}")

    def _view(self, step: int, result: Any, ctx: Any) -> tuple[Any, tuple[Any, Any] | None]:
        """The ``CulpritView`` the artifacts, the cause and the console show: under torch.distributed,
        rank 0's, with every culprit's sample gathered from its rank (a collective); None on a rank
        that shows nothing. Beside it, on every rank, every rank's culprit rows as ``(result, context)``
        (``SpikeOutcome.culprit_rows``: what a rank's quarantine blames)."""
        from ..localizer.culprit_view import CulpritView

        if not is_distributed():
            return CulpritView(result, ctx), (result, ctx)
        from ..localizer.dist_context import gather_culprit_rows  # a collective: culprit rows to every rank

        try:
            shown, shown_ctx = gather_culprit_rows(result, ctx, everywhere=True)
            return (CulpritView(shown, shown_ctx) if self.rank == 0 else None), (shown, shown_ctx)
        except Exception as exc:  # building the view after the collective: local, never fatal
            warnings.warn(f"gradloc-track: gathering the culprits' text at step {step} failed: {exc!r}; "
                          "the artifacts show rank 0's own batch; the quarantine blames no sample of this step")
            return (CulpritView(result, ctx) if self.rank == 0 else None), None

    def _count(self, step: int, found: bool) -> None:
        if found:
            self.events_localized += 1
            return
        self.events_unconfirmed += 1
        over = self.events_unconfirmed - self.config.max_events
        if over >= 0:
            self._retry_step = step + 2 ** min(over, 30)
            self._warn_once("unconfirmed", f"{self.events_unconfirmed} detected spikes (the last at step {step}) "
                            "had no culprit; further spikes without one are localized with growing gaps. "
                            "The detector fires on noise here: raise spikes.z_thresh or spikes.warmup_steps.")


def _most_rows(result: Any, located: Any, group: Any) -> bool:
    """Do the culprits lie in more than half the batch's rows (every rank's, equal batches)?"""
    _fns, masks, _labelled = located.micro_batches()
    per_mb = [int(m.shape[0]) for m in masks]
    named = {(c.rank, c.micro_batch, c.batch) for c in result.culprits if c.batch is not None}
    whole = {(c.rank, c.micro_batch) for c in result.culprits if c.batch is None}  # a micro-batch: all its rows
    n = len({key for key in named if key[:2] not in whole}) + sum(per_mb[mb or 0] for _, mb in whole)
    return 2 * n > sum(per_mb) * world_of(group)


def _metrics(result: Any, tried: bool, surgery: Any) -> dict[str, float]:
    """The spike's ``locate/*`` metrics (``locate/failed``: localizing was tried and raised) and surgery's."""
    out: dict[str, float] = {}
    if result is not None:
        out = {"locate/probes": float(result.probes), "locate/culprits": float(len(result.culprits)),
               "locate/threshold": float(result.threshold), "locate/seconds": float(result.wall_time_s)}
    elif tried:
        out = {"locate/failed": 1.0}
    if surgery is not None:
        out.update(surgery.metrics())
    return out
