"""What the detector's signals beyond the gradient norms cost per step (issue 26), on bench_monitor's
4-layer d=256 GPT (batch 4x256, AdamW), CPU.

Variants, each a whole training step (fwd + bwd + AdamW), measured interleaved against the same
plain step, round-robin:

- ``watch(), 0.3's signals``: ``gradloc_track.watch(model, opt)`` with the new signals off
  (``loss_signal``, ``sample_signal``, ``update_signal``, ``junk_signal`` false, ``noise_floor`` 0);
- ``watch(), + loss``: the model's own loss (read from the forward's output: free);
- ``watch(), + update``: the update Adam makes (measured after the optimizer's step: ``||exp_avg||^2`` read,
  ``sum exp_avg_sq`` carried by Adam's recursion and read every 16 steps; no read of the gradients);
- ``watch(), + update, read whole``: the same, reading ``exp_avg_sq`` whole after every step too
  (``AdamUpdate.resync = 1``);
- ``watch(), + sample losses``: each sample's mean loss (a no-grad cross-entropy pass over the logits);
- ``watch(), + junk span``: each term's excess over chance (``mean(logits) - logit of the target``, one
  reduction over the vocabulary) and its largest 16-term run;
- ``watch(), defaults``: all of them.

Every variant logs every step (``log_every=1``) with the detector armed and the localizer off (a chance
spike must not land in the timing). Reported: the median of per-pair ratios against the plain step,
and the difference to ``0.3's signals`` (what the new signals add).

    python benchmarks/bench_signals.py [--rounds 30] [--batch 4] [--seq 256] [--threads N]
    python benchmarks/bench_signals.py --vocab [--rounds 20]   # the signals at a real vocabulary (issue 38)

``--vocab`` measures what the per-term statistics cost where the vocabulary is large:

1. the detector's pass alone against one cross-entropy forward + backward on the same (1, T, V) fp32
   logits, at V = 32k, 128k and 152k (T = 512; the cost is linear in T, so T = 4096 is 8x both), by
   route: from the log-probabilities the model's own cross-entropy saved (``watch()`` when the model
   returns its loss: HF ``labels=``, nanoGPT ``(logits, loss)``), and from the logits (a model that
   returns none), with the number of passes over the (T, V) tensor each route makes (counted from the
   code, hardware-independent);
2. the whole training step of a 1-layer d=64 GPT at V=32k, T=512, ``watch()`` with every default
   against ``watch()`` with the new signals off, interleaved.

On this busy 2-core machine the timings use one torch thread and the process's CPU time (a parallel
region waits for its slowest thread, and a descheduled one costs milliseconds of wall time per op).
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradloc_track  # noqa: E402
from gradloc_track import MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402

OFF = {"loss_signal": False, "sample_signal": False, "update_signal": False, "junk_signal": False, "noise_floor": 0.0}
VARIANTS = {
    "watch(), 0.3's signals": OFF,
    "watch(), + loss": {**OFF, "loss_signal": True},
    "watch(), + update": {**OFF, "update_signal": True},
    "watch(), + update, read whole": {**OFF, "update_signal": True},
    "watch(), + sample losses": {**OFF, "sample_signal": True},
    "watch(), + junk span": {**OFF, "junk_signal": True},
    "watch(), defaults": {},
}


class LM(torch.nn.Module):
    """TinyGPT called the HF way, ``model(input_ids=, labels=)`` returning ``.loss`` and ``.logits``."""

    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels=None):
        logits = self.gpt(input_ids)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def make_step(model, opt, pool):
    def step(i: int) -> None:
        ids = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step


VIEWS = frozenset({"aten::view", "aten::select", "aten::slice", "aten::as_strided", "aten::detach", "aten::alias",
                   "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::expand", "aten::t", "aten::transpose",
                   "aten::narrow", "aten::_unsafe_view", "aten::to"})  # no data moved (a cast is its copy_)


def traffic(fn, T: int, V: int) -> tuple[int, float]:
    """(kernels over a (., V) tensor, what they read in units of the (T, V) tensor), from the profiler's
    record of ``fn``: hardware-independent, what a GPU's launches and memory reads follow. A kernel is an
    op with no op inside it (``isfinite`` is four); views move nothing; a gather reads its index's count,
    an ``index_select`` its rows; a fused kernel that reads its block twice in cache reads it once."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    def works(ev) -> bool:  # an op that moves (., V) data, or holds one that does
        return (ev.name.startswith("aten::") and ev.name not in VIEWS
                and any(sh and sh[-1] == V for sh in ev.input_shapes))

    kernels, read = 0, 0.0
    for ev in prof.events():
        if not works(ev) or any(works(c) for c in ev.cpu_children):
            continue
        shapes = [sh for sh in ev.input_shapes if sh]
        kernels += 1
        big = max(math.prod(sh) for sh in shapes if sh[-1] == V)
        if ev.name == "aten::gather":
            big = math.prod(shapes[-1])
        elif ev.name == "aten::index_select":
            big = shapes[-1][0] * V
        elif ev.name in ("aten::fill_", "aten::zero_"):
            big = 0  # a write
        read += big / (T * V)
    return kernels, read


