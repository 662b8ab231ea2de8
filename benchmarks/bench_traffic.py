"""Memory traffic per step over gradient and weight storage, in multiples of their sizes.

On an accelerator, norms and clipping are bound by memory traffic, not arithmetic. This counts,
with ``gradloc_track.traffic.TrafficCounter`` (a TorchDispatchMode adding up the bytes each ATen
op reads and writes over the watched storages; views left out), what one call costs, for every
configuration, next to ``clip_grad_norm_(foreach=True)``. Hardware-independent: it holds for GPU
runs we cannot time here. Five tables:

1. the monitor/clipper call (``GradMonitor.after_backward``, ``clip()``, ``watch()``'s step),
   non-logging and logging steps, finite and with a NaN;
2. the same without an optimizer guard (the clipper must zero a bad step's gradients itself);
3. the whole step (the call + ``optimizer.step()``) over gradients and weights, with fused and with
   foreach AdamW, next to ``clip_grad_norm_`` + the same optimizer, counted in the same run: a
   single-coefficient clip beside a fused optimizer rides in its kernel (``grad_scale``);
4. what the skip costs inside ``optimizer.step()`` over parameters + optimizer state, per mode;
5. how far that kernel-applied clip lands from ``clip_grad_norm_`` + fused AdamW after N steps
   (the kernel divides by ``1/coef`` where ``clip_grad_norm_`` multiplies by ``coef``).

    python benchmarks/bench_traffic.py [--small]   # --small: a 2-layer d=32 model (same counts)
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradloc_track  # noqa: E402
from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, NoClip, SkipStepGuard, ZClip  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402
from gradloc_track.traffic import TrafficCounter  # noqa: E402

VOCAB, SEQ = 256, 32
CLIPPERS: dict[str, Callable] = {
    "GlobalClip": lambda m: GlobalClip(m, max_norm=0.5),
    "AdaGC": lambda m: AdaGC(m, warmup_steps=1),
    "AdaGC(mode='global')": lambda m: AdaGC(m, warmup_steps=1, mode="global"),
    "ZClip": lambda m: ZClip(m, warmup_steps=2),
    "LayerClip": lambda m: LayerClip(m, warmup_steps=2),
}


SIZE = {"n_layer": 4, "n_head": 4, "d_model": 128}


def make_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=VOCAB, max_seq_len=SEQ, **SIZE)


def backward(model, seed: int, nan: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    model(batch[:, :-1])  # a forward that watch()'s batch capture sees
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1)).backward()
    if nan:
        next(model.parameters()).grad.view(-1)[0] = float("nan")


def count(model, fn: Callable[[], object], extra: dict | None = None) -> TrafficCounter:
    counter = TrafficCounter(grads=[p.grad for p in model.parameters()], weights=list(model.parameters()),
                             **(extra or {}))
    with counter:
        fn()
    return counter


def row(name: str, model, call: Callable[[int], object], warm: int = 3,
        train: Callable[[int], object] | None = None) -> tuple:
    """(name, grads non-logging, grads with a NaN, grads logging, weights logging). ``train``: what a
    training step runs (the optimizer's step, with the call in its hook), for the warm-up steps: the
    optimizer's state then exists as in training."""
    for s in range(1, warm + 1):  # odd steps: past every warm-up, none logging (log_every=2)
        backward(model, s)
        (train or call)(2 * s + 1)
    out = []
    for step, nan in ((2 * warm + 3, False), (2 * warm + 5, True), (2 * warm + 6, False)):
        backward(model, step, nan=nan)
        out.append(count(model, lambda: call(step)))
    return (name, out[0].multiples("grads")["total"], out[1].multiples("grads")["total"],
            out[2].multiples("grads")["total"], out[2].multiples("weights")["total"])


def monitor_call(model, clipper, guard: bool):
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=2)
    if guard and clipper is not None:
        SkipStepGuard(torch.optim.AdamW(model.parameters(), lr=1e-3), clipper)
    return mon.after_backward


