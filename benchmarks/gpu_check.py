"""What only a GPU shows (issue 38, item 5): run on one CUDA GPU, at most ~8 minutes.

1. **Host syncs per step**, counted with ``torch.cuda.set_sync_debug_mode("warn")`` (each synchronizing
   call warns once): ``watch()`` with every default on a step that does not log and whose detector is
   not armed (goal 0), and on a logging step with the detector armed (goal 1: the step's one transfer).
2. **``watch()`` overhead on a 125M-parameter GPT** (12 layers, d=768, V=50257, 8 x 1024 tokens) under
   bf16 autocast with fused AdamW: whole steps, interleaved against a twin's plain step, CUDA-event timed.
3. **Fused clipping inside fused AdamW**: ``watch(clip="global")`` (the coefficient rides in the fused
   kernel's ``grad_scale``) against ``clip_grad_norm_`` + fused AdamW: step time, and the parameters'
   distance after 20 steps against the fused-vs-foreach yardstick.
4. **The detector's logits pass at V = 128k, T = 4096** (bf16 logits): from the log-probabilities the
   loss saved and from the logits, against one cross-entropy forward + backward on the same logits;
   peak memory of each.
5. **Localization time in steps**: one garbage sample injected into a watched run of the 125M model;
   the spike step's wall time over a normal step's.
6. **Where section 2's time goes**: one plain and one watched step of the same model under
   ``torch.profiler``: the host's time to enqueue each step against the device's busy time (is the
   watched step host-bound?), and the kernels and host calls the watched step adds, largest first.
7. **Section 2 taken apart**: the same ratio with one default turned off at a time (the per-token
   signals' logits pass, the update signal, weight norms, the detector), each against its own plain twin.

    python benchmarks/gpu_check.py                # on a CUDA machine: every section, one table each
    python benchmarks/gpu_check.py --only 1 4     # some sections
    python benchmarks/gpu_check.py --dry-run      # CPU, tiny sizes: the code paths only (tests run this)

Until it has run on a GPU, docs/benchmarks.md says so; its printout is what the docs quote.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gradloc_track  # noqa: E402
from gradloc_track import MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402
from gradloc_track.spikes.term_stats import term_stats  # noqa: E402


@dataclass
class Size:
    device: str
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    vocab: int = 50257
    batch: int = 8
    seq: int = 1024
    logits_vocab: int = 128_000
    logits_seq: int = 4096
    rounds: int = 20
    dtype: torch.dtype = torch.bfloat16


TRACE_DIR: Path | None = None  # --trace: section 6 writes its two profiles there (chrome://tracing)
DRY = dict(n_layer=2, d_model=32, n_head=2, vocab=256, batch=2, seq=32, logits_vocab=1000, logits_seq=64, rounds=3)


class LM(torch.nn.Module):
    """TinyGPT called the HF way (``model(input_ids=, labels=)`` -> ``.loss``, ``.logits``): watch()'s
    default front door reads the loss's saved log-probabilities."""

    def __init__(self, s: Size) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab_size=s.vocab, n_layer=s.n_layer, n_head=s.n_head, d_model=s.d_model,
                           max_seq_len=s.seq)

    def forward(self, input_ids, labels=None):
        logits = self.gpt(input_ids)
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                          labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    """Seconds of ``fn()``: CUDA events on a GPU, the process's CPU time otherwise."""
    if device != "cuda":
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _autocast(s: Size):
    return torch.autocast(s.device, dtype=s.dtype) if s.device == "cuda" else contextlib.nullcontext()


def _model(s: Size) -> LM:
    torch.manual_seed(0)
    return LM(s).to(s.device)


def _batches(s: Size, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, s.vocab, (s.batch, s.seq), generator=g).to(s.device) for _ in range(n)]


def _stepper(model, opt, pool, s: Size, clip: float | None = None):
    def step(i: int) -> None:
        ids = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        with _autocast(s):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
        opt.step()

    return step


