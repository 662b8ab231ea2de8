"""SFTTrainer adapter: the loss TRL 1.16 computes, packed documents named, not rows.

``SFTTrainer(packing=True)`` (BFD, padding-free) flattens a micro-batch into one row of several
documents, restarting ``position_ids`` at 0 where each begins (labels there are -100). Its loss
is ``-sum(log p(label)) / num_items_in_batch`` (``loss_type="dft"`` weighs each term by its
detached probability), ``num_items_in_batch`` being Trainer's count of the step's labels, a
fixed normaliser already. The rebuild calls the model's own forward with every key TRL passed
but the labels (``position_ids`` keeps documents apart, as in training), so

    loss(keep) = sum_{b,t} keep[b,t] * w[b,t] * -log p(label[b, t+1]) / num_items_in_batch

and the (B, T) document map (``SpikeContext.document_ids``, and a ``document`` table column)
comes from the position-id restarts: term ``t`` belongs to the document of the token it scores.
``packing_strategy="wrapped"`` cuts the concatenated documents into rows with no position ids (they
attend across each other, as in pretraining): there each end-of-sequence token ends a document
(``eos_documents``), so a bad document is named as itself, not as "spread over" a one-row batch
(held-out tester, stop 57). A chat template whose end-of-turn token is the end-of-sequence one (Qwen's
``<|im_end|>``, Llama 3's ``<|eot_id|>``) makes each turn a document there (BFD packing names
conversations).

Not rebuilt (the run is then monitored, spikes detected, not localized, and the callback says
why): ``compute_loss_func``, label smoothing, a mixture-of-experts load-balancing loss, sequence
parallelism, multimodal inputs.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...localizer.probe import save_rng
from ..batches import IGNORE, LMBatch
from ..sample_info import SAMPLE_INFO_KEY, sample_columns
from ..trainer_frames import tokens_averaged_scale
from .trainer import MethodPatch

NOT_FORWARDED = ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head")


def unsupported(tr: Any, inputs: dict | None = None) -> str | None:
    """Why this SFTTrainer's loss cannot be rebuilt per token, or None."""
    args = tr.args
    if getattr(tr, "compute_loss_func", None) is not None:
        return "a custom compute_loss_func computes the loss"
    if getattr(tr, "label_smoother", None) is not None:
        return "label smoothing mixes every vocabulary entry into each term's normaliser"
    if getattr(args, "loss_type", "nll") not in ("nll", "dft"):
        return f"loss_type={args.loss_type!r} is not one gradloc-track rebuilds (nll, dft)"
    if getattr(tr, "aux_loss_enabled", False):
        return "the model adds a mixture-of-experts load-balancing loss, not a sum over tokens"
    pc = getattr(tr.accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "sp_enabled", False) or getattr(pc, "cp_enabled", False)):
        return "sequence/context parallelism shards each row across ranks"
    if inputs is not None and (inputs.get("pixel_values") is not None or inputs.get("shift_labels") is not None):
        return "multimodal or pre-shifted inputs are not replayed by the rebuilt loss"
    return None


