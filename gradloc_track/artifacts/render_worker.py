"""A spike's heatmap drawn in a low-priority process of its own (issue 38, item 4).

Drawing the heatmap with matplotlib is most of a second of CPU, nearly all of it holding the GIL: on
the tracker's thread it slowed the training steps right after a spike (the demo: 2.4 s wall, 0.76 s of
that thread's CPU, the next steps waiting for the GIL). Here a worker process draws it when the call
comes from a thread of its own (the tracker's: the training loop's thread would only wait for it), started
at the first heatmap as ``python -m gradloc_track.artifacts.render_worker`` (never the user's script: nothing
of an unguarded ``__main__`` runs again), at a lower CPU priority (``NICE``), so on a busy machine it
takes what training leaves; the tracker's thread waits for its answer off the GIL, the training thread
not at all. Later heatmaps reuse it; it ends with this process (its input closes).

The tokenizer never goes there: the sample's tokens are decoded here (``DecodedVocab``). What cannot go
there is drawn on the tracker's thread as before: a request that does not pickle, or that the worker
cannot load (a class defined in the user's script, which it never imports), no POSIX pipes (Windows),
a worker that cannot start, dies, or does not answer within ``TIMEOUT_S``. So is a heatmap the caller
waits for (``hurry``, set by the tracker's ``flush()`` and ``finish()``): no training step runs meanwhile
to be spared, and on a saturated machine the worker's low priority gets it next to no CPU (3 busy
processes on 2 cores: minutes for one heatmap), while every record the tracker queued after the spike
waits behind it.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

NICE = 19  # the lowest priority: on a busy core CFS gives it ~1.5% of what a nice-0 thread gets
TIMEOUT_S = 120.0  # the longest the tracker's thread waits for one heatmap before drawing it itself
HURRY_POLL_S = 0.2  # how often a wait for the worker looks whether the run is finishing
STOP_WAIT_S = 5.0  # the longest a stop waits for a killed worker, and the exit for the worker's lock
_HEADER = 8  # bytes of each message's length prefix


def draw_heatmap(result: Any, sample: int, path: Path, ctx: Any,
                 hurry: threading.Event | None = None) -> Path | None:
    """``heatmap.render_layer_heatmap(result, sample, path, ctx)``, drawn by the worker process when it
    can be (module doc), else here; the PNG's path, or None (with the renderer's warning). ``hurry``: once
    set, the drawing is done here (a worker still at it is stopped)."""
    from .heatmap import render_layer_heatmap

    hurry = hurry if hurry is not None else threading.Event()
    here = threading.current_thread() is threading.main_thread() or hurry.is_set()
    job = None if here else _portable(result, sample, path, ctx)
    answer = None if job is None else _WORKER.run(job, hurry)
    if answer is None:
        return render_layer_heatmap(result, sample, path, ctx=ctx)
    kind, value, said = answer
    if kind == "unreadable":  # the worker cannot load what the request holds (a class of the user's script)
        return render_layer_heatmap(result, sample, path, ctx=ctx)
    for message in said:  # the renderer's warnings, said here as they would have been
        warnings.warn(message, RuntimeWarning)
    if kind == "error":
        raise RuntimeError(f"the heatmap worker: {value}")
    return None if value is None else Path(value)


class DecodedVocab:
    """The tokenizer as the heatmap reads it, for the worker: the sample's tokens decoded here, one by one,
    and the pad id. The user's tokenizer never goes to the worker: its class may live in the user's script
    (which the worker cannot import), and an HF tokenizer pickles its whole vocabulary."""

    def __init__(self, texts: dict[int, str], pad_id: Any = None) -> None:
        self.texts, self.pad_id = texts, pad_id

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[int(i)] for i in ids)


def _decoded(ctx: Any, sample: int) -> DecodedVocab | None:
    """``ctx.tokenizer`` as a ``DecodedVocab`` of the sample's tokens (None: no tokenizer or no ids)."""
    from ..text import decode_token

    tok, ids = getattr(ctx, "tokenizer", None), getattr(ctx, "input_ids", None)
    if tok is None or ids is None:
        return None
    row = ids[sample].tolist() if 0 <= sample < len(ids) else []
    return DecodedVocab({i: decode_token(tok, i) for i in set(row)}, getattr(tok, "pad_id", None))


