"""One GRPO micro-batch as TRL built it, laid out for the localizer.

The model runs on ``[prompt | completion]`` (B, P+C); its logits at position ``P-1+j`` score
completion token ``j``. The localizer's token mask, the display ids and every per-token column
are (B, P+C) in those model positions (the ghost pass hooks see (B, P+C) activations): the term
of completion token ``j`` sits at ``P-1+j`` and shows that token, as the causal-LM capture does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...localizer.probe import restore_rng, save_rng
from ..rl_columns import prompt_response_segments
from .grpo_loss import GRPOLossSpec, PolicyInputs, ratio_terms, token_losses

SEGMENT_NAMES = ("prompt", "completion")
# row tags added to TRL's generation batch before it is shuffled and split (``grpo.GRPOAdapter._tag_rows``)
TAG_REWARD, TAG_GROUP, TAG_INDEX = "gradloc_reward", "gradloc_group", "gradloc_index"


@dataclass
class GRPOMicroBatch:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) right-padded
    completion_mask: torch.Tensor  # (B, C)
    policy: PolicyInputs
    spec: GRPOLossSpec
    rng: dict  # the RNG right before TRL's forward of this micro-batch: probes replay its dropout
    tags: dict[str, torch.Tensor] = field(default_factory=dict)  # (B,) reward / group / index

    @classmethod
    def record(cls, trainer: Any, inputs: dict) -> "GRPOMicroBatch":
        det = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        return cls(det["prompt_ids"], det["prompt_mask"], det["completion_ids"], det["completion_mask"],
                   PolicyInputs.from_inputs(det), GRPOLossSpec.from_trainer(trainer), save_rng(),
                   {k: det[k] for k in (TAG_REWARD, TAG_GROUP, TAG_INDEX) if isinstance(det.get(k), torch.Tensor)})

    @property
    def P(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def C(self) -> int:
        return self.completion_ids.shape[1]

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask), each (B, P+C), as TRL's ``_compute_loss`` builds them."""
        return (torch.cat([self.prompt_ids, self.completion_ids], 1),
                torch.cat([self.prompt_mask, self.completion_mask], 1))

    def to_positions(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """A (B, C) or (B, 1) completion-aligned tensor placed at model positions (B, P+C)."""
        B = self.prompt_ids.shape[0]
        out = torch.full((B, self.P + self.C), fill, dtype=x.dtype, device=x.device)
        out[:, self.P - 1:self.P + self.C - 1] = x.expand(B, self.C)
        return out

    def token_mask(self) -> torch.Tensor:
        """(B, P+C) float: 1 where a completion token's loss term sits (no host sync)."""
        return self.to_positions(self.policy.mask)

    def display_ids(self) -> torch.Tensor:
        """(B, P+C): position t shows token t+1 (the token its term scores); the last repeats."""
        ids, _ = self.model_inputs()
        return torch.cat([ids[:, 1:], ids[:, -1:]], 1)

    def segment_ids(self) -> torch.Tensor:
        """(B, P+C): prompt / completion for the token each position shows, -1 for padding."""
        _, att = self.model_inputs()
        shown = torch.cat([att[:, 1:], torch.zeros_like(att[:, :1])], 1)  # the shown token is real
        return prompt_response_segments(shown[:, :self.P - 1], shown[:, self.P - 1:])


def policy_logps(model: torch.nn.Module, mb: GRPOMicroBatch, autocast: Callable = contextlib.nullcontext
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each sampled completion token, entropy), each (B, C), zero on padding.

    The model's own forward (its LM head runs as a module, so the ghost pass sees it), logits
    divided by the sampling temperature, as TRL's fused head does.
    """
    ids, att = mb.model_inputs()
    with autocast():
        out = model(input_ids=ids, attention_mask=att)
    logits = getattr(out, "logits", out)[:, mb.P - 1:-1].float() / mb.spec.temperature  # (B, C, V)
    logp_all = logits.log_softmax(-1)
    lp = logp_all.gather(-1, mb.completion_ids.unsqueeze(-1)).squeeze(-1)  # (B, C)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, C)
    real = mb.completion_mask.bool()
    return lp.masked_fill(~real, 0.0), entropy.masked_fill(~real, 0.0)


def make_loss_fn(model: torch.nn.Module, trainer: Any, mb: GRPOMicroBatch,
                 autocast: Callable = contextlib.nullcontext) -> Callable[[torch.Tensor], torch.Tensor]:
    """``loss_fn(keep)`` over (B, P+C) positions: TRL's loss restricted to the kept tokens, normalisers fixed."""
    lo, hi = mb.P - 1, mb.P + mb.C - 1

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        lp, entropy = policy_logps(model, mb, autocast)
        terms = token_losses(mb.spec, trainer, lp, entropy, mb.policy)  # (B, C)
        return (terms * keep[:, lo:hi].to(terms.dtype)).sum()

    return loss_fn


def rebuilt_grad(model: torch.nn.Module, trainer: Any, mb: GRPOMicroBatch, param: torch.Tensor,
                 autocast: Callable = contextlib.nullcontext) -> torch.Tensor:
    """The gradient of the rebuilt full-mask loss of ``mb`` with respect to ``param`` alone (no ``.grad``
    touched): one forward replaying the micro-batch's dropout, the caller's RNG left as it was."""
    now = save_rng()
    try:
        restore_rng(mb.rng)
        with torch.enable_grad():
            lp, entropy = policy_logps(model, mb, autocast)
            loss = token_losses(mb.spec, trainer, lp, entropy, mb.policy).sum()
            (grad,) = torch.autograd.grad(loss, param, allow_unused=True)
    finally:
        restore_rng(now)
    return torch.zeros_like(param) if grad is None else grad


def rl_columns(model: torch.nn.Module, mb: GRPOMicroBatch, autocast: Callable = contextlib.nullcontext
               ) -> dict[str, torch.Tensor]:
    """Per-token columns at model positions (B, P+C): advantage, logprob, old_logprob, ratio, entropy
    (+ ref_logprob with a KL term). One no-grad forward replaying the micro-batch's dropout."""
    now = save_rng()
    try:
        restore_rng(mb.rng)
        with torch.no_grad():
            lp, entropy = policy_logps(model, mb, autocast)
    finally:
        restore_rng(now)
    p = mb.policy
    old = lp if p.old_logps is None else p.old_logps
    cols = {"advantage": p.advantages.float(), "logprob": lp, "old_logprob": old.float(),
            "ratio": ratio_terms(mb.spec, lp, p)[1], "entropy": entropy}
    if p.ref_logps is not None:
        cols["ref_logprob"] = p.ref_logps.float()
    return {k: mb.to_positions(v.float()) for k, v in cols.items()}
