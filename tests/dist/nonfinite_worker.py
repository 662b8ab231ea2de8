"""Worker side of test_nonfinite_dist: a NaN on ONE rank, searched on every rank.

A scenario puts NaN loss weights (an advantage gone NaN) at ``nan``: ``[k, rank, b, t]`` cells of
the global batch (``locate_worker.global_batch``). Its ``loss``: ``product`` (``per * w * mask``:
the NaN reaches every probe of its micro-batch through ``0 x NaN``, the term-loss map names it) or
``safe`` (``torch.where`` masking: a masked-out NaN stays out, the mask gets no gradient, so the
search halves over every rank's samples) or ``nomap`` (the mask taken as ``mask != 0``: no term-loss
map, and the NaN reaches every probe: the rank whose own forward is NaN is named). ``monitor``:
through ``GradMonitor`` with a skipping clipper and the optimizer, the step must be skipped on
every rank.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from . import locate_worker as W


def loss_of(model, x, y, w, norm: float, kind: str):
    """``loss_fn(mask)`` with a fixed normaliser; ``kind`` as in the module doc."""
    def loss_fn(mask):
        logits = model(x)  # (B, T, V)
        per = F.cross_entropy(logits.reshape(-1, W.V), y.reshape(-1), reduction="none").view(x.shape)
        if kind == "safe":
            keep = mask != 0
            wk = torch.where(keep, w, torch.zeros_like(w))
            return torch.where(keep, per * wk, torch.zeros_like(per)).sum() / norm
        if kind == "nomap":
            return (per * w * (mask != 0).float()).sum() / norm
        return (per * w * mask).sum() / norm
    return loss_fn


def global_batch(scn: dict, world: int):
    """(x, y, w) of every rank, (K, world * B, T), with the scenario's NaN weights."""
    x, y, w = W.global_batch(world, [], scn.get("micro", 1))
    for k, r, b, t in scn["nan"]:
        w[k, r * W.B + b, t] = math.nan
    return x, y, w


def rows_of(c) -> list:
    """A culprit row as plain values: level, rank, micro-batch, sample, first position, end."""
    return [c.level, c.rank, c.micro_batch, c.batch, c.start, c.end, bool(c.nonfinite)]


def _same_grads(model, grads, before) -> bool:
    """The ``.grad`` objects kept and their values as backward left them (NaN where NaN)."""
    from gradloc_track.norms import local_part

    return all(p.grad is g and torch.equal(local_part(g).isnan(), v.isnan())
               and torch.equal(local_part(g).nan_to_num(), v.nan_to_num())
               for p, g, v in zip(model.parameters(), grads, before))


def run_nonfinite(scn: dict, rank: int, world: int) -> dict:
    """locate() on a step whose gradient a NaN on one rank made non-finite."""
    from gradloc_track import locate
    from gradloc_track.norms import local_part

    model = W.build()
    wrapped = W.wrap(model, scn["wrap"], world)
    K = scn.get("micro", 1)
    x, y, w = global_batch(scn, world)
    rows = slice(rank * W.B, rank * W.B + W.B)
    fns = [loss_of(wrapped, x[k, rows], y[k, rows], w[k, rows], W.B * W.T, scn["loss"]) for k in range(K)]
    masks = [torch.ones(W.B, W.T) for _ in range(K)]
    for fn, m in zip(fns, masks):  # the training step's backward
        fn(m).backward()
    grads = [p.grad for p in model.parameters()]
    before = [local_part(g).clone() for g in grads]
    rng = torch.get_rng_state()
    res = locate(model, fns if K > 1 else fns[0], masks if K > 1 else masks[0])
    nf = res.nonfinite
    return {"where": None if nf is None else nf.where, "detail": None if nf is None else nf.detail,
            "rows": [rows_of(c) for c in res.culprits], "probes": res.probes, "notes": res.notes,
            "grads_equal": _same_grads(model, grads, before), "rng_equal": torch.equal(rng, torch.get_rng_state())}


def run_nonfinite_monitor(scn: dict, rank: int, world: int) -> dict:
    """GradMonitor.after_backward on the NaN step: detected, localized, the table on rank 0, the
    optimizer's step skipped on every rank (SGD's parameters unchanged)."""
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.artifacts import SpikeArtifactWriter
    from gradloc_track.clip import GlobalClip
    from gradloc_track.config.spikes import SpikeConfig
    from gradloc_track.norms import local_part
    from gradloc_track.spikes import SpikeDetector
    from gradloc_track.spikes.context import SpikeContext

    model = W.build()
    wrapped = W.wrap(model, scn["wrap"], world)
    x, y, w = global_batch(scn, world)
    rows = slice(rank * W.B, rank * W.B + W.B)
    fn, mask = loss_of(wrapped, x[0, rows], y[0, rows], w[0, rows], W.B * W.T, scn["loss"]), torch.ones(W.B, W.T)
    fn(mask).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [local_part(p).detach().clone() for p in model.parameters()]
    tracker = MemoryTracker()
    monitor = GradMonitor(model, tracker=tracker, clipper=GlobalClip(model, max_norm=1.0), optimizer=opt,
                          detector=SpikeDetector(SpikeConfig(mode="fixed", per_token_threshold=1e6, warmup_steps=0)),
                          log_every=1000, artifact_writer=SpikeArtifactWriter(tracker, images=False))
    ctx = SpikeContext(loss_fn=fn, token_mask=mask, input_ids=x[0, rows])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = monitor.after_backward(1, spike_context=ctx)
        opt.step()
    table = tracker.tables.get("spikes/tokens", {"columns": [], "rows": []})
    loc = stats.locate
    return {"events": len(stats.events), "detail": None if loc is None or loc.nonfinite is None else
            loc.nonfinite.detail, "rows": [] if loc is None else [rows_of(c) for c in loc.culprits],
            "table": [dict(zip(table["columns"], r)) for r in table["rows"]],
            "warnings": [str(m.message) for m in caught if "gradloc-track" in str(m.message)],
            "skipped": all(torch.equal(local_part(p).detach(), q) for p, q in zip(model.parameters(), params))}
