"""``clip/skip_restore``: the snapshot ``SkipStepGuard(mode="restore")`` takes before a step and the
bitwise select after it, checked directly: every parameter and optimizer state tensor (each float
width, integer, bool, complex) is its pre-step bytes when the flag is set and the step's bytes
(NaN payloads included) when not; state the step created is dropped; python numbers in state put
back. The guard around it, end to end: tests/clip/test_skip_step.py."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.clip.skip_restore import StateSnapshot, _bits, drop_fresh_state, fresh_params

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else \
        t.detach().reshape(1).view(torch.uint8).numpy().tobytes()


class Toy(torch.optim.Optimizer):
    """State of every kind: a float buffer, an int counter tensor, a bool and a complex tensor, and a
    python int. ``step`` writes garbage (NaN, Inf) into all of it."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(buf=torch.zeros_like(p), count=torch.zeros((), dtype=torch.int64),
                              seen=torch.zeros(2, dtype=torch.bool), phase=torch.zeros(2, dtype=torch.complex64),
                              calls=0)
                    continue
                st["buf"].fill_(float("nan"))
                st["count"] += 7
                st["seen"].fill_(True)
                st["phase"].fill_(complex(1, -1))
                st["calls"] += 1
                p.fill_(float("inf"))
                p.view(-1)[0] = float("-nan")


def params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2, generator=g).to(dt)) for dt in FLOATS]


def state_bytes(opt) -> list:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(as_bytes(p))
            for k, v in sorted(opt.state.get(p, {}).items()):
                out.append(as_bytes(v) if isinstance(v, torch.Tensor) else (k, v))
    return out


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_bits_is_a_same_bytes_integer_view_or_none(dtype):
    t = torch.ones(3, dtype=dtype)
    b = _bits(t)
    if dtype.is_floating_point:
        assert b.dtype.is_floating_point is False and b.element_size() == t.element_size()
        assert b.data_ptr() == t.data_ptr()  # a view, no copy
    elif dtype in (torch.bool, torch.complex64):
        assert b is None  # selected per tensor instead
    else:
        assert b is t


def test_fresh_params_are_those_without_state_and_dropping_needs_the_flag():
    ps = params()
    opt = Toy(ps)
    assert fresh_params(opt) == ps
    opt.step()  # creates state
    assert fresh_params(opt) == []
    drop_fresh_state(opt, ps[:2], torch.tensor(False))
    assert all(opt.state.get(p) for p in ps)
    drop_fresh_state(opt, ps[:2], torch.tensor(True))
    assert [bool(opt.state.get(p)) for p in ps] == [False, False, True, True]
    drop_fresh_state(opt, [], torch.tensor(True))  # nothing fresh: nothing read or dropped


@pytest.fixture
def stepped():
    """An optimizer one step in (state exists), and a snapshot taken before its second step."""
    opt = Toy(params())
    opt.step()
    snap = StateSnapshot(opt)
    snap.take()
    before = state_bytes(opt)
    opt.step()
    return opt, snap, before


def test_a_set_flag_restores_every_tensor_bit_for_bit_and_python_state(stepped):
    opt, snap, before = stepped
    assert state_bytes(opt) != before  # the step wrote NaN/Inf everywhere
    snap.select(torch.tensor(True))
    assert state_bytes(opt) == before


def test_a_clear_flag_keeps_the_steps_bytes_exactly_nan_payloads_included(stepped):
    opt, snap, _ = stepped
    after = state_bytes(opt)
    snap.select(torch.tensor(False))
    assert state_bytes(opt) == after


def test_state_the_skipped_step_created_is_dropped():
    opt = Toy(params())
    snap = StateSnapshot(opt)
    snap.take()
    assert snap.fresh == [p for g in opt.param_groups for p in g["params"]]
    opt.step()
    snap.select(torch.tensor(True))
    assert not any(opt.state.get(p) for p in snap.fresh)  # as if the step never ran
    opt2 = Toy(params())
    snap2 = StateSnapshot(opt2)
    snap2.take()
    opt2.step()
    snap2.select(torch.tensor(False))
    assert all(opt2.state.get(p) for p in snap2.fresh)  # a kept step keeps its state


def test_buffers_are_reused_across_steps_and_follow_the_tensors(stepped):
    opt, snap, _ = stepped
    buffers = dict(snap._buffers)
    snap.take()
    assert all(snap._buffers[k] is v for k, v in buffers.items())  # no new memory per step
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["buf"] = torch.zeros(5, dtype=p.dtype)  # a state tensor replaced by a new one
    snap.take()
    assert len(snap._buffers) == len(buffers)  # the old tensor's buffer is let go, the new one has its own
    assert any(b.shape == (5,) for b in snap._buffers.values())


def test_a_state_tensor_two_parameters_share_is_restored_once():
    """One tensor in two parameters' state (a shared step counter, a shared preconditioner) is one
    tensor to restore: selected twice, its bits were summed with themselves."""
    p1, p2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p1, p2], lr=0.1)
    shared = torch.tensor([1.5, 2.5])
    opt.state[p1]["shared"] = opt.state[p2]["shared"] = shared
    snap = StateSnapshot(opt)
    snap.take()
    shared.fill_(9.0)
    snap.select(torch.tensor(True))
    assert shared.tolist() == [1.5, 2.5]
    shared.fill_(9.0)
    snap.take()
    snap.select(torch.tensor(False))
    assert shared.tolist() == [9.0, 9.0]
