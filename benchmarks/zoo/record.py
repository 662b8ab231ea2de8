"""What a zoo run records, step by step, so every trigger is scored on the same numbers.

A ``StepRecord`` holds what the monitor's detector saw (global and per-layer gradient norms, the
loss-token count) and the candidate signals the zoo measures itself with plain reference code
(batch and per-sample losses, the learning rate, the update Adam is about to make, ``g^2/v``), plus
what the live detector did (signals that fired, probes, cause). A ``RunRecord`` is one run of one
scenario and seed with its harm measurements; streams are saved as JSON so ``--replay`` re-scores
the anchors and the detector in seconds.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepRecord:
    step: int
    global_norm: float
    layers: dict[str, float]
    n_tokens: int
    injected: bool = False
    loss: float | None = None  # the step's training loss
    sample_losses: list[float] | None = None  # per-sample mean loss (B values)
    lr: float | None = None
    update: float | None = None  # norm of the update Adam is about to make (weight decay left out)
    update_layers: dict[str, float] | None = None
    gv_elem: float | None = None  # max over elements of g^2 / v (Adam's second moment before this step)
    gv_tensor: float | None = None  # max over tensors of mean(g^2) / mean(v)
    weight_norm: float | None = None
    fired: list[str] = field(default_factory=list)  # signals the live detector fired on
    probes: float | None = None  # locate/probes when the live event was localized
    locate_s: float | None = None
    cause: str | None = None  # SpikeEvent.cause / the event row's cause, when the library names one
    heldout: float | None = None  # held-out loss after the step (runs whose harm is read from the twin)
    fed: dict | None = None  # what the monitor fed the live detector beyond the norms (loss, update, ...)
    span_max: dict | None = None  # width -> the largest mean loss over that many consecutive terms (zoo's own)
    culprits: list | None = None  # the localizer's culprit rows when it ran (heldout zoo: zoo/culprits.py)
    truth: list | None = None  # the injected units a culprit row should name (heldout zoo)
    detail: str | None = None  # the cause in words (GradStats.cause_detail)


@dataclass
class Harm:
    """One injected step, from the same state: held-out loss after the injected step, after the clean
    twin's step, and after a step on another clean batch (how much a clean step moves it anyway)."""

    step: int
    injected: float
    clean: float
    swap: float

    @property
    def delta(self) -> float:
        """Held-out loss the injected step costs against the clean step (inf: a non-finite update)."""
        return math.inf if not math.isfinite(self.injected) else self.injected - self.clean

    @property
    def noise(self) -> float:
        return abs(self.swap - self.clean)


@dataclass
class RunRecord:
    family: str  # demo | hf | trl
    scenario: str
    seed: int
    cause: str  # the known cause: data | numeric | optimizer | schedule | irreproducible | none | placebo
    steps: list[StepRecord] = field(default_factory=list)
    harms: list[Harm] = field(default_factory=list)
    final_loss: float = math.nan  # held-out loss at the end
    twin_loss: float = math.nan  # the clean twin's held-out loss at the same step
    seconds: float = 0.0
    warmup: int = 20  # steps no trigger is scored on (every detector warms up)
    twin: str = "clean"  # the clean run of the same seed this one is compared with
    placebo: str = ""  # the run with other clean batches at the same steps (the final gap's control)
    source: str = ""  # the data source (heldout zoo: zoo/split.py)
    aftermath: int = 0  # steps after each injection that belong to its incident (heldout zoo)

    @property
    def injected_steps(self) -> list[int]:
        return [r.step for r in self.steps if r.injected]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunRecord":
        d = dict(d)
        d["steps"] = [StepRecord(**s) for s in d["steps"]]
        d["harms"] = [Harm(**h) for h in d["harms"]]
        return cls(**d)


def save_runs(runs: list[RunRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.to_json() for r in runs]))


def load_runs(path: Path) -> list[RunRecord]:
    return [RunRecord.from_json(d) for d in json.loads(path.read_text())]


class FeedRecorder:
    """Wraps a detector's ``update`` to keep the keywords the monitor passed (the step's losses, the
    optimizer's update, the weight norm): replays then feed the detector exactly what it saw live."""

    def __init__(self, detector: Any) -> None:
        self.last: dict = {}
        self._update = detector.update
        detector.update = self

    def __call__(self, step, global_norm, layer_norms=None, n_tokens=None, n_micro_batches=1, **signals):
        self.last = {k: v for k, v in signals.items() if v is not None and not callable(v)}
        text = signals.get("junk_text")
        if callable(text):  # read by the detector only when the junk rule would fire: keep what it read
            def read() -> str | None:
                self.last["junk_text"] = value = text()
                return value

            signals = {**signals, "junk_text": read}
        return self._update(step, global_norm, layer_norms, n_tokens, n_micro_batches, **signals)

    def take(self) -> dict:
        out, self.last = self.last, {}
        return out


def live_outcome(stats: Any) -> tuple[list[str], float | None, float | None, str | None]:
    """(signals that fired, probes, locate seconds, cause) of a monitor step's ``GradStats``."""
    events = list(getattr(stats, "events", None) or [])
    fired = [e.signal for e in events]
    m = getattr(stats, "metrics", {}) or {}
    cause = getattr(stats, "cause", None)
    for e in events:
        cause = cause or getattr(e, "cause", None)
    return fired, m.get("locate/probes"), m.get("locate/seconds"), cause
