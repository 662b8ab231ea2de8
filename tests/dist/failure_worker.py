"""Worker side of test_failure_dist: one rank fails during a localization, as an OOM would.

A scenario names the rank (``fail_rank``), the probe (``fail_at``: the rank's n-th ``loss_fn``
call under grad) and where the failure happens: ``loss`` (in loss_fn, before the model runs),
``model`` (inside the model's forward, a block's pre-hook), ``after`` (after the model's forward,
in the loss), ``float`` (loss_fn returns a python float: an input error, ``ValueError``),
``copy`` (copying the probe's gradient) or ``snapshot`` (saving the gradients before any probe).
Faults are injected by wrapping the rank's loss_fn or, for ``copy``/``snapshot``, by replacing
one localizer function on that rank only (fault injection is the one mock we use).
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from . import locate_worker as W


class Injector:
    """Raises ``torch.OutOfMemoryError`` on the failing rank's ``fail_at``-th probe call."""

    def __init__(self, scn: dict, rank: int, model: torch.nn.Module) -> None:
        self.active = rank == scn["fail_rank"]
        self.where, self.fail_at, self.rank = scn["where"], scn.get("fail_at", 1), rank
        self.calls, self.armed, self.t_fail = 0, False, None
        model.h[1].register_forward_pre_hook(self._in_forward)

    def error(self) -> torch.OutOfMemoryError:
        self.t_fail = time.time()
        return torch.OutOfMemoryError(f"injected out of memory on rank {self.rank} at probe {self.fail_at}")

    def _in_forward(self, module, args):
        if self.armed:
            self.armed = False
            raise self.error()

    def wrap(self, fn):
        def loss_fn(mask):
            if not (self.active and torch.is_grad_enabled() and self.where in ("loss", "model", "after", "float")):
                return fn(mask)
            self.calls += 1
            now = self.calls == self.fail_at
            if now and self.where == "loss":
                raise self.error()
            self.armed = now and self.where == "model"
            loss = fn(mask)
            if now and self.where == "after":
                raise self.error()
            if now and self.where == "float":  # a bad loss, not an exception: every rank raises ValueError
                self.t_fail = time.time()
                return float(loss.detach())
            return loss
        return loss_fn

    def patch(self):
        """(module, name, replacement) for the faults outside loss_fn, on the failing rank only."""
        from gradloc_track.localizer import dist_probe, distributed

        if not self.active or self.where not in ("copy", "snapshot"):
            return None
        if self.where == "snapshot":
            def snapshot(model):
                raise self.error()
            return distributed, "DistSnapshot", snapshot
        take = dist_probe.DistProber._take_grads

        def take_grads(prober):
            self.calls += 1
            if self.calls == self.fail_at:
                raise self.error()
            return take(prober)
        return dist_probe.DistProber, "_take_grads", take_grads


def setup(scn: dict, rank: int, world: int):
    """(model, its loss_fns, masks): one training step's backward already run."""
    model = W.build()
    wrapped = W.wrap(model, scn["wrap"], world)
    K = scn.get("micro", 1)
    x, y, w = W.global_batch(world, scn["culprits"], K)
    rows = slice(rank * W.B, rank * W.B + W.B)
    fns = [W.make_loss_fn(wrapped, x[k, rows], y[k, rows], w[k, rows], W.B * W.T) for k in range(K)]
    masks = [torch.ones(W.B, W.T) for _ in range(K)]
    for fn, m in zip(fns, masks):
        fn(m).backward()
    return model, fns, masks


def train_on(model, fns, masks) -> list[torch.Tensor]:
    """Training after the localization: the step with the kept gradient, then one more step."""
    from gradloc_track.norms import local_part

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    for fn, m in zip(fns, masks):
        fn(m).backward()
    opt.step()
    return [local_part(p).detach().clone() for p in model.parameters()]


def run_failure(scn: dict, rank: int, world: int) -> dict:
    from gradloc_track import locate
    from gradloc_track.localizer.dist_failure import LocateAborted
    from gradloc_track.norms import local_part

    model, fns, masks = setup(scn, rank, world)
    inj = Injector(scn, rank, model)
    grads = [p.grad for p in model.parameters()]
    before = [local_part(g).clone() for g in grads]
    rng, modes = torch.get_rng_state(), [m.training for m in model.modules()]
    patch = inj.patch()
    saved = getattr(patch[0], patch[1]) if patch else None
    if patch:
        setattr(*patch)
    probed = [inj.wrap(fn) for fn in fns]
    one = len(fns) == 1
    error, cause = None, None
    try:
        locate(model, probed[0] if one else probed, masks[0] if one else masks, method=scn.get("method", "auto"),
               threshold=scn.get("threshold"))
    except (LocateAborted, ValueError) as exc:
        error, cause = f"{type(exc).__name__}: {exc}", type(exc.__cause__).__name__ if exc.__cause__ else None
    finally:
        t_return = time.time()
        if patch:
            setattr(patch[0], patch[1], saved)
    out = {"error": error, "cause": cause, "t_fail": inj.t_fail, "t_return": t_return,
           "grads_equal": all(p.grad is g and torch.equal(local_part(g), b)
                              for p, g, b in zip(model.parameters(), grads, before)),
           "rng_equal": torch.equal(rng, torch.get_rng_state()),
           "modes_equal": modes == [m.training for m in model.modules()]}
    return {**out, **goes_on(scn, rank, world, model, fns, masks)}


def goes_on(scn: dict, rank: int, world: int, model, fns, masks) -> dict:
    """The process group is in step (the next all_reduce pairs with the peers' next one) and
    training continues exactly as if no localization had run (a fresh model, same steps)."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    after = train_on(model, fns, masks)
    ref_model, ref_fns, ref_masks = setup(scn, rank, world)
    ref = train_on(ref_model, ref_fns, ref_masks)
    return {"all_reduce": float(t), "params_equal": all(torch.equal(a, b) for a, b in zip(after, ref))}


def run_failure_monitor(scn: dict, rank: int, world: int) -> dict:
    """``GradMonitor.after_backward`` whose localization fails on one rank: every rank warns and
    returns, and the next step's all_reduce pairs."""
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.config.spikes import SpikeConfig
    from gradloc_track.spikes import SpikeDetector
    from gradloc_track.spikes.context import SpikeContext

    model, fns, masks = setup(scn, rank, world)
    inj = Injector(scn, rank, model)
    detector = SpikeDetector(SpikeConfig(mode="fixed", per_token_threshold=1e-6, warmup_steps=0))  # fires
    monitor = GradMonitor(model, tracker=MemoryTracker(), detector=detector, log_every=1000)
    ctx = SpikeContext(loss_fn=inj.wrap(fns[0]), token_mask=masks[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = monitor.after_backward(1, spike_context=ctx)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"warnings": [str(w.message) for w in caught if "gradloc-track" in str(w.message)],
            "events": len(stats.events), "located": stats.locate is not None, "all_reduce": float(t)}
