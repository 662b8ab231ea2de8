"""Cost of gradient monitoring per training step, on a 6.2M-parameter GPT on CPU.

Variants, measured interleaved in one run, each against the same plain step (fwd+bwd+AdamW):
(a) the GradMonitor logging every step to a MemoryTracker; (b) a naive per-parameter ``.item()``
loop computing the same metrics; (c) ``wandb.watch(log="gradients", log_freq=1)`` offline;
(d) ``gradloc_track.watch(model, opt)`` logging every step (the optimizer pre-hook, batch capture
and the armed spike detector's per-step context; localization off so a chance spike does not
land in the timing), against a twin copy's plain step.
Reported: medians and the median of per-pair ratios (each variant step timed right next to its
plain step), then the extra call alone (the figure that survives a busy machine).

A second table puts ``watch()``'s fixed per-step cost where it shows: small models (a 2-layer
d=64 and a 4-layer d=256 GPT), ``watch()`` with its defaults (logging every step, detector armed,
localizer on) on random batches that hold no spike (the events column says so), against a twin's
plain step; and the ``watch()`` step alone.

    python benchmarks/bench_monitor.py [--rounds 20] [--batch 4] [--seq 256] [--threads N] [--no-wandb]
    python benchmarks/bench_monitor.py --only small [--rounds 40]
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402

import gradloc_track  # noqa: E402
from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402
from gradloc_track.grouping import layer_of  # noqa: E402


def make_step(model, batch, extra=None, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch[:, :-1], batch[:, 1:]

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        if extra is not None:
            extra(i)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-wandb", action="store_true")
    ap.add_argument("--only", choices=["small"], default=None, help="only the small-model watch() table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    small_models(args)
    if args.only == "small":
        return
    torch.manual_seed(0)
    proto = TinyGPT(vocab_size=256, n_layer=6, n_head=6, d_model=288, max_seq_len=args.seq)
    n_params = sum(p.numel() for p in proto.parameters())
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    # base, monitor and naive share ONE model and optimizer: they differ only by the extra call
    # (separate copies differ by a few % from memory placement alone, which is noise, not cost)
    shared = copy.deepcopy(proto)
    opt = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    models = {"watch": copy.deepcopy(proto), "watch_base": copy.deepcopy(proto)}
    monitor = GradMonitor(shared, tracker=MemoryTracker(), log_every=1)
    naive_tracker = MemoryTracker()

    layer = {n: layer_of(n) for n, _ in shared.named_parameters()}

    def naive(i: int) -> None:
        """The same metrics the monitor logs, the usual way: one ``.item()`` (sync) per tensor."""
        g_sq: dict[str, float] = {}
        w_sq: dict[str, float] = {}
        for n, p in shared.named_parameters():
            g, w = p.grad.norm().item(), p.detach().norm().item()  # two host syncs per tensor
            g_sq[layer[n]] = g_sq.get(layer[n], 0.0) + g * g
            w_sq[layer[n]] = w_sq.get(layer[n], 0.0) + w * w
        metrics = {"grad_norm/global": math.sqrt(sum(g_sq.values())),
                   "weight_norm/global": math.sqrt(sum(w_sq.values()))}
        for lay in g_sq:
            metrics[f"grad_norm/{lay}"] = math.sqrt(g_sq[lay])
            metrics[f"weight_norm/{lay}"] = math.sqrt(w_sq[lay])
            metrics[f"grad_weight_ratio/{lay}"] = math.sqrt(g_sq[lay] / max(w_sq[lay], 1e-24))
        naive_tracker.log_metrics(metrics, i)

    pairs = {  # variant -> (its step, the plain step it is compared with)
        "GradMonitor, logging every step": (make_step(shared, batch, monitor.after_backward, opt=opt), "shared"),
        "naive per-parameter .item() loop": (make_step(shared, batch, naive, opt=opt), "shared"),
    }
    bases = {"shared": make_step(shared, batch, opt=opt)}
    # watch() hooks its model and optimizer for good: its baseline is a twin copy's plain step
    gl_model, gl_twin = copy.deepcopy(proto), copy.deepcopy(proto)
    gl_opt = torch.optim.AdamW(gl_model.parameters(), lr=1e-4)
    gradloc_track.watch(gl_model, gl_opt, tracker=MemoryTracker(), log_every=1, locate=False)
    bases["watch() twin"] = make_step(gl_twin, batch)
    pairs["gradloc_track.watch(), logging every step"] = (make_step(gl_model, batch, opt=gl_opt), "watch() twin")
    run = None
    if not args.no_wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run = wandb.init(project="gradloc-bench", dir=tempfile.mkdtemp(), mode="offline")
        run.watch(models["watch"], log="gradients", log_freq=1)  # hooks stay on that copy
        # wandb.watch hooks a model for good: its baseline is a twin copy logging the same step
        bases["watch twin"] = make_step(models["watch_base"], batch, lambda i: run.log({"step": i}))
        pairs["wandb.watch(log='gradients', log_freq=1), offline"] = (
            make_step(models["watch"], batch, lambda i: run.log({"step": i})), "watch twin")
    print(f"model: {n_params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, "
          f"torch threads {torch.get_num_threads()}, rounds {args.rounds}")
    res = paired(pairs, bases, args.rounds)
    print("\nstep = fwd+bwd+AdamW; each variant timed right next to its plain step, round-robin")
    print(f"{'variant':<52}{'plain ms':>9}{'variant ms':>11}{'ratio':>8}")
    for name, (tb, tv, ratio) in res.items():
        print(f"{name:<52}{tb * 1e3:>9.1f}{tv * 1e3:>11.1f}{ratio:>8.3f}")
    # the extra work alone, interleaved, on the gradients the last step left: the stable figure
    alone = interleaved({"monitor": monitor.after_backward, "naive": naive}, 50)
    base = statistics.median([tb for tb, _, _ in res.values()])
    print()
    for name, t in alone.items():
        print(f"{name} call alone: {t * 1e3:.2f} ms = {t / base:.2%} of the plain step")
    if run is not None:
        run.finish()


def small_models(args) -> None:
    """watch() with no spike against a twin's plain step, on models where a fixed cost shows."""
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(16)]

    def rotating_step(model, opt):
        def step(i: int) -> None:
            batch = pool[i % len(pool)]  # random tokens: no spike to find
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
            opt.step()
        return step

    print(f"\nwatch() with its defaults (logging every step, detector armed) vs a twin's plain step, batch "
          f"{args.batch}x{args.seq}, rounds {args.rounds * 2}")
    print(f"{'model':<28}{'plain ms':>9}{'watch ms':>10}{'ratio':>8}{'step alone ms':>15}{'events':>8}")
    for n_layer, d_model, n_head in ((2, 64, 2), (4, 256, 4)):
        torch.manual_seed(0)
        proto = TinyGPT(vocab_size=256, n_layer=n_layer, n_head=n_head, d_model=d_model, max_seq_len=args.seq)
        model, twin = copy.deepcopy(proto), copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        handle = gradloc_track.watch(model, opt, tracker=MemoryTracker())
        res = paired({"watch": (rotating_step(model, opt), "twin")},
                     {"twin": rotating_step(twin, torch.optim.AdamW(twin.parameters(), lr=1e-4))}, args.rounds * 2)
        tb, tv, ratio = res["watch"]
        alone = []
        for i in range(30):  # the watch() step alone, on a fresh forward + backward each time
            batch = pool[i % len(pool)]
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
            t0 = time.perf_counter()
            handle.step()
            alone.append(time.perf_counter() - t0)
        name = f"{n_layer}-layer d={d_model} ({sum(p.numel() for p in proto.parameters()) / 1e6:.2f}M)"
        print(f"{name:<28}{tb * 1e3:>9.1f}{tv * 1e3:>10.1f}{ratio:>8.3f}{statistics.median(alone) * 1e3:>15.2f}"
              f"{len(handle.spikes):>8}")
        handle.remove()


def paired(pairs, bases, rounds: int, warmup: int = 2) -> dict[str, tuple[float, float, float]]:
    """Per variant: median plain-step seconds, median variant seconds, median of per-pair ratios.

    Each variant step runs right next to its own plain step (order alternating), so slow drifts
    of a shared machine cancel in the ratio of each pair.
    """
    for i in range(warmup):
        for fn, b in pairs.values():
            bases[b](i)
            fn(i)
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in pairs}
    i = warmup
    for r in range(rounds):
        for name, (fn, b) in pairs.items():
            order = [("v", fn), ("b", bases[b])] if r % 2 else [("b", bases[b]), ("v", fn)]
            t = {}
            for tag, f in order:
                t0 = time.perf_counter()
                f(i)
                t[tag] = time.perf_counter() - t0
                i += 1
            out[name].append((t["b"], t["v"]))
    return {k: (statistics.median(b for b, _ in v), statistics.median(x for _, x in v),
                statistics.median(x / b for b, x in v)) for k, v in out.items()}


if __name__ == "__main__":
    main()
