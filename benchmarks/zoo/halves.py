"""Scoring the held-out zoo, each half of the split on its own, side by side (issue 37, item 4).

Per half (``split.half`` of each run's family, source and kind):

- **recall**: harmful injected steps the detector fired on, over harmful injected steps (harm as
  the spike zoo measures it, ``table.harm_of``: the step's held-out loss against the clean step's
  and a swap's, and the final loss against the placebo of the same seed, or the clean twin's at
  the same step when the kind has no placebo; a non-finite update is harm);
- **false events per 1000 clean steps**: events on the clean twins (every step from 0: the early
  transient counts), and on twins and placebos;
- **cause right**: live events at injected steps, and in the recovery window after each (the kind's
  ``aftermath``), whose cause is one of the kind's right causes (``split.KINDS``); an aftermath event
  counts as right when its cause is the incident's, or when its detail links it
  (``aftermath of step N``). The library does not link events yet (issue 37, item 5), so today an
  aftermath event is right only when it repeats the incident's cause;
- **culprit named**: injected steps of the kinds whose culprit is in the batch (data and RL kinds, at
  levels token, span, sample, document; not the numeric ``fp16_sample``, shown in its row) whose
  live localization named every injected unit at its level (``culprits.py``), over all such steps
  (a step the detector missed is not named); ``localizer alone`` is the same from ``--relocate``
  (the localizer re-run on the saved injected steps, detected or not).

Causes and culprits are the live run's (``--rescore`` re-runs the detector only).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from . import culprits
from .record import RunRecord
from .split import DATA_LEVELS, KINDS, half
from .table import harm_of

Trigger = Callable[[RunRecord], set]  # a run -> the steps the detector fires on
CLEAN = ("clean", "converged")
GOALS = {"recall": ">= 95%", "false": "<= 0.5", "cause": ">= 90%", "named": ">= 90%"}


def live(r: RunRecord) -> set[int]:
    """What the detector did in the run itself."""
    return {s.step for s in r.steps if s.fired}


def key(r: RunRecord) -> tuple[str, str, str]:
    return r.family, r.source, r.scenario


def is_clean(r: RunRecord) -> bool:
    return r.scenario in CLEAN or r.scenario.startswith("placebo")


def controls(runs: list[RunRecord], r: RunRecord) -> dict[int, SimpleNamespace]:
    """seed -> the final loss ``r``'s kind is compared with: its placebo's, else the twin's at that step."""
    out = {}
    for c in runs:
        if c.family != r.family or c.source != r.source:
            continue
        if r.placebo and c.scenario == r.placebo:
            out[c.seed] = SimpleNamespace(final_loss=c.final_loss)
        elif not r.placebo and c.scenario == r.twin and c.seed not in out and c.twin_loss is not None:
            out[c.seed] = SimpleNamespace(final_loss=c.twin_loss)
    return out


def windows(r: RunRecord) -> dict[int, int]:
    """step -> the injected step whose recovery window it is in (injected steps excluded)."""
    inj = sorted(r.injected_steps)
    out = {}
    for s in r.steps:
        if s.step in inj:
            continue
        before = [t for t in inj if 0 < s.step - t <= r.aftermath]
        if before:
            out[s.step] = before[-1]
    return out


def cause_ok(r: RunRecord, s, incident: int | None = None) -> bool:
    right = KINDS[r.scenario].causes if r.scenario in KINDS else (r.cause,)
    if s.cause in right:
        return True
    return incident is not None and f"aftermath of step {incident}" in (s.detail or "")


@dataclass
class Row:
    """One (family, source, kind) over its seeds."""

    family: str
    source: str
    kind: str
    half: str
    runs: list[RunRecord]
    harm: dict
    hits: int = 0
    n: int = 0  # injected steps
    cause: list[int] = field(default_factory=lambda: [0, 0])  # right, live events at injected steps
    after: list[int] = field(default_factory=lambda: [0, 0])  # right, live events in the recovery windows
    named: list[int] = field(default_factory=lambda: [0, 0])  # injected data steps named, of all
    localized: int = 0  # injected data steps the live localizer ran on
    alone: list[int] = field(default_factory=lambda: [0, 0])  # --relocate: named, of saved steps
    other: int = 0  # events outside the injected steps and their windows
    n_other: int = 0
    twice: int = 0  # sample rows naming a sample already named
    innocent: list[int] = field(default_factory=lambda: [0, 0])  # culprit rows in no injected unit, of all


def in_batch(kind: str) -> bool:
    """A culprit the batch carries (data and RL kinds): scored for culprit named. A numeric kind's sample
    (fp16_sample) is shown in its row, not counted there."""
    k = KINDS.get(kind)
    return k is not None and k.level in DATA_LEVELS and "numeric" not in k.causes


