"""Training-thread time per spike event of ``SpikeArtifactWriter.write`` at B=32, T=2048, and the
W&B run size over many events.

``write`` is what the monitor calls on the training thread. Two trackers: the local run dir
(``tracker=none`` with a run dir) and the background writer that W&B/MLflow sit behind (an
``AsyncTracker`` over an in-memory backend, so only our cost is measured). "total" waits for the
tracker to have written everything (``flush``), i.e. the work that moved off the training thread.

    python benchmarks/bench_artifacts.py [--events 6] [--wandb-events 600]
    PYTHONPATH=<other checkout> python benchmarks/bench_artifacts.py   # e.g. the code before
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext, SpikeEvent
from gradloc_track.trackers import LocalTracker, MemoryTracker
from gradloc_track.trackers.async_writer import AsyncTracker

B, T, L = 32, 2048, 8


def spike(culprits: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layers = [f"h.{i}" for i in range(L)]
    tokens = [CulpritToken(batch=i % B, position=(97 * i) % T, grad_norm=10.0 - 0.1 * i,
                           layer_norms={n: float(j + i) for j, n in enumerate(layers)}, share=0.02)
              for i in range(culprits)]
    result = LocateResult(tokens=tokens, probes=40, method="auto", threshold=1.0, total_norm=50.0,
                          layer_names=layers, ghost_map=torch.rand(B, T, generator=g),
                          layer_map=torch.rand(L, B, T, generator=g))
    ids = torch.randint(32, 127, (B, T), generator=g)  # printable bytes: realistic text volume
    ctx = SpikeContext(loss_fn=lambda m: m.sum(), token_mask=torch.ones(B, T), input_ids=ids,
                       tokenizer=ByteTokenizer())
    return [SpikeEvent(0, "global", 9.0, 1.0, 12.0, 9.0)], result, ctx


def per_event(make_tracker, events: int, images: bool) -> tuple[float, float]:
    """(median training-thread seconds per write, total seconds until the tracker has flushed)."""
    ev, result, ctx = spike()
    with tempfile.TemporaryDirectory() as tmp:
        tracker = make_tracker(Path(tmp))
        writer = SpikeArtifactWriter(tracker, run_dir=Path(tmp), images=images)
        times = []
        t_all = time.perf_counter()
        for e in range(events):
            t0 = time.perf_counter()
            writer.write(100 + e, ev, result, ctx)
            times.append(time.perf_counter() - t0)
        tracker.flush()
        total = time.perf_counter() - t_all
        tracker.finish()
    return statistics.median(times), total


def wandb_size(events: int) -> float:
    """MiB of the offline W&B run after ``events`` table events (2 culprit rows each)."""
    from gradloc_track.trackers.wandb_tracker import WandbTracker

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        tracker = WandbTracker(dir=tmp, run_dir=tmp)
        cols = ["step", "sample", "position", "token_id", "token", "grad_norm", "share", "top_layers", "signal", "z"]
        for e in range(events):
            rows = [[e, s, 7 * s, 65 + s, "tok", 1.5, 0.3, "h.1:1.0e+00, h.0:5.0e-01", "global", 9.0] for s in range(2)]
            tracker.log_table("spikes/tokens", cols, rows, e)
        tracker.finish()
        time.sleep(2.0)  # wandb-core closes its files after finish() returns
        return sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file()) / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=6)
    ap.add_argument("--wandb-events", type=int, default=600)
    ap.add_argument("--no-images", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import gradloc_track

    print(f"gradloc_track from {Path(gradloc_track.__file__).parent.parent}; B={B}, T={T}, 16 culprits, "
          f"{args.events} events")
    trackers = {
        "local run dir (tracker=none)": lambda d: LocalTracker(d),
        "background writer (W&B/MLflow stand-in)": lambda d: AsyncTracker(lambda: MemoryTracker(), "bench", d),
    }
    print(f"{'tracker':<44}{'train-thread ms/event':>22}{'total s':>10}")
    for name, make in trackers.items():
        med, total = per_event(make, args.events, not args.no_images)
        print(f"{name:<44}{med * 1e3:>22.1f}{total:>10.2f}")
    if args.wandb_events:
        print(f"W&B offline run after {args.wandb_events} table events: {wandb_size(args.wandb_events):.2f} MiB")


if __name__ == "__main__":
    main()