def watch_call(model, clip: str | None, fused: bool = False) -> tuple[Callable, Callable]:
    """(the hook's call alone, a training step: the optimizer's step with the hook inside)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=2, locate=False,
                                 **({"clip": clip} if clip else {}))
    return (lambda step: handle.step(step)), (lambda step: opt.step())


def call_table(guard: bool) -> list[tuple]:
    rows = []
    base = make_model()
    rows.append(row("clip_grad_norm_(foreach=True)", base,
                    lambda s: torch.nn.utils.clip_grad_norm_(base.parameters(), 0.5, foreach=True)))
    m = make_model()
    rows.append(row("GradMonitor alone", m, monitor_call(m, None, guard)))
    for name, make in CLIPPERS.items():
        m = make_model()
        rows.append(row(f"GradMonitor + {name}", m, monitor_call(m, make(m), guard)))
    m = make_model()
    rows.append(row("GradMonitor + NoClip (measures, handles NaN)", m, monitor_call(m, NoClip(m), guard)))
    for name in ("GlobalClip", "AdaGC"):
        m = make_model()
        clipper = CLIPPERS[name](m)
        if guard:
            SkipStepGuard(torch.optim.AdamW(m.parameters(), lr=1e-3), clipper)
        rows.append(row(f"{name}.clip() alone", m, lambda s, c=clipper: c.clip()))
    if guard:  # every default on (detector armed, update signal), the optimizer's state as in training
        for clip, fused in ((None, False), ("global", False), ("global", True), ("adagc", False)):
            m = make_model()
            call, train = watch_call(m, clip, fused)
            name = f"watch(), detector armed{', clip=' + clip if clip else ''}{', fused AdamW' if fused else ''}"
            rows.append(row(name, m, call, train=train))
    return rows


def print_calls(title: str, rows: list[tuple]) -> None:
    print(f"\n{title}")
    print(f"{'configuration':<50}{'non-logging':>12}{'with NaN':>10}{'logging':>9}{'+ weights':>11}")
    for name, a, b, c, w in rows:
        print(f"{name:<50}{a:>12.2f}{b:>10.2f}{c:>9.2f}{w:>11.2f}")


def adamw(model, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=fused, foreach=not fused)


def step_configs() -> dict[str, Callable]:
    """name -> make(model, opt) -> step(s): everything after backward, ``optimizer.step()`` included."""
    def baseline(m, opt):
        return lambda s: (torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=True), opt.step())

    def monitored(make_clipper):
        def make(m, opt):
            mon = GradMonitor(m, tracker=MemoryTracker(), clipper=make_clipper(m) if make_clipper else None,
                              optimizer=opt, log_every=2)
            return lambda s: (mon.after_backward(s), opt.step())
        return make

    def watched(clip):
        def make(m, opt):
            gradloc_track.watch(m, opt, tracker=MemoryTracker(), log_every=2, locate=False,
                                **({"clip": clip} if clip else {}))
            return lambda s: opt.step()  # watch()'s step pre-hook runs the monitor and the clip
        return make

    configs = {"clip_grad_norm_(foreach=True) + step": baseline,
               "step alone (no clipping, no guard)": lambda m, opt: (lambda s: opt.step()),
               "GradMonitor(optimizer=) alone (skip guard)": monitored(None)}
    configs.update({f"GradMonitor(optimizer=) + {name}": monitored(make) for name, make in CLIPPERS.items()})
    configs["GradMonitor(optimizer=) + NoClip"] = monitored(NoClip)
    configs["watch(model, opt)"] = watched(None)
    configs["watch(model, opt, clip='global')"] = watched("global")
    configs["watch(model, opt, clip='adagc')"] = watched({"kind": "adagc", "warmup_steps": 1})
    return configs


def step_traffic(make: Callable, fused: bool, warm: int = 3) -> tuple[float, float]:
    """(gradients, weights) read+written by one whole non-logging step, in gradient sizes."""
    model = make_model()
    step = make(model, adamw(model, fused))
    for s in range(1, warm + 1):  # odd steps: past every warm-up, none logging (log_every=2)
        backward(model, s)
        step(2 * s + 1)
    backward(model, 2 * warm + 3)
    counter = count(model, lambda: step(2 * warm + 3))
    size = counter.size["grads"]
    return counter.multiples("grads")["total"], (counter.bytes["weights"]["read"] + counter.bytes["weights"][
        "write"]) / size


def step_table() -> None:
    print("\nthe whole step (the call + optimizer.step()), non-logging: gradient and weight traffic in gradient "
          "sizes (read + written), AdamW fused / foreach")
    print(f"{'configuration':<50}{'fused: grads':>13}{'weights':>9}{'total':>7}{'vs clip_grad_norm_':>20}"
          f"{'foreach: grads':>16}{'weights':>9}{'total':>7}")
    base = {}
    for name, make in step_configs().items():
        cells = []
        for fused in (True, False):
            g, w = step_traffic(make, fused)
            base.setdefault(fused, g + w)
            cells.append((g, w, g + w, (g + w) / base[fused]))
        (fg, fw, ft, fr), (xg, xw, xt, _) = cells
        print(f"{name:<50}{fg:>13.2f}{fw:>9.2f}{ft:>7.2f}{fr:>20.3f}{xg:>16.2f}{xw:>9.2f}{xt:>7.2f}")


def _trained(kind: str, steps: int) -> TinyGPT:
    """The model after ``steps`` clipped steps with fused AdamW: ``clip_grad_norm_`` ("ref"), or GlobalClip
    through the monitor with the guard in ``kind`` mode (auto: the clip in the kernel's grad_scale;
    sync: the clipper's own multiply, the same optimizer)."""
    model = make_model()
    opt = adamw(model, True)
    if kind == "ref":
        def clip(s):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)
    else:
        mon = GradMonitor(model, tracker=MemoryTracker(), clipper=GlobalClip(model, max_norm=0.05, skip_step=kind),
                          optimizer=opt, log_every=1000)
        assert mon.skip_guard.mode == ("fused" if kind == "auto" else kind)

        def clip(s):
            assert mon.after_backward(s + 1).clip.deferred == (kind == "auto")
    for s in range(steps):
        backward(model, s)
        clip(s)
        opt.step()
    return model


