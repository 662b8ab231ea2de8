"""``gradloc-track`` command line: ``gradloc-track report <run dir | MLflow run id> [-o out.html]``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradloc-track", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="write one standalone HTML page with every spike event of a run")
    rep.add_argument("source", help="a run directory (tracker=none) or an MLflow run id")
    rep.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLflow's own resolution)")
    rep.add_argument("-o", "--output", default="spike_report.html", help="output file (default: %(default)s)")
    args = parser.parse_args(argv)
    from .report import build_report

    try:
        page = build_report(args.source, args.tracking_uri)
    except (FileNotFoundError, ImportError) as exc:
        print(f"gradloc-track report: {exc}", file=sys.stderr)
        return 2
    Path(args.output).write_text(page, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