def _portable(result: Any, sample: int, path: Path, ctx: Any) -> bytes | None:
    """The call's arguments pickled with what the renderer reads (the layer map on the CPU, no ghost maps,
    the token ids, the mask and the sample's decoded tokens); None when something does not pickle."""
    slim = copy.copy(result)
    for name, empty in (("ghost_map", None), ("ghost_maps", []), ("layer_maps", [])):
        if hasattr(slim, name):
            setattr(slim, name, empty)
    if getattr(slim, "layer_map", None) is not None:
        slim.layer_map = slim.layer_map.detach().cpu()
    try:
        view = SimpleNamespace(input_ids=getattr(ctx, "input_ids", None), token_mask=getattr(ctx, "token_mask", None),
                               tokenizer=_decoded(ctx, sample))
        return pickle.dumps((slim, sample, str(path), view), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a column that does not pickle, ids the tokenizer cannot list: drawn here
        return None


class _Worker:
    """The one worker process of this process, started at first use; ``run`` is one request."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._broken = os.name != "posix"  # select() on pipes: POSIX only

    def run(self, job: bytes, hurry: threading.Event) -> tuple[str, Any, list[str]] | None:
        """(kind, value, warnings) from the worker, or None when it cannot answer, or ``hurry`` is set
        before it does (drawn here then). The request goes through a file of its own and the pipe carries
        only its name: a layer map is far beyond a pipe's buffer, and a worker not reading yet (still
        starting, at its low priority) must never block this thread in a write that no bound or hurry
        reaches."""
        with self._lock:
            if self._broken or hurry.is_set():
                return None
            request = _request_file(job)
            if request is None:  # no room for it (a full temp dir): drawn here, the worker stays usable
                return None
            try:
                proc = self._started()
                name = os.fsencode(request)
                proc.stdin.write(len(name).to_bytes(_HEADER, "little") + name)
                proc.stdin.flush()
                return pickle.loads(_read_message(proc.stdout, TIMEOUT_S, hurry))
            except _Hurried:  # the run is finishing: this worker's half-drawn heatmap is not waited for
                self._stop(wait_s=0.0)
                return None
            except Exception as exc:  # no worker, a dead one, no answer in time: never again this process
                self._stop()
                self._broken = True
                warnings.warn(f"gradloc-track: the heatmap worker process failed ({exc!r}); heatmaps are drawn on "
                              "the tracker's thread", RuntimeWarning)
                return None
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(request)

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            package_root = str(Path(__file__).resolve().parents[2])  # where this gradloc_track is imported from
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                               if p), "MPLBACKEND": "Agg"}
            self._proc = subprocess.Popen([sys.executable, "-m", "gradloc_track.artifacts.render_worker"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          env=env, close_fds=True)
        return self._proc

    def _stop(self, wait_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the worker's read ends: it exits
            proc.wait(timeout=wait_s)
        except Exception:
            proc.kill()
            with contextlib.suppress(Exception):  # a worker stuck in the kernel (a hung disk) is not waited for
                proc.wait(timeout=STOP_WAIT_S)

    def close(self) -> None:
        """At exit: the worker stops. A tracker's thread still waiting for it (a daemon thread, up to
        ``TIMEOUT_S``) holds the lock: then the worker is killed without it, which ends that wait too."""
        if self._lock.acquire(timeout=STOP_WAIT_S):
            try:
                self._stop()
            finally:
                self._lock.release()
            return
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.kill()


def _request_file(job: bytes) -> str | None:
    """``job`` in a new file of the temp dir (owner-only), its path; None when it cannot be written."""
    from ..trackers.files import atomic_write_bytes

    try:
        fd, name = tempfile.mkstemp(prefix="gradloc-heatmap-", suffix=".pkl")
    except OSError:
        return None
    os.close(fd)
    try:
        atomic_write_bytes(Path(name), job)
        return name
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name)
        return None


class _Hurried(Exception):
    """The run finished while the worker drew: the caller draws it itself."""


def _read_message(stream: Any, timeout_s: float, hurry: threading.Event | None = None) -> bytes:
    """One length-prefixed message from ``stream`` (a pipe), waiting at most ``timeout_s`` for it to start
    (``_Hurried`` as soon as ``hurry`` is set)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(0.0, min(left, HURRY_POLL_S)))
        if ready:
            break
        if hurry is not None and hurry.is_set():
            raise _Hurried()
        if left <= HURRY_POLL_S:
            raise TimeoutError(f"no heatmap within {timeout_s:g} s")
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        raise EOFError("the heatmap worker closed its output")
    data = stream.read(int.from_bytes(header, "little"))
    if len(data) < int.from_bytes(header, "little"):
        raise EOFError("the heatmap worker's answer was cut short")
    return data


_WORKER = _Worker()
atexit.register(_WORKER.close)


def _serve() -> None:
    """The worker: lower its priority, then draw each request from stdin and answer on stdout."""
    try:
        os.nice(NICE)
    except (AttributeError, OSError):
        pass
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing a library prints may land in the answers
    from .heatmap import render_layer_heatmap

    while True:
        header = requests.read(_HEADER)
        if len(header) < _HEADER:
            return  # the parent closed the pipe (or exited)
        request = os.fsdecode(requests.read(int.from_bytes(header, "little")))
        try:
            with open(request, "rb") as f:
                result, sample, path, ctx = pickle.loads(f.read())
        except Exception as exc:  # removed meanwhile, or a class this process cannot import: drawn there
            answer = pickle.dumps(("unreadable", f"the request could not be read: {exc!r}", []))
            answers.write(len(answer).to_bytes(_HEADER, "little") + answer)
            answers.flush()
            continue
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                png = render_layer_heatmap(result, sample, path, ctx=ctx)
                answer = ("ok", None if png is None else str(png))
            except Exception as exc:
                answer = ("error", repr(exc))
        out = pickle.dumps((*answer, [str(w.message) for w in said]))
        answers.write(len(out).to_bytes(_HEADER, "little") + out)
        answers.flush()


if __name__ == "__main__":
    _serve()
