"""Capture a step's causal-LM micro-batches and rebuild the per-term loss from them.

Localization needs ``loss_fn(mask)``: the step's loss restricted to some loss terms, with a
FIXED normalizer. For a causal LM that loss is known from the tokens alone, so nobody has to
write it: ``MicroBatchCapture`` records each training forward's ``input_ids`` / ``labels``
(``-100`` = no loss) / ``attention_mask`` (token ids only, on the device they came on, no copy
of activations), and ``lm_spike_context`` rebuilds, per micro-batch ``k``,

    loss_k(mask) = sum_{b,t} CE(logits_k[b, t], target_k[b, t]) * mask[b, t] / N

where ``target[:, t] = labels[:, t + 1]`` (or ``input_ids[:, t + 1]`` where ``attention_mask`` is 1
when no labels were given; the last position has no term) and ``N`` = the step's loss terms over all its micro-batches. The K losses
sum to the step's loss, so their gradients sum to the step's gradient (gradient accumulation).
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

log = logging.getLogger(__name__)
IGNORE = -100  # the label that carries no loss (HF / PyTorch convention)
MAX_HELD = 256  # micro-batches kept when nobody takes them (no optimizer step seen)


@dataclass
class LMBatch:
    """One micro-batch as the model was called: ``style`` "kwargs" (``model(input_ids=...)``) or
    "positional" (``model(input_ids)``)."""

    input_ids: torch.Tensor  # (B, T) integer
    labels: torch.Tensor | None = None  # (B, T), IGNORE where no loss
    attention_mask: torch.Tensor | None = None  # (B, T)
    style: str = "kwargs"

    @classmethod
    def from_call(cls, args: tuple, kwargs: dict) -> "LMBatch | None":
        """From a forward call's arguments; None when it is not a token-id call we understand."""
        ids, style = kwargs.get("input_ids"), "kwargs"
        if ids is None and args:
            ids, style = args[0], "positional"
        if not _is_ids(ids):
            return None
        labels, mask = kwargs.get("labels"), kwargs.get("attention_mask")
        return cls(ids.detach(), labels.detach() if _is_ids(labels) else None,
                   mask.detach() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else None, style)

    @classmethod
    def from_batch(cls, batch: Any) -> "LMBatch | None":
        """From a dataloader batch: a mapping with ``input_ids`` (HF style), a tuple/list whose first
        item is the ids (and second, if ids too, the labels), or a tensor of ids."""
        if isinstance(batch, dict) or hasattr(batch, "keys"):
            if "input_ids" not in batch:
                return None
            return cls.from_call((), {k: batch[k] for k in ("input_ids", "labels", "attention_mask") if k in batch})
        if isinstance(batch, (tuple, list)) and batch:
            ids = batch[0]
            labels = batch[1] if len(batch) > 1 and _is_ids(batch[1]) and batch[1].shape == getattr(ids, "shape", None) \
                else None
            return cls(ids.detach(), None if labels is None else labels.detach(), None, "positional") \
                if _is_ids(ids) else None
        return cls(batch.detach(), None, None, "positional") if _is_ids(batch) else None

    def targets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target ids with IGNORE, loss-term mask (float), ids to display), each (B, T).

        Position ``t`` holds the term its logits predict (the token at ``t + 1``), so the mask lines
        up with the model's positions (the ghost map's per-position norms); the last position has
        no term. The display row is the targets (what each term is the loss of), as in the demo.
        """
        ids = self.input_ids
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, T): the next token; last repeats
        if self.labels is not None:
            tgt = torch.cat([self.labels[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
        else:
            tgt = nxt.clone()
            tgt[:, -1] = IGNORE
            if self.attention_mask is not None:
                tgt = tgt.masked_fill(torch.cat([self.attention_mask[:, 1:], self.attention_mask[:, :1]], 1) == 0,
                                      IGNORE)
        valid = tgt != IGNORE
        return tgt, valid.float(), torch.where(valid, tgt, nxt)


def _is_ids(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and x.shape[1] >= 2


def logits_of(model: torch.nn.Module, batch: LMBatch) -> torch.Tensor:
    """The model's logits for the batch, called the way training called it (no labels: no own loss)."""
    if batch.style == "kwargs":
        kw = {"input_ids": batch.input_ids}
        if batch.attention_mask is not None:
            kw["attention_mask"] = batch.attention_mask
        out = model(**kw)
    else:
        out = model(batch.input_ids)
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not (isinstance(out, torch.Tensor) and out.dim() == 3):
        raise TypeError(f"the model returned {type(out).__name__}, not logits (B, T, V) or an output with "
                        ".logits: pass loss_fn(mask) yourself (handle.set_loss_fn) for this model")
    return out


