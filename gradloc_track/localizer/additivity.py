"""Subset probes mean something only when the loss is a SUM over the kept terms with a fixed
normaliser: this checks it once per micro-batch, with that micro-batch's first full-mask probe.

The probe runs with a mask that requires grad (``Prober.on_full``), so its backward gives, at the
cost of one elementwise product, ``d_t = d loss / d mask_t``: for ``(l * mask).sum() / n`` that
is each term's value ``l_t / n``, and it must not depend on which other terms are kept. Then ONE
extra forward, of half the terms (every other term of each sample, so every sample's count
halves), with only the mask requiring grad (the weights frozen for it: no graph through the
model, no backward through it) gives the half's loss and its ``d_t``:

- each kept term's value at the half equals its value at the full mask, as vectors:
  ``||d_half - d_full|| <= tol * ||d_full||`` over the half's terms. A normaliser counted from the
  mask (a per-sample or batch mean, also through ``(mask > 0).sum()`` or ``mask.detach()``) or a
  mask that reaches the model changes them; this is a comparison of derivatives, on their own
  scale, whatever the loss's value;
- the loss is the sum of its terms' values, at the full mask and at the half, relative to
  ``sum_t |mask_t * d_t|``: catches a term that ignores the mask.

Never relative to the loss's value: an on-policy GRPO loss is ~1e-8 because its terms (advantage
x ratio, ratio = 1) cancel across a group while each term and the gradient are O(1). When the
loss has no derivative in the mask (it indexes with ``mask.bool()``), the two halves' losses must
add up to the full one (two forwards), relative to ``|a| + |b|``. Only when a check fails do the
slower passes run that name the normaliser (both splits, and a second full pass telling
randomness the RNG does not replay, which is then judged on gross breaks only, from a real break).
"""
from __future__ import annotations

import math
import warnings
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
HALF = (torch.float16, torch.bfloat16)


def check_additive(prober: Prober, i: int, terms: list, rng: dict) -> None:
    """Arm the check of micro-batch ``i`` (run by its first full-mask probe: ``Prober.on_full``);
    it raises ``ValueError`` naming the normaliser and its fix when the loss is not additive."""
    prober.on_full[i] = partial(_verify, prober, i, terms, rng)


def _tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in HALF else 1e-3


def _verify(prober: Prober, i: int, terms: list, rng: dict, full: torch.Tensor, d_mask: torch.Tensor | None) -> None:
    """The fast check (module doc); the slow one, which explains, only when it fails."""
    if not bool(torch.isfinite(full)):  # host sync: once per micro-batch
        return  # non-finite losses are reported once the step's gradient is known
    half = terms[0::2]
    if d_mask is not None:
        why = _by_term_values(prober, i, half, full, d_mask, rng)
    else:
        why = "" if _by_halves(prober, i, half, terms[1::2], full, rng) else "its halves do not add up"
    if why:
        _explain(prober, i, terms, rng, why)


def _by_term_values(prober: Prober, i: int, half: list, full: torch.Tensor, d_mask: torch.Tensor,
                    rng: dict) -> str:
    """'' when the kept terms' values hold at the half mask and add up to the losses, else why not."""
    mask = prober.masks[i].detach().double()
    part = prober.mask_of(i, half) != 0
    loss_half, d_half = _half_with_terms(prober, i, prober.mask_of(i, half), rng)
    if d_half is None:
        return "the loss of half the terms has no derivative in the mask"
    d, dh = d_mask.detach().double(), d_half.detach().double()
    values = mask * d
    nums = torch.stack([full.double(), values.sum(), values.abs().sum(), loss_half.detach().double(),
                        values[part].sum(), values[part].abs().sum(), (dh - d)[part].norm(), d[part].norm()])
    f, f_sum, f_scale, h, h_sum, h_scale, moved, size = nums.tolist()  # host sync: once per micro-batch
    tol = _tol(full.dtype)
    if moved > tol * size + 1e-30:
        return (f"each kept term's value changes when half the terms are dropped (d loss/d mask moves by "
                f"{moved / max(size, 1e-300):.3g} of its size)")
    if not (_close(f, f_sum, f_scale, tol) and _close(h, h_sum, h_scale, tol)):
        return f"the loss is not the sum of its terms' values ({f:.6g} vs {f_sum:.6g})"
    return ""


def _half_with_terms(prober: Prober, i: int, mask: torch.Tensor,
                     rng: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loss at ``mask`` and its derivative in the mask; the weights do not require grad for
    it, so no graph is built through the model and nothing is back-propagated through it."""
    leaf = mask.detach().clone().requires_grad_(True)
    flags = [p.requires_grad for p in prober.params]
    try:
        for p in prober.params:
            p.requires_grad_(False)
        restore_rng(rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # checkpointing warns that no input requires grad: none needs to
            loss = prober.loss_fns[i](leaf)
    except Exception as exc:
        raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. "
                         "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    finally:
        for p, f in zip(prober.params, flags):
            p.requires_grad_(f)
    check_loss(loss)
    if not loss.requires_grad:
        return loss, None
    (d,) = torch.autograd.grad(loss, [leaf], allow_unused=True)
    return loss, d


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