def _adamw(model, s: Size, fused: bool | None = None):
    """AdamW as the sections use it: fused on CUDA (``fused=False``: foreach, section 3's yardstick)."""
    fused = s.device == "cuda" if fused is None else fused
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)


def syncs(s: Size) -> None:
    print("\n1. host syncs per step (torch.cuda.set_sync_debug_mode('warn'): one warning per synchronizing call)")
    model = _model(s)
    opt = _adamw(model, s)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=4, locate=False)
    step = _stepper(model, opt, _batches(s), s)
    for i in range(6):  # past warm-up: the detector is armed from here
        step(i)
    _sync(s.device)
    rows = []
    for i, what in ((9, "non-logging step (log_every=4), detector armed"), (12, "logging step, detector armed")):
        handle.steps = i
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if s.device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                step(i)
                _sync(s.device) if s.device != "cuda" else None
            finally:
                if s.device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        # the synchronizing calls ("called a synchronizing CUDA operation"), not the mode's one-time notice
        # ("Synchronization debug mode is a prototype feature"), which the first run counted as a sync
        n = sum("called a synchronizing" in str(w.message) for w in caught)
        rows.append((what, n))
    handle.finish()
    for what, n in rows:
        print(f"  {what:<52}{n:>4} sync(s)" + ("" if s.device == "cuda" else "  (CPU dry run: not counted)"))
    print("  goal: the monitor adds no sync to a step whose detector is not armed, one to an armed step "
          "(with every default the detector is armed every step after warm-up)")


def _twins(s: Size, **watch_kw):
    """(plain step, watched step, handle) on twins of one model with the same batches, each stepped 6 times (past
    the detector's first steps: it is armed from there, section 1). ``watch_kw``: watch()'s options beyond the
    sections' own (a MemoryTracker, log_every=10, no localizer)."""
    base = _model(s)
    twin = copy.deepcopy(base)
    pool = _batches(s)
    plain = _stepper(base, _adamw(base, s), pool, s)
    opt = _adamw(twin, s)
    handle = gradloc_track.watch(twin, opt, tracker=MemoryTracker(), log_every=10, locate=False, **watch_kw)
    watched = _stepper(twin, opt, pool, s)
    for i in range(6):
        plain(i)
        watched(i)
    return plain, watched, handle


