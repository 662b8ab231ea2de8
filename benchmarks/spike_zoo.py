"""The spike zoo: reproducible spikes with a known cause and a known harm, and how every trigger does on them.

Families (``--families``):

- ``demo``: TinyGPT 4 layers d=32 on the demo corpus (byte tokens), ``GradMonitor`` in a plain loop
  (``zoo/demo.py``);
- ``hf``: a random-init GPT-2 (4 layers, d=32) in a real ``transformers.Trainer`` with
  ``GradLocCallback`` (``zoo/hf.py``);
- ``trl``: TRL's ``GRPOTrainer`` on a tiny GPT-2 with ``GradLocCallback`` (``zoo/trl.py``).

Each scenario changes known steps (a corrupted sample, a learning-rate jump, a flipped bit, ...) of a
run that is otherwise its clean twin (same seed). Its harm is measured, not assumed: held-out loss
after each injected step against the twin's step from the same state, and at the end against the
twin. Every run records, per step, what the detector was fed and the candidate signals (losses, the
update Adam is about to make), so the anchors' triggers (GradLoc's fixed threshold, ZClip's z-score,
OLMo-core's 6 sigma) are scored on the same numbers as ours (``zoo/anchors.py``). Long clean runs give
false events per 1000 clean steps.

    python benchmarks/spike_zoo.py                    # the full table (seeds 0 1 2)
    python benchmarks/spike_zoo.py --quick            # a few minutes: fewer steps, one seed
    python benchmarks/spike_zoo.py --replay           # re-score the cached streams (seconds)
    python benchmarks/spike_zoo.py --replay --rescore # ... and re-run this code's detector on them
    python benchmarks/spike_zoo.py --families demo --scenarios bad_document lr_jump
    python benchmarks/spike_zoo.py --replay --rescore --span-signal 16   # a candidate span-loss signal
    python benchmarks/zoo_conflict.py                 # does the culprit's gradient tell junk from odd clean text?
    python benchmarks/zoo_clean_events.py             # the clean steps that fired: their text, one step's harm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo.record import RunRecord, load_runs, save_runs  # noqa: E402
from zoo.table import Family, render  # noqa: E402

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "gradloc-track-spike-zoo"
FAMILIES = ("demo", "hf", "trl")


def _module(family: str):
    if family == "demo":
        from zoo import demo
        return demo
    if family == "hf":
        from zoo import hf
        return hf
    from zoo import trl
    return trl


_STATE: dict = {}


def _run_job(job: tuple[str, str, int, bool, dict]) -> dict:
    """One run in a worker process (one torch thread): returns the ``RunRecord`` as JSON."""
    import torch

    family, scenario, seed, quick, detector = job
    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    mod = _module(family)
    key = (family, quick)
    if key not in _STATE:
        setting = mod.setting(quick)
        _STATE[key] = (setting, mod.context(setting))
    setting, ctx = _STATE[key]
    if detector:
        setting.detector = dict(detector)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = mod.run(scenario, seed, setting, *ctx)
    return rec.to_json()


def record(families: list[str], seeds: list[int], quick: bool, jobs: int, scenarios: list[str] | None,
           cache: Path, detector: dict) -> list[Family]:
    out = []
    for family in families:
        mod = _module(family)
        work = [(family, sc, seed, quick, detector) for sc, seed in mod.jobs(mod.setting(quick), seeds, scenarios)]
        t0 = time.perf_counter()
        runs = []
        with ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
            for d in (pool.map(_run_job, work) if pool is not None else map(_run_job, work)):
                runs.append(RunRecord.from_json(d))
                print(f"  {family} {runs[-1].scenario} seed {runs[-1].seed}: {runs[-1].seconds:.0f} s "
                      f"({len(runs)}/{len(work)})", file=sys.stderr, flush=True)
        if hasattr(mod, "finish"):
            mod.finish(runs)
        print(f"{family}: {len(runs)} runs in {time.perf_counter() - t0:.0f} s", flush=True)
        save_runs(runs, cache / f"{family}{'-quick' if quick else ''}.json")
        out.append(split(family, runs))
    return out


def split(family: str, runs: list[RunRecord]) -> Family:
    fam = Family(family)
    for r in runs:
        if r.scenario == "calibration":
            fam.calibration.append(r)
        elif r.cause in ("none", "placebo"):  # a placebo swaps in other clean batches: clean steps too
            fam.clean.append(r)
        else:
            fam.scenarios.append(r)
    return fam


def _rescorer(overrides: dict, span: str | None = None):
    """``family -> trigger``: the library's ``SpikeDetector`` with the family's live configuration (the TRL
    callback's RL defaults for ``trl``) plus ``--detector``, fed what the monitor fed it live; with
    ``--span-signal W``, plus a span-loss detector of its own (``anchors.with_span``)."""
    from zoo import anchors

    from gradloc_track.integrations.rl_defaults import RL_SPIKES

    def trigger(family: str):
        ours = anchors.ours(**{**(RL_SPIKES if family == "trl" else {}), **overrides})
        return anchors.with_span(ours, span) if span else ours

    return trigger


def main(argv: list[str] | None = None) -> list[Family]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--scenarios", nargs="+", default=None, help="a subset of the scenarios (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="small runs, one seed: a few minutes, no numbers to quote")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one torch thread each)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--replay", action="store_true", help="re-score the cached streams, run nothing")
    ap.add_argument("--rescore", action="store_true",
                    help="with --replay: 'ours' is this code's detector re-run on the recorded inputs (the live "
                         "events' probes and causes stay the run's), not what fired live")
    ap.add_argument("--detector", type=json.loads, default={}, help='SpikeConfig overrides, JSON: \'{"z_thresh": 5}\'')
    ap.add_argument("--span-signal", default=None, choices=("1", "8", "16", "32", "c8", "c16", "c32"),
                    help="with --replay --rescore: add a span-loss signal over this many terms (a candidate)")
    args = ap.parse_args(argv)
    seeds = args.seeds[:1] if args.quick else args.seeds
    t0 = time.perf_counter()
    if args.replay:
        fams = [split(f, load_runs(args.cache / f"{f}{'-quick' if args.quick else ''}.json")) for f in args.families
                if (args.cache / f"{f}{'-quick' if args.quick else ''}.json").exists()]
    else:
        fams = record(args.families, seeds, args.quick, args.jobs, args.scenarios, args.cache, args.detector)
    print(render(fams, _rescorer(args.detector, args.span_signal) if args.replay and args.rescore else None))
    print(f"\n{time.perf_counter() - t0:.0f} s in all; streams in {args.cache}")
    return fams


if __name__ == "__main__":
    main()
