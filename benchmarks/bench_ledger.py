"""The CLI's readers at scale: start-up, the ledger over many runs and over one long run, a huge blocklist.

Each measurement runs in a fresh interpreter (what a user starts), timed from outside (wall, and CPU
from the kernel's accounting of the finished child: the ratios are of CPU), with its peak RSS read
from the kernel (``VmHWM``, by ``_peak.py``). Its baseline, measured in the same run, is the least a
reader has to do: start python and ``json.loads`` the same files (for start-up: ``import argparse,
json``). Synthetic run dirs, laid out as the local tracker writes them (``spikes/tokens`` and
``spikes/events`` parts, one per event, 3 culprit rows per event)::

    python benchmarks/bench_ledger.py                    # 1000 runs x 20 events, 10,000 events, 10^6 entries
    python benchmarks/bench_ledger.py --quick            # 100 x 20, 1,000, 10^5
    python benchmarks/bench_ledger.py --before <other checkout>   # and that code, same data, interleaved
    python benchmarks/bench_ledger.py --only ledger               # the cases whose name holds "ledger"

Goals (issue 29 item 4): each command starts in < 0.5 s and < 80 MB; the ledger over 1000 runs x
20 events in <= 1.5 s; a 10^6-entry blocklist loads in <= 2 s and <= 300 MB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK = Path(__file__).with_name("_peak.py")
SIZES = {"full": (1000, 20, 10_000, 1_000_000), "quick": (100, 20, 1000, 100_000)}

COLUMNS = ["step", "level", "token", "share", "grad_norm", "sample", "position", "end", "top_layers", "signal", "z",
           "token_id", "sample_id", "dataset_index", "source"]
EVENT_COLUMNS = ["step", "signal", "norm", "running_mean", "ratio", "z", "layers", "localization", "culprits",
                 "micro_batch_norms", "sample_shares"]


def _fp(i: int) -> str:
    return f"{(i * 2654435761) % (1 << 64):016x}"


def _write_run(run_dir: Path, events: int, seed: int) -> None:
    """One run dir: per event a 3-row culprit part (a sample row and two token rows) and an events part."""
    for folder in ("tokens", "events"):
        (run_dir / "spikes" / folder).mkdir(parents=True, exist_ok=True)
    for e in range(events):
        step = 10 * e + 5
        sid = _fp(seed * 100_000 + e % 50)  # 50 distinct samples per run, shared across runs
        rows = [[step, "sample", "the whole sample's text " * 4, 0.55, 1.2, 1, 0, 128, "lm_head:1.2e+00", "wpe", 9.1,
                 None, sid, 4 * step + 1, "corpus"]]
        rows += [[step, "token", "tok", 0.1 + k / 10, 0.8, 2, 40 + k, 41 + k, "lm_head:8.3e-01", "wpe", 9.1, 101 + k,
                  _fp(7 + k), 4 * step + 2, "injected"] for k in range(2)]
        name = f"step_{step:06d}.json"
        (run_dir / "spikes" / "tokens" / name).write_text(json.dumps({"columns": COLUMNS, "data": rows}))
        ev = [[step, "wpe", 0.6, 0.09, 6.8, 9.1, "wte (z 5)", "localized", 3, None, None]]
        (run_dir / "spikes" / "events" / name).write_text(json.dumps({"columns": EVENT_COLUMNS, "data": ev}))


def _write_blocklist(path: Path, n: int) -> None:
    """``n`` entries as ``culprits --export-blocklist`` writes them, through the library's own writer."""
    from gradloc_track.data.blocklist import write_blocklist

    entries = ({"sample_id": _fp(i), "index": i, "blamed": 2, "runs": ["sweepA/run0", "sweepB/run0"],
                "steps": ["sweepA/run0@100", "sweepB/run0@100"], "max_share": 0.9,
                "text": "a culprit text of some forty characters", "metadata": {"source": "web"}}
               for i in range(n))
    write_blocklist(path, entries)


def layout(root: Path, size: str) -> dict[str, object]:
    runs, events, long_events, entries = SIZES[size]
    return {"many": [root / "many" / f"sweep{r % 10}" / f"run{r // 10}" for r in range(runs)], "events": events,
            "long": root / "long" / "run", "long_events": long_events, "block": root / "blocklist.json",
            "entries": entries}


