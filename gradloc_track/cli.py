"""``gradloc-track`` command line.

``gradloc-track report <run dir | W&B run dir | MLflow run id> [--tracking-uri URI] [-o out.html]``
writes one standalone HTML page with every spike event of a run (no script, nothing loaded from
outside). The run dir the app prints works whatever the tracker: its ``gradloc_run.json`` names
the MLflow run or the W&B files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradloc-track", description="Gradient-spike tools for LLM training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="write one standalone HTML page with every spike event of a run")
    rep.add_argument("source", help="the run directory the app printed (any tracker), a W&B run directory, "
                                    "or an MLflow run id")
    rep.add_argument("--tracking-uri", default=None,
                     help="MLflow tracking URI for a run id (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    rep.add_argument("-o", "--output", default="spike_report.html", help="output file (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .report import build_report

    try:
        notes: list[str] = []
        page = build_report(args.source, args.tracking_uri, notes=notes)
    except (OSError, ImportError) as exc:  # ReportSourceError is a FileNotFoundError
        print(f"gradloc-track report: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"gradloc-track report: note: {note}", file=sys.stderr)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
