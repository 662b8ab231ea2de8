"""Worker for the distributed localization tests: one process per rank runs every scenario.

``main(rank, world, port, out_dir, scenarios_json)`` (started by ``launch.fork_ranks``); each scenario is
``{"name", "wrap": "ddp"|"fsdp2", "culprits": [[rank, b, t], ...], "method", "micro": K}``.
Writes ``OUT_DIR/<name>.rank<r>.json`` with the result and the leave-no-trace checks.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

B, T, V = 2, 8, 64  # per rank and micro-batch: 2 samples of 8 loss terms
WEIGHT = 60.0  # a culprit term's loss weight (an importance ratio gone wild)


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=16, max_seq_len=T)


def global_batch(world: int, culprits, micro: int = 1):
    """(x, y, w), each (micro, world * B, T): rank r holds rows r*B .. r*B+B-1 of every micro-batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, V, (micro, world * B, T), generator=g)
    y = torch.randint(0, V, (micro, world * B, T), generator=g)
    w = torch.ones(micro, world * B, T)
    for c in culprits:
        r, b, t = c[-3:]
        k = c[0] if len(c) == 4 else 0
        w[k, r * B + b, t] = WEIGHT
    return x, y, w


def make_loss_fn(model, x, y, w, norm: float):
    """``loss_fn(mask)`` with a FIXED normalizer: the rank's own mean (DDP/FSDP2 average over
    ranks, so the optimizer sees the global mean)."""
    def loss_fn(mask):
        logits = model(x)  # (B, T, V)
        per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(x.shape)
        return (per * w * mask).sum() / norm

    return loss_fn


def wrap(model, kind: str, world: int):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(scn: dict, rank: int, world: int) -> dict:
    from gradloc_track import locate
    from gradloc_track.norms import local_part

    model = build()
    wrapped = wrap(model, scn["wrap"], world)
    K = scn.get("micro", 1)
    x, y, w = global_batch(world, scn["culprits"], K)
    rows = slice(rank * B, rank * B + B)
    fns = [make_loss_fn(wrapped, x[k, rows], y[k, rows], w[k, rows], B * T) for k in range(K)]
    masks = [torch.ones(B, T) * (rank not in scn.get("empty", [])) for _ in range(K)]
    for fn, m in zip(fns, masks):  # the training step's backward: the grads locate must leave alone
        fn(m).backward()
    grads = [p.grad for p in model.parameters()]
    before = [local_part(g).clone() for g in grads]
    rng = torch.get_rng_state()
    modes = [m.training for m in model.modules()]
    if scn.get("bad_rank") is not None:  # one rank's input is wrong: EVERY rank must raise, none hang
        bad = [m.long() if rank == scn["bad_rank"] else m for m in masks]
        try:
            locate(model, fns[0], bad[0])
        except ValueError as exc:
            return {"error": str(exc), "grads_equal": all(p.grad is g for p, g in zip(model.parameters(), grads))}
        return {"error": None}
    res = locate(model, fns if K > 1 else fns[0], masks if K > 1 else masks[0], method=scn.get("method", "auto"),
                 threshold=scn.get("threshold"))
    from gradloc_track.artifacts.table import attribution_table
    from gradloc_track.localizer.dist_context import gather_culprit_rows
    from gradloc_track.spikes.context import SpikeContext

    ctx = SpikeContext(loss_fn=fns if K > 1 else fns[0], token_mask=masks if K > 1 else masks[0],
                       input_ids=[x[k, rows] for k in range(K)] if K > 1 else x[0, rows])
    view, view_ctx = gather_culprit_rows(res, ctx)  # a collective: the culprits' token ids to rank 0
    table = attribution_table(0, [], view, view_ctx) if rank == 0 else ([], [])
    same_grads = all(p.grad is g and torch.equal(local_part(g), b)
                     for p, g, b in zip(model.parameters(), grads, before))
    return {
        "tokens": [[c.rank, c.micro_batch, c.batch, c.position, c.grad_norm, c.layer_norms, c.share, c.raw_share]
                   for c in res.tokens],
        "probes": res.probes, "threshold": res.threshold, "total_norm": res.total_norm,
        "exhausted": res.budget_exhausted, "grads_equal": same_grads,
        "rng_equal": torch.equal(rng, torch.get_rng_state()),
        "modes_equal": modes == [m.training for m in model.modules()],
        "sharded": type(grads[0]).__name__ == "DTensor",
        "table": [dict(zip(table[0], r)) for r in table[1]],
    }


