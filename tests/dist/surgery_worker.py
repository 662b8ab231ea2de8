"""Worker for the 2-process spike-surgery test: DDP/FSDP2 on gloo, GradMonitor with ``spikes.response=surgery``.

``main(rank, world, port, out_dir, scenarios_json)`` (started by ``launch.fork_ranks``); each scenario
is ``{"name", "micro": K, "wrap": "ddp"|"fsdp2"}``: a few steps of K micro-batches (gradient sync
on the last only, as accumulation loops do), one loss term of rank 1's last micro-batch blown up at ``SPIKE_AT``.
Writes ``OUT_DIR/<name>.rank<r>.pt``: what the optimizer received at the spike step, the step's
own gradient, the weights and batches of that step, the culprits and the surgery metrics.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .locate_worker import wrap  # DDP with bucket-view gradients, or FSDP2 per block

B, T, V = 2, 8, 64  # per rank and micro-batch
SPIKE_AT, STEPS = 6, 8
WEIGHT = 40.0  # the culprit term's loss weight
MAX_NORM = 0.5
CULPRIT = (1, 1, 3)  # (rank, sample, position) in the last micro-batch


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=16, max_seq_len=T)


def batch(step: int, rank: int, k: int, n_micro: int):
    """Micro-batch ``k`` of ``rank`` at ``step``: (x, y, w), each (B, T)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    if step == SPIKE_AT and rank == CULPRIT[0] and k == n_micro - 1:
        w[CULPRIT[1], CULPRIT[2]] = WEIGHT
    return x, y, w


def make_loss_fn(net, x, y, w, n_micro: int):
    """The training loss of one micro-batch restricted to ``mask``: this rank's mean over the step's
    terms (DDP averages over ranks, so the optimizer sees the global mean)."""
    def loss_fn(mask):
        per = F.cross_entropy(net(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T * n_micro)

    return loss_fn


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an FSDP2 DTensor gathered), on the CPU."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def accumulating(net, last: bool):
    """DDP's ``no_sync`` for all but the last micro-batch (FSDP2: its own switch)."""
    if hasattr(net, "no_sync"):
        return contextlib.nullcontext() if last else net.no_sync()
    net.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def run(scn: dict, rank: int, world: int) -> dict:
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.clip import GlobalClip
    from gradloc_track.config import SpikeConfig
    from gradloc_track.spikes import SpikeContext, SpikeDetector

    model = build()
    net = wrap(model, scn.get("wrap", "ddp"), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = MemoryTracker()
    monitor = GradMonitor(model, tracker=tracker, clipper=GlobalClip(model, max_norm=MAX_NORM), optimizer=opt,
                          detector=SpikeDetector(SpikeConfig(warmup_steps=3, response="surgery")))
    received = []
    opt.register_step_pre_hook(lambda o, a, kw: received.append([full(p.grad).clone() for p in model.parameters()]))
    K = scn["micro"]
    out: dict = {}
    for step in range(STEPS):
        mbs = [batch(step, rank, k, K) for k in range(K)]
        fns = [make_loss_fn(net, *mb, K) for mb in mbs]
        opt.zero_grad(set_to_none=True)
        for k, fn in enumerate(fns):  # DDP's accumulation: all-reduce on the last micro-batch only
            with accumulating(net, k == K - 1):
                fn(torch.ones(B, T)).backward()
        if step == SPIKE_AT:
            out["own"] = [full(p.grad).clone() for p in model.parameters()]
            out["weights"] = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
            out["batches"] = mbs
        masks = [torch.ones(B, T)] * K
        ids = [x for x, _, _ in mbs]
        ctx = SpikeContext(fns, masks, ids) if K > 1 else SpikeContext(fns[0], masks[0], ids[0])
        stats = monitor.after_backward(step, spike_context=ctx)
        if step == SPIKE_AT:
            out["events"] = len(stats.events)
            out["culprits"] = [(c.rank, c.micro_batch or 0, c.batch, c.position) for c in stats.locate.culprits]
            out["surgery"] = vars(stats.surgery)
            out["metrics"] = dict(tracker.metrics).get(SPIKE_AT, {})
        opt.step()
    out["received"] = received[SPIKE_AT]
    return out


def main(rank: int, world: int, port: str, out_dir: str, scenarios: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for scn in json.loads(scenarios):
            torch.save(run(scn, rank, world), Path(out_dir) / f"{scn['name']}.rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
