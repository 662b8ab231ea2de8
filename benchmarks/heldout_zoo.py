"""The held-out spike zoo (issue 37): the split's two halves, side by side, on this code's defaults.

``zoo/split.py`` fixes, before any tuning, which (family, data source, scenario kind) is ``dev`` and
which is ``heldout``; tune on ``dev`` only and report both. Families (``zoo/split.py``'s
``FAMILIES``): the nanoGPT-style byte loop with ``gradloc_track.watch(model, opt)`` (``loop``,
``loop64``), HF ``Trainer`` with ``GradLocCallback()`` on random-init Llama, GPT-2 (dropout on) and
Qwen2 with a local 2k BPE (``llama``, ``gpt2``, ``qwen2``), packed rows of long documents
(``packed``) and TRL's GRPO (``grpo``). Each scenario has a known cause, a measured harm (held-out
loss against its clean twin's step and a placebo) and the units a localizer should name; clean
twins give false events. Scoring: ``zoo/halves.py``.

Runs go one at a time in this process (one torch thread): the machine is shared. Every finished run
is written to the cache at once, so an interrupted pass resumes where it stopped (``--fresh``
starts over). Per-step detector feeds are recorded, so a changed detector re-scores in seconds
(``--replay --rescore``), and injected steps are saved so the localizer re-runs on them alone
(``--relocate``).

    python benchmarks/heldout_zoo.py --quick                  # one seed of short runs
    python benchmarks/heldout_zoo.py --seeds 0 1 2            # the full pass
    python benchmarks/heldout_zoo.py --replay                 # the tables from the cache (seconds)
    python benchmarks/heldout_zoo.py --replay --rescore --detector '{"z_thresh": 5}'   # this code's detector
    python benchmarks/heldout_zoo.py --replay --relocate      # this code's localizer on the saved steps
    python benchmarks/heldout_zoo.py --replay --events        # ... and the text of each clean step that fired
    python benchmarks/heldout_zoo.py --halves dev --families loop llama
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo import halves, snapshots, split  # noqa: E402
from zoo.record import RunRecord, load_runs, save_runs  # noqa: E402
from zoo.schedule import Plan  # noqa: E402

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "gradloc-track-heldout-zoo"
HF = ("llama", "gpt2", "qwen2", "packed")


def groups(halves_wanted: list[str], families: list[str] | None) -> dict[tuple[str, str], list[str]]:
    """(family, source) -> its kinds (the clean twin first, then the scenarios, then their placebos)."""
    out: dict[tuple[str, str], list[str]] = {}
    for h in halves_wanted:
        for fam, src, kind in split.runs(h, families):
            out.setdefault((fam, src), [])
            if kind not in out[(fam, src)]:
                out[(fam, src)].append(kind)
    for (fam, _), kinds in out.items():
        if fam != "grpo":
            kinds += sorted({Plan.of(k, 300).placebo for k in kinds} - {""})
    return out


class Runner:
    """Settings and contexts of each (family, source), built once."""

    def __init__(self, quick: bool, detector: dict, snap_dir: str) -> None:
        self.quick, self.detector, self.snap_dir = quick, detector, snap_dir
        self._grpo: dict[str, tuple] = {}

    def run(self, fam: str, src: str, kind: str, seed: int) -> RunRecord:
        if fam in ("loop", "loop64"):
            from zoo import loop

            s = loop.LoopSetting.of(fam, src, self.quick)
            s.detector, s.snapshots = dict(self.detector), self.snap_dir
            return loop.run(kind, seed, s)
        if fam in HF:
            from zoo import trainer

            s = trainer.TrainerSetting.of(fam, src, self.quick)
            s.detector, s.snapshots = dict(self.detector), self.snap_dir
            return trainer.run(kind, seed, s)
        from zoo import grpo

        s = grpo.setting(self.quick)
        s.detector = dict(self.detector)
        if src not in self._grpo:
            self._grpo[src] = grpo.context(src, s)
        return grpo.run(kind, seed, src, s, self._grpo[src])


def cache_file(cache: Path, fam: str, src: str, quick: bool) -> Path:
    return cache / f"{fam}-{src}{'-quick' if quick else ''}.json"


def record(args, cache: Path) -> list[RunRecord]:
    """Every run of the groups asked for, seed by seed (a seed is whole before the next starts)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    snap_dir = str(cache / f"snapshots{'-quick' if args.quick else ''}")
    runner, t_all = Runner(args.quick, args.detector, snap_dir), time.perf_counter()
    (cache / "logs").mkdir(parents=True, exist_ok=True)
    todo = groups(args.halves, args.families)
    runs = {g: [] if args.fresh or not cache_file(cache, *g, args.quick).exists()
            else load_runs(cache_file(cache, *g, args.quick)) for g in todo}
    for seed in args.seeds:
        t_seed = time.perf_counter()
        for (fam, src), kinds in todo.items():
            done = {(r.scenario, r.seed) for r in runs[(fam, src)]}
            for kind in [k for k in kinds if (k, seed) not in done]:
                rec = _one(runner, cache, args.quick, fam, src, kind, seed)
                runs[(fam, src)].append(rec)
                if fam == "grpo":
                    from zoo import grpo

                    grpo.finish(runs[(fam, src)])
                save_runs(runs[(fam, src)], cache_file(cache, fam, src, args.quick))
                print(f"  {fam} {src} {kind} seed {seed}: {rec.seconds:.0f} s ({len(rec.steps)} steps)", flush=True)
        print(f"seed {seed}: {time.perf_counter() - t_seed:.0f} s", flush=True)
    print(f"recorded in {time.perf_counter() - t_all:.0f} s", flush=True)
    return [r for rs in runs.values() for r in rs if r.seed in args.seeds]


