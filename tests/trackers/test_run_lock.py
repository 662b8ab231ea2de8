"""One run per run directory (``trackers/run_lock.py``): a second writer gets a clear error, the
directory is free again once the first run finished."""
from __future__ import annotations

import os

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, make_tracker
from gradloc_track.trackers.async_writer import AsyncTracker
from gradloc_track.trackers.run_lock import RunDirInUse, RunOwner, owner_alive


def test_a_second_writer_on_the_same_run_dir_gets_a_clear_error(tmp_path):
    first = AsyncTracker(lambda: MemoryTracker(), "mlflow", tmp_path)
    with pytest.raises(RunDirInUse, match=rf"{tmp_path}.*in use by .*pid {os.getpid()}.*another run directory"):
        AsyncTracker(lambda: MemoryTracker(), "mlflow", tmp_path)
    with pytest.raises(RunDirInUse):
        make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)  # any writer of the same directory
    assert owner_alive(tmp_path)
    first.finish()
    assert not owner_alive(tmp_path)
    again = AsyncTracker(lambda: MemoryTracker(), "mlflow", tmp_path)  # free once the first run finished
    again.finish()


def test_two_backends_of_one_run_share_its_directory(tmp_path):
    """``tracker=both``: the MLflow and the W&B writer of ONE run (one owner of the directory)."""
    run = RunOwner()
    both = [AsyncTracker(lambda: MemoryTracker(), name, tmp_path, owner=run) for name in ("mlflow", "wandb")]
    both[0].finish()
    assert owner_alive(tmp_path)  # the W&B writer still holds it
    both[1].finish()
    assert not owner_alive(tmp_path)
