"""What a spike response does to training: the same corrupted documents, identical runs otherwise.

The demo's model and data (``gradloc_track.demo``: the hand-written GPT, the CPython-docs corpus,
byte tokens, AdamW with warm-up and cosine decay, per-sample loss averaging as in SFT). At each
injection step one sample of the batch is the spike demo's corrupted instruction pair
(``garbled_span``: a prose prompt, no loss, and an answer of mojibake ``â€™``): the same documents
at the same steps in every arm. Arms (every one with the same spike detector, ``spikes`` defaults but
the early-transient rule, off so the arms see the same detections from the warm-up on):

- ``clean``, ``clean+adagc``: no injection (what the corrupted documents cost, without and with AdaGC,
  which changes training on its own);
- ``none``: no clipping, no response;
- ``adagc``: AdaGC (``clip=adagc`` defaults, its warm-up shortened to the detector's);
- ``skip``: skip-step (OLMo-core's response): the optimizer step is skipped when the detector fires;
- ``surgery``: ``spikes.response=surgery``, no clipper;
- ``surgery+adagc``: surgery, then AdaGC clips the operated gradient.

Loss is measured on fixed held-out batches (the same for every arm and seed): right before and
right after each injection step (after its optimizer step), and at the end; and, at the end, on the
corrupted answers after held-out prompts (how much of the junk the model learned: lower = more).
Printed per arm: mean and spread (std over seeds) of the jump at the spikes, of the final loss and
of its difference to ``clean`` (paired by seed); spikes detected, steps skipped or operated,
seconds per run (wall clock on a shared machine: indicative only). A second table gives the
held-out loss right after each spike step.

    python benchmarks/bench_surgery.py [--seeds 0 1 2 3 4] [--steps 200] [--arms none surgery] [--z-thresh 6]
                                       [--quick]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor
from gradloc_track.clip import build_clipper
from gradloc_track.config import AdaGCConfig, LocateConfig, SpikeConfig
from gradloc_track.demo.config import ModelConfig, OptimConfig
from gradloc_track.demo.data import ByteTokenizer, TextBatches, load_corpus
from gradloc_track.demo.inject import inject
from gradloc_track.demo.model import build_model
from gradloc_track.demo.optim import make_optimizer, make_schedule
from gradloc_track.localizer import save_rng
from gradloc_track.spikes import SpikeContext, SpikeDetector

ARMS = {  # name -> (inject, clip, response, skip)
    "clean": (False, "none", "none", False),
    "clean+adagc": (False, "adagc", "none", False),
    "none": (True, "none", "none", False),
    "adagc": (True, "adagc", "none", False),
    "skip": (True, "none", "none", True),
    "surgery": (True, "none", "surgery", False),
    "surgery+adagc": (True, "adagc", "surgery", False),
}
JUNK = "â€™"  # the spike demo's mojibake answer


@dataclass
class Setting:
    steps: int = 200
    inject_at: tuple[int, ...] = tuple(range(70, 170, 10))  # a corrupted shard: every 10th batch
    batch_size: int = 8
    seq_len: int = 64
    n_bad: int = 3  # corrupted samples in an injected batch (the last ones)
    span: int = 3  # the answer's loss tokens: each weighs seq_len / span normal tokens (per-sample mean)
    n_layer: int = 4
    d_model: int = 128
    warmup: int = 50  # the detector's and AdaGC's warm-up
    z_thresh: float = SpikeConfig.z_thresh  # the detector's threshold (spikes.z_thresh)
    eval_batches: int = 4


@dataclass
class Run:
    """One arm, one seed: held-out loss around each injection and at the end."""

    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    final: float = math.nan
    junk: float = math.nan  # final loss on the corrupted answers (held-out prompts): low = the junk was learned
    detected: int = 0  # detector events at injection steps
    false_alarms: int = 0  # detector events elsewhere
    acted: int = 0  # steps skipped (skip) or operated on (surgery)
    seconds: float = 0.0


@dataclass
class Probe:
    """Fixed held-out data: clean batches, and the same prose with the corrupted answer."""

    clean: list[torch.Tensor]  # each (16, T+1)
    junk: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x, y, mask: (16, T)

    @classmethod
    def build(cls, corpus: str, s: Setting) -> "Probe":
        clean = [TextBatches(corpus, s.seq_len, 16, 10 ** 6).batch(i) for i in range(s.eval_batches)]
        b = TextBatches(corpus, s.seq_len, 16, 10 ** 6 + 1).batch(0)
        x, y = b[:, :-1].clone(), b[:, 1:].clone()  # (16, T)
        mask = torch.ones_like(x, dtype=torch.float32)
        for i in range(16):
            inject("garbled_span", x, y, mask, sample=i, span=s.span, junk_ids=ByteTokenizer().encode(JUNK))
        return cls(clean, (x, y, mask))

    @torch.no_grad()
    def loss(self, model) -> float:
        model.eval()
        total = sum(float(F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())) for b in self.clean)
        model.train()
        return total / len(self.clean)

    @torch.no_grad()
    def junk_loss(self, model) -> float:
        x, y, mask = self.junk
        model.eval()
        per = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view_as(mask)  # (16, T)
        model.train()
        return float((per * mask).sum() / mask.sum())


def masked_lm_loss(model, x, y, mask):
    """The demo's ``loss_fn(keep)`` under per-sample averaging, with a FIXED normaliser."""
    B, T = x.shape
    weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0) / B  # (B, T)

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        per_tok = F.cross_entropy(model(x).reshape(B * T, -1), y.reshape(-1), reduction="none").view(B, T)
        return (per_tok * weights * keep).sum()

    return loss_fn


