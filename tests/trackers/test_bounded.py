"""The bounded call (``trackers/bounded.py``): the writer, the report and the SIGTERM handler stop
waiting at a deadline; quick failures are retried inside the same bound."""
from __future__ import annotations

import threading
import time

import pytest

from gradloc_track.trackers.bounded import CallThread, CallTimeout, bounded_call


def test_a_call_past_its_bound_is_left_running_and_its_late_answer_kept():
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(CallTimeout, match=r"no answer within 0.2 s \(tracker.call_timeout_s\)") as caught:
        bounded_call(lambda: release.wait(30) and "late", 0.2, what="tracker.call_timeout_s")
    took = time.perf_counter() - t0
    assert took < 0.2 + 3.0, f"waited {took:.1f} s for a 0.2 s bound"
    assert not caught.value.future.done()  # still running on its own thread
    release.set()
    assert caught.value.future.result(timeout=10) == "late"


def test_quick_failures_are_retried_with_backoff_then_raised():
    calls = []

    def flaky():
        calls.append(time.perf_counter())
        if len(calls) < 3:
            raise ConnectionError("refused")
        return 42

    assert bounded_call(flaky, 10.0, retries=3, backoff_s=0.05) == 42
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 3 and gaps[0] >= 0.05 and gaps[1] >= 0.1  # backoff doubles

    calls.clear()
    with pytest.raises(ConnectionError, match="refused"):
        bounded_call(lambda: _refuse(calls), 10.0, retries=2, backoff_s=0.01)
    assert len(calls) == 3  # the first try and two retries


def _refuse(calls):
    calls.append(1)
    raise ConnectionError("refused")


def test_no_retry_that_would_end_past_the_bound():
    calls = []
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError):
        bounded_call(lambda: _refuse(calls), 0.5, retries=5, backoff_s=2.0)  # the first backoff alone overruns
    assert len(calls) == 1 and time.perf_counter() - t0 < 0.5 + 3.0


def test_an_sdk_timeout_error_is_a_quick_failure_not_our_timeout():
    calls = []

    def sdk_timeout():
        calls.append(1)
        raise TimeoutError("read timed out (the SDK's own)")

    with pytest.raises(TimeoutError, match="the SDK's own") as caught:
        bounded_call(sdk_timeout, 10.0, retries=1, backoff_s=0.01)
    assert not isinstance(caught.value, CallTimeout) and len(calls) == 2  # retried like any quick failure


def test_one_call_thread_runs_its_calls_one_at_a_time_in_order():
    thread = CallThread("test-calls")
    release = threading.Event()
    running, order = [], []

    def call(i, wait=None):
        def run():
            running.append(i)
            assert len(running) == 1, "two calls at once"
            if wait is not None:
                wait.wait(30)
            order.append(i)
            running.remove(i)
            return i
        return run

    with pytest.raises(CallTimeout):
        bounded_call(call(0, release), 0.1, thread=thread)
    assert thread.busy
    second = thread.submit(call(1))
    time.sleep(0.1)
    assert order == [] and not second.done()  # waits behind the stuck call
    release.set()
    assert second.result(timeout=10) == 1 and order == [0, 1] and not thread.busy