def build(root: Path, size: str) -> None:
    """The synthetic data (in a process of its own: the measured ones must not fork a big parent)."""
    data = layout(root, size)
    for r, d in enumerate(data["many"]):
        _write_run(d, data["events"], r)
    _write_run(data["long"], data["long_events"], 0)
    _write_blocklist(data["block"], data["entries"])


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def measure(argv: list[str], env: dict[str, str], peak_file: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MiB) of one python command (``-m mod ...`` or ``-c code
    ...``), from start to exit, run through ``_peak.py``; it must succeed. The CPU time (user + system,
    from the kernel's accounting of the finished child) is the figure a busy machine disturbs least."""
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run([sys.executable, str(PEAK), str(peak_file), *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]}... exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall, cpu, int(peak_file.read_text()) / 1024


PLAIN_JSON = ("import json, sys, pathlib\n"
              "for d in sys.argv[1:]:\n"
              "    for p in sorted(pathlib.Path(d, 'spikes', 'tokens').glob('step_*.json')):\n"
              "        json.loads(p.read_text(encoding='utf-8'))\n")


def cases(data: dict, out: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, command, its baseline command): python arguments after the interpreter. A name ending in
    ``*`` is a case the code before cannot run (it is measured on the code under test only)."""
    cli = ["-m", "gradloc_track.cli"]
    start = ["-c", "import argparse, json"]
    many = [str(d) for d in data["many"]]
    return [
        ("start: import gradloc_track.cli", ["-c", "import gradloc_track.cli"], start),
        ("start: culprits --help", cli + ["culprits", "--help"], start),
        ("start: report --help", cli + ["report", "--help"], start),
        ("start: replay --help", cli + ["replay", "--help"], start),
        (f"ledger: {len(many)} runs x {data['events']} events", cli + ["culprits", *many, "-o", str(out / "a")],
         ["-c", PLAIN_JSON, *many]),
        (f"ledger: {len(many)} runs x {data['events']} events --by source",
         cli + ["culprits", *many, "--by", "source", "-o", str(out / "s")], ["-c", PLAIN_JSON, *many]),
        (f"ledger: the folder of {len(many)} runs *", cli + ["culprits", str(data["many"][0].parents[1]), "-o",
                                                             str(out / "f")], ["-c", PLAIN_JSON, *many]),
        (f"ledger: 1 run x {data['long_events']} events", cli + ["culprits", str(data["long"]), "-o", str(out / "b")],
         ["-c", PLAIN_JSON, str(data["long"])]),
        (f"report: 1 run x {data['long_events']} events",
         cli + ["report", str(data["long"]), "-o", str(out / "r.html")], ["-c", PLAIN_JSON, str(data["long"])]),
        (f"blocklist: {data['entries']:,} entries",
         ["-c", "import sys; from gradloc_track.data.blocklist import load_blocklist; "
                    "assert len(load_blocklist(sys.argv[1]).fingerprints) > 0", str(data["block"])],
         ["-c", "import json, sys; json.loads(open(sys.argv[1], encoding='utf-8').read())", str(data["block"])]),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 runs, 1,000 events, 10^5 entries")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each command; the median is printed")
    ap.add_argument("--before", metavar="CHECKOUT", help="also measure the code of another checkout, interleaved")
    ap.add_argument("--only", metavar="TEXT", help="only the cases whose name holds TEXT (e.g. ledger)")
    ap.add_argument("--build", metavar="DIR", help=argparse.SUPPRESS)  # internal: write the data into DIR
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    if args.build:
        build(Path(args.build), size)
        return []
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(Path.cwd())) if p)
    env = {**os.environ, "PYTHONPATH": path}
    before = {**os.environ, "PYTHONPATH": args.before} if args.before else None
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build", str(root), *(["--quick"] if args.quick else [])],
                       env=env, check=True)
        data = layout(root, size)
        print(f"built the synthetic runs in {time.perf_counter() - t0:.1f} s; python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPU(s), load {os.getloadavg()[0]:.1f}")
        now, then = cases(data, root / "out"), cases(data, root / "out-before")
        keep = [i for i, c in enumerate(now) if args.only is None or args.only in c[0]]
        return _run([now[i] for i in keep], [then[i] for i in keep], env, before, root, args.repeats)


def _run(now: list, then: list, env: dict, before: dict | None, root: Path, repeats: int) -> list[dict]:
    """Each case ``repeats`` times, interleaved with its baseline (and the code before); medians. The
    ratios are of CPU time."""
    print(f"\n{'case':<48}{'s':>7}{'cpu s':>7}{'MiB':>6}{'base cpu':>9}{'MiB':>6}{'x base':>8}"
          + (f"{'before cpu':>11}{'MiB':>6}{'x before':>9}" if before else ""))
    results = []
    for (name, cmd, base), (_, old, _) in zip(now, then):
        runs: dict[str, list[tuple[float, float, float]]] = {"now": [], "base": [], "before": []}
        for _ in range(repeats):  # interleaved: noise hits them alike
            runs["now"].append(measure(cmd, env, root / "peak"))
            runs["base"].append(measure(base, env, root / "peak"))
            if before is not None and not name.endswith("*"):
                runs["before"].append(measure(old, before, root / "peak"))
        (s, cpu, mib), (_, bcpu, bmib) = _median(runs["now"]), _median(runs["base"])
        line = f"{name:<48}{s:>7.2f}{cpu:>7.2f}{mib:>6.0f}{bcpu:>9.2f}{bmib:>6.0f}{cpu / bcpu:>8.2f}"
        row = {"case": name, "s": s, "cpu_s": cpu, "mib": mib, "base_cpu_s": bcpu, "base_mib": bmib}
        if runs["before"]:
            _, ocpu, omib = _median(runs["before"])
            line += f"{ocpu:>11.2f}{omib:>6.0f}{cpu / ocpu:>9.2f}"
            row.update(before_cpu_s=ocpu, before_mib=omib)
        print(line, flush=True)
        results.append(row)
    return results


def _median(runs: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Each column's median on its own."""
    return tuple(sorted(col)[len(col) // 2] for col in zip(*runs))


if __name__ == "__main__":
    main()
