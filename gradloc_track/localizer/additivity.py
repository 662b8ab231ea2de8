"""Subset probes mean something only when the loss is a SUM over the kept terms with a fixed
normaliser: this checks it once per micro-batch, forward only, before any probe.

Two splits of the terms, each compared with the full loss (six forward passes, the full one
twice):
- whole samples (the first half of the samples | the rest): a per-sample mean keeps its value
  here, so this split alone cannot see it; a batch mean over the kept terms can;
- interleaved (every other term of each sample): every sample's count halves, so any normaliser
  counted from the mask (per sample, per batch, ``ignore_index`` means) breaks the sum.
The error names the normaliser the numbers point to and shows its fixed-normaliser form.
"""
from __future__ import annotations

import math

import torch

from .probe import Prober, check_loss, restore_rng

FIX = ("multiply each per-term loss by mask before reducing, with a FIXED normalizer, e.g. "
       "(per_token_loss * mask).sum() / n_tokens_in_batch, where n_tokens_in_batch is computed from the "
       "full batch, never from mask")
PER_SAMPLE_FIX = ("it divides each sample's sum by the sample's count of KEPT terms (a per-sample mean, e.g. "
                  "((l * mask).sum(1) / mask.sum(1)).mean()). Divide by the FULL mask's counts instead: "
                  "loss = ((per_token_loss * mask).sum(1) / full_counts).mean(), with "
                  "full_counts = token_mask.sum(1).clamp(min=1) computed once from the full mask, never from mask")
TOKEN_MEAN_FIX = ("it divides by the number of KEPT terms (a token mean: (l * mask).sum() / mask.sum(), or "
                  "F.cross_entropy(..., ignore_index=-100)'s default mean over the targets left). Divide by the "
                  "FULL mask's count instead: loss = (per_token_loss * mask).sum() / n_tokens, with "
                  "n_tokens = token_mask.sum() computed once from the full mask; for cross-entropy take "
                  "per_token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), "
                  "reduction='none').view(B, T)")


def check_additive(prober: Prober, i: int, terms: list, rng: dict) -> float:
    """``loss(all) == loss(A) + loss(B)`` for a whole-sample and an interleaved split ``A | B``;
    returns the full loss (a non-finite one is not checked: the non-finite search names its terms)."""
    splits = _splits(terms)
    vals, dtype = _losses(prober, i, [m for _, a, b in splits for m in (a, b)], rng)
    full, again = vals[0], vals.pop()
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3
    if again != full:  # randomness the RNG does not replay: judge only gross breaks (a mean's ~2x)
        tol = max(tol, 0.05, 20 * abs(full - again) / max(abs(full), 1e-30))
    if not math.isfinite(full):
        return full  # non-finite losses are reported once the step's gradient is known
    where = "" if prober.k == 1 else f" (micro-batch {i})"
    if full != 0 and all(v == full for v in vals[1:]):
        raise ValueError(f"loss_fn(mask) does not depend on the mask{where} (same loss with half the terms "
                         f"dropped): {FIX}")
    verdicts = []
    for j, (name, a_terms, b_terms) in enumerate(splits):
        a, b = vals[1 + 2 * j], vals[2 + 2 * j]
        ok = math.isfinite(a) and math.isfinite(b) and _close(full, a + b, abs(a) + abs(b), tol)
        token_mean = math.isfinite(a) and math.isfinite(b) and \
            _close(full * len(terms), a * len(a_terms) + b * len(b_terms), abs(full) * len(terms), tol)
        verdicts.append((name, a, b, ok, token_mean))
    if all(v[3] for v in verdicts):
        return full
    raise ValueError(_message(where, full, verdicts))


def _close(x: float, y: float, scale: float, tol: float) -> bool:
    return abs(x - y) <= tol * max(abs(x), scale) + 1e-12


def _message(where: str, full: float, verdicts: list) -> str:
    """The failing split's numbers and the normaliser they point to: non-finite halves (0/0) or
    whole samples adding up while terms within a sample do not -> per-sample counts; whole
    samples giving ``full * N == a * n_a + b * n_b`` -> a count of the batch's kept terms."""
    name, a, b, _, _ = next(v for v in verdicts if not v[3])
    head = (f"loss_fn(mask) is not additive over the mask{where}: loss(all terms)={full:.6g} but splitting the "
            f"terms {name} gives {a:.6g} + {b:.6g}")
    samples_ok, samples_token_mean = verdicts[0][3], verdicts[0][4]
    if not (math.isfinite(a) and math.isfinite(b)):
        return f"{head} (0/0 for a sample with no kept terms): {PER_SAMPLE_FIX}"
    if samples_ok:
        return f"{head} (whole samples add up, terms within a sample do not): {PER_SAMPLE_FIX}"
    if samples_token_mean:
        return f"{head}: {TOKEN_MEAN_FIX}"
    return (f"{head}. A normaliser counted from the mask (per sample: {PER_SAMPLE_FIX}; or per batch) or a term "
            f"that ignores the mask does this; {FIX}")


def _splits(terms: list) -> list[tuple[str, list, list]]:
    """(name, A, B): whole samples (halves of the sample list; a lone sample's terms halved) and
    interleaved (every other term, so each sample's count halves)."""
    rows = sorted({t[0] for t in terms})
    if len(rows) > 1:
        first = set(rows[: len(rows) // 2])
        a = [t for t in terms if t[0] in first]
        whole = ("into whole samples", a, [t for t in terms if t[0] not in first])
    else:
        half = len(terms) // 2
        whole = ("into halves", terms[:half], terms[half:])
    return [whole, ("within each sample (every other term)", terms[0::2], terms[1::2])]


def _losses(prober: Prober, i: int, subsets: list[list], rng: dict) -> tuple[list[float], torch.dtype]:
    """The loss with all terms, then with each subset, then with all terms again, each under the
    same RNG state (same dropout masks); and the loss's dtype. Randomness the RNG does not replay
    shows as a difference of the two full losses (the step check then says so)."""
    mask, fn = prober.masks[i], prober.loss_fns[i]
    with torch.no_grad():
        try:
            vals = []
            for m in [mask] + [prober.mask_of(i, s) for s in subsets] + [mask]:
                restore_rng(rng)  # same dropout masks for all, so only the mask differs
                vals.append(fn(m))
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. "
                             "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    for v in vals:
        check_loss(v)
    return torch.stack([v.detach().double() for v in vals]).tolist(), vals[0].dtype  # host sync: once
