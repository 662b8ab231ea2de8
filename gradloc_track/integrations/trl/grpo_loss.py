"""GRPOTrainer's loss, rebuilt per token with FIXED normalisers (checked against TRL 1.16's ``_compute_loss``).

TRL computes, per completion token ``t`` of row ``b`` (``lp`` = the policy's log-prob of the
sampled token, ``old`` = ``old_per_token_logps`` or ``lp.detach()``, ``A`` = the advantage)::

    r = exp(lp - old)                      (token level; "sequence": exp(masked mean of lp - old))
    l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)      grpo, bnpo, dr_grpo, dapo, luspo
        (r capped at ``delta`` first when set); cispo, sapo and vespo have their own forms
    l = l * off-policy mask * entropy mask * vLLM IS ratio   (each only when TRL applies it)
    l = l + beta * KL,  KL = exp(ref - lp) - (ref - lp) - 1  (x r with use_bias_correction_kl)

and reduces ``l * mask`` by the loss type's normaliser; the entropy bonus subtracts
``coef * sum(H * mask) / sum(mask) / G``. Every one of those is a SUM over tokens once the
normalisers are counted from the FULL mask and held fixed:

    grpo, sapo   1 / (B * n_b * G)             n_b = row b's loss tokens (full mask), G = accumulation
    bnpo         1 / (sum(mask) * G)
    dr_grpo      1 / (B * max_completion_length * G)
    dapo, cispo, vespo   processes * spg / (num_items_in_batch * G)
    luspo        1 / (B * G)

so ``loss(keep) = sum_{b,t} keep[b,t] * mask[b,t] * w_b * l[b,t]`` equals TRL's loss with
``keep = 1`` and subset gradients add up. Per-row and batch statistics that TRL computes from
the forward (sequence-level ratios, the entropy quantile, the off-policy mask, VESPO's weights)
are computed from the full mask on every call: the same values on every probe, since the
parameters and the replayed dropout do not change. Under ``importance_sampling_level="sequence"``
(GSPO, luspo) every token of a row carries the row's ratio, so a culprit row's tokens are
found together: the answer is the completion.

Not rebuildable: a mixture-of-experts load-balancing loss (``aux_loss``) is a function of the
whole batch's routing, not a sum over tokens; multimodal inputs (pixel values) are not replayed.
Then localization is off for the run (detection and metrics go on) and the callback says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
              "mm_token_type_ids", "image_position_ids", "num_images")


@dataclass(frozen=True)
class GRPOLossSpec:
    """What TRL's ``_compute_loss`` reads from the trainer, read right before it runs (the adaptive
    entropy coefficient changes inside the step's last call)."""

    loss_type: str
    eps_low: float
    eps_high: float
    delta: float | None
    beta: float
    bias_correction_kl: bool
    sequence_level: bool
    temperature: float
    accum: int  # current_gradient_accumulation_steps
    processes: int
    steps_per_generation: int
    max_completion_length: int
    sapo_tau: tuple[float, float]  # (positive, negative advantages)
    vespo: tuple[float, float, float, float]  # k_pos, lambda_pos, k_neg, lambda_neg
    entropy_quantile: float  # top_entropy_quantile (1.0: no entropy mask)
    off_policy_threshold: float | None
    vllm_is: bool  # multiply by the batch's importance_sampling_ratio
    entropy_coef: float  # the bonus coefficient this call applies (0: none)

    @classmethod
    def from_trainer(cls, tr: Any) -> "GRPOLossSpec":
        a = tr.args
        return cls(
            loss_type=tr.loss_type, eps_low=float(tr.epsilon_low), eps_high=float(tr.epsilon_high),
            delta=a.delta, beta=float(tr.beta), bias_correction_kl=bool(getattr(a, "use_bias_correction_kl", False)),
            sequence_level=getattr(tr, "importance_sampling_level", "token") == "sequence",
            temperature=float(tr.temperature), accum=int(getattr(tr, "current_gradient_accumulation_steps",
                                                                 a.gradient_accumulation_steps)),
            processes=int(tr.accelerator.num_processes), steps_per_generation=int(a.steps_per_generation),
            max_completion_length=int(tr.max_completion_length),
            sapo_tau=(float(getattr(a, "sapo_temperature_pos", 1.0)), float(getattr(a, "sapo_temperature_neg", 1.0))),
            vespo=tuple(float(getattr(a, f"vespo_{n}", 0.0)) for n in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")),
            entropy_quantile=float(getattr(tr, "top_entropy_quantile", 1.0)),
            off_policy_threshold=getattr(tr, "off_policy_mask_threshold", None),
            vllm_is=bool(getattr(tr, "use_vllm", False) and getattr(tr, "vllm_importance_sampling_correction", False)
                         and tr.loss_type != "vespo"),
            entropy_coef=_entropy_coef(tr))


def _entropy_coef(tr: Any) -> float:
    """The bonus coefficient TRL applies in this call (its adaptive gate read before the call)."""
    if not getattr(tr, "_entropy_bonus_enabled", False):
        return 0.0
    if getattr(tr, "use_adaptive_entropy", False):
        return float(tr.entropy_coef) if tr._last_world_entropy <= tr.args.entropy_target else 0.0
    return float(tr.entropy_coef)


def unsupported(tr: Any, inputs: dict | None = None) -> str | None:
    """Why this trainer's loss cannot be rebuilt per token, or None."""
    lt = getattr(tr, "loss_type", None)
    if lt not in LOSS_TYPES:
        return f"loss_type={lt!r} is not one gradloc-track rebuilds ({', '.join(LOSS_TYPES)})"
    if getattr(tr, "aux_loss_enabled", False):
        return ("the model adds a mixture-of-experts load-balancing loss (router_aux_loss_coef), a function of the "
                "whole batch's routing, not a sum over tokens; set router_aux_loss_coef=0 to localize")
    if inputs is not None and any(inputs.get(k) is not None for k in MULTIMODAL):
        return "multimodal inputs (pixel values) are not replayed by the rebuilt loss"
    return None


@dataclass
class PolicyInputs:
    """One micro-batch's loss inputs as TRL built them, completion-aligned: (B, C) unless noted."""

    mask: torch.Tensor  # float: completion_mask (x tool_mask)
    advantages: torch.Tensor  # (B, 1) or (B, C)
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    is_ratio: torch.Tensor | None  # vLLM importance sampling ratio, (B, C) or (B, 1)
    sampling_logps: torch.Tensor | None
    num_items: torch.Tensor | None  # the generation batch's loss tokens (dapo, cispo, vespo)

    @classmethod
    def from_inputs(cls, inputs: dict) -> "PolicyInputs":
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        adv = inputs["advantages"]
        return cls(mask=mask.float(), advantages=adv.unsqueeze(1) if adv.dim() == 1 else adv,
                   old_logps=inputs.get("old_per_token_logps"), ref_logps=inputs.get("ref_per_token_logps"),
                   is_ratio=inputs.get("importance_sampling_ratio"),
                   sampling_logps=inputs.get("sampling_per_token_logps"), num_items=inputs.get("num_items_in_batch"))


def row_weights(spec: GRPOLossSpec, p: PolicyInputs) -> torch.Tensor:
    """(B, 1) fixed weight of each row's token terms: the loss type's normaliser from the full mask."""
    B = p.mask.shape[0]
    ones = p.mask.new_ones(B, 1)
    G = spec.accum
    if spec.loss_type in ("grpo", "sapo"):
        return 1.0 / (B * p.mask.sum(-1, keepdim=True).clamp(min=1.0) * G)
    if spec.loss_type == "bnpo":
        return ones / (p.mask.sum().clamp(min=1.0) * G)
    if spec.loss_type == "dr_grpo":
        return ones / (B * spec.max_completion_length * G)
    if spec.loss_type == "luspo":
        return ones / (B * G)
    n = p.num_items.to(p.mask).clamp(min=1.0) / spec.processes * G / spec.steps_per_generation  # dapo, cispo, vespo
    return ones / n


def ratio_terms(spec: GRPOLossSpec, lp: torch.Tensor, p: PolicyInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(log importance weight, importance ratio): (B, C) at token level, (B, 1) at sequence level."""
    old = lp.detach() if p.old_logps is None else p.old_logps
    log_ratio = lp - old
    if spec.sequence_level:
        log_ratio = ((log_ratio * p.mask).sum(-1) / p.mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return log_ratio, torch.exp(log_ratio)


def surrogate(spec: GRPOLossSpec, tr: Any, lp: torch.Tensor, p: PolicyInputs) -> torch.Tensor:
    """The per-token policy loss before masks and KL, as TRL's loss type computes it."""
    A = p.advantages
    _, coef_1 = ratio_terms(spec, lp, p)
    if spec.loss_type == "cispo":
        return -torch.clamp(coef_1, max=spec.eps_high).detach() * A * lp
    if spec.loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - spec.eps_low, 1 + spec.eps_high)
        if spec.delta is not None:
            coef_1 = torch.clamp(coef_1, max=spec.delta)
        return -torch.min(coef_1 * A, coef_2 * A)
    if spec.loss_type == "sapo":
        tau = torch.where(A > 0, spec.sapo_tau[0], spec.sapo_tau[1])
        return -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * A
    # vespo: TRL's own gamma weights (a detached per-row factor) on the full mask
    old = lp.detach() if p.old_logps is None else p.old_logps
    k_pos, l_pos, k_neg, l_neg = spec.vespo
    phi = type(tr).get_gamma_weights(advantages=A, log_ratio_per_token=lp - old, mask=p.mask,
                                     importance_sampling_ratio=p.is_ratio, k_pos=k_pos, lambda_pos=l_pos,
                                     k_neg=k_neg, lambda_neg=l_neg)
    return -phi * A * lp


def token_losses(spec: GRPOLossSpec, tr: Any, lp: torch.Tensor, entropy: torch.Tensor,
                 p: PolicyInputs) -> torch.Tensor:
    """(B, C) each token's term of TRL's loss, normaliser included: ``loss = (terms * keep).sum()``."""
    loss = surrogate(spec, tr, lp, p)
    if spec.off_policy_threshold is not None:
        sampling = p.sampling_logps if p.sampling_logps is not None else \
            (lp.detach() if p.old_logps is None else p.old_logps)
        loss = loss * type(tr).get_off_policy_mask(advantages=p.advantages, per_token_logps=lp,
                                                   sampling_per_token_logps=sampling, mask=p.mask,
                                                   off_policy_threshold=spec.off_policy_threshold)
    eff = p.mask
    if spec.entropy_quantile < 1.0:
        high = tr.get_high_entropy_mask(entropy, p.mask, 1 - spec.entropy_quantile)  # full mask: fixed
        loss = loss * high
        eff = p.mask * high
    if spec.vllm_is:
        loss = loss * p.is_ratio
    if spec.beta != 0.0:
        d = p.ref_logps - lp
        kl = torch.exp(d) - d - 1
        if spec.bias_correction_kl:
            kl = kl * ratio_terms(spec, lp, p)[1]
        loss = loss + spec.beta * kl
    terms = loss * p.mask * row_weights(spec, p)  # (B, C)
    if spec.entropy_coef != 0.0:
        terms = terms - spec.entropy_coef * entropy * eff / (eff.sum().clamp(min=1.0) * spec.accum)
    return terms
