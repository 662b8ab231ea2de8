"""The spike detector: adaptive z-scores, in log space, on the gradient norms (global and per layer)
and on what else the step shows: its loss, its largest per-sample loss, the update the optimizer is
about to make.

Every signal is a ``LogSignal`` (``spikes/signal.py``): a baseline that follows early training's
fall (~10 steps) and a variance and fourth moment over ~100 steps. After its warm-up a signal fires
when ``z > z_eff and ratio > min_ratio`` (``loss_min_ratio`` for the losses, which must also rise
``loss_min_rise`` / ``sample_min_rise`` nats: a memorised loss of 0.1 doubles on a clean batch), or ``ratio >
ratio_thresh`` (a 20x safety net, gradient norms only), and the optimizer's update above
``update_ratio_thresh`` (3x: Adam normalises its step, so a clean update barely moves).

Why several signals (issue 26, measured on ``benchmarks/spike_zoo.py``): harm is what counts, and
the global norm is a poor witness of it. A few corrupted samples among many move the batch loss
far more, relative to its noise, than the gradient norm (whose small-batch noise is heavy-tailed:
one rare token can hold most of a clean batch's squared norm); a learning-rate jump or Adam's
preconditioner losing track of a tensor (``v`` decayed, then a normal gradient) change the update,
not the gradient; a single layer exploding hides in the global norm (GradLoc's "layerwise
heterogeneity"). The signals a step does not provide (no loss given, an optimizer without a
second moment) are simply absent.

Calibration (issue 13): how noisy a signal is depends on the batch. ``tail_correction`` scales the
threshold with the observed tails, ``z_eff = z_thresh * clamp((kurtosis / 3) ** 0.25, 1, 2)``: by
the fourth-moment (Markov) bound ``P(|d| > k sigma) <= kurtosis / k**4`` this keeps the bound on
the false-alarm rate where ``z_thresh`` puts it for Gaussian noise. The bound is for one signal's own tail;
when many layers move at once it is not a tail event, so the broad rule (``broad_z``, ``broad_share``) fires
the global norm at its plain z when at least that share of the layers pass ``broad_z`` too (junk targets in
a few rows of a 1024-term batch: the global norm at z 7-10 and most layers past z 5, under 8 x a code corpus's
tail factor of 1.2-1.55).
``spike/threshold`` is the bar of the global norm alone, without that rule.

On a step the detector caught (any signal fired), every signal moves its baseline by its value
clipped to ``exp(m +- z_eff * sqrt(v))`` and keeps the step out of its variance and fourth moment,
so the spike does not raise the threshold, while a genuine level shift is still followed over a few
steps. A value far below the baseline is absorbed clipped to ``exp(m - z_eff * sqrt(v))``. Non-finite
values (norms, losses) always fire and are never absorbed; a zero value (no gradient: an all-masked
batch, ``loss * 0``, a layer unused this step) neither fires nor enters, and a layer seen at zero
after it had a gradient, while others have one (a mixture-of-experts expert, a conditional branch),
loses the ratio net: its norm follows how many tokens reach it (a rarely routed expert goes 20-200x
between clean steps: held-out tester, stop 55), and only the z rule, which learns that spread, reads
it. A gradient norm below
``noise_floor`` times the parameter norm is float noise (RL groups whose gradients cancel: 7.6e-8
against weights of norm ~30 fired as "436.8x its running mean 1.74e-10" in 0.3): the norm signals
skip the step, they neither fire nor learn from it.

``mode="fixed"`` is GradLoc's trigger exactly: fire when the global norm exceeds
``per_token_threshold / sqrt(n_tokens) * n_micro_batches`` (``n_tokens``: loss tokens of the whole
step; Tencent-Hunyuan/GradLoc ``patches/gradloc.patch``); unlike GradLoc it also fires on NaN/Inf.
It reads nothing else.

The junk signal (``spikes/junk.py``) is no z-score: it fires when ``junk_terms`` consecutive loss
terms average more than ``junk_margin`` nats above a random token's loss (the model rates them
below chance) once the model has learned (its batch averages ``junk.LEARNED`` nats below chance)
and the signal has seen ``warmup_steps`` steps. Chance is a fixed reference, so no history is kept.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from ..config import SpikeConfig
from .event import SpikeEvent
from .fixed_trigger import fixed_events
from .junk_signals import JunkSignals
from .score import RunningWindow
from .signal import MAX_LOG, LogSignal
from .transient import Transient
from .text_check import WindowText

# the statistics of the non-norm signals live under these keys (a layer cannot be named so)
EXTRA = {"loss": "@loss", "sample_loss": "@sample_loss", "update": "@update"}
SMOOTH = frozenset({"@loss", "@sample_loss"})  # averages over many tokens: their fall is forecast too
NAMES_READ = 2  # a state's layer names are as the monitor reads them (2: PEFT's base_model.model. dropped too)
SHIFT_STEPS = 3  # a signal above its band this many steps in a row has moved, not spiked: it is taken in


@dataclass
class StepSignals:
    """What a step shows beyond its gradient norms; ``None``: the step does not say."""

    loss: float | None = None  # the step's training loss
    sample_losses: Sequence[float] | None = None  # each sample's mean loss (spikes.sample_loss)
    update: float | None = None  # norm of the update the optimizer is about to make
    weight_norm: float | None = None  # the parameters' norm (the scale of float noise)
    # (largest run's excess over chance, the batch's mean excess[, the largest row's leaked-label share])
    junk_span: Sequence[float] | None = None
    junk_text: Callable[[], str | WindowText | None] | None = None  # the junk run's text, asked when it would fire


@dataclass
class _Pending:
    sig: LogSignal
    lx: float
    band: float


class SpikeDetector:
    """``update(step, global_norm, layer_norms, ..., loss=, sample_losses=, update=, weight_norm=)
    -> list[SpikeEvent]``; ``metrics()`` for logging.

    Metric keys (``metrics()``):

    - ``spike/detected``: 1 on a step the detector fired, else 0
    - ``spike/detected_total``: steps it has fired on so far
    - ``spike/threshold``: the global norm above which this step would have fired on its own (adaptive:
      ``baseline * min(exp(max(z_eff * sigma, log(min_ratio))), ratio_thresh)``; fixed: GradLoc's threshold); plot
      it with ``grad_norm/global``
    - ``spike/ratio``: global norm / its running baseline (fixed: / the threshold)
    - ``spike/zscore``: z-score of the global log-norm; ``spike/zscore_max_layer``: the largest
      layer z-score (adaptive mode, after warm-up)
    - ``spike/zscore_loss``, ``spike/zscore_sample_loss``, ``spike/zscore_update``: the z-scores of
      the loss, the largest per-sample loss and the optimizer's update, on steps that provide them
    - ``spike/junk_span``, ``spike/junk_mean``: the largest run's mean excess over chance and the
      batch's (nats a term; ``spikes/junk.py``), on steps that provide them
    - ``spike/transient``: 1 on a step past ``warmup_steps`` still in early training's fall (gradient norms
      that jump alone, finite, the step's under ``ratio_thresh``, do not fire; ``spikes.transient_fall``), 0 once
      it has ended
    - ``spike/junk_excused``: 1 on a step whose junk run would have fired but decodes to plainly clean
      text (``spikes.text_check``: a run of one character, letters of a non-Latin script, words its
      tokenizer wrote), else 0
    - ``spike/leaked_labels``: the largest row's share of terms whose target is their own input token
      (``spikes.junk.leaked``; fires at ``junk.LEAKED``), on steps that provide it
    - ``spike/noise_floor``: 1 on a step whose gradient norm is below the noise floor (skipped)
    - ``spike/olmo_score``: OLMo-core's stability score, the fraction of steps so far whose global
      norm exceeded mean + 6 sigma of the previous ``score_window`` values (a separate, fixed rule
      kept for comparison with OLMo runs; it is not what fires the detector)
    """

    def __init__(self, config: SpikeConfig | None = None, **overrides: Any) -> None:
        self.config = config = _as_config(config, overrides)
        self.signals: dict[str, LogSignal] = {}
        self.count = 0
        self._history = RunningWindow(config.score_window)
        self._score_hits = 0
        self._score_seen = 0
        self._last: dict[str, float] = {}
        self._z: dict[str, float] = {}  # latest z per signal
        # layers seen without a gradient on some step (a mixture-of-experts expert, a conditional branch): their
        # norm follows how much of the batch reaches them, so only the z rule reads them, not the ratio net
        self._conditional: set[str] = set()
        self._last_step: int | None = None
        self.junk = JunkSignals(config)  # the junk run and leaked labels (no z-scores)
        self.transient = Transient(config.transient_fall, config.warmup_steps)

    @property
    def zscores(self) -> dict[str, float]:
        """The last step's z-score of each signal it read (``global``, each layer, ``@loss``, ...): what the rules
        compared with their bars (none for a signal in its warm-up or without a value that step)."""
        return dict(self._z)

    @property
    def junk_excused(self) -> tuple[str, str] | None:
        """(text, why) of the last junk run found to be plainly clean text (``spikes.text_check``)."""
        return self.junk.excused

    @property
    def needs_token_count(self) -> bool:
        """GradLoc's fixed trigger (``mode="fixed"``) divides by the step's loss-token count."""
        return self.config.mode == "fixed"

    @property
    def wants(self) -> frozenset[str]:
        """The step inputs this detector reads beyond the norms (the monitor computes only these)."""
        cfg = self.config
        if cfg.mode == "fixed":
            return frozenset()
        on = {"loss": cfg.loss_signal, "sample_losses": cfg.sample_signal, "update": cfg.update_signal,
              "weight_norm": cfg.noise_floor > 0, "junk_span": cfg.junk_signal}
        return frozenset(k for k, v in on.items() if v)

    def update(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None = None,
               n_tokens: int | None = None, n_micro_batches: int = 1, *, loss: float | None = None,
               sample_losses: Sequence[float] | None = None, update: float | None = None,
               weight_norm: float | None = None, junk_span: Sequence[float] | None = None,
               junk_text: Callable[[], str | WindowText | None] | None = None) -> list[SpikeEvent]:
        """Feed one step. ``n_tokens`` (loss tokens of the whole step) and ``n_micro_batches`` are read
        by ``mode="fixed"`` only; ``loss``, ``sample_losses``, ``update`` and ``weight_norm`` (see
        ``StepSignals``) by the adaptive mode when their signal is on; ``junk_span``: (the largest run's
        mean excess over chance, the batch's mean excess), nats a term (``spikes.junk.junk_span``);
        ``junk_text``: called only when the junk rule would fire, the run's decoded text, or a
        ``WindowText`` that also says whether the tokenizer wrote it (None: unknown);
        plainly clean text does not fire (``spikes.text_check``). A repeated step changes nothing."""
        cfg = self.config
        if self._last_step is not None and step == self._last_step:
            warnings.warn(f"gradloc-track: SpikeDetector.update called twice for step {step}; the repeat is "
                          "ignored (its statistics advance once per step)", stacklevel=2)
            return []
        self._last_step = step
        self._score(global_norm)
        if cfg.mode == "fixed":
            events = fixed_events(cfg.per_token_threshold, step, global_norm, n_tokens, n_micro_batches, self._last)
        else:
            events = self._adaptive(step, global_norm, layer_norms,
                                    StepSignals(loss, sample_losses, update, weight_norm, junk_span, junk_text))
        self.count += len(events) > 0
        self._last["spike/detected"] = float(len(events) > 0)
        self._last["spike/detected_total"] = float(self.count)
        return events

    def metrics(self) -> dict[str, float]:
        out = dict(self._last)
        out["spike/olmo_score"] = self._score_hits / self._score_seen if self._score_seen else 0.0
        return out

    # -- internals ---------------------------------------------------------------------
    def _adaptive(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None,
                  extra: StepSignals) -> list[SpikeEvent]:
        """Check every signal first, absorb afterwards: whether the step fired decides how."""
        pending: list[_Pending] = []
        events = self._norm_events(step, global_norm, layer_norms, extra.weight_norm, pending)
        events += self._extra_events(step, extra, pending)
        if events and self.transient.active(self.signals.get(EXTRA["loss"])) and all(
                e.is_norm and math.isfinite(e.value) for e in events) and all(
                e.ratio <= (self.config.ratio_thresh or math.inf) for e in events if e.signal == "global"):
            events = []  # early training's transient: gradient norms jumping alone, the step's under the safety net
        self._absorb(pending, fired=bool(events))
        self.transient.follow(self.signals.get(EXTRA["loss"]), self._last)
        return events

    def _below_floor(self, global_norm: float, weight_norm: float | None) -> bool:
        """Is this step's gradient float noise (a norm below ``noise_floor`` x the parameter norm)?"""
        floor = self.config.noise_floor
        noise = (floor > 0 and weight_norm is not None and math.isfinite(global_norm) and global_norm > 0
                 and math.isfinite(weight_norm) and global_norm < floor * weight_norm)
        if weight_norm is not None:
            self._last["spike/noise_floor"] = float(noise)
        return noise

    def _norm_events(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None,
                     weight_norm: float | None, pending: list[_Pending]) -> list[SpikeEvent]:
        """The global norm's and each layer's verdict (none on a step below the noise floor)."""
        if self._below_floor(global_norm, weight_norm):
            for key in ("spike/zscore", "spike/ratio", "spike/zscore_max_layer"):  # none read this step (review)
                self._last.pop(key, None)
            return []
        events = []
        global_ev = self._check("global", "global", step, global_norm, pending, self.config.min_ratio,
                                self.config.ratio_thresh)
        if global_ev:
            events.append(global_ev)
        if self.config.per_layer and layer_norms:
            zmax = -math.inf
            layer_events = []
            for name, x in layer_norms.items():
                # a layer this step did not reach while others learned, after it had learned itself (module doc; a
                # step with no gradient at all, loss * 0, says nothing of one layer; nor does step 0 of a layer
                # behind a zero-initialised one, a zeroed head or LoRA's B: review, stop 55)
                seen = self.signals.get(name)
                if x <= 0.0 < global_norm and seen is not None and seen.n > 0:
                    self._conditional.add(name)
                net = None if name in self._conditional else self.config.ratio_thresh
                ev = self._check(name, name, step, x, pending, self.config.min_ratio, net)
                zmax = max(zmax, self._z.get(name, -math.inf))
                if ev:
                    layer_events.append(ev)
            events += sorted(layer_events, key=lambda e: -e.z)
            broad = None if global_ev else self._broad_event(step, global_norm, layer_norms)
            if broad:
                events.insert(0, broad)
            if zmax > -math.inf:
                self._last["spike/zscore_max_layer"] = zmax if math.isfinite(zmax) else 0.0
            else:  # no layer had a z this step (all zero, or in their warm-up): not the last step's again
                self._last.pop("spike/zscore_max_layer", None)
        return events

    def _broad_event(self, step: int, global_norm: float, layer_norms: Mapping[str, float]) -> SpikeEvent | None:
        """``spikes.broad_z``: the global norm fires below its tail-corrected bar when its plain z passes ``broad_z``
        and so do at least ``broad_share`` of the layers read this step. The tail correction is there for one
        heavy-tailed layer's rare token; junk across several rows moves most layers at once."""
        cfg = self.config
        z = self._z.get("global")
        if cfg.broad_z is None or z is None or not math.isfinite(global_norm):
            return None
        ratio = self._last.get("spike/ratio", 0.0)
        zs = [self._z[k] for k in layer_norms if k in self._z]
        if not (z > cfg.broad_z and ratio > cfg.min_ratio and zs):
            return None
        if sum(v > cfg.broad_z for v in zs) < cfg.broad_share * len(zs):
            return None
        return SpikeEvent(step, "global", global_norm, self.signals["global"].baseline, z, ratio)

    def _extra_events(self, step: int, extra: StepSignals, pending: list[_Pending]) -> list[SpikeEvent]:
        """The loss, the largest per-sample loss and the update, where the step gives them."""
        cfg = self.config
        values = {}
        if cfg.loss_signal and extra.loss is not None:
            values["loss"] = float(extra.loss)
        if cfg.sample_signal and extra.sample_losses is not None:
            # -inf: a sample without loss terms (all masked), which is no sample; NaN and +inf still fire
            vals = [v for v in map(float, extra.sample_losses) if v != -math.inf]
            if vals:
                values["sample_loss"] = math.nan if not all(map(math.isfinite, vals)) else max(vals)
        if cfg.update_signal and extra.update is not None:
            values["update"] = float(extra.update)
        events = self.junk.events(step, extra.junk_span, extra.junk_text, self._last)
        for name in ("loss", "sample_loss", "update"):
            if name not in values:  # not read this step (the update after a step that fired): no z logged, not the
                self._last.pop(f"spike/zscore_{name}", None)  # last one again (held-out testers, stop 55)
        for name, x in values.items():
            ratio, rise = {"loss": (cfg.loss_min_ratio, cfg.loss_min_rise),
                           "sample_loss": (cfg.sample_min_ratio, cfg.sample_min_rise)}.get(name, (cfg.min_ratio, 0.0))
            ev = self._check(EXTRA[name], name, step, x, pending, ratio,
                             safety_net=cfg.update_ratio_thresh if name == "update" else None,
                             z_thresh=cfg.update_z_thresh if name == "update" else cfg.loss_z_thresh, min_rise=rise)
            if EXTRA[name] in self._z:  # a z computed this step (none for a value <= 0 or in the warm-up)
                self._last[f"spike/zscore_{name}"] = min(self._z[EXTRA[name]], 1e6)
            else:
                self._last.pop(f"spike/zscore_{name}", None)
            if ev:
                events.append(ev)
        return events

    def _absorb(self, pending: list[_Pending], fired: bool) -> None:
        """A step the detector caught (on any signal: a layer's spike is the global norm's too) moves
        each baseline by its value clipped to the band and leaves the variance and tails alone, so
        the spike raises no threshold; other steps are absorbed whole, a value far below the
        baseline (a near-empty batch) clipped to the band."""
        cfg = self.config
        for p in pending:
            f = p.sig.forecast
            above = p.lx > f + p.band
            p.sig.streak = p.sig.streak + 1 if above else 0
            if above and p.sig.streak >= SHIFT_STEPS:  # not a spike: the signal moved to a new level
                p.sig.absorb(p.lx, cfg.alpha, cfg.baseline_alpha, cfg.warmup_steps)
                continue
            lx = max(p.lx, f - p.band)
            if fired:
                lx = min(lx, f + p.band)
            p.sig.absorb(lx, cfg.alpha, cfg.baseline_alpha, cfg.warmup_steps, moments=not fired)

    def _check(self, key: str, name: str, step: int, x: float, pending: list[_Pending], min_ratio: float,
               safety_net: float | None, z_thresh: float | None = None,
               min_rise: float = 0.0) -> SpikeEvent | None:
        """Does ``x`` fire on signal ``key`` (reported as ``name``)? ``safety_net``: the ratio above which
        it fires whatever the noise (None: none); ``min_rise``: how far above the forecast, in the value's own
        units (the losses' nats), a value the z rule fires on must also be. A post-warm-up value joins ``pending``
        for ``_absorb``."""
        cfg = self.config
        sig = self.signals.get(key)
        if sig is None:
            sig = self.signals[key] = LogSignal(falls=key in SMOOTH)
        if not math.isfinite(x):  # always fires, never enters the statistics
            self._z[key] = math.inf
            return SpikeEvent(step, name, x, sig.baseline if sig.n else 0.0, math.inf, math.inf)
        if x <= 0.0:  # no gradient (an all-masked batch, loss * 0, an unused layer): no spike, no sample
            self._z.pop(key, None)  # and no z-score: the last one is not this step's (review, stop 55)
            if key == "global":
                self._last.pop("spike/zscore", None)
                self._last.pop("spike/ratio", None)
            return None
        lx = math.log(x)
        if sig.n < max(1, cfg.warmup_steps):
            sig.absorb(lx, cfg.alpha, cfg.baseline_alpha, cfg.warmup_steps)
            return None
        z, ratio = sig.z_ratio(lx)
        self._z[key] = z
        z_eff = (z_thresh if z_thresh is not None else cfg.z_thresh) * (sig.tail_factor() if cfg.tail_correction
                                                                        else 1.0)
        band = z_eff * math.sqrt(sig.var)
        pending.append(_Pending(sig, lx, band))
        if key == "global":
            self._last["spike/zscore"], self._last["spike/ratio"] = z, ratio
            level = max(band, math.log(cfg.min_ratio))
            if safety_net is not None:  # the net fires below the noise band too (round 9: 341.7 read, 68 fired)
                level = min(level, math.log(safety_net))
            self._last["spike/threshold"] = math.exp(min(MAX_LOG, sig.forecast + level))
        net = safety_net is not None and ratio > safety_net
        if (z > z_eff and ratio > min_ratio and x - x / ratio > min_rise) or net:
            return SpikeEvent(step, name, x, sig.baseline, z, ratio)
        return None

    def _score(self, g: float) -> None:
        if len(self._history) >= min(16, self.config.score_window):
            self._score_seen += 1
            self._score_hits += (not math.isfinite(g)) or self._history.is_spike(g)
        if math.isfinite(g) and g > 0:  # a zero-gradient step is no sample of the norm
            self._history.append(g)

    def state_dict(self) -> dict[str, Any]:
        return {"signals": {k: s.as_tuple() for k, s in self.signals.items()},
                "count": self.count,
                "history": list(self._history), "score": (self._score_hits, self._score_seen),
                "last_step": self._last_step, "junk_seen": self.junk.seen, "junk_recent": self.junk.recent,
                "transient": self.transient.state(), "names_as_read": NAMES_READ,
                "conditional": sorted(self._conditional)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # older states hold 3 (0.1: m4 = 0), 6 (0.3: no trend) or 8 (no warm-up fourth moment: d4 = 0) values
        from ..grouping import PEFT_PREFIX, saved_without_wrapper

        saved = state["signals"]
        layers = [k for k in saved if k != "global" and not k.startswith("@")]
        # a state from before DDP's ``module.`` was dropped from layer names: as they read now. A state that
        # says its names are as read (a user's own submodule called ``module`` keeps its name) is taken as is,
        # but for PEFT's ``base_model.model.``, read before stop 57 (names_as_read True; 2 since)
        read = state.get("names_as_read")
        renamed = {} if read == NAMES_READ else dict(zip(layers, saved_without_wrapper(
            layers, prefixes=(PEFT_PREFIX,) if read else ("module.", PEFT_PREFIX))))
        self.signals = {renamed.get(k, k): LogSignal(*v, falls=k in SMOOTH) for k, v in saved.items()}
        self.count = int(state["count"])
        self._history = RunningWindow(self.config.score_window, state["history"])
        self._score_hits, self._score_seen = state["score"]
        self._last_step = state.get("last_step")
        self.junk.seen = int(state.get("junk_seen", 0))
        self.junk.recent = float(state.get("junk_recent", math.inf))
        self.transient.load(state.get("transient"))
        self._conditional = {renamed.get(k, k) for k in state.get("conditional", [])}


def _as_config(config: SpikeConfig | None, overrides: dict[str, Any]) -> SpikeConfig:
    """``SpikeDetector(config)`` or ``SpikeDetector(**options)``, checked."""
    if config is None:
        known = {f.name for f in fields(SpikeConfig)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"SpikeDetector got unknown option(s) {sorted(unknown)}; valid: {sorted(known)}")
        return SpikeConfig(**overrides)
    if overrides:
        raise TypeError("pass either config=SpikeConfig(...) or option keywords, not both")
    if not isinstance(config, SpikeConfig):
        raise TypeError(f"SpikeDetector: config must be a gradloc_track.config.SpikeConfig, "
                        f"got {type(config).__name__}")
    return config