def _cpu_median(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def logits_rows(rounds: int) -> None:
    import gradloc_track.spikes.term_stats as ts

    print("the detector's per-term pass vs one cross-entropy forward + backward on the same (1, 512, V) fp32\n"
          "logits; ops over (., V) and the elements they read, in (T, V) tensors, from the profiler (host: the\n"
          "CPU's route; device: an accelerator's, run here on the CPU with its blocks and without host reads)")
    print(f"{'V':>8}  {'route':<28}{'ops / reads: host':>19}{'device':>12}{'pass ms':>9}{'CE fwd+bwd ms':>15}"
          f"{'ratio':>7}")
    T = 512
    for V in (32_000, 128_000, 152_064):
        g = torch.Generator().manual_seed(0)
        z = torch.randn(T, V, generator=g).requires_grad_()
        tgt = torch.randint(0, V, (T,), generator=g)

        def ce():
            F.cross_entropy(z, tgt).backward()
            z.grad = None

        base = _cpu_median(ce, rounds)
        ce_ops, ce_read = traffic(ce, T, V)
        logp = torch.log_softmax(z.detach(), -1)  # what the model's own cross-entropy saved
        for route, fn in (("from the loss's log-probs", lambda: ts.term_stats(logp, tgt, log_probs=True)),
                          ("from the logits", lambda: ts.term_stats(z.detach(), tgt, log_probs=False))):
            t = _cpu_median(fn, rounds)
            host = traffic(fn, T, V)
            on_host, ts._on_host = ts._on_host, lambda _t: False
            try:
                device = traffic(fn, T, V)
            finally:
                ts._on_host = on_host
            print(f"{V:>8}  {route:<28}{host[0]:>11} / {host[1]:<5.2f}{device[0]:>5} / {device[1]:<5.2f}"
                  f"{t * 1e3:>9.1f}{base * 1e3:>15.1f}{t / base:>7.2f}")
        print(f"{V:>8}  {'(one CE fwd + bwd)':<28}{ce_ops:>11} / {ce_read:<5.2f}")


def vocab_step(rounds: int) -> None:
    torch.manual_seed(0)
    V, T = 32_000, 512
    proto = LM(TinyGPT(vocab_size=V, n_layer=1, n_head=2, d_model=64, max_seq_len=T))
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, V, (1, T), generator=gen) for _ in range(8)]
    steps, handles = {}, []
    for name, spikes in (("watch(), new signals off", OFF), ("watch(), defaults", {})):
        model = copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        handles.append(gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=1, locate=False,
                                           spikes=spikes))
        steps[name] = make_step(model, opt, pool)
    for i in range(3):
        for fn in steps.values():
            fn(i)
    (off_name, off), (on_name, on) = steps.items()
    ratios, base = [], []
    for i in range(3, 3 + rounds):
        first, second = (off, on) if i % 2 else (on, off)
        t0 = time.process_time()
        first(i)
        t1 = time.process_time()
        second(i)
        t2 = time.process_time()
        t_off, t_on = (t1 - t0, t2 - t1) if i % 2 else (t2 - t1, t1 - t0)
        ratios.append(t_on / t_off)
        base.append(t_off)
    print(f"\nthe whole step, 1-layer d=64 GPT, V={V}, T={T}, batch 1, AdamW, log_every=1, detector armed, "
          f"rounds {rounds}: {off_name} {statistics.median(base) * 1e3:.0f} ms CPU; "
          f"{on_name} / {off_name} = {statistics.median(ratios):.3f} (median of interleaved pairs)")
    for h in handles:
        h.finish()


def main() -> None:
    if "--vocab" in sys.argv:
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
        torch.set_num_threads(1)
        logits_rows(max(5, rounds // 2))
        vocab_step(rounds)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    proto = LM(TinyGPT(vocab_size=256, n_layer=4, n_head=4, d_model=256, max_seq_len=args.seq))
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 256, (args.batch, args.seq), generator=gen) for _ in range(16)]
    plain_model = copy.deepcopy(proto)
    plain = make_step(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-4), pool)
    steps, handles = {}, []
    for name, spikes in VARIANTS.items():
        model = copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        handles.append(gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=1, locate=False,
                                           spikes=spikes))
        if name.endswith("read whole"):
            handles[-1].monitor.detector_inputs.adam.resync = 1
        steps[name] = make_step(model, opt, pool)
    for i in range(3):  # warm-up: allocator, Adam state
        plain(i)
        for fn in steps.values():
            fn(i)
    ratios: dict[str, list[float]] = {k: [] for k in steps}
    base: list[float] = []
    i = 3
    for r in range(args.rounds):
        for name, fn in (reversed(list(steps.items())) if r % 2 else steps.items()):
            t0 = time.perf_counter()
            plain(i)
            t1 = time.perf_counter()
            fn(i)
            t2 = time.perf_counter()
            base.append(t1 - t0)
            ratios[name].append((t2 - t1) / (t1 - t0))
            i += 1
    n_params = sum(p.numel() for p in proto.parameters())
    print(f"4-layer d=256 GPT ({n_params / 1e6:.2f}M), batch {args.batch}x{args.seq}, torch threads "
          f"{torch.get_num_threads()}, rounds {args.rounds}; plain step {statistics.median(base) * 1e3:.1f} ms")
    ref = statistics.median(ratios["watch(), 0.3's signals"])
    print(f"{'variant':<34}{'ratio':>8}{'vs 0.3 signals':>16}")
    for name, rs in ratios.items():
        med = statistics.median(rs)
        print(f"{name:<34}{med:>8.3f}{med - ref:>+16.3f}")
    events = {name: len(h.spikes) for name, h in zip(VARIANTS, handles)}
    print(f"events (random tokens: none expected): {events}")
    for h in handles:
        h.finish()


if __name__ == "__main__":
    main()
