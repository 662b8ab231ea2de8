"""The probe loss: verl's own ``forward_step`` with verl's own loss function, the loss masks cut.

``loss_fn(keep)`` replays the micro-batch through the engine's ``forward_step(micro_batch,
loss_function)`` (the engine's model call, autocast, temperature, log-prob and entropy heads,
then ``ppo_loss``: policy loss mode, ``loss_agg_mode``, entropy and KL terms, ``rollout_is_weights``)
with ``response_mask``/``loss_mask`` cut to the kept terms. The global normalisers verl put on the
batch (``batch_num_tokens``, ``global_batch_size``, ``dp_size``) are the step's, so:

- ``token-mean`` (sum / the global token count), ``token-sum``, ``seq-mean-token-sum`` and
  ``seq-mean-token-sum-norm`` (per-row sums / the global row count): the loss of the kept terms
  is a sum over them, as the localizer needs;
- ``seq-mean-token-mean`` divides each row by ITS OWN count of masked tokens, which cutting the
  mask would change. A row with ``k`` of its ``n`` terms kept contributes ``k/n`` times verl's
  loss of that row alone (``(1/k) sum_kept`` -> ``(1/n) sum_kept``): rows are grouped by ``k/n``
  and verl's loss function is called once per group on the one forward's output, each scaled.

Sequence-level or batch-statistic policy losses (GSPO, geo_mean, clip_cov, kl_cov) are not sums
over tokens: the localizer's additivity check says so and the spike is not localized.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .layout import MASKS, MicroBatch

PER_ROW_MEAN = "seq-mean-token-mean"


def agg_mode(loss_function: Any) -> str | None:
    """The ``loss_agg_mode`` of the actor config verl bound to its loss function (None: unknown)."""
    config = getattr(loss_function, "keywords", {}).get("config") if hasattr(loss_function, "keywords") else None
    return getattr(config, "loss_agg_mode", None)


def _rows_only(data: Any, rows: torch.Tensor) -> Any:
    """``data`` with the loss masks kept on ``rows`` (B,) only."""
    out = data.copy()
    for name in MASKS:
        if name in out.keys() and isinstance(out[name], torch.Tensor) and not out[name].is_nested:
            out[name] = out[name] * rows.unsqueeze(-1).to(out[name].dtype)
    return out


def per_row_scaled(loss_function: Callable, full: torch.Tensor) -> Callable:
    """``loss_function`` for a cut mask under ``seq-mean-token-mean``: rows grouped by their kept
    share ``k/n`` of the FULL mask ``full`` (B, R), each group's loss scaled by its share."""
    n = full.sum(-1)

    def scaled(model_output, data, dp_group=None):
        kept = data["response_mask"].float().sum(-1)
        share = kept / n.to(kept.device).clamp(min=1)
        groups = torch.unique(share[kept > 0]).tolist()  # host sync: a few groups per probe
        if not groups:  # nothing kept: verl's loss of an empty mask (zero, with the graph)
            return loss_function(model_output=model_output, data=data, dp_group=dp_group)
        total, metrics = None, {}
        for s in groups:
            loss, metrics = loss_function(model_output=model_output, data=_rows_only(data, (share == s) & (kept > 0)),
                                          dp_group=dp_group)
            total = loss * s if total is None else total + loss * s
        return total, metrics

    return scaled


def make_loss_fn(engine: Any, mb: MicroBatch, loss_function: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss_fn(keep)`` over (B, P+R) positions: verl's loss of the kept terms, normalisers fixed."""
    per_row = agg_mode(loss_function) == PER_ROW_MEAN
    fn = per_row_scaled(loss_function, mb.response_mask()) if per_row else loss_function

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        loss, _ = engine.forward_step(mb.narrowed(keep), loss_function=fn, forward_only=False)
        return loss

    return loss_fn