def score_row(row: Row, trig: Trigger, relocated: dict) -> None:
    data = KINDS.get(row.kind) is not None and KINDS[row.kind].level in DATA_LEVELS
    for r in row.runs:
        fired, inj, win = trig(r), set(r.injected_steps), windows(r)
        row.n += len(inj)
        row.hits += len(fired & inj)
        for s in r.steps:
            if s.step in inj and s.fired:
                row.cause[0] += cause_ok(r, s)
                row.cause[1] += 1
            elif s.step in win and s.fired:
                row.after[0] += cause_ok(r, s, win[s.step])
                row.after[1] += 1
            elif s.step not in inj and s.step not in win:
                row.n_other += 1
                row.other += s.step in fired
            if s.step in inj and data:
                got, want = culprits.named(s.truth or [], s.culprits if s.fired else None)
                row.named[0] += bool(want) and got == want
                row.named[1] += 1
                row.localized += s.culprits is not None
                row.twice += culprits.twice(s.culprits)
                bad, all_rows = culprits.innocent(s.truth or [], s.culprits if s.fired else None)
                row.innocent[0] += bad
                row.innocent[1] += all_rows
                alone = relocated.get((r.family, r.source, r.scenario, r.seed, s.step))
                if alone is not None:
                    row.alone[0] += alone
                    row.alone[1] += 1


def rows(runs: list[RunRecord], trig: Trigger, relocated: dict | None = None) -> list[Row]:
    by: dict[tuple, list[RunRecord]] = {}
    for r in runs:
        if not is_clean(r):
            by.setdefault(key(r), []).append(r)
    out = []
    for (fam, src, kind), rs in by.items():
        ctrl = {seed: c for seed, c in controls(runs, rs[0]).items()  # a NaN final loss has no gap (its harm is
                if math.isfinite(c.final_loss) and all(math.isfinite(x.final_loss) for x in rs if x.seed == seed)}
        row = Row(fam, src, kind, half(fam, src, kind), rs, harm_of(rs, ctrl))  # the non-finite update's)
        score_row(row, trig, relocated or {})
        out.append(row)
    return sorted(out, key=lambda w: (w.half, w.family, w.source, w.kind))


@dataclass
class Clean:
    family: str
    source: str
    half: str
    steps: int = 0
    events: list = field(default_factory=list)  # (kind, seed, step)
    steps_all: int = 0  # twins and placebos
    events_all: int = 0


def clean_rows(runs: list[RunRecord], trig: Trigger) -> list[Clean]:
    by: dict[tuple, Clean] = {}
    for r in runs:
        if not is_clean(r):
            continue
        c = by.setdefault((r.family, r.source), Clean(r.family, r.source, half(r.family, r.source, r.scenario)))
        fired = trig(r)
        c.steps_all += len(r.steps)
        c.events_all += len(fired)
        if not r.scenario.startswith("placebo"):
            c.steps += len(r.steps)
            c.events += [(r.scenario, r.seed, s) for s in sorted(fired)]
    return sorted(by.values(), key=lambda c: (c.half, c.family, c.source))


def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "–"


def summary(rs: list[Row], cs: list[Clean], name: str) -> dict[str, str]:
    harmful = [r for r in rs if r.half == name and r.harm["harmful"]]
    mine = [r for r in rs if r.half == name]
    clean = [c for c in cs if c.half == name]
    steps, events = sum(c.steps for c in clean), sum(len(c.events) for c in clean)
    steps_all, events_all = sum(c.steps_all for c in clean), sum(c.events_all for c in clean)
    cause = [sum(r.cause[0] + r.after[0] for r in mine), sum(r.cause[1] + r.after[1] for r in mine)]
    at_inj = [sum(r.cause[0] for r in mine), sum(r.cause[1] for r in mine)]
    named = [sum(r.named[0] for r in mine if in_batch(r.kind)), sum(r.named[1] for r in mine if in_batch(r.kind))]
    alone = [sum(r.alone[0] for r in mine if in_batch(r.kind)), sum(r.alone[1] for r in mine if in_batch(r.kind))]
    incidents = sum(r.n for r in mine if KINDS.get(r.kind) is not None and KINDS[r.kind].aftermath)
    after = [sum(r.after[0] for r in mine), sum(r.after[1] for r in mine)]
    per_kind = [r.hits / r.n for r in harmful if r.n]
    named_kind = [r.named[0] / r.named[1] for r in mine if in_batch(r.kind) and r.named[1]]
    return {
        "recall": _pct(sum(r.hits for r in harmful), sum(r.n for r in harmful)),
        "recall_kind": f"{100 * statistics.fmean(per_kind):.0f}% ({len(per_kind)})" if per_kind else "–",
        "named_kind": f"{100 * statistics.fmean(named_kind):.0f}% ({len(named_kind)})" if named_kind else "–",
        "false": f"{1000 * events / max(1, steps):.2f} ({events} in {steps})",
        "false_all": f"{1000 * events_all / max(1, steps_all):.2f} ({events_all} in {steps_all})",
        "cause": _pct(*cause),
        "cause_inj": _pct(*at_inj),
        "after": f"{after[0]}/{after[1]} right, {after[1] / max(1, incidents):.1f} per incident ({incidents})",
        "named": _pct(*named),
        "innocent": (f"{sum(r.innocent[0] for r in mine)} of {sum(r.innocent[1] for r in mine)}"
                     if any(r.innocent[1] for r in mine) else "–"),
        "alone": _pct(*alone),
    }