def _one(runner: Runner, cache: Path, quick: bool, fam: str, src: str, kind: str, seed: int) -> RunRecord:
    """One run, its stderr (the library's spike blocks, warnings) kept in the cache's logs/."""
    log = cache / "logs" / f"{fam}-{src}-{kind}-{seed}{'-quick' if quick else ''}.txt"
    with open(log, "w") as fh, contextlib.redirect_stderr(fh), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return runner.run(fam, src, kind, seed)


def load(args, cache: Path) -> list[RunRecord]:
    out = []
    for fam, src in groups(args.halves, args.families):
        path = cache_file(cache, fam, src, args.quick)
        if path.exists():
            out += [r for r in load_runs(path) if r.seed in args.seeds or args.all_seeds]
    return out


def rescorer(overrides: dict):
    """run -> the steps this code's ``SpikeDetector`` fires on, fed the recorded inputs (RL defaults for grpo)."""
    from zoo import anchors

    from gradloc_track.integrations.rl_defaults import RL_SPIKES

    triggers = {}

    def trig(r: RunRecord) -> set[int]:
        if r.family not in triggers:
            triggers[r.family] = anchors.ours(**{**(RL_SPIKES if r.family == "grpo" else {}), **overrides})
        return triggers[r.family](r.steps)

    return trig


def relocate(cache: Path, quick: bool) -> dict:
    """Re-run this code's localizer on every saved injected data step; (family, source, kind, seed, step) -> named."""
    import torch

    from zoo import culprits

    torch.set_num_threads(1)
    snap_dir = cache / f"snapshots{'-quick' if quick else ''}"
    out, t0 = {}, time.perf_counter()
    for path in sorted(snap_dir.glob("*.pt")):
        snap = snapshots.load(path)
        m = snap["meta"]
        if not snap["truth"]:
            continue
        mod = _family_module(m["family"])
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, ctx = mod.replay(snap)
            rows, _ = snapshots.locate_rows(model, ctx)
        got, want = culprits.named(snap["truth"], rows)
        out[(m["family"], m["source"], m["kind"], m["seed"], m["step"])] = got == want
    name = cache / f"relocate{'-quick' if quick else ''}.json"
    name.write_text(json.dumps([[*k, v] for k, v in out.items()]))
    print(f"relocated {len(out)} injected steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _family_module(family: str):
    if family in ("loop", "loop64"):
        from zoo import loop
        return loop
    from zoo import trainer
    return trainer


def relocated(cache: Path, quick: bool) -> dict:
    name = cache / f"relocate{'-quick' if quick else ''}.json"
    return {tuple(k[:5]): k[5] for k in json.loads(name.read_text())} if name.exists() else {}


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--halves", nargs="+", default=[split.DEV, split.HELDOUT], choices=(split.DEV, split.HELDOUT))
    ap.add_argument("--families", nargs="+", default=None, choices=list(split.FAMILIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--all-seeds", action="store_true", help="with --replay: every seed in the cache")
    ap.add_argument("--quick", action="store_true", help="short runs (160 steps, twins 240), one seed")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--fresh", action="store_true", help="run again what the cache already holds")
    ap.add_argument("--replay", action="store_true", help="score the cache, run nothing")
    ap.add_argument("--rescore", action="store_true", help="this code's detector on the recorded feeds")
    ap.add_argument("--relocate", action="store_true", help="this code's localizer on the saved injected steps")
    ap.add_argument("--detector", type=json.loads, default={}, help='SpikeConfig overrides, JSON')
    ap.add_argument("--events", action="store_true", help="with --replay: the text of each clean step that fired")
    args = ap.parse_args(argv)
    if args.quick and not args.replay:
        args.seeds = args.seeds[:1]
    t0 = time.perf_counter()
    runs = load(args, args.cache) if args.replay else record(args, args.cache)
    moved = relocate(args.cache, args.quick) if args.relocate else relocated(args.cache, args.quick)
    table = halves.render(runs, rescorer(args.detector) if args.rescore else halves.live, moved)
    print(table)
    if args.events:
        from zoo.clean_text import describe

        print("\n### The clean steps that fired\n")
        for line in (x for r in runs if r.scenario == "clean" for x in describe(r)):
            print(line)
    print(f"\n{time.perf_counter() - t0:.0f} s in all; runs in {args.cache}")
    return table


if __name__ == "__main__":
    main()
