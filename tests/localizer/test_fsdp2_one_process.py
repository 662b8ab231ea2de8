"""FSDP2 on one process (a 1-rank mesh, as verl's engine on one GPU): ``locate()`` takes the single-
process path and reads the DTensor gradients' local tensors (``probe._dense``, ``Snapshot.grads_for``).
The reference is the same model unsharded: the same culprits, norms and probes."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from gradloc_track import locate

from .helpers import LM, data, sum_loss

B, T = 4, 24


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group in this process (a file rendezvous: no port), torn down after the test."""
    # a file rendezvous in the test's own directory: gloo's FileStore deletes the file when the group
    # is done, which a NamedTemporaryFile's own unlink then raced (FileNotFoundError at teardown)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(model: LM) -> LM:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model.mid, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model):
    x, y, w, culprits = data(n_culprits=1, seed=3)
    fn = sum_loss(model, x, y, w)
    fn(torch.ones(B, T)).backward()
    return fn, culprits


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_locate_on_fsdp2_one_process_matches_the_plain_model(one_rank_group):
    plain, sharded = LM(), _sharded(LM())  # same seed: the same weights
    assert type(sharded.mid.weight).__name__ == "DTensor"
    fn_p, culprits = _step(plain)
    fn_s, _ = _step(sharded)
    grads = [p.grad for p in sharded.parameters()]
    before = [g.to_local().clone() for g in grads]

    ref = locate(plain, fn_p, torch.ones(B, T))
    got = locate(sharded, fn_s, torch.ones(B, T))

    assert {(c.batch, c.position) for c in got.tokens} == culprits == {(c.batch, c.position) for c in ref.tokens}
    assert [c.grad_norm for c in got.tokens] == pytest.approx([c.grad_norm for c in ref.tokens], rel=1e-5)
    assert [(c.level, c.batch) for c in got.culprits] == [(c.level, c.batch) for c in ref.culprits]
    assert got.probes == ref.probes
    assert got.step_check.replayed and got.step_check.residual < 1e-5  # the probes add up to the DTensor .grad
    assert [p.grad for p in sharded.parameters()] == grads  # the same DTensor objects, bitwise unchanged
    assert all(torch.equal(g.to_local(), b) for g, b in zip(grads, before))
