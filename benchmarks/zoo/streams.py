"""Deterministic batches of one source and seed, as the held-out zoo's families train on them.

Every builder returns ``demo.Batch`` (x, y, mask (B, T); ``docs`` for packed rows) for a step, the
same for every run of a seed, so a scenario run is its clean twin until its first injection:

- ``Windows``: random windows of the source's token stream (bytes or BPE), every term a loss term;
- ``ChatRows``: one chat conversation per row, cut or padded to T+1 tokens, the loss on the
  assistant's answer only (SFT);
- ``PackedRows``: whole documents of 256-4096 tokens (longer ones cut at 4096) laid end to end in
  rows of T+1 tokens; a document that does not fit goes on in the next row (its position ids
  restart there, as a packing collator's do); ``docs`` numbers each row's segments from 0.
"""
from __future__ import annotations

import torch

from .demo import Batch

MIN_DOC, MAX_DOC = 256, 4096


class Windows:
    def __init__(self, ids: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        self.ids, self.T, self.B, self.seed = ids, seq_len, batch, seed

    def rows(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - self.T - 1, (self.B,), generator=g)
        return torch.stack([self.ids[s: s + self.T + 1] for s in starts.tolist()])  # (B, T+1)

    def clean(self, step: int) -> Batch:
        r = self.rows(step)
        return Batch(r[:, :-1].clone(), r[:, 1:].clone(), torch.ones(self.B, self.T))


class ChatRows:
    def __init__(self, convs: list[tuple[list[int], list[int]]], seq_len: int, batch: int, seed: int,
                 pad: int) -> None:
        self.convs, self.T, self.B, self.seed, self.pad = convs, seq_len, batch, seed, pad

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(T+1 ids, T mask): the mask is 1 on terms whose target is an answer token."""
        prompt, answer = self.convs[i]
        ids = (prompt + answer)[: self.T + 1]
        n = len(ids)
        r = torch.full((self.T + 1,), self.pad, dtype=torch.long)
        r[:n] = torch.tensor(ids)
        mask = torch.zeros(self.T)
        mask[max(0, len(prompt) - 1): n - 1] = 1.0  # term t predicts r[t+1]
        return r, mask

    def clean(self, step: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        pick = torch.randint(0, len(self.convs), (self.B,), generator=g).tolist()
        rows, masks = zip(*(self.row(i) for i in pick))
        r, m = torch.stack(rows), torch.stack(masks)
        return Batch(r[:, :-1].clone(), r[:, 1:].clone(), m)


def segments(boundary: torch.Tensor) -> torch.Tensor:
    """(B, T+1) bool, True where a document starts -> (B, T+1) segment number within each row."""
    start = boundary.clone()
    start[:, 0] = True
    return start.long().cumsum(1) - 1


class PackedRows:
    def __init__(self, docs: list[torch.Tensor], seq_len: int, batch: int, seed: int) -> None:
        self.docs = [d[:MAX_DOC] for d in docs if len(d) >= MIN_DOC]
        if not self.docs:
            raise ValueError(f"no document of {MIN_DOC} tokens or more to pack")
        self.T, self.B, self.seed = seq_len, batch, seed

    def stream(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        need = self.B * (self.T + 1)
        ids, starts, n = [], [], 0
        while n < need:
            d = self.docs[int(torch.randint(0, len(self.docs), (1,), generator=g))]
            flag = torch.zeros(len(d), dtype=torch.bool)
            flag[0] = True
            ids.append(d)
            starts.append(flag)
            n += len(d)
        return torch.cat(ids)[:need].view(self.B, -1), torch.cat(starts)[:need].view(self.B, -1)

    def clean(self, step: int) -> Batch:
        r, start = self.stream(step)  # (B, T+1) each
        docs = segments(start)
        return Batch(r[:, :-1].clone(), r[:, 1:].clone(), torch.ones(self.B, self.T), docs[:, :-1].clone())
