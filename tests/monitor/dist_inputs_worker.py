"""Worker for the 2-process gloo test of the detector's loss inputs: each rank passes its own batch's
loss, per-sample losses and junk-span statistics; every rank's detector must read the same values."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

try:  # imported by the test
    from .dist_worker import build, global_batch
except ImportError:  # run as the worker script (its folder is on sys.path)
    from dist_worker import build, global_batch

STEPS, SPIKE_AT, MISSING_AT = 8, 6, 5


def local_inputs(model, batch):
    """The rank's loss, per-sample losses and junk statistics, from one forward (as watch() reads them)."""
    from gradloc_track.spikes import junk_span

    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(x)
    per = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1), reduction="none").view_as(y)
    return per.mean(), per.detach().mean(1), junk_span(logits.detach(), y, x, terms=4), logits


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel

    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.spikes import SpikeDetector

    model = build()
    wrapped = DistributedDataParallel(model)
    detector = SpikeDetector(warmup_steps=3, junk_terms=4)
    monitor = GradMonitor(model, tracker=MemoryTracker(), detector=detector, log_every=1)
    loss, samples, junk, _ = local_inputs(wrapped, global_batch().chunk(world)[rank])
    loss.backward()
    fed, events, gathers = [], [], []
    update = detector.update
    detector.update = lambda *a, **k: fed.append({n: v for n, v in k.items() if v is not None and not callable(v)}) \
        or update(*a, **k)  # junk_text: a callable the detector reads only when the junk rule would fire
    real_gather = dist.all_gather_into_tensor

    def counting_gather(*a, **k):
        gathers.append(1)
        return real_gather(*a, **k)

    dist.all_gather_into_tensor = counting_gather
    for step in range(STEPS):
        mine = samples.clone()
        if step == SPIKE_AT and rank == 1:
            mine[0] = 100.0  # one rank's sample: every rank must fire
        given = None if (step == MISSING_AT and rank == 1) else mine
        stats = monitor.after_backward(step, loss=loss.detach(), sample_losses=given, junk_span=junk)
        events.append(sorted(e.signal for e in stats.events))
    dist.all_gather_into_tensor = real_gather
    result = {"fed": fed, "events": events, "gathers": len(gathers),
              "local": {"loss": float(loss), "samples": samples.tolist(), "junk": [float(junk.span), float(junk.mean)]}}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    sys.stdout.flush()
    sys.stderr.flush()
    # Results are on disk and the group is destroyed; skip interpreter teardown, where static
    # destructors of gloo/TCPStore threads occasionally call std::terminate on a loaded machine
    # ("terminate called without an active exception"), a teardown race, not a result of the test.
    os._exit(0)
