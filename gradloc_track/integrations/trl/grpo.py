"""GRPOTrainer adapter: record each micro-batch TRL trains on, hand the step's context to the monitor.

Three wrappers on the trainer (``trainer.py``'s ``MethodPatch``), all removed at train end:

- ``compute_loss`` (public, the hook ``Trainer.training_step`` calls once per micro-batch): the
  ``inputs`` dict TRL built (ids, masks, advantages, old/ref log-probs, ``num_items_in_batch``),
  the loss settings and the RNG state, recorded right before TRL's own forward;
- ``_calculate_rewards`` and ``_generate_and_score_completions`` (private, optional): each row
  of the generation batch is tagged with its reward and its (group, index) BEFORE TRL shuffles
  and splits that batch, so a culprit names the completion it came from. Without them (another
  TRL version) the table simply has no reward/group/index columns.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .grpo_batch import (SEGMENT_NAMES, TAG_GROUP, TAG_INDEX, TAG_REWARD, GRPOMicroBatch, make_loss_fn,
                         rebuilt_grad, rl_columns)
from .grpo_loss import unsupported
from ..rl_columns import LazyColumns
from .trainer import MethodPatch

RL_COLUMNS = ("advantage", "logprob", "old_logprob", "ratio", "entropy")
SAMPLE_TAGS = {TAG_REWARD: "reward", TAG_GROUP: "group", TAG_INDEX: "index"}
# the first micro-batch's check: ||g_rebuilt - g_trainer|| within this fraction of the larger gradient's norm on
# the output layer (fp32 agrees to ~1e-5; under bf16/fp16 autocast TRL's fused head rounds differently, ~1e-2)
FP32_TOL, HALF_TOL = 1e-3, 5e-2


def check_param(model: torch.nn.Module) -> torch.Tensor | None:
    """The output layer's weight (every policy loss reaches it through the logits), else the last
    trainable parameter."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and w.requires_grad:
        return w
    return next((p for p in reversed(list(model.parameters())) if p.requires_grad), None)


