"""The ``loop`` and ``loop64`` families: a nanoGPT-style byte-level GPT in its own loop, with the
library's default front door ``gradloc_track.watch(model, opt)`` (clipping off, the detector's
defaults, the localizer on at injected steps and the 10 steps after them).

nanoGPT's character recipe, small: 4 layers, d=32, AdamW (0.9, 0.99), weight decay 0.1, lr 1e-3
with a 20-step warm-up and a cosine to 1e-4 (``schedule.lr_factor``); ``model(x, y)`` returns (logits, the
token-mean loss), which ``watch()`` captures and rebuilds. ``loop``: batches of 8 windows of 64
bytes; ``loop64``: 64 windows of 16 bytes (1024 terms), for the token kinds, whose corrupted
per-term weights reach the localizer through ``handle.set_loss_fn`` (the front door's way for a
loss it cannot rebuild from the call). Harm as in the spike zoo (``demo.counterfactual``'s
recipe): held-out loss after the injected step against the clean step and a step on another clean
batch, from the same state.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kinds, snapshots
from .culprits import rows_of
from .demo import FP16_MAX, Batch
from .measure import HeldOut, adam_signals, grads_of, set_grads, step_effect, weight_norm
from .nanogpt import NanoGPT
from .record import FeedRecorder, Harm, RunRecord, StepRecord, live_outcome
from .schedule import Plan, horizon, lr_factor
from .sources import text
from .split import KINDS, known_cause
from .streams import Windows


@dataclass
class LoopSetting:
    family: str = "loop"
    source: str = "pydoc"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 32
    seq_len: int = 64
    batch: int = 8
    steps: int = 300
    clean_steps: int = 600
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    warmup: int = 20
    horizon: int = 250
    eval_batches: int = 2
    detector: dict = field(default_factory=dict)  # SpikeConfig overrides (none: the defaults)
    snapshots: str = ""  # where injected steps are saved for --relocate ("" = not saved)

    @classmethod
    def of(cls, family: str, source: str, quick: bool) -> "LoopSetting":
        shape = {"seq_len": 16, "batch": 64} if family == "loop64" else {}
        length = {"steps": 160, "clean_steps": 240} if quick else {}
        s = cls(family=family, source=source, **shape, **length)
        s.horizon = horizon(s.steps)
        return s


def model_args(s: LoopSetting) -> dict:
    return {"vocab_size": 256, "n_layer": s.n_layer, "n_head": s.n_head, "d_model": s.d_model,
            "max_seq_len": s.seq_len}


def build(s: LoopSetting, seed: int, plan: Plan):
    import gradloc_track

    torch.manual_seed(seed)
    model = NanoGPT(**model_args(s))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=s.lr, betas=s.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, s.warmup, s.horizon, plan.restart))
    handle = gradloc_track.watch(model, opt, tracker="none", spikes=dict(s.detector), locate={"max_events": 10 ** 6},
                                 log_every=10 ** 9)
    return model, opt, sched, handle


def weighted_loss_fn(model, b: Batch):
    """The weighted token mean of ``b`` (``b.weights``), with the full batch's weight sum as normaliser."""
    w = b.weights
    norm = float((w * b.mask).sum())

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        logits, _ = model(b.x)
        per = F.cross_entropy(logits.float().flatten(0, 1), b.y.flatten(), reduction="none").view_as(w)
        return (per * w * keep).sum() / norm

    return loss_fn


