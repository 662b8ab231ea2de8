"""The monitor's seams (``gradloc_track.protocols``): the library's own classes satisfy them, and an
object that does not is refused at construction, naming what it lacks."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, NoClip, ZClip
from gradloc_track.monitor import GradMonitor
from gradloc_track import protocols
from gradloc_track.protocols import ArtifactWriterLike, ClipperLike, DetectorLike
from gradloc_track.spikes import SpikeDetector
from gradloc_track.trackers import MemoryTracker, NullTracker, Tracker


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("cls", [AdaGC, GlobalClip, LayerClip, NoClip, ZClip])
def test_every_clipper_is_clipper_like(cls):
    assert isinstance(cls(_model()), ClipperLike)


def test_the_detector_writer_and_trackers_satisfy_their_protocols(tmp_path):
    assert isinstance(SpikeDetector(), DetectorLike)
    assert SpikeDetector().needs_token_count is False
    assert SpikeDetector(mode="fixed", per_token_threshold=100.0).needs_token_count is True
    assert isinstance(SpikeArtifactWriter(NullTracker(), run_dir=tmp_path), ArtifactWriterLike)
    assert isinstance(NullTracker(), Tracker) and isinstance(MemoryTracker(), Tracker)
    assert not hasattr(protocols, "TrackerLike")  # one seam per concept: the tracker's is trackers.Tracker


def test_a_writer_without_write_detection_is_refused_by_name():
    class OnlyWrite:
        def write(self, step, events, result, ctx):
            pass

    assert not isinstance(OnlyWrite(), ArtifactWriterLike)
    with pytest.raises(TypeError, match="write_detection"):
        GradMonitor(_model(), artifact_writer=OnlyWrite())


def test_a_user_detector_without_needs_token_count_reads_no_token_count():
    class Quiet:
        def update(self, step, global_norm, layer_norms=None, **kw):
            return []

        def metrics(self):
            return {"spike/custom": 1.0}

    mon = GradMonitor(_model(), detector=Quiet())
    assert mon._detector_counts_tokens is False
