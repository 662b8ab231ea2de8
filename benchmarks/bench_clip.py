"""Cost of each clipper against ``torch.nn.utils.clip_grad_norm_(foreach=True)``, 6.2M-param GPT, CPU.

Three tables from one run, each measured interleaved: the clip call alone on the same gradients,
the clip call on 5000 small tensors (per-tensor overhead: no Python loop over tensors may show),
and a full training step (fwd+bwd+clip+AdamW), including "GradMonitor + AdaGC logging every step".

    python benchmarks/bench_clip.py [--rounds 15] [--only small]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, report  # noqa: E402

from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, ZClip  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402

BASE = "clip_grad_norm_(foreach=True)"


def clippers(model):
    return {"GlobalClip": GlobalClip(model, 1.0), "AdaGC": AdaGC(model, warmup_steps=5),
            "ZClip": ZClip(model, warmup_steps=5), "LayerClip": LayerClip(model, warmup_steps=5)}


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
    variants["AdaGC(mode='global')"] = with_fresh_grads(AdaGC(model, warmup_steps=5, mode="global").clip)
    variants["GlobalClip as in 0.1 (nan_to_num_ per tensor)"] = with_fresh_grads(lambda: global_clip_v01(flat, 1.0))
    variants["(copying the gradients only)"] = with_fresh_grads(lambda: None)
    report(f"clip call alone, {n} tensors of 64 values (gradient copy included in every row)",
           interleaved(variants, rounds), BASE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--only", choices=["small"], default=None, help="run only the 5000-small-tensor table")
    args = ap.parse_args()
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

    def with_fresh_grads(fn):
        def run(i):
            for p, gr in zip(model.parameters(), grads):
                p.grad.copy_(gr) if p.grad is not None else setattr(p, "grad", gr.clone())
            fn()
        return run

    cl = clippers(model)
    alone = {BASE: with_fresh_grads(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True))}
    alone |= {name: with_fresh_grads(c.clip) for name, c in cl.items()}
    alone["(copying the gradients only)"] = with_fresh_grads(lambda: None)
    report("clip call alone (gradient copy included in every row)", interleaved(alone, args.rounds * 4), BASE)

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