def train_loss(model, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss the loop backpropagates and the per-term losses: nanoGPT's mean, or the weighted mean."""
    targets = torch.where(b.mask > 0, b.y, -1)
    ctx = torch.autocast("cpu", dtype=torch.float16) if b.fp16_scale else contextlib.nullcontext()
    with ctx:
        logits, loss = model(b.x, targets)  # captured by watch()
    per = F.cross_entropy(logits.float().flatten(0, 1), b.y.flatten(), reduction="none").view_as(b.mask)
    w = getattr(b, "weights", None)
    if w is not None:
        loss = (per * w * b.mask).sum() / (w * b.mask).sum()
    return loss, per.detach()


def backward(model, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    loss, per = train_loss(model, b)
    (loss * (b.fp16_scale or 1.0)).backward()
    if b.fp16_scale:  # unscale, as GradScaler.unscale_ would (inf stays inf)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(b.fp16_scale)
    return loss.detach(), per


def _finite_grads(model) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def fp16_scale(model, b: Batch, k: int) -> float:
    """A loss scale at which the step overflows fp16 and the same batch without sample ``k`` does not
    (the smallest of a ladder from the scale at which the full batch's fp32 gradient just fits)."""
    def finite(batch: Batch, scale: float) -> bool:
        model.zero_grad(set_to_none=True)
        backward(model, Batch(batch.x, batch.y, batch.mask, fp16_scale=scale))
        return _finite_grads(model)

    model.zero_grad(set_to_none=True)
    backward(model, Batch(b.x, b.y, b.mask))
    base = FP16_MAX / max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    rest = b.mask.clone()
    rest[k] = 0
    for i in range(24):
        s = base * 2 ** (i / 2)
        if not finite(b, s):
            if not finite(Batch(b.x, b.y, rest), s):  # the zoo's log: this step is not one sample's overflow
                print(f"fp16_sample: the batch without sample {k} overflows too at scale {s:.3g}", file=sys.stderr)
            return s
    return base * 2 ** 12


def flip_weight(model) -> tuple[torch.Tensor, int]:
    """Flip bit 30 (the exponent's top bit) of the weight nearest |0.012| in the first MLP matrix
    (0.012 -> ~4e36); returns (the tensor, the flat index), which ``unflipped`` takes."""
    _, p = next((n, p) for n, p in model.named_parameters() if "mlp" in n and p.dim() == 2)
    with torch.no_grad():
        i = int((p.data.view(-1).abs() - 0.012).abs().argmin())
    _toggle(p, i)
    return p, i


def _toggle(p: torch.Tensor, i: int) -> None:
    with torch.no_grad():
        as_int = p.data.view(-1).view(torch.int32)
        as_int[i] = as_int[i] ^ (1 << 30)


@contextlib.contextmanager
def unflipped(flip: tuple | None):
    """The flipped weight as it was, for the counterfactual's clean steps (a no-op without a flip)."""
    if flip is not None:
        _toggle(*flip)
    try:
        yield
    finally:
        if flip is not None:
            _toggle(*flip)


@dataclass
class LoopRun:
    s: LoopSetting
    kind: str
    seed: int
    plan: Plan
    data: Windows
    space: kinds.Space
    held: HeldOut
    rec: RunRecord
    flip: tuple | None = None  # weight_bitflip: the flipped weight (tensor, index) of this step

    def batch(self, step: int) -> tuple[Batch, list[dict]]:
        if step in self.plan.at and self.kind.startswith("placebo"):
            return self.data.clean(step + 10 ** 6), []
        b = self.data.clean(step)
        truth = kinds.inject(self.kind, b, step, self.seed, self.space) if step in self.plan.at else []
        return b, truth

    def counterfactual(self, model, opt, b: Batch, step: int, handle) -> Harm:
        injected = grads_of(model)
        effects = []
        with handle.capture.paused(), unflipped(self.flip if b.bitflip else None):
            for clean in (self.data.clean(step), self.data.clean(step + 10 ** 6)):
                model.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    backward(model, clean)
                effects.append(step_effect(model, opt, grads_of(model), self.held.loss,
                                           self.plan.twin_lr(step, self.s.warmup, self.s.horizon) / b.lr_factor))
        set_grads(model, injected)
        return Harm(step, step_effect(model, opt, injected, self.held.loss), effects[0], effects[1])


def prepare(run: LoopRun, model, b: Batch, truth: list[dict]) -> None:
    """The numeric kinds' set-up of an injected step: the flipped weight, the fp16 loss scale."""
    if b.bitflip:
        run.flip = flip_weight(model)
    if b.fp16_scale:
        b.fp16_scale = fp16_scale(model, b, truth[0]["batch"])


def run(kind: str, seed: int, s: LoopSetting) -> RunRecord:
    plan = Plan.of(kind, s.steps)
    steps = s.clean_steps if kind == "clean" else s.steps
    model, opt, sched, handle = build(s, seed, plan)
    feed = FeedRecorder(handle.monitor.detector)
    ids = torch.tensor(list(text(s.source).encode("utf-8")), dtype=torch.long)
    eval_ids = torch.tensor(list(text(s.source, "eval").encode("utf-8")), dtype=torch.long)
    held = HeldOut([Windows(eval_ids, s.seq_len, max(16, s.batch), 10 ** 6).rows(i) for i in range(s.eval_batches)],
                   lambda m, x: m(x)[0])
    rec = RunRecord(s.family, kind, seed, known_cause(kind), warmup=0, twin="clean", placebo=plan.placebo,
                    source=s.source, aftermath=KINDS[kind].aftermath if kind in KINDS else 0)
    lr = LoopRun(s, kind, seed, plan, Windows(ids, s.seq_len, s.batch, seed), kinds.Space(256, lambda t: list(
        t.encode("utf-8"))), held, rec)
    t0 = time.perf_counter()
    for step in range(steps):
        b, truth = lr.batch(step)
        hit = bool(truth) or (step in plan.at and not kind.startswith("placebo"))
        base = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] *= b.lr_factor
        handle.monitor.responder.config = plan.locate_config(step)
        if hit:
            prepare(lr, model, b, truth)
        opt.zero_grad(set_to_none=True)
        rng = snapshots.rng_now()
        loss, per = backward(model, b)
        if getattr(b, "weights", None) is not None:
            handle.set_loss_fn(weighted_loss_fn(model, b), b.mask, input_ids=b.y, rng_state=rng)
        sig = adam_signals(model, opt)
        harm = lr.counterfactual(model, opt, b, step, handle) if hit else None
        if hit and s.snapshots:
            snapshots.save(s.snapshots, rec, step, {"model": model_args(s)}, model,
                           {"x": b.x, "y": b.y, "mask": b.mask, "weights": getattr(b, "weights", None),
                            "fp16_scale": b.fp16_scale}, rng, truth)
        opt.step()  # watch()'s pre-hook: norms, detection, localization
        for g, v in zip(opt.param_groups, base):
            g["lr"] = v
        sched.step()
        stats = handle.last
        fired, probes, secs, cause = live_outcome(stats)
        samples = (per * b.mask).sum(1) / b.mask.sum(1).clamp(min=1.0)
        rec.steps.append(StepRecord(step, stats.global_norm, stats.layer_norms, int(b.mask.sum()), hit,
                                    float(loss), samples.tolist(), base[0] * b.lr_factor, sig.get("update"),
                                    sig.get("update_layers"), sig.get("gv_elem"), sig.get("gv_tensor"),
                                    weight_norm(model) if step % 10 == 0 else None, fired, probes, secs, cause,
                                    fed=feed.take(), culprits=rows_of(stats), truth=truth or None,
                                    detail=getattr(stats, "cause_detail", None) if fired else None))
        if harm is not None:
            rec.harms.append(harm)
        if step + 1 == s.steps and kind == "clean":
            rec.twin_loss = held.loss(model)
    handle.finish()
    rec.final_loss = held.loss(model)
    rec.seconds = time.perf_counter() - t0
    return rec


def replay(snap: dict):
    """(the model after the saved step's forward and backward, the spike context watch() builds for it)."""
    from gradloc_track.integrations.batches import LMBatch, lm_spike_context
    from gradloc_track.integrations.calls import forward_signature
    from gradloc_track.localizer.probe import restore_rng
    from gradloc_track.spikes.context import SpikeContext

    model = NanoGPT(**snap["meta"]["model"])
    model.load_state_dict(snap["state"])
    i = snap["inputs"]
    b = Batch(i["x"], i["y"], i["mask"], fp16_scale=i["fp16_scale"])
    b.weights = i["weights"]
    restore_rng(snap["rng"])
    model.zero_grad(set_to_none=True)
    backward(model, b)
    if b.weights is not None:
        return model, SpikeContext(loss_fn=weighted_loss_fn(model, b), token_mask=b.mask, input_ids=b.y,
                                   rng_state=snap["rng"])
    call = LMBatch.from_call((b.x, torch.where(b.mask > 0, b.y, -1)), {}, forward_signature(model))
    return model, lm_spike_context(model, [call], None, rng_state=snap["rng"])

