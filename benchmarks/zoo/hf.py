"""The HF family: a random-init GPT-2 (4 layers, d=32, tied embeddings, byte vocabulary) trained by a
real ``transformers.Trainer`` with ``GradLocCallback`` (its defaults: it takes over Trainer's
``max_grad_norm=1.0`` clipping, the detector armed, the localizer on).

The batches are the demo family's (``DemoData``: the same windows, the same injections) served in
order (``train_sampling_strategy="sequential"``), the loss is Trainer's own (a token mean over the
batch, ``num_items_in_batch``), AdamW (0.9, 0.999) lr 1e-3, warm-up 20 and cosine over 2000 steps
(the learning-rate jump is part of that schedule). Three zoo callbacks around ``GradLocCallback``:
one that corrupts the gradient before it (the bit flip), one after it that records the step (what
the monitor saw, the losses from the training forward, the update Adam is about to make) and
measures the harm of an injected step (the counterfactual steps run on a copy of the model).
fp16 is left out: Trainer's fp16 needs CUDA.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gradloc_track.integrations.step_losses import document_index

from .demo import PLACEBOS as DEMO_PLACEBOS
from .demo import SCENARIOS as DEMO_SCENARIOS
from .demo import Batch, DemoData, DemoSetting, Scenario, drop_state, injection_steps, localize_if
from .measure import (HeldOut, adam_signals, flip_bit, grads_of, inner_optimizer, set_grads, span_maxima, step_effect,
                      weight_norm)
from .record import FeedRecorder, Harm, RunRecord, StepRecord, live_outcome

SCENARIOS: dict[str, Scenario] = {k: Scenario(v.cause, v.at, "token" if v.loss == "token" else "hf", v.note,
                                           v.placebo) for k, v in DEMO_SCENARIOS.items() if k != "fp16_overflow"}
PLACEBOS = {k: Scenario(v.cause, v.at, "token" if v.loss == "token" else "hf") for k, v in DEMO_PLACEBOS.items()}
TWIN = {"hf": "clean", "token": "clean_packed"}
CLIP = 1.0  # Trainer's default max_grad_norm, applied by the callback


@dataclass
class HFSetting(DemoSetting):
    detector: dict = field(default_factory=dict)

    @classmethod
    def quick(cls) -> "HFSetting":
        return cls(steps=110, clean_steps=200)


def setting(quick: bool) -> HFSetting:
    return HFSetting.quick() if quick else HFSetting()


def gpt2(s: HFSetting, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=s.seq_len + 1, n_embd=s.d_model, n_layer=s.n_layer,
                                      n_head=s.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0))


def context(s: HFSetting) -> tuple:
    from gradloc_track.demo.data import TextBatches, load_corpus

    corpus = load_corpus()
    rows = [TextBatches(corpus, s.seq_len, 16, 10 ** 6).batch(i) for i in range(s.eval_batches)]
    return corpus, HeldOut(rows, lambda m, x: m(input_ids=x).logits)


def hf_item(b: Batch, i: int) -> dict:
    """Sample ``i`` of a batch as Trainer's inputs: ids (T+1), labels (-100: no term), packed position ids."""
    ids = torch.cat([b.x[i], b.y[i, -1:]])
    labels = torch.full_like(ids, -100)
    labels[1:] = torch.where(b.mask[i] > 0, b.y[i], -100)
    item = {"input_ids": ids, "labels": labels}
    if b.docs is not None:  # position ids restart at each packed document
        d = torch.cat([b.docs[i], b.docs[i, -1:]])
        start = torch.cat([torch.ones(1, dtype=torch.bool), d[1:] != d[:-1]])
        idx = torch.arange(len(d))
        item["position_ids"] = idx - torch.cummax(torch.where(start, idx, 0), 0).values
    return item


