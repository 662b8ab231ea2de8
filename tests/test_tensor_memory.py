"""``tensor_memory.TensorMemoryMeter``: the peak and current bytes of known allocation patterns,
computed by hand (numel x element size of each fresh storage), with views, in-place results,
tensors from outside the block and backward's own allocations."""
from __future__ import annotations

import torch

from gradloc_track.tensor_memory import TensorMemoryMeter

F32 = 4


def test_a_sequence_of_allocations_and_frees_peaks_where_expected():
    with TensorMemoryMeter() as m:
        a = torch.empty(1000)  # 4000
        b = torch.empty(2000)  # 12000 live
        del a  # 8000
        c = torch.empty(500)  # 10000
        d = torch.empty(250, dtype=torch.float64)  # 12000
        del c  # 10000
    assert m.peak == 12000 and m.current == 2000 * F32 + 250 * 8
    del b, d


def test_the_peak_is_the_most_held_at_once_not_the_total_allocated():
    with TensorMemoryMeter() as m:
        for _ in range(10):
            t = torch.ones(100)  # the previous one is freed when the name is rebound
            del t
    assert m.peak == 100 * F32 and m.current == 0


def test_views_and_in_place_results_are_not_new_memory():
    with TensorMemoryMeter() as m:
        a = torch.zeros(10, 10)
        v = a[2:5].t()  # a view: same storage
        a.add_(1.0)  # in place
        a.view(-1).mul_(2.0)
        r = a.reshape(100)  # contiguous: a view
    assert m.peak == 100 * F32 == m.current
    del a, v, r


def test_tensors_made_outside_the_block_are_not_counted_but_their_results_are():
    x = torch.ones(256)
    with TensorMemoryMeter() as m:
        y = x * 2  # a fresh storage of 256 floats
        x.add_(1)  # the outside tensor, in place: nothing new
    assert m.peak == 256 * F32 and m.current == 256 * F32
    del y


def test_a_backward_is_measured_too():
    w = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 32)
    with TensorMemoryMeter() as m:
        out = x @ w  # (8, 16), kept alive
        loss = out.sum()  # a scalar
        loss.backward()  # d loss (a scalar 1, expanded as a view) and w.grad = x.T @ it: (32, 16)
    assert m.peak == (8 * 16 + 1 + 1 + 32 * 16) * F32
    del out, loss
    assert m.current == 32 * 16 * F32  # the gradient it left behind is still held


def test_empty_tensors_are_free():
    with TensorMemoryMeter() as m:
        e = torch.empty(0)
        e2 = torch.ones(0, 5)
    assert m.peak == 0 and m.current == 0
    del e, e2
