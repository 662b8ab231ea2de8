"""One rank of ``watch(ddp_model, opt, spikes={"quarantine": True})`` (``launch.fork_ranks``): a tiny GPT-2 counting
up (``tests/integrations/conftest.py``'s batches), a garbage document on rank 1 at ``INJECT_AT`` that comes back at
``AGAIN`` on rank 1 and at ``AGAIN_0`` on rank 0, and a NaN multiplier on rank 1's loss at ``NAN_AT`` (a step no
sample of the batch made). Writes what the rank saw to ``OUT_DIR/rank<r>.json``."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

INJECT_AT, AGAIN, AGAIN_0, NAN_AT, STEPS = 40, 43, 45, 48, 50


def main(rank: int, world: int, port: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradloc_track
    from gradloc_track.data import record_fingerprint
    from tests.integrations.conftest import CORRUPT, FAST, LR, counting_batch, tiny_gpt2

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    handle = gradloc_track.watch(model, opt, tracker="none", console=False,
                                 **{**FAST, "spikes": {**FAST["spikes"], "quarantine": True}})
    seen: dict = {"skipped": [], "blamed_at": {}, "spikes": {}}
    for step in range(STEPS):
        bad = CORRUPT if (rank == 1 and step in (INJECT_AT, AGAIN)) or (rank == 0 and step == AGAIN_0) else None
        # the garbage document is the same content wherever it comes: the same rows every time it comes
        batch = counting_batch(step * world + rank if bad is None else 7, 4, bad)
        for b in range(batch["labels"].shape[0]):
            row = {k: v[b] for k, v in batch.items()}
            if not handle.quarantine.admit(record_fingerprint(row), step):
                seen["skipped"].append([step, b])
                clean = counting_batch(10_000 + step * world + rank, 1)
                for k in batch:
                    batch[k][b] = clean[k][0]
        loss = model(**batch).loss
        if rank == 1 and step == NAN_AT:
            loss = loss * float("nan")  # a multiplier the replay does not rebuild: no sample made the step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if handle.last.events:
            s = handle.last
            nf = s.locate.nonfinite if s.locate is not None else None
            seen["spikes"][str(step)] = {"cause": s.cause, "nonfinite": None if nf is None else nf.where,
                                         "rows": len(s.locate.culprits) if s.locate is not None else 0}
        seen["blamed_at"] = {fp: at for fp, at in handle.quarantine.blamed.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    handle.close()
    dist.destroy_process_group()