class GRPOAdapter:
    """``context()`` after the step's last backward; ``remove()`` at train end."""

    def __init__(self, trainer: Any, model: torch.nn.Module, tokenizer: Any = None) -> None:
        self.trainer, self.model, self.tokenizer = trainer, model, tokenizer
        self.batches: list[GRPOMicroBatch] = []
        self.skipped: str | None = unsupported(trainer)
        self.checked = False  # the first micro-batch's loss compared with the rebuild (``_check``)
        self._rewards: torch.Tensor | None = None
        self._patches = [MethodPatch(trainer, "compute_loss", self._wrap_compute_loss)]
        for name, make in (("_calculate_rewards", self._wrap_rewards), ("_generate_and_score_completions",
                                                                        self._wrap_generate)):
            if callable(getattr(trainer, name, None)):
                self._patches.append(MethodPatch(trainer, name, make))
        if self.skipped:
            warnings.warn(f"gradloc-track: GRPO spikes are detected but not localized: {self.skipped}", UserWarning,
                          stacklevel=3)

    # -- wrappers ---------------------------------------------------------------------------
    def _wrap_compute_loss(self, original):
        def compute_loss(model, inputs, *args, **kwargs):
            mb = None
            if self.trainer.model.training and torch.is_grad_enabled() and not self.skipped:
                why = unsupported(self.trainer, inputs)
                if why is None:
                    mb = GRPOMicroBatch.record(self.trainer, inputs)  # RNG saved now
                    self.batches.append(mb)
                else:
                    self._skip(why)
            out = original(model, inputs, *args, **kwargs)
            if mb is not None and not self.checked:
                self._check(mb, out[0] if isinstance(out, tuple) else out)
            return out

        return compute_loss

    def _check(self, mb: GRPOMicroBatch, theirs: torch.Tensor) -> None:
        """Once, on the run's first micro-batch: the gradient of the loss the trainer returned against the
        rebuild's, on the output layer's weight (``torch.autograd.grad``: nothing lands in ``.grad``).
        A trainer whose loss is not GRPOTrainer's (a patched method, another TRL version) is then
        detection only, never localized with a wrong loss. Gradients, not values: an on-policy GRPO
        loss is ~0 whatever its form (its advantages cancel), its gradient is not."""
        self.checked = True
        param = check_param(self.model)
        if param is None or not theirs.requires_grad:
            return
        try:
            (g_theirs,) = torch.autograd.grad(theirs, param, retain_graph=True, allow_unused=True)
            g_ours = rebuilt_grad(self.model, self.trainer, mb, param, self.trainer.accelerator.autocast)
            g_theirs = torch.zeros_like(param) if g_theirs is None else g_theirs
            # host sync: once per run
            diff, scale = torch.stack([(g_ours - g_theirs).norm(), torch.maximum(g_ours.norm(), g_theirs.norm())]
                                      ).float().tolist()
        except Exception as exc:  # a guard: when it cannot run, the rebuild stays (said once)
            warnings.warn(f"gradloc-track: could not check the rebuilt GRPO loss against the trainer's: {exc!r}")
            return
        half = bool(getattr(self.trainer.args, "bf16", False) or getattr(self.trainer.args, "fp16", False))
        if diff > (HALF_TOL if half else FP32_TOL) * max(scale, 1e-30):
            name = type(self.trainer).__name__
            self._skip(f"the loss {name} returned on its first micro-batch is not the rebuilt GRPO loss (their "
                       f"gradients differ by {diff / max(scale, 1e-30):.0%}): {name} computes another loss (a patched "
                       "method, another TRL version)")

    def _wrap_rewards(self, original):
        def calculate_rewards(*args, **kwargs):
            out = original(*args, **kwargs)
            self._rewards = out.detach() if isinstance(out, torch.Tensor) else None  # (N_all, n_funcs)
            return out

        return calculate_rewards

    def _wrap_generate(self, original):
        def generate_and_score(*args, **kwargs):
            self._rewards = None
            out = original(*args, **kwargs)
            try:
                self._tag_rows(out)
            except Exception as exc:  # tags are a nicety: never break TRL's batch
                warnings.warn(f"gradloc-track: could not tag GRPO completions with reward/group: {exc!r}")
            return out

        return generate_and_score

    def _tag_rows(self, out: dict) -> None:
        """(B,) reward / group / index rows, before TRL shuffles and splits the generation batch."""
        ids = out.get("completion_ids")
        if not isinstance(ids, torch.Tensor):
            return
        tr, n = self.trainer, ids.shape[0]
        start = tr.accelerator.process_index * n
        row = torch.arange(start, start + n, device=ids.device)  # index in the global generation batch
        gen = tr.num_generations if tr.model.training else getattr(tr, "num_generations_eval", tr.num_generations)
        out[TAG_GROUP], out[TAG_INDEX] = row // gen, row % gen
        r = self._rewards
        if r is not None and r.dim() == 2 and r.shape[0] >= start + n:
            weights = tr.reward_weights.to(r.device).unsqueeze(0)
            total = (r * weights).nansum(dim=1)
            total[torch.isnan(r).all(dim=1)] = float("nan")  # unscorable: as TRL logs it
            out[TAG_REWARD] = total[start:start + n].to(ids.device)

    def _skip(self, why: str) -> None:
        if self.skipped is None:
            self.skipped = why
            self.batches.clear()
            warnings.warn(f"gradloc-track: GRPO spikes are detected but not localized: {why}", UserWarning,
                          stacklevel=3)

    # -- the step ---------------------------------------------------------------------------
    def context(self) -> Any:
        """The step's ``SpikeContext`` (its micro-batches taken), or None when nothing was recorded."""
        from ...spikes.context import SpikeContext, per_micro_batch

        batches, self.batches = self.batches, []
        if not batches or self.skipped:
            return None
        autocast = self.trainer.accelerator.autocast
        fns = [make_loss_fn(self.model, self.trainer, mb, autocast) for mb in batches]
        pick = per_micro_batch(len(batches))

        def columns():
            cols = [rl_columns(self.model, mb, autocast) for mb in batches]
            return {k: pick([c[k] for c in cols]) for k in cols[0]}

        keys = list(RL_COLUMNS) + (["ref_logprob"] if batches[0].policy.ref_logps is not None else [])
        tags = [k for k in SAMPLE_TAGS if all(k in mb.tags for mb in batches)]
        return SpikeContext(
            loss_fn=pick(fns), token_mask=pick([mb.token_mask() for mb in batches]),
            input_ids=pick([mb.display_ids() for mb in batches]), tokenizer=self.tokenizer,
            extra_columns=LazyColumns(keys, columns),
            sample_columns={SAMPLE_TAGS[k]: pick([mb.tags[k] for mb in batches]) for k in tags},
            rng_state=pick([mb.rng for mb in batches]),
            segment_ids=pick([mb.segment_ids() for mb in batches]), segment_names=SEGMENT_NAMES)

    def remove(self) -> None:
        for p in reversed(self._patches):
            p.remove()
        self._patches.clear()
        self.batches.clear()
