"""Cost of each clipper against ``torch.nn.utils.clip_grad_norm_(foreach=True)``, 6.2M-param GPT, CPU.

Three tables from one run, each measured interleaved: the clip call alone on the same gradients
(including ``GradMonitor`` + AdaGC on a non-logging step: the monitor's norm pass is the one the
clipper uses), the clip call on 5000 small tensors (per-tensor overhead: no Python loop over
tensors may show), and a full training step (fwd+bwd+clip+AdamW), including "GradMonitor + AdaGC
logging every step". Clippers are bound to an optimizer with ``SkipStepGuard`` (as
``GradMonitor(optimizer=...)``, ``watch()`` and the callbacks do), so a non-finite step is skipped
by the optimizer and the clip is one norm pass + one scale pass; rows marked "no guard" zero a bad
step's gradients themselves (one pass more). Every call restores the gradients first; "net" ratios
subtract that copy (the "(copying the gradients only)" row) from both sides.

    python benchmarks/bench_clip.py [--rounds 15] [--only small] [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, report  # noqa: E402

from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, SkipStepGuard, ZClip  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402

BASE = "clip_grad_norm_(foreach=True)"


COPY = "(copying the gradients only)"


def guarded(model, clipper):
    """Bound to an optimizer: a non-finite step is skipped by it, no zeroing pass in clip()."""
    SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1), clipper)
    return clipper


def clippers(model):
    return {"GlobalClip": guarded(model, GlobalClip(model, 1.0)), "AdaGC": guarded(model, AdaGC(model, warmup_steps=5)),
            "ZClip": guarded(model, ZClip(model, warmup_steps=5)),
            "LayerClip": guarded(model, LayerClip(model, warmup_steps=5)),
            "GlobalClip, no guard": GlobalClip(model, 1.0)}


def monitor_call(model, clipper):
    """``GradMonitor.after_backward`` on non-logging steps (its norms feed the clipper)."""
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=10 ** 9)
    return lambda i: mon.after_backward(i + 1)


def report_net(title, medians):
    report(title, medians, BASE)
    copy, base = medians[COPY], medians[BASE]
    print(f"net of the gradient copy (ratio to {BASE}):")
    for name, t in medians.items():
        if name not in (BASE, COPY):
            print(f"  {name:<52}{(t - copy) / (base - copy):>8.3f}")


def global_clip_v01(params, max_norm: float) -> None:
    """0.1's GlobalClip scaling path, kept for comparison: per-tensor coefficients cast to the first
    gradient's dtype, then a Python loop of ``nan_to_num_`` (one kernel per tensor)."""
    from gradloc_track.norms import sq_norms

    grads = [p.grad for p in params]
    norms = sq_norms(grads).sqrt()
    coef = (max_norm / (norms.pow(2).sum().sqrt() + 1e-6)).clamp(max=1.0).expand_as(norms)
    torch._foreach_mul_(grads, list(coef.to(grads[0].dtype).unbind()))
    for t in grads:
        torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)


def small_tensors(rounds: int, n: int = 5000) -> None:
    """5000 tensors of 64 values: the cost is per-tensor dispatch, not arithmetic."""
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(8, 8)) for _ in range(n))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, 8, generator=g) for _ in range(n)]
    flat = list(model.parameters())

    def with_fresh_grads(fn):
        def run(i):
            torch._foreach_copy_([p.grad for p in flat], grads) if flat[0].grad is not None else \
                [setattr(p, "grad", gr.clone()) for p, gr in zip(flat, grads)]
            fn()
        return run

    variants = {BASE: with_fresh_grads(lambda: torch.nn.utils.clip_grad_norm_(flat, 1.0, foreach=True))}
    variants |= {name: with_fresh_grads(c.clip) for name, c in clippers(model).items()}
    ada_global = guarded(model, AdaGC(model, warmup_steps=5, mode="global"))
    variants["AdaGC(mode='global')"] = with_fresh_grads(ada_global.clip)
    variants["GlobalClip as in 0.1 (nan_to_num_ per tensor)"] = with_fresh_grads(lambda: global_clip_v01(flat, 1.0))
    variants[COPY] = with_fresh_grads(lambda: None)
    report_net(f"clip call alone, {n} tensors of 64 values (gradient copy included in every row)",
               interleaved(variants, rounds))


def main() -> None:
    warnings.simplefilter("ignore")  # the "no guard" rows' one-time advice
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--only", choices=["small", "alone"], default=None,
                    help="run only the 5000-small-tensor table, or only the two clip-call tables")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (the issue's figures: 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    small_tensors(args.rounds * 4)
    if args.only == "small":
        return
    torch.manual_seed(0)
    proto = TinyGPT(vocab_size=256, n_layer=6, n_head=6, d_model=288, max_seq_len=args.seq)
    print(f"model: {sum(p.numel() for p in proto.parameters()) / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, "
          f"torch threads {torch.get_num_threads()}")

    # 1) the clip call alone, gradients restored before each call
    model = copy.deepcopy(proto)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 0.01 for p in model.parameters()]

    params = list(model.parameters())
    for p, gr in zip(params, grads):
        p.grad = gr.clone()

    def with_fresh_grads(fn):
        def run(i):
            torch._foreach_copy_([p.grad for p in params], grads)
            fn(i)
        return run

    cl = clippers(model)
    alone = {BASE: with_fresh_grads(lambda i: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True))}
    alone |= {name: with_fresh_grads(lambda i, c=c: c.clip()) for name, c in cl.items()}
    # the monitor hooks nothing: its rows share the model (a copy differs by a few % from memory placement)
    alone["GradMonitor + AdaGC, non-logging step"] = with_fresh_grads(
        monitor_call(model, guarded(model, AdaGC(model, warmup_steps=5))))
    alone["GradMonitor + AdaGC, no guard"] = with_fresh_grads(monitor_call(model, AdaGC(model, warmup_steps=5)))
    alone[COPY] = with_fresh_grads(lambda i: None)
    report_net("clip call alone (gradient copy included in every row)", interleaved(alone, args.rounds * 4))
    if args.only == "alone":
        return

    # 2) full training steps
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    x, y = batch[:, :-1], batch[:, 1:]

    def step_with(m, after):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step(i):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1)).backward()
            after(i)
            opt.step()
        return step

    models = {k: copy.deepcopy(proto) for k in ("base", "adagc", "zclip", "layerclip", "monitor")}
    ada_mon = GradMonitor(models["monitor"], tracker=MemoryTracker(), clipper=AdaGC(models["monitor"], warmup_steps=5))
    steps = {
        f"step + {BASE}": step_with(models["base"], lambda i: torch.nn.utils.clip_grad_norm_(
            models["base"].parameters(), 1.0, foreach=True)),
        "step + AdaGC": step_with(models["adagc"], lambda i, c=AdaGC(models["adagc"], warmup_steps=5): c.clip()),
        "step + ZClip": step_with(models["zclip"], lambda i, c=ZClip(models["zclip"], warmup_steps=5): c.clip()),
        "step + LayerClip": step_with(models["layerclip"],
                                      lambda i, c=LayerClip(models["layerclip"], warmup_steps=5): c.clip()),
        "step + GradMonitor(AdaGC), logging every step": step_with(models["monitor"], ada_mon.after_backward),
    }
    report("training step (fwd+bwd+clip+AdamW), median of interleaved rounds", interleaved(steps, args.rounds),
           f"step + {BASE}")


if __name__ == "__main__":
    main()