def render_summary(rs: list[Row], cs: list[Clean]) -> list[str]:
    d, h = summary(rs, cs, "dev"), summary(rs, cs, "heldout")
    lines = ["| metric | goal | dev | heldout |", "|---|---|---|---|"]
    names = [("recall", "harmful injected steps detected", "recall"),
             ("recall_kind", "... each harmful (family, source, kind) weighted alike (how many)", None),
             ("false", "false events per 1000 clean steps (clean twins)", "false"),
             ("false_all", "false events per 1000 clean steps (twins and placebos)", None),
             ("cause", "cause right (injected steps and their aftermath)", "cause"),
             ("cause_inj", "cause right at injected steps only", None),
             ("after", "events in the recovery windows of schedule and weight incidents", None),
             ("named", "culprit named at its level, data and RL injections (live)", "named"),
             ("named_kind", "... each (family, source, kind) weighted alike (how many)", None),
             ("innocent", "clean rows named beside them (culprit rows in no injected unit, of all)", None),
             ("alone", "culprit named at its level, localizer alone (--relocate)", None)]
    for k, label, goal in names:
        lines.append(f"| {label} | {GOALS[goal] if goal else ''} | {d[k]} | {h[k]} |")
    return lines


def render_rows(rs: list[Row]) -> list[str]:
    lines = ["| half | family | source | kind | harm: step + / swap | final + | harmful | detected | cause right "
             "(injected) | aftermath events right | culprit named (live / localized / alone) | other events /1000 "
             "| s/run |", "|---" * 13 + "|"]
    for r in rs:
        h = r.harm
        step = "non-finite" if h["nonfinite"] else f"{h['step']:+.2g} (t {h['t']:.1f})"
        detected = _pct(r.hits, r.n) if h["harmful"] else f"({r.hits}/{r.n})"
        data = KINDS.get(r.kind) is not None and KINDS[r.kind].level in DATA_LEVELS
        named = f"{r.named[0]}/{r.named[1]} / {r.localized} / {r.alone[0]}/{r.alone[1]}" if data else "–"
        if r.twice:
            named += f" ({r.twice} twice)"
        secs = statistics.fmean(x.seconds for x in r.runs)
        gap = f"{h['gap']:+.4f}" if not math.isnan(h["gap"]) else "–"
        lines.append(f"| {r.half} | {r.family} | {r.source} | {r.kind} | {step} / {h['swap']:.2g} | {gap} | "
                     f"{'yes' if h['harmful'] else 'no'} | {detected} | {r.cause[0]}/{r.cause[1]} | "
                     f"{r.after[0]}/{r.after[1]} | {named} | {1000 * r.other / max(1, r.n_other):.1f} | {secs:.0f} |")
    return lines


def render_clean(cs: list[Clean]) -> list[str]:
    lines = ["| half | family | source | clean steps | events | /1000 | where (kind seed:step) |", "|---" * 7 + "|"]
    for c in cs:
        where = " ".join(f"{k}{s}:{t}" if k != "clean" else f"{s}:{t}" for k, s, t in c.events[:12])
        more = f" (+{len(c.events) - 12})" if len(c.events) > 12 else ""
        lines.append(f"| {c.half} | {c.family} | {c.source} | {c.steps} | {len(c.events)} | "
                     f"{1000 * len(c.events) / max(1, c.steps):.2f} | {where}{more} |")
    return lines


def render(runs: list[RunRecord], trig: Trigger = live, relocated: dict | None = None) -> str:
    rs, cs = rows(runs, trig, relocated), clean_rows(runs, trig)
    out = ["### Both halves", ""] + render_summary(rs, cs)
    out += ["", "### Scenarios", ""] + render_rows(rs)
    out += ["", "### Clean runs (false events)", ""] + render_clean(cs)
    return "\n".join(out)
