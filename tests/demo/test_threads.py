"""The demo apps' thread default: half the usable cores, 1 to 4; 0 leaves torch's own."""
from __future__ import annotations

import torch

from gradloc_track.demo.threads import default_threads, set_threads, usable_cores


def test_half_the_cores_at_most_four_and_zero_leaves_torchs_count():
    assert [default_threads(c) for c in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4, 4]
    assert 1 <= usable_cores()
    before = torch.get_num_threads()
    try:
        assert set_threads(2) == 2 == torch.get_num_threads()
        assert set_threads(0) == 2  # 0: left as it is (torch's default in a fresh process)
        assert set_threads(None) == default_threads()
    finally:
        torch.set_num_threads(before)