class ZooData(torch.utils.data.Dataset):
    """Item ``i`` = sample ``i % B`` of the batch of Trainer's step ``i // B + 1`` (clean or injected):
    the run's step numbers are Trainer's (the callback logs under them), the data's too."""

    def __init__(self, data: DemoData, s: HFSetting, scenario: str, loss: str, at: list[int], steps: int) -> None:
        self.data, self.s, self.scenario, self.loss, self.at, self.steps = data, s, scenario, loss, at, steps
        self._cache: dict[int, Batch] = {}

    def batch(self, step: int) -> Batch:
        if step not in self._cache:
            mode = "token" if self.loss == "token" else "sample"
            self._cache = {step: self.data.injected(self.scenario, step, mode, self.at.index(step))
                           if step in self.at else self.data.clean(step, mode)}
        return self._cache[step]

    def __len__(self) -> int:
        return self.steps * self.s.batch

    def __getitem__(self, i: int) -> dict:
        return hf_item(self.batch(i // self.s.batch + 1), i % self.s.batch)


def collate(items: list[dict]) -> dict:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


def make_callbacks(run: "HFRun"):
    base = _trainer_callback_base()

    class Corrupt(base):
        """Before GradLocCallback: what happens to the gradient on the way (a flipped bit)."""

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            step = state.global_step + 1
            run.reset = None
            if step in run.at and run.scenario == "bitflip":
                flip_bit(model, "h.0.mlp.c_fc.weight")
            if step in run.at and run.scenario == "optimizer_reset":
                run.reset = drop_state(inner_optimizer(optimizer))

    class Record(base):
        """After GradLocCallback: the step's record and, on an injected step, its harm."""

        def on_train_begin(self, args, state, control, **kw):  # after GradLocCallback built its handle
            run.feed = FeedRecorder(run.handle_of.handle.monitor.detector)

        def on_step_begin(self, args, state, control, **kw):
            run.step = state.global_step + 1
            run.fresh = True
            run.nan_active = run.scenario == "nan_sample" and run.step in run.at
            run.handle_of.handle.monitor.responder.config = localize_if(run.step in run.at
                                                                        and not run.scenario.startswith("placebo"))

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            run.record_step(model, optimizer)

    return Corrupt(), Record()


@dataclass
class HFRun:
    scenario: str
    seed: int
    s: HFSetting
    data: DemoData
    held: HeldOut
    at: list[int]
    loss_mode: str
    handle_of: object = None  # the GradLocCallback
    step: int = 0
    fresh: bool = False  # the next training forward is this step's (not a probe's)
    nan_active: bool = False
    dataset: ZooData | None = None
    rec: RunRecord | None = None
    last_loss: float | None = None
    last_samples: list[float] | None = None
    last_spans: dict | None = None
    reset: dict | None = None  # optimizer_reset: the optimizer state dropped this step
    feed: FeedRecorder | None = None

    def forward_hook(self, module, args, kwargs, out) -> None:
        """The training forward's loss and per-sample losses (the zoo's own measurement)."""
        if not (self.fresh and module.training and torch.is_grad_enabled()):
            return
        self.fresh = False
        labels = kwargs.get("labels")
        with torch.no_grad():
            lg = out.logits[:, :-1].float()
            tgt = labels[:, 1:]
            per = F.cross_entropy(lg.flatten(0, 1), tgt.flatten().clamp(min=0), reduction="none").view_as(tgt)
            valid = (tgt != -100).float()
            per = torch.where(valid > 0, per, 0.0)
            self.last_samples = ((per.sum(1) / valid.sum(1).clamp(min=1.0)).tolist())
            pos = kwargs.get("position_ids")
            docs = None if pos is None else document_index(pos[:, 1:], tgt.shape)
            self.last_spans = span_maxima(per, valid > 0, docs)
            self.last_loss = float(per.sum() / valid.sum().clamp(min=1.0))

    def nan_hook(self, module, args, out):
        """An additive vocabulary mask that allows nothing at one position of one sample (training only)."""
        if not (self.nan_active and module.training):
            return None
        b = self.dataset.batch(self.step)
        if b.nan_rows is None:
            return None
        rows = torch.cat([b.nan_rows, b.nan_rows[:, -1:] & False], 1)  # (B, T+1)
        return out + torch.where(rows, float("-inf"), 0.0)[..., None]

    def record_step(self, model, optimizer) -> None:
        stats = self.handle_of.handle.last
        b = self.dataset.batch(self.step)
        sig = adam_signals(model, optimizer)
        fired, probes, secs, cause = live_outcome(stats)
        hit = self.step in self.at and not self.scenario.startswith("placebo")
        self.rec.steps.append(StepRecord(
            self.step, stats.global_norm, stats.layer_norms, int(b.mask.sum()), hit, self.last_loss,
            self.last_samples, float(optimizer.param_groups[0]["lr"]), sig.get("update"), sig.get("update_layers"),
            sig.get("gv_elem"), sig.get("gv_tensor"), weight_norm(model) if self.step % 10 == 0 else None,
            fired, probes, secs, cause, fed=self.feed.take(), span_max=self.last_spans))
        if hit:
            self.rec.harms.append(self.counterfactual(model, optimizer, b))

    def _grads_on(self, model, b: Batch) -> list:
        items = collate([hf_item(b, i) for i in range(b.x.shape[0])])
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            n = (items["labels"][:, 1:] != -100).sum()
            model(**items, num_items_in_batch=n).loss.backward()
        return grads_of(model)

    def counterfactual(self, model, optimizer, b: Batch) -> Harm:
        injected = grads_of(model)
        nan, self.nan_active = self.nan_active, False
        mode = "token" if self.loss_mode == "token" else "sample"
        base = 1.0 / b.lr_factor  # the optimizer's lr is the injected step's: the twin's is lr / factor
        opt = inner_optimizer(optimizer)
        if self.reset is not None:  # the clean steps keep the state the injected step lost
            opt.state.update(self.reset)
        effects = [step_effect(model, optimizer, self._grads_on(model, clean), self.held.loss, base, clip=CLIP)
                   for clean in (self.data.clean(self.step, mode), self.data.clean(self.step + 10 ** 6, mode))]
        if self.reset is not None:
            opt.state.clear()
        set_grads(model, injected)
        self.nan_active = nan
        hurt = step_effect(model, optimizer, injected, self.held.loss)  # already clipped by the callback
        return Harm(self.step, hurt, effects[0], effects[1])


def run(scenario: str, seed: int, s: HFSetting, corpus: str, held: HeldOut) -> RunRecord:
    from transformers import Trainer, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback

    sc = SCENARIOS.get(scenario) or PLACEBOS.get(scenario)
    loss_mode = sc.loss if sc else ("token" if scenario == "clean_packed" else "hf")
    steps = {"clean": s.clean_steps, "calibration": s.clean_steps // 2}.get(scenario, s.steps)
    at = injection_steps(sc, s) if sc else []
    model = gpt2(s, seed)
    jumps = set(at) if scenario == "lr_jump" else set()

    def factor(t: int) -> float:  # LambdaLR's t = optimizer steps taken: step t+1 of Trainer's count
        warm = min(1.0, (t + 1) / s.warmup)
        cos = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t / s.horizon)))
        return warm * cos * (10.0 if t + 1 in jumps else 1.0)

    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=s.betas, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    data = DemoData(corpus, s, seed)
    hr = HFRun(scenario, seed, s, data, held, at, loss_mode)
    hr.dataset = ZooData(data, s, scenario, loss_mode, at, steps)
    hr.rec = RunRecord("hf", scenario, seed, sc.cause if sc else "none", warmup=s.scored_from,
                       twin=TWIN[loss_mode], placebo=sc.placebo if sc else "")
    gl = GradLocCallback(tracker="none", spikes=dict(s.detector), locate={"max_events": 10 ** 6}, log_every=10 ** 9)
    hr.handle_of = gl
    corrupt, record = make_callbacks(hr)
    model.register_forward_hook(hr.forward_hook, with_kwargs=True)
    model.lm_head.register_forward_hook(hr.nan_hook)
    args = TrainingArguments(output_dir="/tmp/gradloc-zoo-hf", per_device_train_batch_size=s.batch, max_steps=steps,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             logging_strategy="no", train_sampling_strategy="sequential", seed=seed,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=hr.dataset, data_collator=collate,
                      optimizers=(opt, sched), callbacks=[corrupt, gl, record])
    t0 = time.perf_counter()
    twin_at = s.steps

    class TwinEval(_trainer_callback_base()):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == twin_at and not sc:
                hr.rec.twin_loss = held.loss(model)

    trainer.add_callback(TwinEval())
    trainer.train()
    hr.rec.final_loss = held.loss(model)
    hr.rec.seconds = time.perf_counter() - t0
    return hr.rec


def jobs(s: HFSetting, seeds: list[int], scenarios: list[str] | None = None) -> list[tuple[str, int]]:
    names = [n for n in (scenarios or list(SCENARIOS)) if n in SCENARIOS]
    controls = sorted({SCENARIOS[n].placebo for n in names} - {""})
    twins = sorted({TWIN[SCENARIOS[n].loss] for n in names})
    return [(n, seed) for seed in seeds for n in names + controls + twins] + [("calibration", 1000)]
