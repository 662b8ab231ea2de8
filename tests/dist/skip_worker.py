"""Worker for the skipped-step test: one rank skips ``optimizer.step()`` under DDP with ``watch()`` on
(``launch.fork_ranks``). Rank 0 writes what it saw to ``OUT_DIR/rank0.json``."""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

SKIP_AT = 3


def main(rank: int, world: int, port: str, out_dir: str) -> None:
    import gradloc_track
    from gradloc_track.monitor import rank_wait

    from .locate_worker import B, T, V, build, wrap

    rank_wait.WARN_AFTER_S = 1.0  # our own threshold (120 s by default), not the SDK's: the wait is real
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=6))
    torch.set_num_threads(1)
    model = wrap(build(), "ddp", world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker="none", console=False)
    g = torch.Generator().manual_seed(rank)
    seen: dict = {"steps": [], "warnings": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(SKIP_AT + 2):
                x = torch.randint(0, V, (B, T + 1), generator=g)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1)).backward()
                if rank == world - 1 and step == SKIP_AT:
                    time.sleep(12)  # skipped its step (a per-rank check), then stalls past the peers' timeout
                    break
                opt.step()
                seen["steps"].append(step)
        except Exception as exc:  # what the waiting rank's loop gets
            seen["error"] = f"{type(exc).__name__}: {exc}"
        seen["warnings"] = [str(w.message) for w in caught if "gradloc-track" in str(w.message)]
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps(seen))
    handle.close()
    os._exit(0)  # the process group is broken: no destroy
