"""Fault injection for the tracker tests: backends that hang, fail or recover, and a tiny training loop.

A tracker is mocked only to inject a fault; everything else is real (the writer thread, the spool
on disk, a real model and optimizer).
"""
from __future__ import annotations

import threading
import time
import warnings

import torch

from gradloc_track import GradMonitor
from gradloc_track.trackers import MemoryTracker, Tracker


class Hangs(MemoryTracker):
    """log_metrics of step >= 3 never returns (until the test ends)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def log_metrics(self, metrics, step):
        if step >= 3:
            self.release.wait(60)
        super().log_metrics(metrics, step)


class DownThenUp(MemoryTracker):
    """log_metrics raises until the test sets ``down = False``."""

    def __init__(self):
        super().__init__()
        self.down = True

    def log_metrics(self, metrics, step):
        if self.down:
            raise ConnectionError("down")
        super().log_metrics(metrics, step)


class AlwaysFails(Tracker):
    """Every call raises."""

    def __init__(self):
        self.calls = 0

    def log_metrics(self, metrics, step):
        self.calls += 1
        raise ConnectionError("backend down")

    log_table = log_html = log_params = set_tags = log_metrics

    def finish(self, status="success", timeout_s=None):
        raise ConnectionError("backend down")


class RecoversAtStep(MemoryTracker):
    """Every call fails until a metric of step >= ``step`` arrives."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.recover_at, self.up = step, False

    def _check(self):
        if not self.up:
            raise ConnectionError("backend down")

    def log_metrics(self, metrics, step):
        self.up = self.up or step >= self.recover_at
        self._check()
        super().log_metrics(metrics, step)

    def log_params(self, params):
        self._check()
        super().log_params(params)


def train(tracker, steps: int, at_step=None) -> float:
    """A real (tiny) training loop logging every step; returns the loop's wall time (without ``at_step``)."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)
    monitor = GradMonitor(model, tracker=tracker, log_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for step in range(steps):
        if at_step is not None:
            t_hook = time.perf_counter()
            at_step(step)
            t0 += time.perf_counter() - t_hook
        opt.zero_grad()
        model(x).mean().backward()
        monitor.after_backward(step)
        opt.step()
    return time.perf_counter() - t0


def timed_finish(tracker, status="success") -> float:
    """Seconds ``tracker.finish(status)`` took (its warnings silenced)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.finish(status)
    return time.perf_counter() - t0


class CustomBase(BaseException):
    """A BaseException of the user's or an SDK's own (not an Exception)."""


class RaisesOnce(MemoryTracker):
    """The ``at``-th ``log_metrics`` call raises ``exc`` (any BaseException), then the backend works again;
    ``finish_exc``: its ``finish`` raises that instead of ending the run."""

    def __init__(self, exc: type[BaseException], at: int = 5, finish_exc: type[BaseException] | None = None):
        super().__init__()
        self.exc, self.at, self.finish_exc, self.calls = exc, at, finish_exc, 0

    def log_metrics(self, metrics, step):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc("injected in a backend call")
        super().log_metrics(metrics, step)

    def finish(self, status="success", timeout_s=None):
        if self.finish_exc is not None:
            raise self.finish_exc("injected in the backend's finish")
        super().finish(status, timeout_s)


class SlowCalls(MemoryTracker):
    """Every call takes ``delay_s`` (a slow server: 2 s a call in the fault round)."""

    def __init__(self, delay_s: float = 2.0):
        super().__init__()
        self.delay_s = delay_s

    def _slow(self):
        time.sleep(self.delay_s)

    def log_metrics(self, metrics, step):
        self._slow()
        super().log_metrics(metrics, step)

    def log_table(self, key, columns, rows, step=None):
        self._slow()
        super().log_table(key, columns, rows, step)

    def log_html(self, key, html, step=None):
        self._slow()
        super().log_html(key, html, step)

    def finish(self, status="success", timeout_s=None):
        self._slow()
        super().finish(status, timeout_s)


class ArtifactsHang(MemoryTracker):
    """``log_table`` never returns (until ``release``), as an upload stuck in the SDK's retries against an artifact
    store that answers 500; ``apart``: the adapter says its artifact store is apart (MLflow's)."""

    def __init__(self, apart: bool):
        super().__init__()
        self.artifacts_apart = apart
        self.release = threading.Event()

    def log_table(self, key, columns, rows, step=None):
        self.release.wait(60)
        super().log_table(key, columns, rows, step)
