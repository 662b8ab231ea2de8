"""Worker for the HSDP test: a 2x2 (replicate x shard) mesh on 4 gloo processes; GradMonitor's
per-tensor norms and AdaGC's per-tensor thresholds over two steps of the same batch."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.monitor import dist_worker as base  # the model, batch and loss of the 2-process tests


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradloc_track import GradMonitor
    from gradloc_track.clip import AdaGC

    model = base.build()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clipper = AdaGC(model, warmup_steps=1, lambda_abs=0.5)
    monitor = GradMonitor(model, clipper=clipper, per_tensor=True, weight_norms=False)
    batch = base.global_batch().chunk(world)[rank]
    counted = []
    real = dist.all_reduce

    def counting(*a, **k):
        counted.append(1)
        return real(*a, **k)

    steps = []
    for step in range(2):  # warm-up (global clip), then per-tensor thresholds from gamma
        for p in model.parameters():
            p.grad = None
        base.loss_of(model, batch).backward()
        dist.all_reduce = counting  # observe only: collectives inside after_backward
        try:
            stats = monitor.after_backward(step)
        finally:
            dist.all_reduce = real
        steps.append({"norms": stats.grad_norms, "thresholds": stats.clip.threshold_t.tolist(),
                      "gamma": clipper.gamma.tolist()})
    placements = sorted({str(p.placements) for p in model.parameters()})
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "collectives": len(counted),
                                                         "placements": placements, "names": clipper.names}))
    dist.barrier()
    dist.destroy_process_group()
