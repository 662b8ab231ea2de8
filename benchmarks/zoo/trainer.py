"""The ``llama``, ``gpt2``, ``qwen2`` and ``packed`` families: a random-init causal LM in a real
``transformers.Trainer`` with the default front door ``GradLocCallback()`` (it takes over Trainer's
``max_grad_norm=1.0`` clipping; the detector's defaults; the localizer on at injected steps and
the 10 after them), on a 2048-token byte-level BPE trained on the run's source (``sources.ByteBpe``).

Tiny configs: Llama and Qwen2 with 2 layers, d=64, 4 heads (2 key/value heads), GPT-2 with 2
layers, d=64, 4 heads and its default dropout 0.1 on. Batches of 8 rows of 128 tokens (windows of
the source, or one chat conversation per row with the prompt masked); ``packed``: Llama on 2 rows
of 1024 tokens packing whole documents (position ids restart at each, as a packing collator's).
Trainer's AdamW (0.9, 0.999) at lr 1e-3 with the zoo's schedule (``schedule.lr_factor``) through
``optimizers=``, Trainer's own token-mean loss. Trainer's step numbers (from 1) are the run's.
Three zoo callbacks around ``GradLocCallback``: one before it (the flipped weight, before the
forward), one after it that records the step and measures the harm of an injected step on copies
of the model (the capture paused, so those forwards are no step's batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kinds, snapshots
from .culprits import rows_of
from .demo import Batch
from .hf import collate, hf_item
from .loop import flip_weight, unflipped
from .measure import HeldOut, adam_signals, grads_of, set_grads, step_effect, weight_norm
from .record import FeedRecorder, Harm, RunRecord, StepRecord, live_outcome
from .schedule import Plan, horizon, lr_factor
from .sources import IM_START, ByteBpe, documents
from .split import KINDS, known_cause
from .streams import ChatRows, PackedRows, Windows

CLIP = 1.0  # Trainer's default max_grad_norm, applied by the callback


@dataclass
class TrainerSetting:
    family: str = "llama"
    source: str = "pydoc"
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    seq_len: int = 128
    batch: int = 8
    steps: int = 300
    clean_steps: int = 600
    lr: float = 1e-3
    warmup: int = 20
    horizon: int = 250
    eval_rows: int = 16
    detector: dict = field(default_factory=dict)
    snapshots: str = ""

    @classmethod
    def of(cls, family: str, source: str, quick: bool) -> "TrainerSetting":
        shape = {"seq_len": 1024, "batch": 2, "eval_rows": 4, "steps": 240, "clean_steps": 400} \
            if family == "packed" else {}
        length = {"steps": 160, "clean_steps": 240} if quick else {}
        s = cls(family=family, source=source, **{**shape, **length})
        s.horizon = horizon(s.steps)
        return s


def model_config(s: TrainerSetting, vocab: int, pad: int):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = {"vocab_size": vocab, "bos_token_id": pad, "eos_token_id": pad, "pad_token_id": pad}
    if s.family == "gpt2":  # its defaults: dropout 0.1 in residual, embedding and attention
        return GPT2Config(n_embd=s.d_model, n_layer=s.n_layer, n_head=s.n_head, n_positions=s.seq_len + 1, **common)
    cls = Qwen2Config if s.family == "qwen2" else LlamaConfig
    return cls(hidden_size=s.d_model, intermediate_size=172, num_hidden_layers=s.n_layer,
               num_attention_heads=s.n_head, num_key_value_heads=2, max_position_embeddings=s.seq_len + 1, **common)


def build_model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


@dataclass
class Data:
    """The run's batches (clean or injected), its tokenizer and held-out rows."""

    stream: object
    tok: ByteBpe
    held: HeldOut
    space: kinds.Space


def make_data(s: TrainerSetting, seed: int) -> Data:
    src = "chat" if s.source == "chat" else s.source
    tok = ByteBpe.train_or_load(src)
    space = kinds.Space(tok.vocab_size, tok.encode, low=3)  # the three specials are never junk

    def logits(m, x):
        return m(input_ids=x).logits

    if s.source == "chat":
        convs = [tuple(tok.encode(p) for p in _split_turn(d)) for d in documents("chat")]
        stream = ChatRows(convs, s.seq_len, s.batch, seed, tok.pad_id)
        held = [ChatRows([tuple(tok.encode(p) for p in _split_turn(d)) for d in documents("chat", "eval")],
                         s.seq_len, s.eval_rows, 10 ** 6, tok.pad_id)]
        rows = [torch.cat([b.x, b.y[:, -1:]], 1) for b in (held[0].clean(0), held[0].clean(1))]
        return Data(stream, tok, HeldOut(rows, logits), space)
    if s.family == "packed":
        docs = [torch.tensor(tok.encode(d)) for d in documents(s.source)]
        stream = PackedRows(docs, s.seq_len, s.batch, seed)
        eval_len = 256
    else:
        stream = Windows(torch.tensor(tok.encode("\n\n".join(documents(s.source)))), s.seq_len, s.batch, seed)
        eval_len = s.seq_len
    eval_ids = torch.tensor(tok.encode("\n\n".join(documents(s.source, "eval"))))
    held = Windows(eval_ids, eval_len, s.eval_rows, 10 ** 6)
    return Data(stream, tok, HeldOut([held.rows(0), held.rows(1)], logits), space)


