"""The demo family: TinyGPT (4 layers, d=32) on the demo corpus in byte tokens, the library's
``GradMonitor`` in a plain loop (the detector armed with a spike context every step, the localizer
on at injected steps, no clipping; a non-finite step is skipped by the monitor's guard, as ``clip.on_nonfinite=skip``).

Batches of 8 windows of 64 bytes, per-sample loss averaging (SFT style; the packed scenario uses
a token mean over rows of 4 documents), AdamW lr 1e-3 with PyTorch's betas (0.9, 0.999), warm-up 20
then cosine over 2000 steps, so a scenario run of 280 steps is a prefix of the clean run until its
first injection. Each scenario changes some steps' batch (or learning rate, loss scale, gradient);
the clean twin is the same seed with nothing changed.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor
from gradloc_track.clip.simple import NoClip
from gradloc_track.config import LocateConfig, SpikeConfig
from gradloc_track.demo.data import ByteTokenizer, TextBatches, load_corpus
from gradloc_track.demo.inject import inject
from gradloc_track.demo.model import TinyGPT
from gradloc_track.localizer import save_rng
from gradloc_track.spikes import SpikeContext, SpikeDetector

from .measure import HeldOut, adam_signals, flip_bit, grads_of, set_grads, span_maxima, step_effect, weight_norm
from .record import FeedRecorder, Harm, RunRecord, StepRecord, live_outcome

FP16_MAX = 65504.0
JUNK = "â€™"  # the spike demo's mojibake answer
# clean text in scripts the corpus never shows: their byte rows of the embedding have never been updated
RARE_TEXTS = (
    "Η ενότητα επιτρέπει την ανάγνωση και την εγγραφή αρχείων σε μορφή που κατανοούν άλλα προγράμματα. ",
    "Модуль позволяет читать и записывать файлы в формате, который понимают другие программы. ",
    "تسمح هذه الوحدة بقراءة الملفات وكتابتها بتنسيق تفهمه البرامج الأخرى. ",
)
FULL_STEPS = 280
LAST_SPANS: dict[str, float] = {}  # the last training step's span maxima (train_step's side output)
LAST_JUNK: list = []  # the last training step's junk-span statistics (train_step's side output, the library's)
LAST_SAMPLES: list = []  # the last training step's per-sample losses as the library's helper gives them
_LOGITS: list = []  # per_term's last logits, as the loss saw them


@dataclass(frozen=True)
class Scenario:
    cause: str
    at: tuple[int, ...]
    loss: str = "sample"  # sample (per-sample mean, SFT) | token (token mean over the batch, packed rows)
    note: str = ""
    placebo: str = ""  # the run that swaps in other clean batches at the same steps (the harm's control)


EVERY_30 = (90, 120, 150, 180, 210, 240, 270)
THREE = (150, 200, 250)
MILD = tuple(range(70, 170, 10))
DUP = tuple(range(100, 180, 2))
LR = (120, 180, 240)
SCENARIOS = {
    "garbled_tokens": Scenario("data", EVERY_30, note="16 garbage bytes inside one sample", placebo="placebo_30"),
    "bad_document": Scenario("data", EVERY_30, note="one sample is 64 random high bytes", placebo="placebo_30"),
    "mild_3of8": Scenario("data", MILD, note="3 of 8 samples a prose prompt + a 3-token mojibake answer "
                          "(bench_surgery's corruption)", placebo="placebo_mild"),
    "duplicate_doc": Scenario("data", DUP, note="the same window as sample 0, 40 times", placebo="placebo_dup"),
    "packed_bad_doc": Scenario("data", EVERY_30, loss="token", note="rows of 4 packed documents; one is garbage",
                               placebo="placebo_30_packed"),
    "lr_jump": Scenario("schedule", LR, note="the learning rate x10 for one step", placebo="placebo_lr"),
    "unseen_script": Scenario("data", THREE, note="clean text in a script never seen (Greek, Russian, Arabic): "
                              "its loss is ~2x the batch's, and Adam's v is 0 on those embedding rows",
                              placebo="placebo_three"),
    "optimizer_reset": Scenario("optimizer", THREE, note="a clean batch; the optimizer's state is lost before the "
                                "step (a resume that loads the weights, not the optimizer): Adam's first step moves "
                                "every element by lr", placebo="placebo_three"),
    "nan_sample": Scenario("numeric", THREE, note="one position of one sample has every logit -inf (NaN loss)",
                           placebo="placebo_three"),
    "fp16_overflow": Scenario("numeric", THREE, note="the step under fp16 autocast with a loss scale 2x too "
                              "large: the summed gradients overflow", placebo="placebo_three"),
    "bitflip": Scenario("irreproducible", THREE, note="bit 30 of one gradient element flipped after backward",
                        placebo="placebo_three"),
}
# controls: other clean batches at the scenarios' steps (a clean step's effect on the final loss)
PLACEBOS = {"placebo_30": Scenario("placebo", EVERY_30), "placebo_30_packed": Scenario("placebo", EVERY_30, "token"),
            "placebo_mild": Scenario("placebo", MILD), "placebo_dup": Scenario("placebo", DUP),
            "placebo_lr": Scenario("placebo", LR), "placebo_three": Scenario("placebo", THREE)}
TWIN = {"sample": "clean", "token": "clean_packed"}


@dataclass
class DemoSetting:
    n_layer: int = 4
    d_model: int = 32
    n_head: int = 4
    seq_len: int = 64
    batch: int = 8
    steps: int = 280  # a scenario run
    clean_steps: int = 1500  # the clean run (the twin, and the false-event count)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.1
    warmup: int = 20
    horizon: int = 2000  # cosine decay horizon (the same for every run: runs share their prefix)
    eval_batches: int = 4
    scored_from: int = 50  # no trigger is scored before this step: every one warms up (ours 50, ZClip 25, OLMo 64)
    detector: dict = field(default_factory=dict)  # SpikeConfig overrides (defaults: none)

    @classmethod
    def quick(cls) -> "DemoSetting":
        return cls(steps=110, clean_steps=200, eval_batches=2)


@dataclass
class Batch:
    x: torch.Tensor  # (B, T) inputs
    y: torch.Tensor  # (B, T) targets
    mask: torch.Tensor  # (B, T) float loss mask
    docs: torch.Tensor | None = None  # (B, T) document id (packed rows)
    nan_rows: torch.Tensor | None = None  # (B, T) bool: positions whose logits are all -inf
    fp16_scale: float | None = None  # run the step under fp16 autocast with this loss scale
    lr_factor: float = 1.0
    bitflip: bool = False
    reset_state: bool = False  # the optimizer's state is lost before the step


class DemoData:
    """Deterministic batches of one seed, clean or injected."""

    def __init__(self, corpus: str, s: DemoSetting, seed: int) -> None:
        self.s, self.seed, self.tok = s, seed, ByteTokenizer()
        self.windows = TextBatches(corpus, s.seq_len, s.batch, seed, self.tok)
        self.docs = TextBatches(corpus, s.seq_len // 4, 4 * s.batch, seed + 7919, self.tok)
        g = torch.Generator().manual_seed(seed + 17)
        start = int(torch.randint(0, len(self.windows.data) - s.seq_len - 1, (1,), generator=g))
        self.duplicate = self.windows.data[start: start + s.seq_len + 1]  # (T+1,) the repeated window

    def clean(self, step: int, loss: str) -> Batch:
        if loss == "token":  # rows of 4 packed documents of T/4 bytes, each from its own place
            d = self.docs.batch(step).view(self.s.batch, 4, -1)  # (B, 4, T/4+1)
            x, y = d[..., :-1].reshape(self.s.batch, -1), d[..., 1:].reshape(self.s.batch, -1)
            docs = torch.arange(4).repeat_interleave(d.shape[-1] - 1).expand(self.s.batch, -1).clone()
            return Batch(x, y, torch.ones_like(x, dtype=torch.float32), docs)
        b = self.windows.batch(step)
        x, y = b[:, :-1].clone(), b[:, 1:].clone()
        return Batch(x, y, torch.ones_like(x, dtype=torch.float32))

    def garbage(self, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7 + step)
        return torch.randint(0x80, 0x100, (n,), generator=g)

    def injected(self, name: str, step: int, loss: str, index: int = 0) -> Batch:
        """The batch of ``step`` with scenario ``name``'s change (``index``: which injection of the run)."""
        b, T = self.clean(step, loss), self.s.seq_len
        k = (self.seed + step) % self.s.batch  # the sample that is hit
        if name.startswith("placebo"):
            return self.clean(step + 10 ** 6, loss)  # the counterfactual's swap batch: a clean step elsewhere
        if name == "garbled_tokens":
            inject("corrupt_span", b.x, b.y, b.mask, sample=k, span=T // 4, seed=self.seed * 131 + step)
        elif name == "bad_document":
            row = self.garbage(step, T + 1)
            b.x[k], b.y[k] = row[:-1], row[1:]
        elif name == "mild_3of8":
            for i in range(3):
                inject("garbled_span", b.x, b.y, b.mask, sample=self.s.batch - 1 - i, span=3,
                       junk_ids=self.tok.encode(JUNK))
        elif name == "duplicate_doc":
            b.x[0], b.y[0] = self.duplicate[:-1], self.duplicate[1:]
        elif name == "packed_bad_doc":
            n = T // 4
            row = self.garbage(step, n + 1)
            d = (step // 30) % 4
            b.x[k, d * n:(d + 1) * n], b.y[k, d * n:(d + 1) * n] = row[:-1], row[1:]
        elif name == "lr_jump":
            b.lr_factor = 10.0
        elif name == "unseen_script":
            text = RARE_TEXTS[index % len(RARE_TEXTS)]
            ids = torch.tensor(self.tok.encode(text * (2 + T // 40)))[: T + 1]
            b.x[k], b.y[k] = ids[:-1], ids[1:]
        elif name == "nan_sample":
            b.nan_rows = torch.zeros_like(b.mask, dtype=torch.bool)
            b.nan_rows[k, T // 2] = True
        elif name == "fp16_overflow":
            b.fp16_scale = 1.0  # set from the step's own gradient by run()
        elif name == "bitflip":
            b.bitflip = True
        elif name == "optimizer_reset":
            b.reset_state = True
        return b


def per_term(model: torch.nn.Module, b: Batch, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of each kept term (a vector) and the (B*T,) bool of kept positions. Only kept positions
    enter (a NaN row outside the mask stays out of the probe's gradient)."""
    ctx = torch.autocast("cpu", dtype=torch.float16) if b.fp16_scale else contextlib.nullcontext()
    with ctx:
        logits = model(b.x)  # (B, T, V)
    logits = logits.float()
    if b.nan_rows is not None:  # an additive vocabulary mask that allows nothing there: log_softmax is NaN
        logits = logits + torch.where(b.nan_rows, float("-inf"), 0.0)[..., None]
    _LOGITS[:] = [logits.detach()]
    sel = keep.flatten() > 0
    return F.cross_entropy(logits.flatten(0, 1)[sel], b.y.flatten()[sel], reduction="none"), sel


def term_weights(b: Batch, loss: str) -> torch.Tensor:
    """(B, T) the fixed weight of each term: per-sample mean or token mean, counted from the full mask."""
    if loss == "token":
        return b.mask / b.mask.sum().clamp(min=1.0)
    return b.mask / b.mask.sum(1, keepdim=True).clamp(min=1.0) / b.mask.shape[0]


def make_loss_fn(model: torch.nn.Module, b: Batch, weights: torch.Tensor):
    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        per, sel = per_term(model, b, keep)
        return (per * (weights * keep).flatten()[sel]).sum() * (b.fp16_scale or 1.0)

    return loss_fn


def build(s: DemoSetting, seed: int):
    torch.manual_seed(seed)
    model = TinyGPT(256, s.n_layer, s.n_head, s.d_model, s.seq_len)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=s.lr, betas=s.betas)

    def factor(t: int) -> float:
        warm = min(1.0, (t + 1) / s.warmup)
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t / s.horizon))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    detector = SpikeDetector(SpikeConfig(**s.detector))
    monitor = GradMonitor(model, clipper=NoClip(model), optimizer=opt, detector=detector,
                          locate_config=LocateConfig(max_events=10 ** 6), log_every=10 ** 9)
    return model, opt, sched, monitor


def localize_if(hit: bool) -> LocateConfig:
    """The localizer runs on events at injected steps only (the probes column): it changes nothing in
    training (gradients, RNG and buffers are restored), and elsewhere it would only cost the zoo time."""
    return LocateConfig(enabled=hit, max_events=10 ** 6)


def heldout_rows(corpus: str, s: DemoSetting) -> HeldOut:
    rows = [TextBatches(corpus, s.seq_len, 16, 10 ** 6).batch(i) for i in range(s.eval_batches)]
    return HeldOut(rows, lambda m, x: m(x))


def _monitor_kwargs(monitor: GradMonitor, loss: torch.Tensor, sample_losses: torch.Tensor) -> dict:
    """The step's losses for a monitor that takes them (the library after issue 26); none before."""
    params = inspect.signature(monitor.after_backward).parameters
    out = {}
    if "loss" in params:
        out["loss"] = loss.detach()
    if "sample_losses" in params:  # the library's helper where it has one (the loop a user writes)
        out["sample_losses"] = LAST_SAMPLES[0] if LAST_SAMPLES else sample_losses.detach()
    if "junk_span" in params and LAST_JUNK:
        out["junk_span"] = LAST_JUNK[0]
    return out


def train_step(model, b: Batch, loss: str):
    """Forward and backward of the training step; returns (loss, each sample's mean loss: (B,), or each
    document's for packed rows)."""
    weights = term_weights(b, loss)
    per, sel = per_term(model, b, b.mask)
    total = (per * weights.flatten()[sel]).sum()
    (total * (b.fp16_scale or 1.0)).backward()
    if b.fp16_scale:  # unscale, as GradScaler.unscale_ would (inf stays inf)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(b.fp16_scale)
    full = torch.zeros(sel.numel()).masked_scatter(sel, per.detach()).view_as(b.mask) * b.mask  # (B, T)
    LAST_SPANS.clear()
    LAST_SPANS.update(span_maxima(full, b.mask > 0, b.docs))
    LAST_JUNK[:] = _junk(b)
    LAST_SAMPLES[:] = _library_samples(b, full)
    return total.detach(), unit_means(b, full)


def _junk(b: Batch) -> list:
    """The library's junk-span statistics of the training forward (none before the library had them)."""
    try:
        from gradloc_track.spikes.junk import junk_span
    except ImportError:
        return []
    targets = torch.where(b.mask > 0, b.y, -100)
    return [junk_span(_LOGITS[0], targets, b.x, b.docs)]


def _library_samples(b: Batch, per: torch.Tensor) -> list:
    """Each sample's loss by the library's rule (``spikes.sample_loss``; none before it had one)."""
    try:
        from gradloc_track.spikes.sample_loss import sample_losses
    except ImportError:
        return []
    return [sample_losses(per, b.mask, b.x, b.y)]


def unit_index(b: Batch) -> tuple[torch.Tensor, int]:
    """(B, T) the unit each position belongs to, and the number of units: the sample (its row), or for
    packed rows the document (the unit a packed pipeline knows from its boundaries), row-major."""
    B, T = b.mask.shape
    if b.docs is None:
        return torch.arange(B)[:, None].expand(B, T), B
    per_row = int(b.docs.max()) + 1
    return b.docs + torch.arange(B)[:, None] * per_row, B * per_row


def unit_means(b: Batch, per: torch.Tensor) -> torch.Tensor:
    """Each unit's mean of ``per`` (B, T) over its loss terms (``unit_index``'s order)."""
    key, n = unit_index(b)
    sums = torch.zeros(n).index_add_(0, key.flatten(), (per * b.mask).flatten())
    return sums / torch.zeros(n).index_add_(0, key.flatten(), b.mask.flatten()).clamp(min=1.0)


def drop_state(opt) -> dict:
    """``optimizer_reset``: take every tensor's optimizer state out (the step creates it afresh, as after
    a resume without the optimizer's state); returns it for the counterfactual's clean steps."""
    saved = dict(opt.state)
    opt.state.clear()
    return saved


def counterfactual(model, opt, b: Batch, clean: Batch, swap: Batch, loss: str, held: HeldOut, step: int,
                   reset: dict | None = None) -> Harm:
    """The injected step's harm: held-out loss after it, after the clean twin's step and after a step on
    another clean batch, each from the same state (the gradient of the injected step is restored; the
    clean steps keep the optimizer state an ``optimizer_reset`` step dropped)."""
    injected = grads_of(model)
    if reset is not None:
        opt.state.update(reset)
    effects = []
    for batch in (clean, swap):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            train_step(model, batch, loss)
        effects.append(step_effect(model, opt, grads_of(model), held.loss))
    if reset is not None:
        opt.state.clear()
    set_grads(model, injected)
    hurt = step_effect(model, opt, injected, held.loss, lr_factor=b.lr_factor)
    return Harm(step, hurt, effects[0], effects[1])


def run(scenario: str, seed: int, s: DemoSetting, corpus: str, held: HeldOut) -> RunRecord:
    """One run: ``scenario`` (or a clean twin, ``clean`` / ``clean_packed``)."""
    sc = SCENARIOS.get(scenario) or PLACEBOS.get(scenario)
    loss = sc.loss if sc else ("token" if scenario == "clean_packed" else "sample")
    steps = {"clean": s.clean_steps, "calibration": s.clean_steps // 2}.get(scenario, s.steps)
    model, opt, sched, monitor = build(s, seed)
    feed = FeedRecorder(monitor.detector)
    data = DemoData(corpus, s, seed)
    rec = RunRecord("demo", scenario, seed, sc.cause if sc else "none", warmup=s.scored_from,
                    twin=TWIN[loss], placebo=sc.placebo if sc else "")
    t0 = time.perf_counter()
    at = injection_steps(sc, s) if sc else []
    for step in range(steps):
        hit = step in at
        control = sc is not None and sc.cause == "placebo"  # a placebo's swapped batches are clean steps
        b = data.injected(scenario, step, loss, at.index(step)) if hit else data.clean(step, loss)
        if b.lr_factor != 1.0:
            for g in opt.param_groups:
                g["lr"] *= b.lr_factor
        monitor.responder.config = localize_if(hit and not control)
        if b.fp16_scale:  # a loss scale 2x what this step's largest fp32 gradient allows in fp16
            opt.zero_grad(set_to_none=True)
            train_step(model, Batch(b.x, b.y, b.mask, b.docs), loss)
            b.fp16_scale = 2 * FP16_MAX / max(float(p.grad.abs().max()) for p in model.parameters()
                                              if p.grad is not None)
        opt.zero_grad(set_to_none=True)
        rng = save_rng()  # right before the forward: probes replay it
        total, samples = train_step(model, b, loss)
        if b.bitflip:
            flip_bit(model, "h.0.mlp.fc.weight")
        reset = drop_state(opt) if b.reset_state else None
        sig = adam_signals(model, opt)
        ctx = SpikeContext(make_loss_fn(model, b, term_weights(b, loss)), b.mask, input_ids=b.y,
                           tokenizer=data.tok, rng_state=rng, document_ids=b.docs)
        stats = monitor.after_backward(step, spike_context=ctx, **_monitor_kwargs(monitor, total, samples))
        fired, probes, secs, cause = live_outcome(stats)
        rec.steps.append(StepRecord(step, stats.global_norm, stats.layer_norms, int(b.mask.sum()), hit and not control,
                                    float(total), [float(v) for v in samples], opt.param_groups[0]["lr"],
                                    sig.get("update"), sig.get("update_layers"), sig.get("gv_elem"),
                                    sig.get("gv_tensor"), weight_norm(model) if step % 10 == 0 else None,
                                    fired, probes, secs, cause, fed=feed.take(), span_max=dict(LAST_SPANS)))
        if hit and not control:
            rec.harms.append(counterfactual(model, opt, b, data.clean(step, loss), data.clean(step + 10 ** 6, loss),
                                            loss, held, step, reset))
        opt.step()  # a non-finite step is skipped by the monitor's guard
        sched.step()
        if step + 1 == s.steps and not sc:
            rec.twin_loss = held.loss(model)  # the clean twin at the scenario runs' end
    rec.final_loss = held.loss(model)
    rec.seconds = time.perf_counter() - t0
    return rec


def jobs(s: DemoSetting, seeds: list[int], scenarios: list[str] | None = None) -> list[tuple[str, int]]:
    """(scenario, seed) of every run: the scenarios, their placebos and clean twins, GradLoc's calibration."""
    names = scenarios or list(SCENARIOS)
    controls = sorted({SCENARIOS[n].placebo for n in names} - {""})
    twins = sorted({TWIN[SCENARIOS[n].loss] for n in names})
    return [(n, seed) for seed in seeds for n in names + controls + twins] + [("calibration", 1000)]


def injection_steps(sc: Scenario, s: DemoSetting) -> list[int]:
    """The scenario's steps, mapped into a shorter run (``--quick``) after the detector's warm-up."""
    if s.steps >= FULL_STEPS:
        return list(sc.at)
    lo, hi = s.scored_from + 10, s.steps - 5
    return sorted({lo + round((t - 70) * (hi - lo) / (FULL_STEPS - 70)) for t in sc.at})


def setting(quick: bool) -> DemoSetting:
    return DemoSetting.quick() if quick else DemoSetting()


def context(s: DemoSetting) -> tuple:
    corpus = load_corpus()
    return corpus, heldout_rows(corpus, s)