def run_monitor(scn: dict, rank: int, world: int) -> dict:
    """GradMonitor.after_backward with a fixed-mode detector on ranks with DIFFERENT token counts
    (rank 0 masks out its second sample): the threshold ``thr / sqrt(n_tokens)`` must use the
    global count, or rank 1 would fire and localize alone (a hang). ``thr`` sits where local
    counts would disagree: ``thr / sqrt(16) < ||g|| < thr / sqrt(8)``."""
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.artifacts import SpikeArtifactWriter
    from gradloc_track.config.spikes import SpikeConfig
    from gradloc_track.spikes import SpikeDetector
    from gradloc_track.spikes.context import SpikeContext

    model = build()
    wrapped = wrap(model, scn["wrap"], world)
    x, y, w = global_batch(world, scn["culprits"])
    rows = slice(rank * B, rank * B + B)
    fn = make_loss_fn(wrapped, x[0, rows], y[0, rows], w[0, rows], B * T)
    mask = torch.ones(B, T)
    if rank == 0:
        mask[1] = 0.0
    fn(mask).backward()
    g = float(sum(p.grad.double().pow(2).sum() for p in model.parameters())) ** 0.5  # DDP: same on all ranks
    thr = g * 12 ** 0.5
    tracker = MemoryTracker()
    detector = SpikeDetector(SpikeConfig(mode="fixed", per_token_threshold=thr, warmup_steps=0))
    from gradloc_track.clip import GlobalClip

    # clipped to half before the localizer runs: the step check gets the coefficient (the same on every rank)
    monitor = GradMonitor(model, tracker=tracker, detector=detector, log_every=1000,
                          clipper=GlobalClip(model, max_norm=g / 2),
                          artifact_writer=SpikeArtifactWriter(tracker, images=False))
    # per-sample columns as users hand them over: a tensor and a list of python strings
    ctx = SpikeContext(loss_fn=fn, token_mask=mask, input_ids=x[0, rows],
                       sample_columns={"dataset_index": torch.arange(B) + rank * B,
                                       "source": [f"rank{rank}-sample{b}" for b in range(B)]})
    stats = monitor.after_backward(1, spike_context=ctx)
    table = tracker.tables.get("spikes/tokens", {"columns": [], "rows": []})
    return {"events": len(stats.events),
            "tokens": [[c.rank, c.micro_batch, c.batch, c.position, c.grad_norm] for c in stats.locate.tokens]
            if stats.locate is not None else None,
            "table": [dict(zip(table["columns"], r)) for r in table["rows"]], "html": len(tracker.html),
            "check": None if stats.locate is None else vars(stats.locate.step_check),
            "notes": [] if stats.locate is None else stats.locate.notes}


def _nonfinite(scn: dict, rank: int, world: int) -> dict:
    from .nonfinite_worker import run_nonfinite

    return run_nonfinite(scn, rank, world)


def _nonfinite_monitor(scn: dict, rank: int, world: int) -> dict:
    from .nonfinite_worker import run_nonfinite_monitor

    return run_nonfinite_monitor(scn, rank, world)


def _port(scn: dict, rank: int, world: int) -> dict:
    from .gradloc_port import run_case

    return run_case(scn, rank, world)


def _failure(scn: dict, rank: int, world: int) -> dict:
    from .failure_worker import run_failure

    return run_failure(scn, rank, world)


def _failure_monitor(scn: dict, rank: int, world: int) -> dict:
    from .failure_worker import run_failure_monitor

    return run_failure_monitor(scn, rank, world)


def _levels(scn: dict, rank: int, world: int) -> dict:
    from .levels_case import run_levels

    return run_levels(scn, rank, world)


RUNNERS = {"locate": run, "error": run, "monitor": run_monitor, "nonfinite": _nonfinite,
           "nonfinite_monitor": _nonfinite_monitor, "levels": _levels, "port": _port, "failure": _failure,
           "failure_monitor": _failure_monitor}


def main(rank: int, world: int, port: str, out_dir: str, scenarios: str) -> None:
    t0 = time.perf_counter()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    for scn in json.loads(scenarios):
        t0 = time.perf_counter()
        result = RUNNERS[scn.get("kind", "locate")](scn, rank, world)
        result["seconds"] = time.perf_counter() - t0
        Path(out_dir, f"{scn['name']}.rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank}: {time.perf_counter() - t0:.1f} s in the group", flush=True)
    dist.barrier()  # nobody tears gloo down while a peer still talks to it
    dist.destroy_process_group()