def _split_turn(doc: str) -> tuple[str, str]:
    """A chat document back into (prompt, answer) (``sources.chat_turn``'s parts)."""
    marker = f"{IM_START}assistant\n"
    head, _, answer = doc.partition(marker)
    return head + marker, answer


class ZooData(torch.utils.data.Dataset):
    """Item ``i`` = row ``i % B`` of the batch of Trainer's step ``i // B + 1`` (clean or injected)."""

    def __init__(self, run: "TrainerRun", steps: int) -> None:
        self.run, self.steps = run, steps
        self._cache: dict[int, tuple[Batch, list[dict]]] = {}

    def batch(self, step: int) -> tuple[Batch, list[dict]]:
        if step not in self._cache:
            self._cache = {step: self.run.make_batch(step)}
        return self._cache[step]

    def __len__(self) -> int:
        return self.steps * self.run.s.batch

    def __getitem__(self, i: int) -> dict:
        return hf_item(self.batch(i // self.run.s.batch + 1)[0], i % self.run.s.batch)


@dataclass
class TrainerRun:
    kind: str
    seed: int
    s: TrainerSetting
    plan: Plan
    data: Data
    rec: RunRecord
    gl: object = None  # the GradLocCallback
    dataset: ZooData | None = None
    step: int = 0
    fresh: bool = False
    last: dict = field(default_factory=dict)  # the training forward's loss and per-sample losses
    taken: tuple = ((), None)  # the capture's last (batches, rng)
    feed: object = None  # the FeedRecorder on the callback's detector
    flip: tuple | None = None  # weight_bitflip: the flipped weight (tensor, index)

    def make_batch(self, step: int) -> tuple[Batch, list[dict]]:
        if step in self.plan.at and self.kind.startswith("placebo"):
            return self.data.stream.clean(step + 10 ** 6), []
        b = self.data.stream.clean(step)
        truth = kinds.inject(self.kind, b, step, self.seed, self.data.space) if step in self.plan.at else []
        return b, truth

    def hit(self, step: int) -> bool:
        return step in self.plan.at and not self.kind.startswith("placebo")

    def forward_hook(self, module, args, kwargs, out) -> None:
        if not (self.fresh and module.training and torch.is_grad_enabled()):
            return
        self.fresh = False
        with torch.no_grad():
            tgt = kwargs["labels"][:, 1:]
            lg = out.logits[:, :-1].float()
            per = F.cross_entropy(lg.flatten(0, 1), tgt.flatten().clamp(min=0), reduction="none").view_as(tgt)
            valid = (tgt != -100).float()
            per = per * valid
            self.last = {"loss": float(per.sum() / valid.sum().clamp(min=1.0)),
                         "samples": (per.sum(1) / valid.sum(1).clamp(min=1.0)).tolist()}

    def grads_on(self, model, b: Batch) -> list:
        items = collate([hf_item(b, i) for i in range(b.x.shape[0])])
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            n = (items["labels"][:, 1:] != -100).sum()
            model(**items, num_items_in_batch=n).loss.backward()
        return grads_of(model)

    def counterfactual(self, model, optimizer, b: Batch) -> Harm:
        injected = grads_of(model)
        with self.gl.handle.capture.paused(), unflipped(self.flip if b.bitflip else None):
            effects = [step_effect(model, optimizer, self.grads_on(model, c), self.data.held.loss,
                                   self.plan.twin_lr(self.step - 1, self.s.warmup, self.s.horizon, 1) / b.lr_factor,
                                   clip=CLIP)
                       for c in (self.data.stream.clean(self.step), self.data.stream.clean(self.step + 10 ** 6))]
        set_grads(model, injected)
        hurt = step_effect(model, optimizer, injected, self.data.held.loss)  # already clipped by the callback
        return Harm(self.step, hurt, effects[0], effects[1])

    def record(self, model, optimizer) -> None:
        stats = self.gl.handle.last
        b, truth = self.dataset.batch(self.step)
        sig = adam_signals(model, optimizer)
        fired, probes, secs, cause = live_outcome(stats)
        hit = self.hit(self.step)
        self.rec.steps.append(StepRecord(
            self.step, stats.global_norm, stats.layer_norms, int(b.mask.sum()), hit, self.last.get("loss"),
            self.last.get("samples"), float(optimizer.param_groups[0]["lr"]), sig.get("update"),
            sig.get("update_layers"), sig.get("gv_elem"), sig.get("gv_tensor"),
            weight_norm(model) if self.step % 10 == 0 else None, fired, probes, secs, cause, fed=self.feed.take(),
            culprits=rows_of(stats), truth=truth or None,
            detail=getattr(stats, "cause_detail", None) if fired else None))
        if hit:
            self.rec.harms.append(self.counterfactual(model, optimizer, b))

    def snapshot(self, model) -> None:
        batches, rng = self.taken
        if not (self.hit(self.step) and self.s.snapshots and batches):
            return
        call = batches[0]
        inputs = {"input_ids": call.input_ids, "labels": call.labels, "position_ids": call.position_ids,
                  "num_items": call.num_items}
        snapshots.save(self.s.snapshots, self.rec, self.step, {"config": model.config.to_dict()}, model, inputs,
                       rng[0], self.dataset.batch(self.step)[1])


def make_callbacks(run: TrainerRun):
    from transformers import TrainerCallback

    class Corrupt(TrainerCallback):
        """Before GradLocCallback and before the forward: the flipped weight."""

        def on_step_begin(self, args, state, control, model=None, **kw):
            step = state.global_step + 1
            if run.hit(step) and run.dataset.batch(step)[0].bitflip:
                run.flip = flip_weight(model)

    class Record(TrainerCallback):
        """After GradLocCallback: the step's record and, on an injected step, its harm."""

        def on_train_begin(self, args, state, control, model=None, **kw):  # after GradLocCallback built its handle
            run.feed = FeedRecorder(run.gl.handle.monitor.detector)
            capture = run.gl.handle.capture
            take = capture.take

            def taking():
                run.taken = take()
                return run.taken

            capture.take = taking

        def on_step_begin(self, args, state, control, model=None, **kw):
            run.step = state.global_step + 1
            run.fresh = True
            run.gl.handle.monitor.responder.config = run.plan.locate_config(run.step)

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            run.record(model, optimizer)
            run.snapshot(model)  # the weights the step's forward saw: the optimizer has not stepped yet

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == run.s.steps and run.kind == "clean":
                run.rec.twin_loss = run.data.held.loss(model)  # the clean twin at the scenario runs' end

    return Corrupt(), Record()


def schedule(s: TrainerSetting, plan: Plan, kind: str):
    jumps = set(plan.at) if kind == "lr_x50" else set()
    restart = plan.restart - 1 if plan.restart is not None else None

    def factor(t: int) -> float:  # LambdaLR's t = optimizer steps taken: Trainer's step t + 1
        return lr_factor(t, s.warmup, s.horizon, restart) * (50.0 if t + 1 in jumps else 1.0)

    return factor


def run(kind: str, seed: int, s: TrainerSetting) -> RunRecord:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from gradloc_track.integrations.hf import GradLocCallback

    plan = Plan.of(kind, s.steps)
    steps = s.clean_steps if kind == "clean" else s.steps
    data = make_data(s, seed)
    torch.manual_seed(seed)
    model = build_model(model_config(s, data.tok.vocab_size, data.tok.pad_id))
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(s, plan, kind))
    rec = RunRecord(s.family, kind, seed, known_cause(kind), warmup=0, twin="clean", placebo=plan.placebo,
                    source=s.source, aftermath=KINDS[kind].aftermath if kind in KINDS else 0)
    tr = TrainerRun(kind, seed, s, plan, data, rec)
    tr.dataset = ZooData(tr, steps)
    tr.gl = GradLocCallback(tracker="none", spikes=dict(s.detector), locate={"max_events": 10 ** 6},
                            log_every=10 ** 9)
    corrupt, record = make_callbacks(tr)
    model.register_forward_hook(tr.forward_hook, with_kwargs=True)
    args = TrainingArguments(output_dir="/tmp/gradloc-heldout-zoo", per_device_train_batch_size=s.batch,
                             max_steps=steps, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             logging_strategy="no", train_sampling_strategy="sequential", seed=seed,
                             dataloader_num_workers=0)
    # the run's tokenizer as a user hands it to Trainer: GradLocCallback() takes processing_class for the culprit
    # text and for reading a junk run (before, the zoo passed none: token ids, and no text to read)
    trainer = Trainer(model=model, args=args, train_dataset=tr.dataset, data_collator=collate,
                      optimizers=(opt, sched), callbacks=[corrupt, tr.gl, record],
                      processing_class=data.tok.to_transformers())
    trainer.remove_callback(PrinterCallback)
    t0 = time.perf_counter()
    trainer.train()
    rec.final_loss = data.held.loss(model)
    rec.seconds = time.perf_counter() - t0
    return rec


def replay(snap: dict):
    """(the model after the saved step's forward and backward, the spike context the callback builds)."""
    from transformers import AutoConfig

    from gradloc_track.integrations.batches import LMBatch, lm_spike_context
    from gradloc_track.integrations.calls import forward_signature
    from gradloc_track.localizer.probe import restore_rng

    cfg = dict(snap["meta"]["config"])
    model = build_model(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.load_state_dict(snap["state"])
    model.train()
    i = snap["inputs"]
    kwargs = {k: v for k, v in (("input_ids", i["input_ids"]), ("labels", i["labels"]),
                                 ("position_ids", i["position_ids"])) if v is not None}
    kwargs["num_items_in_batch"] = i["num_items"]
    restore_rng(snap["rng"])
    model.zero_grad(set_to_none=True)
    model(**kwargs).loss.backward()
    call = LMBatch.from_call((), kwargs, forward_signature(model))
    return model, lm_spike_context(model, [call], None, rng_state=snap["rng"])
