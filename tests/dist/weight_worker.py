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
