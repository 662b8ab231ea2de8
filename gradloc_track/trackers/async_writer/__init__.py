"""Logging that never blocks, kills or loses training data: a bounded queue, a writer thread,
and OUR timeout on every backend call.

The training thread only enqueues (``async_tracker.AsyncTracker``). The writer thread
(``writer.WriterLoop``) builds the backend (``opener``: an unreachable server cannot stall
start-up), merges queued metrics per step (``pending``), writes them across steps once per
``flush_interval_s`` (or when a request is full; never once per step) and delivers each record
through a *call thread* (``..bounded``): it waits at most ``call_timeout_s`` for the SDK (whose own
retries, left at their defaults, can take minutes). A call that fails or times out marks the
backend **down** (``health``): from then on records go straight to the spool
``<run_dir>/spool/<backend>.jsonl`` (``spill``; no minutes of retries stacking up), and every
``probe_interval_s`` the next record probes the backend again (only once the stuck call has
returned: never two SDK calls at once).

``finish(status)`` waits at most ``finish_timeout_s``; whatever is still queued or in flight
then goes to the spool, with the final status (``handover``), so ``gradloc-track replay <run dir>``
can complete the original run. If the spool itself cannot be written (disk full), the records are
counted in ``dropped``, reported once in a warning and logged as ``tracker/dropped`` when the
backend takes data again. Nothing here raises into the training loop.
"""
from ..bounded import CallTimeout
from ..naming import DROPPED_KEY
from .async_tracker import AsyncTracker
from .settings import WriterSettings

__all__ = ["AsyncTracker", "WriterSettings", "CallTimeout", "DROPPED_KEY"]
