"""Worker for the 2-process gloo tests: DDP and FSDP2 gradients seen by GradMonitor and AdaGC."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 17), generator=g)  # (B, T+1), split over 2 ranks


def loss_of(model, batch):
    x, y = batch[:, :-1], batch[:, 1:]
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))


def main(rank: int, world: int, port: str, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.clip import AdaGC

    model = build()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    tracker = MemoryTracker()
    clipper = AdaGC(model, warmup_steps=1, lambda_abs=0.5)
    monitor = GradMonitor(model, tracker=tracker, clipper=clipper, per_tensor=True)
    batch = global_batch().chunk(world)[rank]
    loss_of(wrapped, batch).backward()
    collectives = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **k):
        collectives.append("all_reduce")
        return real_all_reduce(*a, **k)

    dist.all_reduce = counting_all_reduce  # observe only: count collectives in after_backward
    try:
        stats = monitor.after_backward(0)  # a logging step: grad AND weight norms
    finally:
        dist.all_reduce = real_all_reduce
    norms = stats.grad_norms
    post = {n: float(torch.as_tensor(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).norm())
            for n, p in model.named_parameters()}
    if rank == 0:
        sharded = any(type(p.grad).__name__ == "DTensor" for p in model.parameters())
        result = {"norms": norms, "post": post, "logged": len(tracker.metrics), "sharded": sharded,
                  "metrics": tracker.metrics[0][1], "layers": stats.layer_norms, "collectives": len(collectives)}
    else:
        result, out = {"logged": len(tracker.metrics)}, out + f".{rank}"
    with open(out, "w") as f:
        json.dump(result, f)
    # Both ranks reach here before either tears gloo down: a rank that destroys its group while
    # the peer's gloo threads still talk to it can abort the peer ("terminate called without an
    # active exception"), which is a teardown race, not a result of the test.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    print(f"rank {sys.argv[1]} done", flush=True)
    # Results are on disk and the group is destroyed; skip interpreter teardown, where static
    # destructors of gloo/TCPStore threads occasionally call std::terminate on a loaded machine.
    os._exit(0)
