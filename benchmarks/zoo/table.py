"""Scoring a zoo: recall over the harmful injected steps and false events per 1000 clean steps, for
the live detector and every anchor on the same streams; the markdown tables.

Harm (per scenario, over seeds): each injected step's held-out loss after it minus after the clean
twin's step from the same state (``step +``, with its t over the steps), beside what a step on
another clean batch moves it (``swap``), and the final held-out loss minus the placebo's (``final +``:
the same seed with other clean batches swapped in at the same steps, so what is left is the
injection's, not any change of those steps; paired by seed). A scenario is harmful when a step's
update is non-finite, when its step harm is positive with t >= 2 and at least a tenth of the swap,
or when its final excess exceeds 0.002 and twice its standard error; every injected step of a harmful
scenario is a harmful step (damage that accumulates, as a learned junk answer, is made of steps that
each look small).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

from . import anchors
from .detector_03 import fire_03
from .record import RunRecord

@dataclass
class Family:
    name: str
    scenarios: list[RunRecord] = field(default_factory=list)
    clean: list[RunRecord] = field(default_factory=list)  # clean twins (scored for false events)
    calibration: list[RunRecord] = field(default_factory=list)  # GradLoc's T comes from these


def triggers(fam: Family, ours: Callable | None = None) -> dict[str, Callable]:
    """The triggers scored side by side; ``ours``: the library's detector re-run on the recorded inputs
    (``--replay --rescore``) instead of what fired live."""
    warm = max([r.warmup for r in fam.calibration] or [20])
    T = anchors.gradloc_threshold([r.steps for r in fam.calibration], warm)
    return {"ours": ours or anchors.live, "ours 0.3": fire_03, f"GradLoc T={T:.3g}": anchors.gradloc(T),
            "ZClip": anchors.zclip, "OLMo 6σ": anchors.olmo}


def harm_of(runs: list[RunRecord], controls: dict[int, RunRecord]) -> dict:
    """The scenario's harm: per injected step (``step``: mean of held-out loss after the injected step
    minus after the clean step, with its t over the steps; ``swap``: how far a step on another clean
    batch moves it), and at the end against the placebo of the same seed (other clean batches at
    the same steps: what any change of those steps costs), paired by seed."""
    deltas = [h.delta for r in runs for h in r.harms]
    noise = [h.noise for r in runs for h in r.harms]
    excess = [r.final_loss - controls[r.seed].final_loss for r in runs if r.seed in controls]
    finite = [d for d in deltas if math.isfinite(d)]
    out = {"step": statistics.fmean(finite) if finite else math.nan, "nonfinite": len(deltas) - len(finite),
           "swap": statistics.fmean(noise) if noise else math.nan,
           "gap": statistics.fmean(excess) if excess else math.nan,
           "gap_sd": statistics.stdev(excess) if len(excess) > 1 else 0.0}
    t = (out["step"] / (statistics.stdev(finite) / math.sqrt(len(finite)))
         if len(finite) > 1 and statistics.stdev(finite) > 0 else 0.0)
    se = out["gap_sd"] / math.sqrt(len(excess)) if excess else 0.0
    out["t"] = t
    out["harmful"] = bool(out["nonfinite"] or (t >= 2 and out["step"] >= 0.1 * out["swap"])
                          or (excess and out["gap"] > max(0.002, 2 * se)))
    return out


def _cell(hit: int, n: int) -> str:
    return f"{hit}/{n}" if n else "–"


def _score(runs: list[RunRecord], trig: dict[str, Callable]) -> dict:
    """Hits at injected steps, events at other steps, probes and causes of the live events."""
    out = {"hits": {k: 0 for k in trig}, "other": {k: 0 for k in trig}, "n": 0, "n_other": 0, "probes": [],
           "causes": [0, 0]}
    for r in runs:
        inj = {s for s in r.injected_steps if s >= r.warmup}
        out["n"] += len(inj)
        out["n_other"] += len([s for s in r.steps if s.step >= r.warmup]) - len(inj)
        for k, fn in trig.items():
            fired = {s for s in fn(r.steps) if s >= r.warmup}
            out["hits"][k] += len(fired & inj)
            out["other"][k] += len(fired - inj)
        for s in r.steps:
            if s.step in inj and s.fired:
                if s.probes is not None:
                    out["probes"].append(s.probes)
                if s.cause is not None:
                    out["causes"][0] += s.cause == r.cause
                    out["causes"][1] += 1
    return out


def by_scenario(fam: Family) -> list[tuple[str, list[RunRecord], dict]]:
    """(scenario, its runs over seeds, its harm) for each scenario of the family."""
    twins: dict[str, dict[int, RunRecord]] = {}
    for r in fam.clean:
        twins.setdefault(r.scenario, {})[r.seed] = r
    by: dict[str, list[RunRecord]] = {}
    for r in fam.scenarios:
        by.setdefault(r.scenario, []).append(r)
    return [(name, runs, harm_of(runs, twins.get(runs[0].placebo) or twins.get(runs[0].twin, {})))
            for name, runs in by.items()]


def scenario_rows(fam: Family, trig: dict[str, Callable]) -> list[str]:
    rows = []
    for name, runs, h in by_scenario(fam):
        sc = _score(runs, trig)
        step = "non-finite" if h["nonfinite"] else f"{h['step']:+.2g} (t {h['t']:.1f})"
        recall = " | ".join(_cell(sc["hits"][k], sc["n"]) if h["harmful"] else f"({_cell(sc['hits'][k], sc['n'])})"
                            for k in trig)
        probes = f"{statistics.fmean(sc['probes']):.1f}" if sc["probes"] else "–"
        ok, n_causes = sc["causes"]
        other = " ".join(f"{1000 * sc['other'][k] / max(1, sc['n_other']):.1f}" for k in trig)
        rows.append(f"| {name} | {runs[0].cause} | {step} / {h['swap']:.2g} | {h['gap']:+.4f} ± {h['gap_sd']:.4f} "
                    f"| {'yes' if h['harmful'] else 'no'} | {recall} | {probes} | "
                    f"{statistics.fmean(r.seconds for r in runs):.0f} | {f'{ok}/{n_causes}' if n_causes else 'n/a'} "
                    f"| {other} |")
    return rows


def clean_row(fam: Family, trig: dict[str, Callable], twins_only: bool = False) -> str:
    """False events per 1000 clean steps: every clean run (twins and placebos), or the clean twins only
    (``twins_only``: each clean batch counted once; a placebo replays its twin's batches from a nearly
    equal state, so a clean batch that fires there fires in most of them)."""
    runs = [r for r in fam.clean if not twins_only or r.cause == "none"]
    steps = sum(len([s for s in r.steps if s.step >= r.warmup]) for r in runs)
    cells = []
    for fn in trig.values():
        ev = sum(len({s for s in fn(r.steps) if s >= r.warmup}) for r in runs)
        cells.append(f"{1000 * ev / max(1, steps):.2f} ({ev})")
    label = f"{fam.name}, clean twins only" if twins_only else f"{fam.name}, twins and placebos"
    return f"| {label} | {steps} | " + " | ".join(cells) + " |"


def totals(fam: Family, trig: dict[str, Callable]) -> str:
    """One line: harmful injected steps each trigger caught, and causes right on the live events."""
    hits = {k: 0 for k in trig}
    n = ok = named = 0
    for _, runs, h in by_scenario(fam):
        sc = _score(runs, trig)
        ok, named = ok + sc["causes"][0], named + sc["causes"][1]
        if h["harmful"]:
            n += sc["n"]
            for k in trig:
                hits[k] += sc["hits"][k]
    caught = ", ".join(f"{k} {hits[k]}/{n} ({100 * hits[k] / max(1, n):.0f}%)" for k in trig)
    return (f"{fam.name}: harmful injected steps detected: {caught}; cause named right on {ok}/{named} live events "
            f"at injected steps")


def render(families: list[Family], ours: Callable[[str], Callable] | None = None) -> str:
    """The tables; ``ours(family)``, when given, is the trigger scored as ``ours`` (a re-score)."""
    out = []
    for fam in families:
        if not fam.scenarios and not fam.clean:
            continue
        trig = triggers(fam, ours(fam.name) if ours else None)
        names = list(trig)
        out.append(f"\n### {fam.name}: recall over injected steps (in parentheses where the scenario did no "
                   "measurable harm)\n")
        out.append("| scenario | cause | harm: step + / swap | final + (vs placebo) | harmful | "
                   + " | ".join(names) + " | probes/event | s/run | cause named | other events /1000 ("
                   + ", ".join(names) + ") |")
        out.append("|---" * (9 + len(names)) + "|")
        out += scenario_rows(fam, trig)
        out.append(f"\n{fam.name}: false events per 1000 clean steps (events)\n")
        out.append("| family | clean steps | " + " | ".join(names) + " |")
        out.append("|---" * (2 + len(names)) + "|")
        out.append(clean_row(fam, trig))
        out.append(clean_row(fam, trig, twins_only=True))
        out.append("\n" + totals(fam, trig))
    return "\n".join(out)