def sample_losses(model, x, y, mask):
    """The training loss (per-sample averaging, as ``masked_lm_loss``) and each sample's mean loss,
    from one forward: the detector's loss and largest-sample signals."""
    B, T = x.shape
    per_tok = F.cross_entropy(model(x).reshape(B * T, -1), y.reshape(-1), reduction="none").view(B, T)
    per_sample = (per_tok * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B,)
    return per_sample.mean(), per_sample.detach()


def build(arm: str, seed: int, s: Setting):
    """Model, optimizer, schedule and monitor of one run (every random draw from ``seed``)."""
    _, clip, response, _ = ARMS[arm]
    torch.manual_seed(seed)
    model = build_model(ModelConfig(n_layer=s.n_layer, d_model=s.d_model, max_seq_len=s.seq_len))
    optim = OptimConfig()
    opt = make_optimizer(model, optim)
    sched = make_schedule(opt, optim, s.steps)
    clipper = build_clipper(AdaGCConfig(warmup_steps=s.warmup), model) if clip == "adagc" else None
    # the responses are compared, not the detector's warm-up: its early-transient rule is off, so every arm
    # sees the same detections from warmup_steps on (``spikes.transient_fall``)
    detector = SpikeDetector(SpikeConfig(warmup_steps=s.warmup, z_thresh=s.z_thresh, response=response,
                                         transient_fall=0.0))
    locate = LocateConfig(enabled=response == "surgery", max_events=10 ** 6)
    monitor = GradMonitor(model, clipper=clipper, optimizer=opt, detector=detector, locate_config=locate,
                          log_every=10 ** 9)
    return model, opt, sched, monitor


def batch_of(data: TextBatches, step: int, s: Setting, corrupt: bool, junk: list[int]):
    """Inputs, targets and loss mask of ``step``; the last ``n_bad`` samples corrupted when asked."""
    batch = data.batch(step)  # (B, T+1)
    x, y = batch[:, :-1].clone(), batch[:, 1:].clone()  # (B, T)
    mask = torch.ones_like(x, dtype=torch.float32)
    for i in range(s.n_bad if corrupt else 0):
        inject("garbled_span", x, y, mask, sample=s.batch_size - 1 - i, span=s.span, junk_ids=junk)
    return x, y, mask


