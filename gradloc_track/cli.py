"""``gradloc-track`` command line.

``gradloc-track report <run dir | W&B run dir | MLflow run id> [--tracking-uri URI] [-o out.html]``
writes one standalone HTML page with every spike event of a run (no script, nothing loaded from
outside). The run dir the app prints works whatever the tracker: its ``tracker/<backend>.json`` names
the MLflow run or the W&B files (``run_dirs`` says what a run dir is).

``gradloc-track culprits <MLflow experiment | run ids | run dirs or folders of them | W&B run dirs>...
[--by COLUMN] [--export-blocklist FILE] [--log-to mlflow|wandb]`` aggregates every spike event of
those runs into one table per culprit sample (CSV, JSON, HTML; see ``ledger``).

``gradloc-track replay <run dir> [--tracking-uri URI]`` sends what a tracker outage left in the
run directory's spool to the ORIGINAL run, with its final status, and ends a run whose process died
(``kill -9``) as KILLED; running it again does nothing.

Starts without torch (nor numpy, MLflow, W&B): only what a command reads is imported. Every file it
writes is written atomically; a SIGTERM ends the command through ``SystemExit``, so a file being
written is left as it was, with no temp file beside it.
"""
from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
import threading
from pathlib import Path

SIGTERM_EXIT = 128 + signal.SIGTERM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradloc-track", description="Gradient-spike tools for LLM training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="write one standalone HTML page with every spike event of a run")
    rep.add_argument("source", help="the run directory the app printed (any tracker), a W&B run directory, "
                                    "or an MLflow run id")
    rep.add_argument("--tracking-uri", default=None,
                     help="MLflow tracking URI for a run id (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    rep.add_argument("-o", "--output", default="spike_report.html",
                     help="output file, or a folder to write spike_report.html into (default: %(default)s)")
    _add_replay(sub)
    from .ledger.command import add_parser

    add_parser(sub)
    return parser


def _add_replay(sub) -> None:
    rp = sub.add_parser("replay", help="send a run directory's spooled records (a tracker outage) to the original "
                                       "run; end a run whose process died as KILLED")
    rp.add_argument("run_dir", help="the run directory training wrote (holding spool/ and tracker/), or a folder "
                                    "of them (a sweep's: each is replayed)")
    rp.add_argument("--tracking-uri", default=None,
                    help="MLflow tracking URI, if the server moved (default: the one the run was logged to)")


def _replay(args) -> int:
    """One run dir, or every run dir under a folder (a Hydra sweep's, a runs/ folder), as ``culprits`` reads."""
    from .run_dirs import find_run_dirs, run_dir_of

    root = Path(args.run_dir)
    if root.is_dir() and run_dir_of(root) is None:
        found = [d for d in find_run_dirs(root) if (d / "spool").is_dir() or (d / "tracker").is_dir()]
        if found:
            codes = []
            for d in found:
                print(f"{d}:")
                codes.append(_replay_one(d, args.tracking_uri))
            return max(codes)
    return _replay_one(root, args.tracking_uri)


def _replay_one(run_dir: Path, tracking_uri: str | None) -> int:
    from .trackers.incomplete import incomplete_reason
    from .trackers.replay import STORE_DOWN_AFTER, RunDirNotWritable, replay_run_dir
    from .trackers.run_lock import RunDirInUse

    try:
        results = replay_run_dir(run_dir, tracking_uri)
    except (FileNotFoundError, ValueError, ImportError, RunDirInUse) as exc:
        print(f"gradloc-track replay: {exc}", file=sys.stderr)
        return 2
    except RunDirNotWritable as exc:  # the run dir, not the store: the store's advice below would mislead
        print(f"gradloc-track replay: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the store is down or gone: said, not a traceback; the spool stays for the next try
        print(f"gradloc-track replay: {exc}\n  what was not sent stays in the spool: replay again once the store "
              "answers, or pass --tracking-uri <uri> if it moved", file=sys.stderr)
        return 1
    refused = [r for r in results if r.refused]
    for r in refused:
        print(f"gradloc-track replay: {r.backend}: not replayed: {r.refused}", file=sys.stderr)
    lost = incomplete_reason(run_dir) is not None
    for r in (r for r in results if not r.refused):
        run = r.run.get("run_id", "?")
        status = f", final status {r.status}" if r.status else ""
        why = ("no final status reached its spool: its process died, or the run dir was full when it finished "
               "(the run dir is INCOMPLETE; the run is tagged gradloc_track.incomplete)") \
            if lost else "its process is gone: it never finished"
        ended = f"; ended as {r.ended.upper()} ({why})" if r.ended else ""
        print(f"{r.backend} run {run}: replayed {r.sent} record(s){status}"
              + (f" ({r.already} replayed before)" if r.already else "") + ended)
        if r.kept:
            own = r.artifacts_sent and r.refused_in_a_row < STORE_DOWN_AFTER  # the store took the others
            why = ("the record itself failed: the other spike files went" if own else "the run's artifact store did "
                   "not take them; fix it (its write permission, the server's --artifacts-destination) and replay "
                   "again")
            print(f"gradloc-track replay: {r.backend}: {r.kept} spike file record(s) (tables, highlight pages, "
                  f"images) stay in the spool ({r.kept_why}): {why}", file=sys.stderr)
    return 2 if refused else 1 if any(r.kept for r in results) else 0


def _report(args) -> int:
    from .report import build_report
    from .text import visible_text
    from .trackers.files import atomic_write_text

    out = Path(args.output)
    if out.is_dir():  # like cp: a folder gets the default file name
        out = out / "spike_report.html"
    try:
        notes: list[str] = []
        problems: list[str] = []  # the run dir is incomplete: the page is written, the exit says so
        page = build_report(args.source, args.tracking_uri, notes=notes, problems=problems)
    except (OSError, ImportError) as exc:  # ReportSourceError is a FileNotFoundError
        print(f"gradloc-track report: {visible_text(str(exc))}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"gradloc-track report: note: {visible_text(note)}", file=sys.stderr)
    try:
        atomic_write_text(out, page)
    except OSError as exc:
        print(f"gradloc-track report: cannot write {visible_text(str(out))} ({exc.strerror or exc}); pass -o a file "
              "in a folder you can write", file=sys.stderr)
        return 2
    print(f"wrote {visible_text(str(out))} ({len(page) // 1024} KiB)")
    for problem in problems:
        print(f"gradloc-track report: the page shows what there is, but {visible_text(problem)}", file=sys.stderr)
    return 1 if problems else 0


def _sigterm(signum, frame) -> None:
    raise SystemExit(SIGTERM_EXIT)  # unwinds: a file being written is taken back (trackers.files)


def _stdout_is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured)
        return False


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it again at exit, into the closed pipe, and says so."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (captured): nothing flushes into a pipe
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # --help ends here, having imported no reader
    from .trackers.quiet import quiet_backend_noise

    quiet_backend_noise()  # our command: MLflow's store-creation lines and download bars off
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm) if main_thread else None
    try:
        if args.command == "replay":
            code = _replay(args)
        elif args.command == "culprits":
            from .ledger.command import run

            code = run(args)
        else:
            code = _report(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is the except below, not a traceback
        return code
    except BrokenPipeError:  # `gradloc-track culprits ... | head`: the reader left; no traceback (held-out tester)
        if not _stdout_is_pipe():  # another pipe broke (a tracker's socket): not ours to hide
            raise
        _quiet_stdout()
        return 141  # a shell's status for a writer its pipe's reader left (128 + SIGPIPE)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
