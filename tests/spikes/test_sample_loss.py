"""The sample signal's per-sample loss: rows are the units, repeats of the input token are capped at
the batch's mean term loss. Hand-computed."""
import math

import torch

from gradloc_track.spikes import sample_losses


def test_rows_with_repeats_capped_at_the_batch_mean():
    losses = torch.tensor([[1.0, 2.0, 9.0, 0.0], [6.0, 6.0, 6.0, 6.0], [3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # row 2 has no terms
    targets = torch.tensor([[4, 5, 6, 7], [8, 8, 8, 8], [1, 1, 1, 1]])
    inputs = torch.tensor([[0, 5, 1, 7], [0, 8, 8, 8], [1, 1, 1, 1]])  # repeats: (0, 1), (1, 1..3), (0, 3) unmasked
    mean = (1 + 2 + 9 + 6 * 4) / 7  # 36 / 7 = 5.14, over the batch's terms
    got = sample_losses(losses, mask, inputs, targets)
    assert got[0] == (1 + min(2, mean) + 9) / 3  # 2 is below the mean: unchanged
    assert math.isclose(float(got[1]), (6 + 3 * mean) / 4, rel_tol=1e-6)  # the three repeats capped
    assert got[2] == -math.inf  # no terms: no sample
    plain = sample_losses(losses, mask)  # no ids: no cap
    assert plain[1] == 6.0 and plain[0] == 4.0


def test_a_nan_term_makes_its_row_and_the_largest_nan():
    losses = torch.tensor([[1.0, math.nan], [2.0, 2.0]])
    mask = torch.ones(2, 2)
    ids = torch.tensor([[1, 2], [3, 4]])
    got = sample_losses(losses, mask, ids, ids)
    assert math.isnan(float(got[0])) and math.isnan(float(got.max()))


def test_a_mask_of_the_wrong_shape_names_the_fix():
    import pytest

    with pytest.raises(ValueError, match=r"token_losses and mask must both be \(B, T\).*\(2, 3\) and \(2, 2\)"):
        sample_losses(torch.ones(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        sample_losses(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(3, 2, dtype=torch.long), None)


def test_a_batch_whose_rows_are_all_masked_gives_the_detector_no_sample():
    """Issue 40: an all-masked batch's largest sample loss is -inf (no sample); the detector left it in and
    fired on every such step, warm-up included (40 events in 40 steps). Such samples are no samples."""
    from gradloc_track.spikes import SpikeDetector

    det = SpikeDetector()
    empty = sample_losses(torch.ones(4, 8), torch.zeros(4, 8))
    assert float(empty.max()) == -math.inf
    fired = [step for step in range(40) if det.update(step, 1.0, sample_losses=[float(empty.max())])]
    assert fired == []
    assert det.update(40, 1.0, sample_losses=[-math.inf, math.nan])  # a NaN sample still fires
