"""The corrupt-weight scan (``monitor/weight_check.py``) against the plain definition, parameter by parameter."""
import math

import pytest
import torch

from gradloc_track.monitor import weight_check


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_a_healthy_model_has_no_corrupt_weight_even_with_large_trained_gains():
    m = model()
    with torch.no_grad():
        m[1].weight.fill_(300.0)  # a large, uniform gain: large, not absurd
        m[0].weight[0, 0] = 50.0  # an outlier weight a trained model can hold
    assert weight_check.scan(m, 7) is None


def test_a_nan_and_an_absurd_value_are_named_with_their_index_and_value():
    m = model()
    with torch.no_grad():
        m[2].weight[1, 9] = math.nan
    found = weight_check.scan(m, 12)
    assert (found.name, found.index, math.isnan(found.value), found.step) == ("2.weight", (1, 9), True, 12)
    assert "a weight is not a number: 2.weight[1, 9] = nan" in found.detail and "before step 12" in found.detail
    assert weight_check.still(m, found)
    with torch.no_grad():
        m[2].weight[1, 9] = 0.1
        m[0].bias[3] = 4e36
    assert not weight_check.still(m, found)
    found = weight_check.scan(m, 13)
    assert (found.name, found.index) == ("0.bias", (3,)) and found.value == pytest.approx(4e36, rel=1e-6)
    assert "is absurd: 0.bias[3] = 4e+36" in found.detail


def test_bf16_weights_are_read_in_their_own_dtype():
    m = model().to(torch.bfloat16)
    assert weight_check.scan(m, 1) is None
    with torch.no_grad():
        m[0].weight[2, 2] = math.inf
    assert weight_check.scan(m, 1).index == (2, 2)
