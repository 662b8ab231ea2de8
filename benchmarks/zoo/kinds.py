"""The held-out zoo's injections into one batch (``split.KINDS``), and the units each should be named by.

``inject(kind, batch, step, seed, space)`` changes the batch in place and returns the truth units
(``culprits.py``: level, sample, positions or document, in the localizer's position space: the term
at ``t`` predicts ``row[t + 1]``). Rows are rewritten whole (``x = row[:-1]``, ``y = row[1:]``) so a
corrupted token is both a target and the next input, as in real data. Which samples are hit
depends on the seed and the step only.

Schedule and numeric kinds only mark the batch (``lr_factor``, ``fp16_scale``, ``bitflip``); the
families apply them. ``weights``: the per-term loss weights of the token kinds (a corrupted
weight column: 64 on the culprit terms, whose targets are junk).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Callable

import torch

from .demo import Batch

TOKEN_WEIGHT = 64.0
PACKED_JUNK = 400
TOKEN_KINDS = {"one_token": 1, "four_tokens": 4, "eight_tokens": 8}  # kind -> culprit terms among 1024


@dataclass
class Space:
    vocab: int
    encode: Callable[[str], list[int]]
    low: int = 0  # the first id junk may take (special tokens sit below it)


def _gen(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + step * 31 + salt)


def _junk(n: int, g: torch.Generator, space: Space) -> torch.Tensor:
    return torch.randint(space.low, space.vocab, (n,), generator=g)


def _row(b: Batch, k: int) -> torch.Tensor:
    return torch.cat([b.x[k], b.y[k, -1:]])


def _set_row(b: Batch, k: int, r: torch.Tensor) -> None:
    b.x[k], b.y[k] = r[:-1], r[1:]


def _samples(n: int, B: int, g: torch.Generator) -> list[int]:
    return sorted(torch.randperm(B, generator=g)[:n].tolist())


def _junk_row(b: Batch, k: int, junk: torch.Tensor) -> None:
    """Every loss target of row ``k`` becomes junk (an SFT prompt stays: only its answer is hit)."""
    r = _row(b, k)
    at = (b.mask[k] > 0).nonzero().flatten() + 1  # the targets of the loss terms
    r[at] = junk[: len(at)]
    _set_row(b, k, r)


def random_samples(b: Batch, g: torch.Generator, space: Space, n: int, identical: bool) -> list[dict]:
    ks = _samples(n, b.x.shape[0], g)
    same = _junk(b.x.shape[1] + 1, g, space)
    for k in ks:
        _junk_row(b, k, same if identical else _junk(b.x.shape[1] + 1, g, space))
    return [{"level": "sample", "batch": k} for k in ks]


def base64_blob(b: Batch, g: torch.Generator, space: Space) -> list[dict]:
    B, T = b.x.shape
    k = int(torch.randint(0, B, (1,), generator=g))
    raw = bytes(torch.randint(0, 256, (4 * T,), generator=g).tolist())
    ids = torch.tensor(space.encode(base64.b64encode(raw).decode("ascii")))[: T // 2]
    a = T // 4
    r = _row(b, k)
    r[a: a + len(ids)] = ids
    _set_row(b, k, r)
    return [{"level": "span", "batch": k, "start": a - 1, "end": a - 1 + len(ids)}]


def labels_leaked(b: Batch, g: torch.Generator) -> list[dict]:
    ks = _samples(3, b.x.shape[0], g)
    for k in ks:
        b.y[k] = b.x[k]  # the target of each term is its own input token
    return [{"level": "sample", "batch": k} for k in ks]


def culprit_tokens(b: Batch, g: torch.Generator, space: Space, n: int) -> list[dict]:
    B, T = b.x.shape
    b.weights = torch.ones(B, T)
    out = []
    for k in _samples(n, B, g):
        t = int(torch.randint(0, T - 1, (1,), generator=g))  # T-1: the junk is also the next input
        r = _row(b, k)
        r[t + 1] = _junk(1, g, space)[0]
        _set_row(b, k, r)
        b.weights[k, t] = TOKEN_WEIGHT
        out.append({"level": "token", "batch": k, "start": t, "end": t + 1})
    return out


def _segments(b: Batch, k: int) -> list[tuple[int, int, int]]:
    """(document id, start, end) of row ``k``'s documents (positions of ``x``)."""
    d = b.docs[k]
    out, s = [], 0
    for t in range(1, len(d) + 1):
        if t == len(d) or d[t] != d[s]:
            out.append((int(d[s]), s, t))
            s = t
    return out


