"""Subset probes mean something only when the loss is a SUM over the kept terms with a fixed
normaliser: this checks it once per micro-batch, on probes the search runs anyway.

A probe's mask can be a leaf that requires grad (``Prober.on_full`` / ``on_subset``): its
backward then also gives, for the cost of one elementwise product, ``d_t = d loss / d mask_t``.
For ``(l * mask).sum() / n`` that is each term's value ``l_t / n``, and it does not depend on
which other terms are kept. So:

- micro-batch ``i``'s first full-mask probe: the loss must be the sum of its terms' values,
  ``loss == sum_t mask_t * d_t``, relative to ``sum_t |mask_t * d_t|`` (a term that ignores the
  mask breaks it; a normaliser counted from the mask is of degree 0 in it and breaks it too);
- its first SUBSET probe (any: a term, a sample, a range): each kept term's value is the one
  the full mask gave, as vectors (``||d_sub - d_full|| <= tol * ||d_full||`` over the kept
  terms), and the subset's loss is the sum of those values. A normaliser counted from the mask
  (a per-sample or batch mean, also through ``(mask > 0).sum()`` or ``mask.detach()``) or a mask
  that reaches the model moves them. Checked before that probe's gradient is used.

No forward pass of its own, and never relative to the loss's value: an on-policy GRPO loss is
~1e-8 because its terms (advantage x ratio, ratio = 1) cancel across a group while each term and
the gradient are O(1); the comparisons are on the terms' own scale. A loss with no derivative in
the mask (it indexes with ``mask.bool()``) is checked at once on its two halves (two forwards):
their losses must add up to the full one, relative to ``|a| + |b|``. Only when a check fails do
the slower passes run that name the normaliser (both splits, and a second full pass telling
randomness the RNG does not replay, then judged on gross breaks only, from a real break).
"""
from __future__ import annotations

import math
from functools import partial

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
CONSTANT_FIX = ("Spread it over the terms so each carries its part: loss = (per_token_loss * mask).sum() / n_tokens "
                "+ aux * mask.sum() / token_mask.sum(), with token_mask the full mask (the full mask's loss is "
                "unchanged); or leave it out of loss_fn if no token should be blamed for it")
HALF = (torch.float16, torch.bfloat16)


def check_additive(prober: Prober, i: int, terms: list, rng: dict) -> None:
    """Arm the checks of micro-batch ``i`` (run by its first full-mask probe, then its first
    subset probe); they raise ``ValueError`` naming the normaliser and its fix when the loss is
    not additive."""
    prober.on_full[i] = partial(_verify_full, prober, i, terms, rng)


def _tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in HALF else 1e-3


def _verify_full(prober: Prober, i: int, terms: list, rng: dict, full: torch.Tensor, d_mask: torch.Tensor | None,
                 mask: torch.Tensor) -> None:
    """At the full mask: the loss is the sum of its terms' values; arms the subset check."""
    prober.full_losses[i] = value = float(full)  # host sync: once per micro-batch
    if not math.isfinite(value):
        return  # non-finite losses: the non-finite search names their terms once the gradient is known
    if d_mask is None:
        if not _by_halves(prober, i, terms[0::2], terms[1::2], full, rng):
            _explain(prober, i, terms, rng, "its halves do not add up")
        return
    d = d_mask.detach().double()
    values = mask.detach().double() * d
    f, f_sum, f_scale = torch.stack([full.double(), values.sum(), values.abs().sum()]).tolist()  # host sync: once
    if not _close(f, f_sum, f_scale, _tol(full.dtype)):
        _explain(prober, i, terms, rng, f"the loss is not the sum of its terms' values ({f:.6g} vs {f_sum:.6g})")
        return
    prober.on_subset[i] = partial(_verify_subset, prober, i, terms, rng, d)


def _verify_subset(prober: Prober, i: int, terms: list, rng: dict, d_full: torch.Tensor, loss: torch.Tensor,
                   d_mask: torch.Tensor | None, mask: torch.Tensor) -> None:
    """At a subset mask: each kept term's value is the full mask's, and the loss their sum."""
    if d_mask is None:
        _explain(prober, i, terms, rng, "the loss of a subset of the terms has no derivative in the mask")
        return
    part = mask.detach() != 0
    d_sub = d_mask.detach().double()
    values = mask.detach().double() * d_full
    nums = torch.stack([loss.double(), values[part].sum(), values[part].abs().sum(), (d_sub - d_full)[part].norm(),
                        d_full[part].norm()])
    x, x_sum, x_scale, moved, size = nums.tolist()  # host sync: once per micro-batch
    tol = _tol(loss.dtype)
    if moved > tol * size + 1e-30:
        _explain(prober, i, terms, rng, f"each kept term's value changes when other terms are dropped (d loss/d mask "
                                        f"moves by {moved / max(size, 1e-300):.3g} of its size)")
    elif math.isfinite(x) and not _close(x, x_sum, x_scale, tol):
        _explain(prober, i, terms, rng, f"the loss of a subset is not the sum of its terms' values ({x:.6g} vs "
                                        f"{x_sum:.6g})")