def run(arm: str, seed: int, s: Setting, corpus: str, probe: Probe) -> Run:
    injects, _, _, skip = ARMS[arm]
    model, opt, sched, monitor = build(arm, seed, s)
    tok = ByteTokenizer()
    data, junk = TextBatches(corpus, s.seq_len, s.batch_size, seed, tok), tok.encode(JUNK)
    out, t0 = Run(), time.perf_counter()
    for step in range(s.steps):
        spiky = step in s.inject_at
        if spiky:
            out.before.append(probe.loss(model))
        x, y, mask = batch_of(data, step, s, injects and spiky, junk)
        loss_fn = masked_lm_loss(model, x, y, mask)
        opt.zero_grad(set_to_none=True)
        rng = save_rng()  # right before the forward: probes replay it
        loss, samples = sample_losses(model, x, y, mask)
        loss.backward()
        stats = monitor.after_backward(step, spike_context=SpikeContext(loss_fn, mask, rng_state=rng),
                                       loss=loss.detach(), sample_losses=samples)
        fired = bool(stats.events)
        out.detected += fired and spiky
        out.false_alarms += fired and not spiky
        out.acted += (skip and fired) or bool(stats.surgery is not None and stats.surgery.applied)
        if not (skip and fired):
            opt.step()
        sched.step()
        if spiky:
            out.after.append(probe.loss(model))
    out.final, out.junk, out.seconds = probe.loss(model), probe.junk_loss(model), time.perf_counter() - t0
    return out


def mean_sd(values: list[float], digits: int = 4) -> str:
    m = statistics.fmean(values)
    return f"{m:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def reference(arm: str, results: dict[str, list[Run]]) -> list[Run] | None:
    """The clean runs with the same clipper (AdaGC changes training on its own)."""
    return results.get("clean+adagc" if ARMS[arm][1] == "adagc" else "clean")


def table(results: dict[str, list[Run]], s: Setting) -> list[str]:
    """One markdown row per arm (mean ± std over seeds; differences paired by seed)."""
    rows = ["| arm | loss jump at a spike | final loss | final − clean (same clipper) | loss on the corrupted "
            "answers | detected | false alarms | skipped / operated | s / run |", "|---" * 9 + "|"]
    for arm, runs in results.items():
        jumps = [statistics.fmean(a - b for a, b in zip(r.after, r.before)) for r in runs]
        clean = reference(arm, results)
        delta = mean_sd([r.final - c.final for r, c in zip(runs, clean)]) if clean else "n/a"
        def avg(attr: str) -> float:
            return statistics.fmean(getattr(r, attr) for r in runs)

        rows.append(f"| {arm} | {mean_sd(jumps)} | {mean_sd([r.final for r in runs])} | {delta} | "
                    f"{mean_sd([r.junk for r in runs], 2)} | {avg('detected'):.1f}/{len(s.inject_at)} | "
                    f"{avg('false_alarms'):.1f} | {avg('acted'):.1f} | {avg('seconds'):.1f} |")
    return rows


def per_spike(results: dict[str, list[Run]], s: Setting) -> list[str]:
    """Held-out loss right after each injection step, mean over seeds."""
    rows = ["| arm | " + " | ".join(str(t) for t in s.inject_at) + " |", "|---" * (len(s.inject_at) + 1) + "|"]
    for arm, runs in results.items():
        cells = [statistics.fmean(r.after[i] for r in runs) for i in range(len(s.inject_at))]
        rows.append(f"| {arm} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[Run]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=Setting.steps)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--z-thresh", type=float, default=Setting.z_thresh, help="the detector's spikes.z_thresh")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the smallest configuration: a smoke run, no numbers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = Setting(steps=args.steps, z_thresh=args.z_thresh)
    if args.quick:
        s = Setting(steps=14, inject_at=(10, 12), batch_size=4, seq_len=32, n_bad=1, n_layer=1, d_model=32,
                    warmup=6, eval_batches=1)
    corpus = load_corpus()
    probe = Probe.build(corpus, s)
    results: dict[str, list[Run]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AdaGC's saturation warning: its effect is in the table
        for arm in args.arms:
            results[arm] = [run(arm, seed, s, corpus, probe) for seed in args.seeds]
            print(f"{arm}: final {mean_sd([r.final for r in results[arm]])}", flush=True)
    print(f"\n{s.steps} steps, batch {s.batch_size}x{s.seq_len}, {s.n_layer} layers d={s.d_model}; {s.n_bad} "
          f"corrupted documents in the batches of steps {list(s.inject_at)}; spikes.z_thresh={s.z_thresh}; "
          f"seeds {args.seeds}; held-out loss, mean ± std over seeds\n")
    print("\n".join(table(results, s)))
    print("\nheld-out loss right after each spike step (mean over seeds):\n")
    print("\n".join(per_spike(results, s)))
    return results


if __name__ == "__main__":
    main()
