"""``norms``: per-tensor squared L2 norms against a plain per-parameter loop in float64 (None grads,
mixed dtypes and devices' groups, fp16/bf16 accumulated in fp32, sparse COO with duplicate indices,
complex), the trainable-parameter order, and the shard reduction's bookkeeping (which entries are
summed over which group) on a real 1-process gloo group. The reduction across real ranks is
tests/dist/test_mesh_norms.py (4 processes, HSDP)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradloc_track import norms
from gradloc_track.norms import (all_reduce_sq_norms, dense_part, global_sq_norms, is_replicated, local_part,
                                 reduce_over_shards, shard_groups, sq_norms, trainable_params)


def loop(tensors) -> list[float]:
    """The reference: one tensor at a time, in float64, |x|^2 summed by hand."""
    out = []
    for t in tensors:
        if t is None:
            out.append(0.0)
            continue
        d = t.to_dense() if t.layout != torch.strided else t
        d = d.to(torch.complex128).abs() if d.is_complex() else d.double()
        out.append(float(d.pow(2).sum()))
    return out


def rand(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def close(got: torch.Tensor, ref: list[float], rel: float = 1e-6):
    assert got.dtype == torch.float32 and got.shape == (len(ref),)
    assert got.tolist() == pytest.approx(ref, rel=rel, abs=1e-30)


def test_plain_fp32_tensors_in_order():
    ts = [rand(3, 4, seed=i) * (i + 1) for i in range(5)] + [rand(7, seed=9).t()]
    close(sq_norms(ts), loop(ts))


def test_none_gradients_count_as_zero_in_their_place():
    ts = [None, rand(3, seed=1), None, rand(2, 2, seed=2), None]
    close(sq_norms(ts), loop(ts))
    close(sq_norms([None, None]), [0.0, 0.0])
    assert sq_norms([]).shape == (0,)


def test_mixed_dtypes_keep_their_places():
    ts = [rand(5, seed=0), rand(4, dtype=torch.bfloat16, seed=1), None, rand(3, dtype=torch.float64, seed=2),
          rand(6, dtype=torch.float16, seed=3), rand(2, seed=4)]
    close(sq_norms(ts), loop(ts), rel=1e-6)  # each against its own (rounded) values: fp32 accumulation


def test_low_precision_is_accumulated_in_fp32():
    """sqrt(3) in bf16 is 1.734375 (3.008 squared): the fp32 result is 3 to fp32 precision."""
    close(sq_norms([torch.ones(3, dtype=torch.bfloat16)]), [3.0], rel=1e-6)
    big = torch.full((3,), 300.0, dtype=torch.float16)  # 270000: far beyond fp16's 65504
    close(sq_norms([big]), [270000.0], rel=1e-6)


def test_float64_is_reduced_in_float64():
    t = torch.tensor([1.0, 1e-9], dtype=torch.float64)
    close(sq_norms([t]), [1.0 + 1e-18])
    close(sq_norms([t, None]), [1.0, 0.0])  # the grouped path too


def test_complex_is_the_sum_of_squared_moduli():
    z = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    close(sq_norms([z]), [2.0 + 5.0])


def test_sparse_coo_is_coalesced_duplicates_summed():
    i = torch.tensor([[0, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0, 3.0]), (4,), check_invariants=True)  # index 0 twice
    assert loop([s]) == [18.0]
    close(sq_norms([s]), [18.0])
    close(sq_norms([rand(3), s, None]), loop([rand(3), s, None]))
    assert torch.equal(dense_part(s), torch.tensor([3.0, 3.0]))
    dense = rand(2)
    assert dense_part(dense) is dense


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make", [lambda: torch.eye(2).to_sparse_csr(), lambda: torch.eye(2).to_sparse_csc()],
                         ids=["csr", "csc"])
def test_other_sparse_layouts_are_refused_by_name(make):
    with pytest.raises(TypeError, match=r"gradients with layout torch.sparse_c.. are not supported"):
        sq_norms([make()])
    with pytest.raises(TypeError, match="not supported"):
        sq_norms([rand(2), make()])


def test_the_result_goes_to_the_device_asked_for():
    assert sq_norms([rand(2)], device=torch.device("meta")).device.type == "meta"


def test_trainable_params_in_named_parameters_order_with_eager_names():
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    inner[0].bias.requires_grad_(False)
    wrapper = torch.nn.Module()
    wrapper._orig_mod = inner  # what torch.compile's OptimizedModule holds
    got = trainable_params(wrapper)
    assert [n for n, _ in got] == ["0.weight", "1.weight", "1.bias"]
    assert [p for _, p in got] == [inner[0].weight, inner[1].weight, inner[1].bias]


# -- DTensor bookkeeping: stand-ins recognised by type name, as the code recognises DTensor ---------

class Shard:
    pass


class Replicate:
    pass


class _StridedShard:
    pass


class Mesh:
    def __init__(self, sizes, groups):
        self.sizes, self.groups = sizes, groups

    def size(self, d):
        return self.sizes[d]

    def get_group(self, d):
        return self.groups[d]


class DTensor:
    def __init__(self, local, mesh, placements):
        self._local, self.device_mesh, self.placements = local, mesh, placements

    def to_local(self):
        return self._local


def test_a_dtensors_local_part_and_replication():
    local = rand(2)
    mesh = Mesh([2], ["g"])
    assert local_part(DTensor(local, mesh, [Shard()])) is local and local_part(local) is local
    assert is_replicated(DTensor(local, mesh, [Replicate(), Replicate()]))
    assert not is_replicated(DTensor(local, mesh, [Replicate(), Shard()])) and not is_replicated(local)
    close(sq_norms([DTensor(local, mesh, [Shard()]), None]), loop([local, None]))  # the local shard's norm


def test_shard_groups_name_each_sharding_dim_once_in_order_of_first_appearance():
    hsdp = Mesh([2, 4], ["replicate", "shard"])
    tp = Mesh([3], ["tp"])
    one = Mesh([1], ["single"])
    ts = [rand(2), DTensor(rand(2), hsdp, [Replicate(), Shard()]), None, DTensor(rand(2), tp, [_StridedShard()]),
          DTensor(rand(2), hsdp, [Shard(), Shard()]), DTensor(rand(2), one, [Shard()]),
          DTensor(rand(2), hsdp, [Replicate(), Replicate()])]
    assert shard_groups(ts) == [("shard", [1, 4]), ("tp", [3]), ("replicate", [4])]  # size-1 dims: nothing to sum


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one process (torch.distributed's own state restored afterwards)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_nothing_is_reduced():
    values = torch.tensor([1.0, 2.0])
    assert not dist.is_initialized()
    assert reduce_over_shards(values, [DTensor(rand(1), Mesh([2], ["g"]), [Shard()]), None]) is values


def test_each_group_sums_exactly_its_tensors_entries(one_rank_group, monkeypatch):
    """Two sharding groups over one real gloo rank; the all-reduce is counted and, to make the sum
    visible with one rank, its result doubled (as two ranks holding equal shards would give)."""
    real, seen = dist.all_reduce, []

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        seen.append((group is g_a, group is g_b, t.numel()))
        real(t, op=op, group=one_rank_group)
        t.mul_(2)

    g_a, g_b = object(), object()
    monkeypatch.setattr(norms.dist, "all_reduce", all_reduce)
    ts = [DTensor(rand(2), Mesh([2], [g_a]), [Shard()]), rand(2), DTensor(rand(2), Mesh([2], [g_b]), [Shard()]),
          DTensor(rand(2), Mesh([2], [g_a]), [Shard()])]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = reduce_over_shards(values, ts)
    assert out.tolist() == [2.0, 2.0, 6.0, 8.0] and values.tolist() == [1.0, 2.0, 3.0, 4.0]  # input kept
    assert seen == [(True, False, 2), (False, True, 1)]  # one collective per group, its entries only
    seen.clear()
    every = [DTensor(rand(2), Mesh([2], [g_a]), [Shard()]) for _ in range(3)]
    assert reduce_over_shards(torch.ones(3), every).tolist() == [2.0, 2.0, 2.0]
    assert seen == [(True, False, 3)]  # all sharded along one dim: the whole vector, in one call
    assert all_reduce_sq_norms(torch.ones(1), [rand(1)]).tolist() == [1.0]  # plain tensors: unchanged


def test_global_sq_norms_on_plain_tensors_under_a_process_group_are_the_local_ones(one_rank_group):
    ts = [rand(3, seed=1), None, rand(2, dtype=torch.bfloat16, seed=2)]
    close(global_sq_norms(ts), loop(ts))