def lm_loss_fns(model: torch.nn.Module, batches: list[LMBatch]) -> tuple[list[Callable], list[torch.Tensor],
                                                                         list[torch.Tensor]]:
    """Per micro-batch ``loss_fn(mask)``, loss-term mask (B, T) and display ids (B, T)."""
    parts = [b.targets() for b in batches]
    n_total = sum(m.sum() for _, m, _ in parts).clamp(min=1.0)  # device scalar: no host sync

    def make(batch: LMBatch, tgt: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        def loss_fn(keep: torch.Tensor) -> torch.Tensor:
            logits = logits_of(model, batch)  # (B, T, V); position t predicts tgt[:, t]
            B, T, V = logits.shape
            per_tok = F.cross_entropy(logits.reshape(B * T, V).float(), tgt.reshape(-1),
                                      ignore_index=IGNORE, reduction="none").view(B, T)
            return (per_tok * keep.to(per_tok.dtype)).sum() / n_total

        return loss_fn

    return [make(b, t) for b, (t, _, _) in zip(batches, parts)], [m for _, m, _ in parts], [i for _, _, i in parts]


def lm_spike_context(model: torch.nn.Module, batches: list[LMBatch], tokenizer: Any = None,
                     rng_state: Any = None):
    """A ``SpikeContext`` for the step: one micro-batch as plain tensors, several as sequences."""
    from ..spikes.context import SpikeContext

    fns, masks, ids = lm_loss_fns(model, batches)
    if len(batches) == 1:
        return SpikeContext(loss_fn=fns[0], token_mask=masks[0], input_ids=ids[0], tokenizer=tokenizer,
                            rng_state=rng_state)
    return SpikeContext(loss_fn=fns, token_mask=masks, input_ids=ids, tokenizer=tokenizer, rng_state=rng_state)


class MicroBatchCapture:
    """A forward pre-hook that records each training forward's token ids (not during eval, under
    ``no_grad``, or while ``paused()``: the localizer's own probes call the model too)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches: list[LMBatch] = []
        self.rng_state: Any = None  # CPU RNG before the step's first forward: probes replay its dropout
        self._paused = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._paused or not module.training or not torch.is_grad_enabled():
            return
        batch = LMBatch.from_call(args, kwargs)
        if batch is None:
            return
        if not self.batches:
            self.rng_state = save_rng()  # CPU and CUDA: probes replay the step's dropout
        self.batches.append(batch)
        if len(self.batches) > MAX_HELD:  # nobody takes them: keep the newest only
            del self.batches[0]

    def add(self, batch: LMBatch | None) -> None:
        """Record a batch seen elsewhere (Lightning's ``on_train_batch_start``)."""
        if batch is not None:
            if not self.batches:
                self.rng_state = save_rng()  # CPU and CUDA: probes replay the step's dropout
            self.batches.append(batch)

    def take(self) -> tuple[list[LMBatch], Any]:
        out, rng = self.batches, self.rng_state
        self.batches, self.rng_state = [], None
        return out, rng

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class BatchList(MicroBatchCapture):
    """The same interface without a hook: batches arrive through ``add()``."""

    def __init__(self) -> None:  # noqa: D401 - no model hook
        self.batches, self.rng_state, self._paused, self._handle = [], None, 0, None


def resolve_tokenizer(model: torch.nn.Module, tokenizer: Any = None) -> Any:
    """The tokenizer given, else the model's ``config.name_or_path`` tokenizer when that path is a
    local directory (never downloads), else None (the table shows token ids)."""
    if tokenizer is not None:
        return tokenizer
    path = getattr(getattr(model, "config", None), "name_or_path", None)
    if not path or not os.path.isdir(str(path)):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # no tokenizer files there: ids it is
        log.info("gradloc-track: no tokenizer at %s (%r); showing token ids", path, exc)
        return None

