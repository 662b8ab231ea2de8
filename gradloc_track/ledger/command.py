"""``gradloc-track culprits``: the ledger across runs, from the command line.

Exit status: 0 when the ledger was written (and, with ``--log-to``, delivered); 2 when a source
cannot be read or yields no run, when no run read has a culprit table (every one logged no spike:
an empty ledger would read as "nothing went wrong"; a run whose every culprit table part is unreadable
has none), or an option is wrong; 1 when a run read is not whole: a run dir marked INCOMPLETE (some of its
writes failed: a full disk) or a culprit table part that cannot be read (the ledger is written from what there is)
or ``--log-to`` could not deliver the ledger run (its records are in the spool: the message
names the ``replay`` command).
"""
from __future__ import annotations

import argparse
import gc
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..text import visible_text
from ..trackers.backends import BACKENDS
from .export import SHARE_FLOOR

PROG = "gradloc-track culprits"


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share: use a fraction between 0 and 1 (e.g. 0.05)")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds: use a positive number (e.g. 60)")
    return v


def add_parser(sub) -> None:
    p = sub.add_parser("culprits", help="one table of every culprit sample across runs (CSV, JSON, HTML); "
                                        "--by a column; --export-blocklist")
    p.add_argument("sources", nargs="+", help="MLflow experiment names (or ids), MLflow run ids, run directories "
                                              "the app printed (or folders holding them), W&B run directories")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--by", default=None, help="group by a metadata column (e.g. source), 'token', 'length' "
                                              "(of the culprit, power-of-two buckets) or 'position'")
    p.add_argument("-o", "--output-dir", default="culprit_ledger",
                   help="the folder culprits.csv/.json/.html go to (default: %(default)s)")
    p.add_argument("--export-blocklist", metavar="FILE", default=None,
                   help="also write the blamed samples' fingerprints and indices, for data.blocklist=FILE")
    p.add_argument("--min-blamed", type=int, default=1, help="export only samples blamed this often (default: 1)")
    p.add_argument("--min-share", type=_share, default=SHARE_FLOOR,
                   help="export only samples that carried at least this share of a spike's squared grad norm "
                        "(default: %(default)s; a row under it cannot have made the step spike, see docs/ledger.md)")
    p.add_argument("--index-column", default="dataset_index",
                   help="the metadata column holding the dataset index (default: %(default)s)")
    p.add_argument("--log-to", choices=tuple(BACKENDS), default=None,
                   help="also log the ledger as a run of its own (tables ledger/samples, ledger/by_<col>)")
    p.add_argument("--log-timeout", type=_seconds, default=60.0,
                   help="--log-to: seconds to wait for the tracker; what it has not taken by then stays in "
                        "the spool for 'gradloc-track replay' (default: %(default)s)")
    p.add_argument("--experiment", default="gradloc-track", help="--log-to mlflow: the experiment "
                                                                 "(default: %(default)s)")
    p.add_argument("--project", default="gradloc-track", help="--log-to wandb: the project (default: %(default)s)")


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the ledger is aggregated and written: that makes a few
    objects per culprit row, on top of the two million of a 1000-run ledger's parts, and each collection walked
    all of them again (1.41 -> 1.03-1.06 s of CPU in one process). Nothing made there is in a cycle. Reading stays
    collected: a tracker's client (an MLflow run's download) may leave cycles behind, and reading did not pay."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _fail(message: str, code: int = 2) -> int:
    print(f"{PROG}: {visible_text(message)}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from .sources import read_runs

    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        return _fail(f"-o {out} is a file; the ledger is a folder of files (culprits.csv, .json, .html): "
                     "pass a folder (it is created if missing)")
    notes: list[str] = []
    incomplete: list[str] = []
    try:
        runs = read_runs(args.sources, args.tracking_uri, notes, incomplete)
    except (OSError, ImportError, KeyError) as exc:  # ReportSourceError is a FileNotFoundError
        return _fail(exc.args[0] if isinstance(exc, KeyError) else str(exc))
    with collector_paused():
        v = _written(args, out, runs, notes)
    if isinstance(v, int):
        return v
    code = _after(args, v)
    if incomplete:
        return _fail(f"the ledger is written from what there is, but {len(incomplete)} run(s) could not be read "
                     f"whole (the first: {incomplete[0]})", code=max(code, 1))
    return code


def _written(args: argparse.Namespace, out: Path, runs: list, notes: list[str]) -> Any:
    """The ledger's views, their files written and the console told; or the exit code of why not."""
    from .aggregate import collect, views
    from .render import write_files

    try:
        v = views(collect(runs, notes), args.by)
    except KeyError as exc:  # a --by no run has
        return _fail(exc.args[0])
    for note in v.ledger.notes:
        print(f"{PROG}: note: {visible_text(note)}", file=sys.stderr)
    if not v.ledger.runs:
        return _fail(f"no run in {' '.join(map(str, args.sources))} has a culprit table (see the notes above); "
                     "nothing was written. Pass runs that logged spike events (the console's 'spike at step' lines "
                     "name their run dirs)")
    if not v.ledger.events and not v.ledger.not_data:  # no usable row: an empty ledger would read as nothing wrong
        return _fail(f"the culprit tables of {' '.join(map(str, args.sources))} hold no row the ledger can use (see "
                     "the notes above: their rows were left out); nothing was written")
    try:
        files = write_files(out, v)
    except OSError as exc:
        return _fail(f"cannot write the ledger into {out}: {exc.strerror or exc}")
    led = v.ledger
    print(f"{len(led.runs)} run(s), {led.events} spike event(s) with culprits, {len(v.samples)} blamed sample(s)")
    for s in v.samples[:10]:
        share = "a non-finite step (no share)" if s.get("nonfinite") and not s["max_share"] else \
            f"max share {s['max_share']:.0%}"  # a NaN step's culprit has no share of a norm: not "0%"
        print(f"  {s['sample_id']}  blamed {s['blamed']}x in {len(s['runs'])} run(s), {share}"
              f"  '{visible_text(s['text'][:60])}'")
    for g in (v.groups or [])[:10]:
        print(f"  {visible_text(g['summary'])}")
    print("wrote " + ", ".join(visible_text(str(f)) for f in files))  # (a path's controls shown, never sent)
    return v


def _after(args: argparse.Namespace, v) -> int:
    """The blocklist and the tracker run, once the files are written."""
    if args.export_blocklist:
        from ..data.blocklist import BlocklistError
        from .export import export_blocklist

        try:
            path, n = export_blocklist(args.export_blocklist, v.samples, args.index_column, args.min_blamed,
                                       args.min_share, ledger=v.ledger)
        except OSError as exc:
            return _fail(f"--export-blocklist {args.export_blocklist}: cannot write it ({exc.strerror or exc})")
        except BlocklistError as exc:  # a value a blocklist cannot hold (a float index): named, never a traceback
            return _fail(f"--export-blocklist {args.export_blocklist}: not written: {exc}")
        left = len(v.samples) - n
        shown = visible_text(str(path))  # (a path's controls shown, never sent to the terminal)
        print(f"wrote blocklist {shown} ({n} sample(s)" + (f"; {left} under --min-blamed {args.min_blamed} or "
                                                           f"--min-share {args.min_share:g} left out" if left else "")
              + f"); train without them with data.blocklist={shown}")
    if args.log_to:
        return _publish(args, v)
    return 0


def _publish(args: argparse.Namespace, v) -> int:
    from .publish import Destination, log_ledger

    dest = Destination(args.log_to, args.tracking_uri, args.experiment, args.project, timeout_s=args.log_timeout)
    got = log_ledger(v, args.output_dir, args.sources, dest)
    if got.delivered:
        print(f"logged the ledger to {args.log_to}: {got.where[args.log_to]}")
        return 0
    what = "nothing of it was delivered" if not got.where else "it was not all delivered"
    return _fail(f"the ledger run did NOT reach {args.log_to} within --log-timeout {args.log_timeout:g} s "
                 f"({what}); its {got.spooled} record(s) are spooled in {got.run_dir / 'spool'}. Once "
                 f"{args.log_to} is reachable, send them with: gradloc-track replay {got.run_dir}", code=1)