def document_map(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of the token each position's term scores (position t scores t+1)."""
    start = (position_ids == 0).long()
    start[:, 0] = 1
    doc = start.cumsum(1) - 1  # (B, T) the document of each token
    return torch.cat([doc[:, 1:], doc[:, -1:]], 1)


def eos_documents(input_ids: torch.Tensor, eos: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) document index of the token each position's term scores, documents ending at each ``eos`` token
    (the end-of-sequence token is its document's last; the token after it starts the next). Padding
    (``attention_mask`` 0) ends nothing: with the pad token the end-of-sequence one (TRL's default when a
    tokenizer has none), a short last row's padding was one "document" per position (review, stop 57)."""
    ends = (input_ids == eos).long()
    if attention_mask is not None and attention_mask.shape == input_ids.shape:
        ends = ends * (attention_mask != 0).long()
    doc = ends.cumsum(1) - ends  # the document of each token
    return torch.cat([doc[:, 1:], doc[:, -1:]], 1)


def packed_eos(tr: Any) -> int | None:
    """The end-of-sequence id that separates SFTTrainer's packed documents (``packing=True``), or None."""
    args, tok = tr.args, getattr(tr, "processing_class", None)
    if not getattr(args, "packing", False) or tok is None:
        return None
    name = getattr(args, "eos_token", None)
    eos = tok.convert_tokens_to_ids(name) if name and hasattr(tok, "convert_tokens_to_ids") else None
    eos = eos if isinstance(eos, int) else getattr(tok, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


@dataclass
class SFTMicroBatch:
    batch: LMBatch
    forward: dict  # the model's keyword arguments as training passed them, labels left out
    num_items: Any  # the step's normaliser (Trainer's num_items_in_batch), or None: this batch's count
    scale: float  # x processes when tokens are averaged across devices (as TRL does)
    dft: bool
    rng: dict
    eos: int | None = None  # packed documents end at this token where no position ids restart (``wrapped``)

    @classmethod
    def record(cls, tr: Any, inputs: dict, num_items: Any) -> "SFTMicroBatch":
        det = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        info = det.pop(SAMPLE_INFO_KEY, None)  # keep_columns' dataset index and metadata: the table's, not the model's
        batch = LMBatch(det["input_ids"], det.get("labels"), det.get("attention_mask"), info=info)
        scale = tokens_averaged_scale(tr) if num_items is not None else 1.0
        forward = {k: v for k, v in det.items() if k not in NOT_FORWARDED}
        forward["use_cache"] = False  # as TRL's compute_loss sets it
        return cls(batch, forward, num_items, scale,
                   getattr(tr.args, "loss_type", "nll") == "dft", save_rng(), packed_eos(tr))

    def documents(self) -> torch.Tensor | None:
        ids, pos = self.batch.input_ids, self.forward.get("position_ids")
        if isinstance(pos, torch.Tensor) and pos.shape == ids.shape:
            return document_map(pos)
        return eos_documents(ids, self.eos, self.batch.attention_mask) if self.eos is not None else None


def make_loss_fn(model: torch.nn.Module, mb: SFTMicroBatch) -> Callable[[torch.Tensor], torch.Tensor]:
    tgt, mask, _ = mb.batch.targets()
    n = mb.num_items if mb.num_items is not None else mask.sum()
    norm = torch.as_tensor(n, dtype=torch.float32, device=mask.device).clamp(min=1.0) / mb.scale

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        logits = model(**mb.forward).logits  # (B, T, V): position t scores tgt[:, t]
        B, T, V = logits.shape
        nll = F.cross_entropy(logits.reshape(B * T, V).float(), tgt.reshape(-1), ignore_index=IGNORE,
                              reduction="none").view(B, T)
        if mb.dft:
            nll = nll * torch.exp(-nll).detach()
        return (nll * keep.to(nll.dtype)).sum() / norm

    return loss_fn


class SFTAdapter:
    """Records each micro-batch SFTTrainer trains on; ``context()`` after the step's last backward."""

    def __init__(self, trainer: Any, model: torch.nn.Module, tokenizer: Any = None) -> None:
        self.trainer, self.model, self.tokenizer = trainer, model, tokenizer
        self.batches: list[SFTMicroBatch] = []
        self.skipped = unsupported(trainer)
        if self.skipped:
            warnings.warn(f"gradloc-track: SFT spikes are detected but not localized: {self.skipped}", UserWarning,
                          stacklevel=3)
        self._patch = MethodPatch(trainer, "compute_loss", self._wrap)

    def _wrap(self, original):
        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
            if self.trainer.model.training and torch.is_grad_enabled() and not self.skipped:
                why = unsupported(self.trainer, inputs)
                if why is None:
                    self.batches.append(SFTMicroBatch.record(self.trainer, inputs, num_items_in_batch))
                else:
                    self.skipped = why
                    warnings.warn(f"gradloc-track: SFT spikes are detected but not localized: {why}", UserWarning,
                                  stacklevel=2)
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                            **kwargs)

        return compute_loss

    def context(self) -> Any:
        from ...spikes.context import SpikeContext, per_micro_batch

        batches, self.batches = self.batches, []
        if not batches or self.skipped:
            return None
        pick = per_micro_batch(len(batches))
        parts = [mb.batch.targets() for mb in batches]
        docs = [mb.documents() for mb in batches]
        packed = all(d is not None for d in docs)
        return SpikeContext(
            loss_fn=pick([make_loss_fn(self.model, mb) for mb in batches]), token_mask=pick([m for _, m, _ in parts]),
            input_ids=pick([i for _, _, i in parts]), tokenizer=self.tokenizer,
            rng_state=pick([mb.rng for mb in batches]),
            extra_columns={"document": pick(docs)} if packed else {},
            sample_columns=sample_columns([mb.batch for mb in batches]),
            document_ids=pick(docs) if packed else None,
            segment_ids=pick(docs) if packed else None)

    def remove(self) -> None:
        self._patch.remove()
        self.batches.clear()