def packed_docs(b: Batch, g: torch.Generator, space: Space, n: int) -> list[dict]:
    """Two documents of 64 tokens or more, in different rows, become random tokens."""
    B = b.x.shape[0]
    out = []
    for k in _samples(n, B, g):
        segs = [s for s in _segments(b, k) if s[2] - s[1] >= 64] or [max(_segments(b, k), key=lambda s: s[2] - s[1])]
        doc, s, e = segs[int(torch.randint(0, len(segs), (1,), generator=g))]
        r = _row(b, k)
        r[s + 1: e + 1] = _junk(e - s, g, space)  # the document's own tokens after its first
        _set_row(b, k, r)
        out.append({"level": "document", "batch": k, "document": doc})
    return out


def packed_junk_doc(b: Batch, g: torch.Generator, space: Space) -> list[dict]:
    """A 400-token junk document inside row k: its own segment (position ids restart at it)."""
    B, T = b.x.shape
    k = int(torch.randint(0, B, (1,), generator=g))
    a = int(torch.randint(64, T - PACKED_JUNK - 64, (1,), generator=g))
    r = _row(b, k)
    r[a: a + PACKED_JUNK] = _junk(PACKED_JUNK, g, space)
    _set_row(b, k, r)
    start = torch.zeros(T + 1, dtype=torch.bool)
    d = torch.cat([b.docs[k], b.docs[k, -1:] + 1])
    start[1:] = d[1:] != d[:-1]
    start[[0, a, a + PACKED_JUNK]] = True
    b.docs[k] = (start.long().cumsum(0) - 1)[:-1]
    return [{"level": "document", "batch": k, "document": int(b.docs[k, a])}]


def inject(kind: str, b: Batch, step: int, seed: int, space: Space) -> list[dict]:
    """Apply ``kind`` to batch ``b`` of ``step``; returns the truth units (none for schedule/numeric kinds)."""
    g = _gen(seed, step)
    if kind == "two_random_samples":
        if b.docs is not None:
            return packed_docs(b, g, space, 2)
        return random_samples(b, g, space, 2, identical=False)
    if kind == "three_identical_junk":
        return random_samples(b, g, space, 3, identical=True)
    if kind == "base64_blob":
        return base64_blob(b, g, space)
    if kind == "labels_leaked":
        return labels_leaked(b, g)
    if kind in TOKEN_KINDS:
        return culprit_tokens(b, g, space, TOKEN_KINDS[kind])
    if kind == "packed_junk_doc":
        return packed_junk_doc(b, g, space)
    if kind == "fp16_sample":  # one row of a single repeated token (erased storage, 0xFF): a coherent gradient
        k = int(torch.randint(0, b.x.shape[0], (1,), generator=g))
        _junk_row(b, k, _junk(1, g, space).repeat(b.x.shape[1] + 1))
        b.fp16_scale = 1.0  # the family sets the scale from the step's gradients
        return [{"level": "sample", "batch": k}]
    if kind == "lr_x50":
        b.lr_factor = 50.0
    elif kind == "weight_bitflip":
        b.bitflip = True
    elif kind not in ("cosine_restart",):
        raise ValueError(f"kind={kind!r} is not an injection of this zoo")
    return []
