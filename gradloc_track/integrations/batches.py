"""Capture a step's causal-LM micro-batches and rebuild the per-term loss from them.

Localization needs ``loss_fn(mask)``: the step's loss restricted to some loss terms, with a
FIXED normalizer. For a causal LM that loss is known from the tokens alone, so nobody has to
write it: ``MicroBatchCapture`` records each training forward's ``input_ids`` / ``labels``
(``-100`` = no loss) / ``attention_mask`` (token ids only, on the device they came on, no copy
of activations), and ``lm_spike_context`` rebuilds, per micro-batch ``k``,

    loss_k(mask) = sum_{b,t} CE(logits_k[b, t], target_k[b, t]) * mask[b, t] / N_k

where ``target[:, t] = labels[:, t + 1]`` (or ``input_ids[:, t + 1]`` where ``attention_mask`` is 1
when no labels were given; the last position has no term), and ``N_k`` is the user's own
normaliser, counted once from the full batch: the ``num_items_in_batch`` the call passed (HF
Trainer's count of the step's labels), else, when labels or targets were passed (the model's own
loss, a mean over its micro-batch's terms, divided by K for accumulation as Trainer, Lightning and
``loss / k`` loops do), ``K x`` micro-batch ``k``'s term count, else the step's term count. The K
losses sum to the step's loss, so their gradients sum to the step's gradient; the localizer checks
it against ``.grad``. Each micro-batch keeps the RNG state saved right before its own forward, so
probes replay its dropout exactly (the RNG has moved on between micro-batches).
The capture interface the handle takes is ``BatchList`` (``add`` / ``add_info`` / ``take`` /
``paused`` / ``remove``): fed by a framework (Lightning's ``on_train_batch_start``), or by the
model's forward hooks (``MicroBatchCapture``, ``watch()`` and HF Trainer).
The call is read by argument name (``calls``): nanoGPT's ``model(x, y)`` gives ids ``x`` and
already-shifted ``targets`` ``y`` (``-1`` = no loss), and a probe calls ``model(idx=x, targets=y)``
again. Per-sample columns (``sample_info``) ride along with each micro-batch.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..localizer.probe import save_rng
from . import sample_info
from .calls import IDS_NAMES, TARGET_NAMES, arguments_by_name, find_key, forward_signature, logits_of_call
from .calls import logits_in, unusable_output
from .step_losses import detector_losses, document_index, loss_in

log = logging.getLogger(__name__)
IGNORE = -100  # the label that carries no loss (HF / PyTorch convention)
MAX_HELD = 256  # micro-batches kept when nobody takes them (no optimizer step seen)


@dataclass
class LMBatch:
    """One micro-batch as the model was called: ``style`` "kwargs" (``model(input_ids=...)``, the
    keyword ``ids_name``) or "positional" (``model(input_ids)``)."""

    input_ids: torch.Tensor  # (B, T) integer
    labels: torch.Tensor | None = None  # (B, T), IGNORE where no loss
    attention_mask: torch.Tensor | None = None  # (B, T)
    style: str = "kwargs"
    target_ids: torch.Tensor | None = None  # (B, T) already shifted (nanoGPT): the term at t is targets[:, t]
    ids_name: str = "input_ids"  # the forward's name for the ids (nanoGPT: idx)
    targets_key: str | int | None = None  # how the targets were passed: their keyword, or position 1
    info: dict[str, Any] | None = None  # per-sample columns, each B values (sample_info)
    unusable: str | None = None  # why the training forward's output cannot rebuild the loss (None: it can)
    num_items: Any = None  # the call's num_items_in_batch (HF Trainer): the loss's normaliser
    items_scale: float = 1.0  # what the trainer multiplies that loss by (``trainer_frames.tokens_averaged_scale``)
    loss: torch.Tensor | None = None  # the loss the model returned (HF ``.loss``, nanoGPT's pair), detached
    sample_max: torch.Tensor | None = None  # the largest per-sample loss (step_losses.py)
    sample_rows: torch.Tensor | None = None  # (B,) each row's mean loss, whose largest sample_max is
    junk: Any = None  # the junk-span statistics of this micro-batch (spikes/junk.py)
    position_ids: torch.Tensor | None = None  # (B, T); restarts at 0 mark packed documents
    precision: str | None = None  # the autocast the forward ran under ("float16 autocast"), if any
    # (B,) the last position's target ids, read from the loss's gradient when the call gave neither labels nor
    # targets (``model(x[:, :-1])`` with the loss on ``x[:, 1:]``: that target is in no input); IGNORE: no term
    last_targets: torch.Tensor | None = None
    # (B, T-1) whether the user's loss has a term at each position but the last, read from the same gradient
    # (a prompt masked in labels the model never saw has none); None: not read
    terms: torch.Tensor | None = None

    @classmethod
    def from_call(cls, args: tuple, kwargs: dict, signature: Any = None) -> "LMBatch | None":
        """From a forward call's arguments (bound to ``signature``, the forward's, when given); None
        when it is not a token-id call we understand."""
        named = arguments_by_name(signature, args, kwargs)
        ids_name = find_key(named, IDS_NAMES, _is_ids)
        ids = named.get(ids_name) if ids_name is not None else named.get(0)
        if not _is_ids(ids):
            return None
        labels, mask = named.get("labels"), named.get("attention_mask")
        tkey = find_key(named, TARGET_NAMES, lambda t: _is_ids(t) and t.shape == ids.shape)
        if tkey is None and ids_name is None and _is_ids(named.get(1)) and named[1].shape == ids.shape:
            tkey = 1  # model(x, y) with a forward(*args): nanoGPT's order
        n, pos = named.get("num_items_in_batch"), named.get("position_ids")
        return cls(ids.detach(), labels.detach() if _is_ids(labels) else None,
                   mask.detach() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None,
                   "kwargs" if ids_name is not None else "positional",
                   named[tkey].detach() if tkey is not None else None, ids_name or "input_ids", tkey,
                   num_items=n.detach() if isinstance(n, torch.Tensor) else n,
                   position_ids=pos.detach() if isinstance(pos, torch.Tensor) and pos.shape == ids.shape else None)

    @classmethod
    def from_batch(cls, batch: Any, shifted: bool = False) -> "LMBatch | None":
        """From a dataloader batch: a mapping with ``input_ids`` (HF style), a tuple/list whose first
        item is the ids (and second, if ids too, the labels; with ``shifted``, targets already shifted:
        ``pair_is_shifted`` tells the two apart), or a tensor of ids."""
        if isinstance(batch, dict) or hasattr(batch, "keys"):
            if "input_ids" not in batch:
                return None
            return cls.from_call((), {k: batch[k] for k in ("input_ids", "labels", "attention_mask") if k in batch})
        if isinstance(batch, (tuple, list)) and batch:
            ids = batch[0]
            pair = len(batch) > 1 and _is_ids(batch[1]) and batch[1].shape == getattr(ids, "shape", None)
            labels = batch[1] if pair else None
            if not _is_ids(ids):
                return None
            if labels is not None and shifted:  # nanoGPT's (x, y): the term at t is y[:, t]
                return cls(ids.detach(), None, None, "positional", target_ids=labels.detach())
            return cls(ids.detach(), None if labels is None else labels.detach(), None, "positional")
        return cls(batch.detach(), None, None, "positional") if _is_ids(batch) else None

    @staticmethod
    def pair_is_shifted(batch: Any) -> bool | None:
        """For an ``(ids, second)`` batch of two (B, T) id tensors: True when ``second`` holds the targets
        already shifted (nanoGPT's ``y = x[1:]`` window: ``second[:, t] == ids[:, t + 1]`` wherever it has a
        term), False when it holds HF labels (``second == ids`` wherever it has a term), None when neither
        or both show (rows of one repeated token) or it is no such pair (then labels, the documented
        convention). Reads both (a host sync on an accelerator): on the first batches of a run only. Held-out
        tester, stop 56: a Lightning loop's shifted ``(x, y)`` was read as labels and shifted again, and its data
        spike named ``irreproducible``."""
        if not (isinstance(batch, (tuple, list)) and len(batch) > 1 and _is_ids(batch[0]) and _is_ids(batch[1])
                and batch[0].dim() == 2 and batch[1].shape == batch[0].shape and batch[0].shape[1] > 1):
            return None
        ids, second = batch[0].detach(), batch[1].detach().to(batch[0].device)
        has = second >= 0
        if not bool(has.any()):
            return None
        labels = bool((~has | (second == ids)).all())
        shifted = bool((~has[:, :-1] | (second[:, :-1] == ids[:, 1:])).all())
        return None if labels == shifted else shifted  # both (rows of one token) or neither: not told

    def targets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target ids with IGNORE, loss-term mask (float), ids to display), each (B, T).

        Position ``t`` holds the term its logits predict (the token at ``t + 1``), so the mask lines
        up with the model's positions (the ghost map's per-position norms); the last position has
        no term. The display row is the targets (what each term is the loss of), as in the demo.
        """
        ids = self.input_ids
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, T): the next token; last repeats
        tgt = self.target_ids_only(nxt)
        valid = tgt != IGNORE
        return tgt, valid.float(), torch.where(valid, tgt, nxt)

    def target_ids_only(self, nxt: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) the target ids of ``targets()`` alone (what the detector's per-step pass reads)."""
        ids = self.input_ids
        if self.labels is not None:
            return torch.cat([self.labels[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
        if self.target_ids is not None:  # already shifted; nanoGPT marks "no loss" with -1
            return self.target_ids.masked_fill(self.target_ids < 0, IGNORE)
        tgt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1) if nxt is None else nxt.clone()  # the next token
        tgt[:, -1] = IGNORE
        if self.attention_mask is not None:
            tgt = tgt.masked_fill(torch.cat([self.attention_mask[:, 1:], self.attention_mask[:, :1]], 1) == 0, IGNORE)
        if self.terms is not None:  # the positions the user's loss has no term at (a masked prompt), from its gradient
            tgt[:, :-1] = tgt[:, :-1].masked_fill(~self.terms.to(tgt.device), IGNORE)
        if self.last_targets is not None:  # the loss had a term at the last position: its target, from its gradient
            tgt[:, -1] = self.last_targets.to(tgt.device)
        return tgt

    def document_ids(self) -> torch.Tensor | None:
        """(B, T) document index per position when ``position_ids`` restart inside a row (packed
        sequences, e.g. TRL's packing); None otherwise."""
        pos = self.position_ids
        if pos is None or not bool((pos[:, 1:] == 0).any()):  # host sync: once per spike
            return None
        return (pos == 0).long().cumsum(1) - (pos[:, :1] == 0).long()


def autocast_in_force(device_type: str) -> str | None:
    """"float16 autocast" while a reduced-precision autocast is on for ``device_type`` (the forward's
    device) or CUDA, else None."""
    for dev in dict.fromkeys((device_type, "cuda")):
        try:
            if torch.is_autocast_enabled(dev):
                return f"{str(torch.get_autocast_dtype(dev)).removeprefix('torch.')} autocast"
        except (RuntimeError, TypeError, AttributeError):  # an older torch, an unknown device type
            continue
    return None


def _is_ids(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and x.shape[1] >= 2


def logits_of(model: torch.nn.Module, batch: LMBatch) -> torch.Tensor:
    """The model's logits (B, T, V) for the batch, called the way training called it (HF labels
    left out: no own loss; nanoGPT's targets kept: its forward returns every position only then)."""
    return logits_of_call(model, batch)


def normalisers(batches: list[LMBatch], masks: list[torch.Tensor]) -> list[Any]:
    """Each micro-batch's loss normaliser as the training step had it (see the module doc), from
    the full masks only: device scalars, no host sync."""
    if all(b.num_items is not None for b in batches):
        return [b.num_items if b.items_scale == 1 else b.num_items / b.items_scale for b in batches]
    if all(b.labels is not None or b.target_ids is not None for b in batches):
        return [m.sum().clamp(min=1.0) * len(batches) for m in masks]
    n_total = sum(m.sum() for m in masks).clamp(min=1.0)
    return [n_total] * len(batches)


def lm_loss_fns(model: torch.nn.Module, batches: list[LMBatch]) -> tuple[list[Callable], list[torch.Tensor],
                                                                         list[torch.Tensor]]:
    """Per micro-batch ``loss_fn(mask)``, loss-term mask (B, T) and display ids (B, T)."""
    parts = [b.targets() for b in batches]
    norms = normalisers(batches, [m for _, m, _ in parts])

    def make(batch: LMBatch, tgt: torch.Tensor, n_norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        def loss_fn(keep: torch.Tensor) -> torch.Tensor:
            logits = logits_of(model, batch)  # (B, T, V); position t predicts tgt[:, t]
            B, T, V = logits.shape
            per_tok = F.cross_entropy(logits.reshape(B * T, V).float(), tgt.reshape(-1),
                                      ignore_index=IGNORE, reduction="none").view(B, T)
            return (per_tok * keep.to(per_tok.dtype)).sum() / n_norm

        return loss_fn

    fns = [make(b, t, n) for b, (t, _, _), n in zip(batches, parts, norms)]
    return fns, [m for _, m, _ in parts], [i for _, _, i in parts]


def lm_spike_context(model: torch.nn.Module, batches: list[LMBatch], tokenizer: Any = None,
                     rng_state: Any = None):
    """A ``SpikeContext`` for the step: one micro-batch as plain tensors, several as sequences.
    ``rng_state``: one state per micro-batch (``MicroBatchCapture.take()``'s), or one for all."""
    from ..spikes.context import SpikeContext, per_micro_batch

    fns, masks, ids = lm_loss_fns(model, batches)
    columns = sample_info.sample_columns(batches)  # dataset index, source, ...: B values per micro-batch
    docs = [b.document_ids() for b in batches]
    docs = None if all(d is None for d in docs) else docs
    precision = next((b.precision for b in batches if b.precision), None)
    rows = [b.sample_rows for b in batches]  # each row's loss, for the sample signal's flags (monitor.data_flags)
    rows = None if all(r is None for r in rows) else rows
    pick = per_micro_batch(len(batches))
    return SpikeContext(loss_fn=pick(fns), token_mask=pick(masks), input_ids=pick(ids), tokenizer=tokenizer,
                        rng_state=pick(rng_state) if isinstance(rng_state, list) else rng_state,
                        sample_columns=columns, document_ids=None if docs is None else pick(docs),
                        precision=precision, sample_losses=None if rows is None else pick(rows))


class BatchList:
    """A step's micro-batches, as they arrive, for the handle to ``take()`` once per step: the
    capture interface every front door hands ``WatchHandle``. This base holds no hook: a framework
    feeds it (Lightning's ``on_train_batch_start`` calls ``add``); ``MicroBatchCapture`` feeds it
    from the model's forward calls. ``paused()``: the localizer's own probes are not batches of the
    step; ``remove()``: take off whatever hooks feed it (none here)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []  # the hooks that feed it (a subclass's), taken off by ``remove()``
        self.batches: list[LMBatch] = []
        # the RNG state (CPU and CUDA) right before each batch's forward: probes replay its dropout
        self.rng_states: list[dict] = []
        self._paused = 0
        self._infos: list[dict[str, Any]] = []  # set_sample_info calls of this step, one per micro-batch
        self.sample_losses = False  # measure each sample's loss from the forward's logits (the detector asks)
        self.junk_terms: int | None = None  # measure the junk-span statistics over runs this long (the detector asks)
        # False when nothing reads the batches (no spike detector: nothing to localize or measure): the hooks
        # then only take the sample columns out of each call (issue 38: ``spikes=False`` paid for the capture)
        self.wanted = True

    def add(self, batch: LMBatch | None) -> None:
        """Record a batch (and the RNG state now, just before its forward)."""
        if batch is None or not self.wanted:
            return
        self.batches.append(batch)
        # each micro-batch's own state: micro-batch k ran with the RNG advanced by 0..k-1
        self.rng_states.append(save_rng())
        if len(self.batches) > MAX_HELD:  # nobody takes them: keep the newest only
            del self.batches[0], self.rng_states[0]

    def measure(self, batch: LMBatch, output: Any) -> None:
        """The detector's largest-sample and junk statistics of ``batch`` (what it asks for), from one pass over
        its forward's ``output`` logits (``step_losses.detector_losses``), onto the batch."""
        if not (self.sample_losses or self.junk_terms):
            return
        pos = batch.position_ids  # packed documents, without document_ids()' host sync
        docs = None if pos is None else document_index(pos, pos.shape)
        batch.sample_max, batch.junk, batch.sample_rows = detector_losses(
            logits_in(output), batch.target_ids_only(), batch.input_ids, docs,
            samples=self.sample_losses, junk_terms=self.junk_terms, output=output, with_rows=True)

    def add_info(self, columns: dict[str, Any]) -> None:
        """Per-sample columns for one micro-batch of this step (``handle.set_sample_info``)."""
        self._infos.append(sample_info.check_columns(columns))

    def take(self) -> tuple[list[LMBatch], list[dict]]:
        """The step's batches and their RNG states (one each); both lists start empty again."""
        out, rng = self.batches, self.rng_states
        infos, self._infos = self._infos, []
        self.batches, self.rng_states = [], []
        if self.wanted:  # (else no batch was recorded for them: nothing reads the columns either)
            sample_info.attach(out, infos)
        return out, rng

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def records(self, module: torch.nn.Module) -> bool:
        """Is a forward of ``module`` now a training forward to record (not eval, ``no_grad`` or ``paused()``)?"""
        return self.wanted and not self._paused and module.training and torch.is_grad_enabled()

    def remove(self) -> None:
        """Take off the hooks that feed it (none on a list a framework feeds by itself)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class MicroBatchCapture(BatchList):
    """Forward hooks that record each training forward's token ids (not during eval, under
    ``no_grad``, or while ``paused()``), and take the collated sample columns
    (``sample_info.SAMPLE_INFO_KEY``) out of every call.

    The pre-hook runs first (``prepend``), so the columns are ours before any other hook or the
    forward sees them; the forward hook checks that the output has logits for every position."""

    def __init__(self, model: torch.nn.Module, caller: torch.nn.Module | None = None) -> None:
        super().__init__()
        self._open: LMBatch | None = None  # the batch whose forward is running
        self._in_caller = False  # ``caller``'s hooks opened the forward running now (the model's own skip it)
        self.traced = False  # a forward this step that would have been recorded ran traced into a compiled graph
        self.traced_step = False  # ... in the step the last take() returned (the handle's warning)
        self._model = model
        self._inner: Any = None  # the in-place compiled call (``model.compile()``) this capture wraps, if any
        self.items_scale = 1.0  # what HF Trainer multiplies a loss over num_items_in_batch by (set by its callback)
        self._signature = forward_signature(model)
        self._handles = [model.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True),
                         model.register_forward_hook(self._check_output)]
        if caller is not None:  # ``torch.compile(model)``'s wrapper, made by someone else (HF Trainer's
            # ``torch_compile=True``): the model's own hooks run traced inside its graph and record nothing, so
            # the capture also runs on the wrapper, eagerly, around the compiled call (held-out tester, stop 57)
            self._handles += [caller.register_forward_pre_hook(self._caller_hook, with_kwargs=True, prepend=True),
                              caller.register_forward_hook(self._caller_output)]
        self.wrap_compiled()

    def wrap_compiled(self) -> bool:
        """``model.compile()`` compiles the module in place, its hooks inside the compiled graph, where they
        record nothing (``_hook``): its compiled call is wrapped so that the capture runs around it, eagerly,
        fullgraph or not (review, stop 54: in place, localization was lost). True when it wrapped (now or before)."""
        model = self._model
        inner = getattr(model, "_compiled_call_impl", None)
        if inner is None or getattr(inner, "_gradloc_capture", None) is self:
            return inner is not None
        capture = self

        def around(*args: Any, **kwargs: Any) -> Any:
            new = capture._record(model, args, kwargs)
            if new is not None:
                args, kwargs = new
            out = inner(*args, **kwargs)
            capture._check_output(model, args, out)
            return out

        around._gradloc_capture = self  # type: ignore[attr-defined]
        self._inner, model._compiled_call_impl = inner, around
        return True

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.compiler.is_compiling():
            # traced into a compiled graph: recording there breaks the graph (fullgraph=True: an error, held-out
            # tester, stop 54), so nothing is recorded. In place (``model.compile()``) the capture runs around the
            # compiled call (``wrap_compiled``); a compiled caller (``torch.compile(model)`` called while watch()
            # was given ``model``) records nothing, and the handle says once to give watch() the compiled module
            info = sample_info.pop_sample_info(kwargs)  # (the model must never see it)
            self.traced = self.traced or (self.records(module) and not self._in_caller)
            return (args, kwargs) if info is not None else None
        return self._record(module, args, kwargs)

    def _caller_hook(self, caller: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self._in_caller = False
        new = self._record(self._model, args, kwargs)
        self._in_caller = True
        return new

    def _caller_output(self, caller: torch.nn.Module, args: tuple, output: Any) -> None:
        self._in_caller = False
        self._check_output(self._model, args, output)

    def _record(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        info = sample_info.pop_sample_info(kwargs)  # always: the model must never see it
        if self.records(module) and not self._in_caller:  # (a compiled caller that ran the model eagerly: once)
            batch = LMBatch.from_call(args, kwargs, self._signature)
            if batch is not None:
                batch.info = info
                batch.precision = autocast_in_force(batch.input_ids.device.type)
                if batch.num_items is not None:
                    batch.items_scale = self.items_scale
                self.add(batch)
                self._open = batch
        return (args, kwargs) if info is not None else None

    def _check_output(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():  # (``_hook``)
            return
        batch, self._open = self._open, None
        if batch is not None:
            batch.unusable = unusable_output(output, batch.input_ids)
            batch.loss = loss_in(output)  # the model's own loss, for the detector's loss signal
            if batch.labels is None and batch.target_ids is None and batch.unusable is None:
                watch_terms(batch, logits_in(output))
            if batch.unusable is None:
                self.measure(batch, output)

    def take(self) -> tuple[list[LMBatch], list[dict]]:
        out = super().take()
        # this step's forwards ran traced into a compiled caller's graph and recorded nothing (compiled in place
        # after watch(): wrapped now, recorded from the next step)
        self.traced_step, self.traced = self.traced and not self.wrap_compiled(), False
        return out

    def remove(self) -> None:
        super().remove()
        if getattr(getattr(self._model, "_compiled_call_impl", None), "_gradloc_capture", None) is self:
            self._model._compiled_call_impl = self._inner  # the model's own compiled call back
        self._inner = None


class FedBatchList(BatchList):
    """A ``BatchList`` a framework feeds (Lightning's ``on_train_batch_start``) that also reads the detector's
    per-micro-batch statistics (the largest sample loss, the junk run) from the training forward's logits
    (held-out tester, stop 54: the Lightning door read gradient norms only and missed a garbage row the other
    doors name). Forward hooks on the module and its direct children keep each training forward's output that
    holds a float (B, T, X) tensor for the fed batch's (B, T) positions; ``backward(loss)``, called with the
    loss about to be back-propagated, measures the one nearest that loss in its graph: the logits the loss was
    computed from, never an embedding's (B, T, D) output or a frozen teacher's (review, stop 54: the first
    child's output was taken, an ``nn.Embedding``'s, and ``fit`` died on an index out of range). A step whose
    forwards hold no such output keeps those signals off; a failure to measure is a warning, never an error."""

    MAX_KEPT = 8  # candidate outputs kept per micro-batch (a module's and its children's: few)
    MAX_NODES = 512  # graph nodes searched from the loss for them (the logits sit a few ops from it)

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self._kept: list[tuple[torch.Tensor, Any]] = []  # (logits, output) of the current batch's forwards
        self._warned = False
        self._handles = [m.register_forward_hook(self._read) for m in (module, *module.children())]

    def add(self, batch: LMBatch | None) -> None:
        super().add(batch)
        self._kept = []  # a new micro-batch: the last one's outputs are not its

    def _read(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch.compiler.is_compiling():  # traced into a compiled caller: nothing recorded (``MicroBatchCapture``)
            return
        batch = self.batches[-1] if self.batches else None
        if (batch is None or not self.records(module) or not (self.sample_losses or self.junk_terms)
                or len(self._kept) >= self.MAX_KEPT):
            return
        logits = logits_in(output)
        if (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.is_floating_point()
                and logits.grad_fn is not None and tuple(logits.shape[:2]) == tuple(batch.input_ids.shape)
                and not any(k is logits for k, _ in self._kept)):
            self._kept.append((logits, output))

    def forget(self) -> None:
        """Drop the kept outputs (a step whose backward did not go through the framework's hook: they would hold
        the logits alive until the next micro-batch)."""
        self._kept = []

    def backward(self, loss: torch.Tensor) -> None:
        """Measure the current batch from the kept output nearest ``loss`` (class doc); forget the rest."""
        kept, self._kept = self._kept, []
        batch = self.batches[-1] if self.batches else None
        if not kept or batch is None or batch.sample_max is not None or batch.junk is not None:
            return
        found = _nearest(loss, kept, self.MAX_NODES)
        if found is None:
            return
        try:
            self.measure(batch, _LossOf(found[0], loss))
        except Exception as exc:  # the detector's extra signals must never stop training
            if not self._warned:
                self._warned = True
                log.warning("gradloc-track: the sample and junk signals could not be read from the training "
                            "forward's logits (%r); they stay off for such steps", exc)


class _LossOf:
    """An output for ``step_losses.detector_losses``: the logits, and the loss computed from them (its saved
    log-probabilities spare the logits' read when the loss is a cross-entropy over them)."""

    def __init__(self, logits: torch.Tensor, loss: torch.Tensor) -> None:
        self.logits, self.loss = logits, loss


def _nearest(loss: torch.Tensor, kept: list[tuple[torch.Tensor, Any]], max_nodes: int
             ) -> tuple[torch.Tensor, Any] | None:
    """The kept (logits, output) whose tensor is first reached walking ``loss``'s graph breadth first (the
    fewest ops from the loss), or None within ``max_nodes`` nodes."""
    wanted = {id(k.grad_fn): (k, out) for k, out in kept}
    start = getattr(loss, "grad_fn", None)
    frontier, seen = ([start] if start is not None else []), set()
    while frontier and len(seen) < max_nodes:
        nxt = []
        for node in frontier:
            if id(node) in wanted:
                return wanted[id(node)]
            if id(node) in seen:
                continue
            seen.add(id(node))
            nxt += [f for f, _ in node.next_functions if f is not None]
        frontier = nxt
    return None


def watch_terms(batch: LMBatch, logits: torch.Tensor) -> None:
    """A forward given only ids: at which positions does the user's loss have a term, and for which target
    at the last one? A prompt masked in the user's labels (``-100``, never seen by the model) has no term,
    and the last position's target is in no input (``model(x[:, :-1])``, the loss on ``x[:, 1:]``). The
    gradient of a cross-entropy term is ``(softmax - onehot(target)) / N``: never exactly 0 on a term, exactly 0
    where there is none. A hook reads it during backward, on the device, no sync: at each position the entry
    of the next token and of two fixed columns (a term that holds its target at probability 1.0 still has the
    others' tiny probabilities), and the whole last row, whose most negative entry is its target. The rebuilt
    loss then has every term the user's has and no other (without it a prompt-masked loop's replay counted
    the prompt, and the step check called a data spike irreproducible). Float16 logits are read for the last
    target only (their gradient underflows to 0 on confident terms); several backwards through the logits add
    up their terms."""
    if not (isinstance(logits, torch.Tensor) and logits.requires_grad and logits.dim() == 3):
        return
    ids = batch.input_ids

    def read(grad: torch.Tensor) -> None:
        g = grad.detach()
        last = g[:, -1, :]  # (B, V)
        term = last.abs().amax(-1) > 0
        target = torch.where(term, last.argmin(-1), torch.full_like(term, IGNORE, dtype=torch.long))
        # a second backward through the same logits (retain_graph: a z-loss on some positions) adds its terms
        old = batch.last_targets
        batch.last_targets = target if old is None else torch.where(term, target, old)
        if g.dtype == torch.float16:
            # float16 underflows a confident term's whole row to 0 (p / N below 6e-8): a zero says nothing there,
            # and dropping such terms halved the rebuilt loss (reviewer round 9); every position stays a term
            return
        body = g[:, :-1, :]
        nxt = ids[:, 1:].to(g.device).clamp(0, g.shape[-1] - 1).unsqueeze(-1)
        terms = (body.gather(-1, nxt).squeeze(-1) != 0) | (body[..., :2] != 0).any(-1)  # (B, T-1)
        batch.terms = terms if batch.terms is None else batch.terms | terms

    logits.register_hook(read)


def resolve_tokenizer(model: torch.nn.Module, tokenizer: Any = None) -> Any:
    """The tokenizer given, else the model's ``config.name_or_path`` tokenizer when that path is a
    local directory (never downloads), else the bytes of a byte-level model (a vocabulary of 256:
    ``text.ByteDecoder``), else None (the table shows token ids)."""
    if tokenizer is not None:
        return tokenizer
    path = getattr(getattr(model, "config", None), "name_or_path", None)
    if path and os.path.isdir(str(path)):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # no tokenizer files there: ids it is
            log.info("gradloc-track: no tokenizer at %s (%r); showing token ids", path, exc)
    if vocabulary_size(model) == 256:
        from ..text import ByteDecoder

        log.info("gradloc-track: a vocabulary of 256 and no tokenizer: culprit ids read as UTF-8 bytes "
                 "(pass tokenizer= to read them otherwise)")
        return ByteDecoder()
    return None


def vocabulary_size(model: torch.nn.Module) -> int | None:
    """The model's vocabulary: its config's ``vocab_size``, else its input embedding's rows
    (``get_input_embeddings()``), else a hand-written model's token embedding, told by its rows matching the
    width of its last ``nn.Linear`` (the head: a position table of 256 rows is not the vocabulary, review)."""
    inner = getattr(model, "module", model)  # DDP and friends
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile
    size = getattr(getattr(inner, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    get_input = getattr(inner, "get_input_embeddings", None)
    emb = get_input() if callable(get_input) else None
    if isinstance(emb, torch.nn.Embedding):
        return int(emb.num_embeddings)
    rows = {int(m.num_embeddings) for m in inner.modules() if isinstance(m, torch.nn.Embedding)}
    head = next((m for m in reversed(list(inner.modules())) if isinstance(m, torch.nn.Linear)), None)
    return int(head.out_features) if head is not None and head.out_features in rows else None
