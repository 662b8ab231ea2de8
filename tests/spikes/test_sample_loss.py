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