def _by_halves(prober: Prober, i: int, a: list, b: list, full: torch.Tensor, rng: dict) -> bool:
    """No derivative in the mask: ``loss(A) + loss(B) == loss(all)``, relative to ``|a| + |b|``."""
    (la, lb), _ = _losses(prober, i, [a, b], rng, again=False)
    f, x, y = torch.stack([full.double(), la.double(), lb.double()]).tolist()  # host sync: once
    return math.isfinite(x) and math.isfinite(y) and _close(f, x + y, abs(x) + abs(y), _tol(full.dtype))


def _close(x: float, y: float, scale: float, tol: float) -> bool:
    return abs(x - y) <= tol * max(abs(x), scale) + 1e-12


def _explain(prober: Prober, i: int, terms: list, rng: dict, why: str) -> None:
    """Both splits, each compared with the full loss, computed twice: randomness the RNG does not
    replay (the two differ) is judged on gross breaks only (a mean's ~2x) and may pass; otherwise
    the fast check's verdict (``why``) stands, with the normaliser the numbers point to."""
    splits = _splits(terms)
    vals, dtype = _losses(prober, i, [s for _, a, b in splits for s in (a, b)], rng, again=True)
    vals = torch.stack([v.double() for v in vals]).tolist()  # host sync: only when the fast check failed
    full, again = vals[0], vals.pop()
    tol, noisy = _tol(dtype), again != full
    if noisy:
        tol = max(tol, 0.05, 20 * abs(full - again) / max(abs(full), 1e-30))
    where = "" if prober.k == 1 else f" (micro-batch {i})"
    if full != 0 and all(v == full for v in vals[1:]):
        raise ValueError(f"loss_fn(mask) does not depend on the mask{where} (same loss with half the terms "
                         f"dropped): {FIX}")
    verdicts = []
    for j, (name, a_terms, b_terms) in enumerate(splits):
        a, b = vals[1 + 2 * j], vals[2 + 2 * j]
        finite = math.isfinite(a) and math.isfinite(b)
        ok = finite and _close(full, a + b, abs(a) + abs(b), tol)
        token_mean = finite and _close(full * len(terms), a * len(a_terms) + b * len(b_terms),
                                       abs(full) * len(terms), tol)
        verdicts.append((name, a, b, ok, token_mean))
    if noisy and all(v[3] for v in verdicts):
        return
    if any(not v[3] for v in verdicts):
        raise ValueError(_message(where, full, verdicts))
    raise ValueError(f"loss_fn(mask) is not additive over the mask{where}: {why}. A normaliser counted from the "
                     f"mask (per sample: {PER_SAMPLE_FIX}; or per batch) or a term that ignores the mask does "
                     f"this; {FIX}")


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
    extra = _constant_part(full, verdicts)
    if extra is not None:
        return (f"{head}: every split counts {extra:.6g} twice, a term that ignores the mask (an auxiliary loss "
                f"computed from the whole batch: a MoE load-balancing loss, a regulariser). {CONSTANT_FIX}")
    return (f"{head}. A normaliser counted from the mask (per sample: {PER_SAMPLE_FIX}; or per batch) or a term "
            f"that ignores the mask does this; {FIX}")


def _constant_part(full: float, verdicts: list) -> float | None:
    """The part of the loss no mask changes, when every split shows the same one: ``loss(S) = sum over S +
    c`` gives ``a + b - full = c`` whichever way the terms are split (tester round 12: a router loss at
    10.2 was met with the per-sample-mean fix, for a normaliser that was already right). None otherwise."""
    excess = [a + b - full for _, a, b, _, _ in verdicts]
    scale = max(abs(full), *(abs(a) + abs(b) for _, a, b, _, _ in verdicts))
    c = excess[0]
    if len(excess) < 2 or abs(c) <= 1e-3 * scale or any(abs(e - c) > 1e-3 * scale for e in excess[1:]):
        return None
    return c


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


def _losses(prober: Prober, i: int, subsets: list[list], rng: dict,
            again: bool) -> tuple[list[torch.Tensor], torch.dtype]:
    """The loss of each subset (``again``: the full loss before and after them), each under the
    same RNG state (same dropout masks), forward only; and the loss's dtype."""
    mask, fn = prober.masks[i], prober.loss_fns[i]
    masks = [prober.mask_of(i, s) for s in subsets]
    if again:
        masks = [mask] + masks + [mask]
    with torch.no_grad():
        try:
            vals = []
            for m in masks:
                restore_rng(rng)  # same dropout masks for all, so only the mask differs
                vals.append(fn(m))
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. "
                             "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    for v in vals:
        check_loss(v)
    return [v.detach() for v in vals], vals[0].dtype