def equality_table() -> None:
    """GlobalClip through fused AdamW's grad_scale against clip_grad_norm_ + fused AdamW after N steps
    (max_norm=0.05: every step clipped); the clipper's own multiply beside the same optimizer as a yardstick
    (it differs from clip_grad_norm_ only in how the global norm is summed)."""
    print("\nparameters after N steps against clip_grad_norm_(0.05) + fused AdamW (every step clipped): "
          "max over tensors of ||ours - ref|| / ||ref||, max elementwise |ours - ref|")
    print(f"{'N':>4}{'grad_scale in the kernel':>34}{'own multiply (sync guard)':>34}")
    for steps in (1, 3, 20):
        ref = list(_trained("ref", steps).parameters())
        cells = []
        for kind in ("auto", "sync"):
            ours = list(_trained(kind, steps).parameters())
            rel = max(float((a - b).norm() / b.norm()) for a, b in zip(ours, ref))
            absd = max(float((a - b).abs().max()) for a, b in zip(ours, ref))
            cells.append(f"{rel:.1e} / {absd:.1e}")
        print(f"{steps:>4}{cells[0]:>34}{cells[1]:>34}")


def skip_table() -> None:
    """Traffic of optimizer.step() over parameters + optimizer state, by skip mode (finite step)."""
    print("\noptimizer.step() with AdamW, over parameters + optimizer state (multiples of the parameter size)")
    print(f"{'skip mode':<42}{'finite step':>12}   extra memory")
    for label, fused, mode in (("no guard (AdamW foreach)", False, None), ("sync (AdamW foreach)", False, "sync"),
                               ("restore (AdamW foreach)", False, "restore"), ("no guard (AdamW fused)", True, None),
                               ("fused found_inf (AdamW fused)", True, "fused")):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        clipper = GlobalClip(model, max_norm=0.5)
        if mode:
            SkipStepGuard(opt, clipper, mode=mode)
        for s in range(2):
            backward(model, s)
            clipper.clip()
            opt.step()
        backward(model, 2)
        clipper.clip()
        params = list(model.parameters())
        state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        counter = TrafficCounter(params=params, state=state)
        with counter:
            opt.step()
        size = counter.size["params"]
        total = sum(counter.bytes[g]["read"] + counter.bytes[g]["write"] for g in ("params", "state")) / size
        extra = {"restore": "1x params + state"}.get(mode or "", "none")
        print(f"{label:<42}{total:>12.2f}   {extra}")


def main() -> None:
    if "--small" in sys.argv:
        SIZE.update(n_layer=2, n_head=2, d_model=32)
    warnings.simplefilter("ignore")  # the unguarded skip's one-time advice (table 2 is about it)
    n = sum(p.numel() for p in make_model().parameters())
    print(f"model: TinyGPT 4x128, {n / 1e6:.2f}M parameters; gradient traffic per call in gradient sizes "
          "(read + write); 'logging' = a step that logs (log_every=2), '+ weights' = its weight-norm reads")
    print_calls("the call, with the optimizer's skip guard (GradMonitor(optimizer=...), watch(), callbacks)",
                call_table(guard=True))
    print_calls("the call, no guard (the optimizer is unknown: a bad step's gradients are zeroed)",
                call_table(guard=False))
    step_table()
    skip_table()
    equality_table()


if __name__ == "__main__":
    main()
