"""Worker for the corrupt-weight scan under torch.distributed: one process per rank (``launch.fork_ranks``)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: str, out_dir: str, wrap_kind: str) -> None:
    from gradloc_track.monitor import weight_check
    from gradloc_track.norms import local_part

    from .locate_worker import build, wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = wrap(build(), wrap_kind, world)
    healthy = weight_check.scan_all(model, 5)
    w = (model.module if wrap_kind == "ddp" else model).h[1].mlp.fc.weight
    if rank == world - 1:  # the last rank's shard (FSDP2) or every replica's copy's last row (DDP: rank's own)
        with torch.no_grad():
            local_part(w.data if wrap_kind == "ddp" else w).view(-1)[-1] = float("nan")
    found = weight_check.scan_all(model, 6)
    still = weight_check.still_all(model, found)
    with torch.no_grad():
        local_part(w.data if wrap_kind == "ddp" else w).nan_to_num_(0.0)
    healed = weight_check.still_all(model, found)
    out = {"healthy": healthy is None, "name": found.name, "index": list(found.index), "step": found.step,
           "still": still, "healed": not healed}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def monitor_main(rank: int, world: int, port: str, out_dir: str) -> None:
    """DDP, ``GradMonitor`` armed, logging every step: one replica's embedding weight set to 1e36 behind
    LayerNorm (its loss and gradient stay finite: no norm fires), on the last rank only. Its weight norm is
    inf there and finite elsewhere; every rank must scan (a collective) and report the same event."""
    import torch.nn.functional as F

    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.spikes import SpikeContext, SpikeDetector

    from .locate_worker import B, T, V, build, wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = build()
    ddp = wrap(model, "ddp", world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = GradMonitor(model, tracker=MemoryTracker(), optimizer=opt, log_every=1,
                      detector=SpikeDetector(warmup_steps=3, transient_fall=0.0))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.roll(x, -1, 1)

    def loss_fn(mask):
        per = F.cross_entropy(ddp(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * mask).sum() / (B * T)

    got = []
    for step in range(12):
        if step == 8 and rank == world - 1:
            with torch.no_grad():
                model.wte.weight[int(x[0, 0]), 3] = 1e36
        opt.zero_grad(set_to_none=True)
        loss_fn(torch.ones(B, T)).backward()
        stats = mon.after_backward(step, spike_context=SpikeContext(loss_fn, torch.ones(B, T), input_ids=x))
        got.append([step, [e.signal for e in stats.events], stats.cause_detail or ""])
        opt.step()
    Path(out_dir, f"monitor{rank}.json").write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()
