"""One rank of ``locate`` under FSDP2 (``launch.fork_ranks``) on a step whose ``.grad`` holds a NaN in rank 1's
shard only, while the batch's loss is finite (a flipped bit, a NaN multiplier the replay does not rebuild).
Writes the rank's finding to ``OUT_DIR/rank<r>.json``."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path


def main(rank: int, world: int, port: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from gradloc_track import locate
    from gradloc_track.norms import local_part

    from .locate_worker import B, T, build, global_batch, make_loss_fn, wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    model = wrap(build(), "fsdp2", world)
    x, y, w = global_batch(world, [])
    rows = slice(rank * B, rank * B + B)
    loss_fn = make_loss_fn(model, x[0, rows], y[0, rows], w[0, rows], B * T)
    mask = torch.ones(B, T)
    loss_fn(mask).backward()
    if rank == 1:  # one element of one shard: the other rank's part of that tensor is finite
        with torch.no_grad():
            local_part(next(model.parameters()).grad).view(-1)[0] = float("nan")
    res = locate(model, loss_fn, mask)
    found = res.nonfinite
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"where": None if found is None else found.where, "detail": None if found is None else found.detail}))
    dist.destroy_process_group()