def overhead(s: Size) -> None:
    print(f"\n2. watch() overhead, {s.n_layer}-layer d={s.d_model} GPT, V={s.vocab}, {s.batch}x{s.seq} tokens, "
          f"{'bf16 autocast, fused AdamW' if s.device == 'cuda' else 'fp32 (dry run)'}")
    n = sum(p.numel() for p in _model(s).parameters())
    plain, watched, handle = _twins(s)
    ratios, base_t = [], []
    for i in range(6, 6 + s.rounds):
        a = _timed(lambda: plain(i), s.device)
        b = _timed(lambda: watched(i), s.device)
        ratios.append(b / a)
        base_t.append(a)
    # back to back, as a training loop runs: the host may run ahead of the device between the steps' one sync
    # each (watched) or all the way (plain); blocks of BLOCK steps, interleaved
    block, runs = 5, []
    for r in range(max(2, s.rounds // 4)):
        first = 6 + s.rounds + r * block
        a = _timed(lambda: [plain(i) for i in range(first, first + block)], s.device)
        b = _timed(lambda: [watched(i) for i in range(first, first + block)], s.device)
        runs.append(b / a)
    handle.finish()
    print(f"  {n / 1e6:.0f}M parameters; plain step {statistics.median(base_t) * 1e3:.1f} ms; watch() defaults / plain "
          f"= {statistics.median(ratios):.3f} (median of {s.rounds} interleaved pairs of steps, each synchronized; "
          f"goal <= 1.02)")
    print(f"  back to back ({block} steps a block, no sync between them but watch()'s own): "
          f"{statistics.median(runs):.3f} (median of {len(runs)} interleaved pairs of blocks)")


def fused_clip(s: Size) -> None:
    print("\n3. fused clipping inside fused AdamW: watch(clip='global') vs clip_grad_norm_ + fused AdamW")
    ref_model = _model(s)
    ours_model = copy.deepcopy(ref_model)
    start = copy.deepcopy(ref_model.state_dict())
    pool = _batches(s)
    ref = _stepper(ref_model, _adamw(ref_model, s), pool, s, clip=1.0)
    opt = _adamw(ours_model, s)
    handle = gradloc_track.watch(ours_model, opt, tracker=MemoryTracker(), log_every=10, locate=False,
                                 clip={"kind": "global", "max_norm": 1.0}, spikes={"enabled": False})
    ours = _stepper(ours_model, opt, pool, s)
    times = {"clip_grad_norm_ + fused AdamW": [], "watch(clip='global') + fused AdamW": []}
    for i in range(s.rounds):
        times["clip_grad_norm_ + fused AdamW"].append(_timed(lambda: ref(i), s.device))
        times["watch(clip='global') + fused AdamW"].append(_timed(lambda: ours(i), s.device))
    handle.finish()
    base = statistics.median(times["clip_grad_norm_ + fused AdamW"])
    for name, ts in times.items():
        print(f"  {name:<44}{statistics.median(ts) * 1e3:>9.1f} ms {statistics.median(ts) / base:>7.3f}")
    # the yardstick: the same reference with foreach AdamW instead of fused, the same steps from the same start
    # (two correct optimizers differ by float order; ours should sit as near the reference as they do)
    yard_model = _model(s)
    yard_model.load_state_dict(start)
    yard = _stepper(yard_model, _adamw(yard_model, s, fused=False), pool, s, clip=1.0)
    for i in range(s.rounds):
        yard(i)

    def distance(model) -> float:
        with torch.no_grad():
            return max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                       for a, b in zip(model.parameters(), ref_model.parameters()))

    ours_d, yard_d = distance(ours_model), distance(yard_model)
    ratio = f"{ours_d / yard_d:.2f} (about 1 or less: within float order)" if yard_d > 0 else \
        "n/a (off CUDA the reference is foreach AdamW too, so the yardstick is the reference itself)"
    print(f"  after {s.rounds} steps, max over tensors of ||x - ref|| / ||ref||: ours {ours_d:.1e}, the yardstick "
          f"(clip_grad_norm_ + foreach AdamW) {yard_d:.1e}; ours / yardstick = {ratio}")


def logits_pass(s: Size) -> None:
    V, T = s.logits_vocab, s.logits_seq
    print(f"\n4. the detector's logits pass, V={V}, T={T}, bf16 logits, against one cross-entropy fwd+bwd")
    g = torch.Generator(device=s.device).manual_seed(0)
    dt = s.dtype if s.device == "cuda" else torch.float32
    z = torch.randn(T, V, generator=g, device=s.device, dtype=dt)
    tgt = torch.randint(0, V, (T,), generator=g, device=s.device)
    zr = z.clone().requires_grad_()

    def ce():
        F.cross_entropy(zr.float(), tgt).backward()
        zr.grad = None

    def peak(fn) -> tuple[float, float]:
        if s.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = statistics.median(_timed(fn, s.device) for _ in range(max(3, s.rounds // 4)))
        mem = (torch.cuda.max_memory_allocated() - before) / 2 ** 30 if s.device == "cuda" else float("nan")
        return t, mem

    ce_t, ce_m = peak(ce)
    logp = torch.log_softmax(z.float(), -1)  # what the model's own cross-entropy saved
    rows = [("CE forward + backward", ce_t, ce_m),
            ("from the loss's saved log-probs", *peak(lambda: term_stats(logp, tgt, log_probs=True))),
            ("from the logits (blocks)", *peak(lambda: term_stats(z, tgt, log_probs=False)))]
    for name, t, mem in rows:
        print(f"  {name:<36}{t * 1e3:>9.2f} ms {t / ce_t:>7.2f}x   peak +{mem:.2f} GiB")
    print("  goal: the pass <= 0.5x one cross-entropy forward + backward, with bounded memory")


def _print_ours(stats, steps: int, top: int) -> None:
    """gradloc_track's functions in a ``pstats.Stats``, the largest cumulative time first, in ms a step."""
    ours = sorted(((v[3], v[2], k) for k, v in stats.stats.items() if "gradloc_track" in k[0]), key=lambda r: -r[0])
    for cum, own, (file, line, fn) in ours[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}"
        print(f"    {cum / steps * 1e3:8.2f} cum {own / steps * 1e3:7.2f} own  {where} {fn}")


def localization(s: Size) -> None:
    print("\n5. localization time in normal steps: a garbage sample injected at one step of a watched run")
    model = _model(s)
    opt = _adamw(model, s)
    # a real tracker's way: artifacts rendered off the training thread (MemoryTracker renders inline, and the
    # first run of this section timed matplotlib's import and a heatmap on the step: 3.4 s)
    import tempfile
    run_dir = tempfile.TemporaryDirectory(prefix="gpu_check_", ignore_cleanup_errors=True)
    handle = gradloc_track.watch(model, opt, tracker="none", run_dir=run_dir.name,
                                 log_every=10, spikes={"warmup_steps": 5, "transient_fall": 0.0},  # spike at 12
                                 locate={"max_events": 2})
    pool = _batches(s)
    step = _stepper(model, opt, pool, s)
    normal = [_timed(lambda: step(i), s.device) for i in range(12)][6:]
    bad = pool[0].clone()
    bad[0] = 7  # one sample of a single repeated token: a coherent, large gradient
    spike_t = _timed(lambda: _stepper(model, opt, [bad], s)(0), s.device)
    # a second spike ten steps on: what the first one paid once (kernels, lazy imports) it does not pay again
    for i in range(13, 23):
        step(i)
    bad2 = pool[1].clone()
    bad2[1] = 11
    import cProfile
    import pstats
    prof_py = cProfile.Profile()
    prof_py.enable()
    spike2_t = _timed(lambda: _stepper(model, opt, [bad2], s)(0), s.device)
    prof_py.disable()
    spikes = [st.step for st in handle.spikes]
    handle.finish()
    run_dir.cleanup()
    located = [st for st in handle.spikes if st.locate is not None]
    probes = [st.locate.probes for st in located]
    base = statistics.median(normal)
    print(f"  normal step {base * 1e3:.1f} ms; the first spike step {spike_t * 1e3:.1f} ms = {spike_t / base:.1f} "
          f"normal steps, a second one {spike2_t * 1e3:.1f} ms = {spike2_t / base:.1f} (probes {probes}; detected at "
          f"steps {spikes})")
    print("  the second spike step's host time, gradloc_track's functions by cumulative time (ms):")
    _print_ours(pstats.Stats(prof_py), steps=1, top=15)


def where_time_goes(s: Size) -> None:
    print("\n6. where section 2's time goes: one plain and one watched step under torch.profiler")
    from torch.profiler import ProfilerActivity, profile
    plain, watched, handle = _twins(s)
    _sync(s.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    import cProfile
    import pstats
    prof_py = cProfile.Profile()
    prof_py.enable()
    for i in range(6, 11):
        watched(i)
        _sync(s.device)
    prof_py.disable()
    print("  the watched step's host time in Python, 5 steps (the largest own time first, ms a step):")
    st = pstats.Stats(prof_py)
    rows = sorted(((v[2], v[3], k) for k, v in st.stats.items()), key=lambda r: -r[0])[:25]
    for own, cum, (file, line, fn) in rows:
        print(f"    {own / 5 * 1e3:7.2f} own {cum / 5 * 1e3:8.2f} cum  {Path(file).name}:{line} {fn}")
    print("  gradloc_track's own functions, the largest cumulative time first (ms a step):")
    _print_ours(st, steps=5, top=25)
    tables = {}
    for name, fn in (("plain", plain), ("watched", watched)):
        host = []
        if name == "watched":
            handle.steps = 8  # watch's count for the next three steps: 8, 9 and 10, which logs (log_every=10)
        with profile(activities=acts) as prof:
            for i in range(6, 9):
                _sync(s.device)
                t0 = time.perf_counter()
                fn(i)
                host.append(time.perf_counter() - t0)  # enqueue time: the step returns before the device ends
                _sync(s.device)
        if TRACE_DIR is not None:
            prof.export_chrome_trace(str(TRACE_DIR / f"trace_{name}.json"))
        ev = prof.key_averages()
        dev = sum(e.self_device_time_total for e in ev) / 1e6 / 3 if s.device == "cuda" else float("nan")
        tables[name] = {e.key: (e.self_device_time_total if s.device == "cuda" else 0.0, e.self_cpu_time_total,
                                e.count) for e in ev}
        bound = "" if s.device != "cuda" else f" ({'host' if statistics.median(host) > dev else 'device'}-bound)"
        print(f"  {name:<8} host enqueue {statistics.median(host) * 1e3:8.1f} ms/step, device busy "
              f"{dev * 1e3:8.1f} ms/step{bound}")
    handle.finish()
    plain_t, watched_t = tables["plain"], tables["watched"]
    diff = []
    for key, (d, c, n) in watched_t.items():
        d0, c0, n0 = plain_t.get(key, (0.0, 0.0, 0))
        diff.append((key, (d - d0) / 3e3, (c - c0) / 3e3, (n - n0) / 3))
    print("  added by watch(), per step (device ms / host self ms / calls), largest device time first:")
    for key, d, c, n in sorted(diff, key=lambda r: -r[1])[:12]:
        print(f"    {key[:60]:<60}{d:>8.2f}{c:>8.2f}{n:>8.1f}")
    print("  largest host self time first:")
    for key, d, c, n in sorted(diff, key=lambda r: -r[2])[:12]:
        print(f"    {key[:60]:<60}{d:>8.2f}{c:>8.2f}{n:>8.1f}")


def _watched_ratio(s: Size, rounds: int, **watch_kw) -> float:
    """watch(**watch_kw) / plain on twins of one model: the median of ``rounds`` interleaved step pairs."""
    plain, watched, handle = _twins(s, **watch_kw)
    ratios = [_timed(lambda: watched(i), s.device) / _timed(lambda: plain(i), s.device)
              for i in range(6, 6 + rounds)]
    handle.finish()
    return statistics.median(ratios)


def taken_apart(s: Size) -> None:
    print("\n7. section 2 taken apart: watch() / plain with one default off at a time")
    variants = {
        "every default": {},
        "per-token signals off (no logits pass)": {"spikes": {"sample_signal": False, "junk_signal": False}},
        "update signal off": {"spikes": {"update_signal": False}},
        "weight norms off": {"weight_norms": False},
        "detector off (norms only)": {"spikes": {"enabled": False}},
    }
    for name, kw in variants.items():
        print(f"  {name:<44}{_watched_ratio(s, max(3, s.rounds // 2), **kw):>7.3f}")


SECTIONS = {1: syncs, 2: overhead, 3: fused_clip, 4: logits_pass, 5: localization, 6: where_time_goes,
            7: taken_apart}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, nargs="*", choices=sorted(SECTIONS))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: exercise the code paths")
    ap.add_argument("--trace", type=Path, help="section 6: write its profiles (chrome traces) into this folder")
    args = ap.parse_args(argv)
    global TRACE_DIR
    TRACE_DIR = args.trace
    if TRACE_DIR is not None:
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        torch.set_num_threads(1)
        s = Size("cpu", **DRY)
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here. Run it on a GPU machine (`run` the device tool: "
              "python benchmarks/gpu_check.py), or --dry-run to exercise it on the CPU.")
        return 2
    else:
        s = Size("cuda")
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    t0 = time.perf_counter()
    for k in args.only or sorted(SECTIONS):
        SECTIONS[k](s)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
