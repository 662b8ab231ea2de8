"""``gradloc-track culprits``: the ledger across runs, from the command line."""
from __future__ import annotations

import argparse
import sys

from .aggregate import by_group, by_sample, check_by, collect
from .sources import read_runs


def add_parser(sub) -> None:
    p = sub.add_parser("culprits", help="one table of every culprit sample across runs (CSV, JSON, HTML); "
                                        "--by a column; --export-blocklist")
    p.add_argument("sources", nargs="+", help="MLflow experiment names (or ids), MLflow run ids, run directories "
                                              "the app printed, W&B run directories")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--by", default=None, help="group by a metadata column (e.g. source), 'token', 'length' "
                                              "(of the culprit, power-of-two buckets) or 'position'")
    p.add_argument("-o", "--output-dir", default="culprit_ledger",
                   help="where culprits.csv/.json/.html go (default: %(default)s)")
    p.add_argument("--export-blocklist", metavar="FILE", default=None,
                   help="also write the blamed samples' fingerprints and indices, for data.blocklist=FILE")
    p.add_argument("--min-blamed", type=int, default=1, help="export only samples blamed this often (default: 1)")
    p.add_argument("--index-column", default="dataset_index",
                   help="the metadata column holding the dataset index (default: %(default)s)")
    p.add_argument("--log-to", choices=("mlflow", "wandb"), default=None,
                   help="also log the ledger as a run of its own (tables ledger/samples, ledger/by_<col>)")
    p.add_argument("--experiment", default="gradloc-track", help="--log-to mlflow: the experiment "
                                                                 "(default: %(default)s)")
    p.add_argument("--project", default="gradloc-track", help="--log-to wandb: the project (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from .render import write_files

    notes: list[str] = []
    try:
        ledger = collect(read_runs(args.sources, args.tracking_uri, notes), notes)
        if args.by is not None:
            check_by(ledger, args.by)
    except (OSError, ImportError, KeyError) as exc:  # ReportSourceError is a FileNotFoundError
        print(f"gradloc-track culprits: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    samples = by_sample(ledger)
    groups = by_group(ledger, args.by) if args.by is not None else None
    for note in ledger.notes:
        print(f"gradloc-track culprits: note: {note}", file=sys.stderr)
    files = write_files(args.output_dir, ledger, samples, groups, args.by)
    print(f"{len(ledger.runs)} run(s), {ledger.events} spike event(s) with culprits, {len(samples)} blamed sample(s)")
    for s in samples[:10]:
        print(f"  {s['sample_id']}  blamed {s['blamed']}x in {len(s['runs'])} run(s), max share {s['max_share']:.0%}"
              f"  {s['text'][:60]!r}")
    for g in (groups or [])[:10]:
        print(f"  {g['summary']}")
    print("wrote " + ", ".join(map(str, files)))
    return _after(args, ledger, samples, groups)


def _after(args: argparse.Namespace, ledger, samples: list[dict], groups: list[dict] | None) -> int:
    """The blocklist and the tracker run, once the files are written."""
    if args.export_blocklist:
        from .export import export_blocklist

        path, n = export_blocklist(args.export_blocklist, samples, args.index_column, args.min_blamed)
        print(f"wrote blocklist {path} ({n} sample(s)); train without them with data.blocklist={path}")
    if args.log_to:
        from .publish import log_ledger

        where = log_ledger(args.log_to, args.output_dir, ledger, samples, groups, args.by, args.sources,
                           args.tracking_uri, args.experiment, args.project)
        print(f"logged the ledger to {args.log_to}: {where.get(args.log_to, {})}")
    return 0
