"""A micro-batch's samples (rows, or the documents of packed rows) and their exact gradient norms
from the ghost pass's own backward: a ranking of samples that costs no probe.

For a linear layer ``y_t = W x_t (+ b)`` a segment's weight gradient is ``sum_t g_t x_t^T`` over
its positions, and its squared norm is ``sum_{t,t'} (g_t . g_t') (x_t . x_t')`` (the Gram form of
Li et al. 2022's ghost clipping); the bias adds ``sum_{t,t'} g_t . g_t'`` and an embedding
``sum_{t,t'} [id_t = id_t'] g_t . g_t'``. Unlike a per-position norm this is EXACT for the hooked
layers: a row's terms get no gradient through another row's positions (documents of a packed row
are exact only when attention is masked per document). Layers the hooks do not see (norms,
broadcast position embeddings) are left out, so exact probes confirm what the ranking proposes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK = 1 << 22  # elements of one (rows, T, T) Gram block: two live at once (32 MiB), whatever the model


@dataclass
class Segment:
    """One sample: a row, or one document of a packed row."""

    micro_batch: int
    batch: int
    document: int | None
    start: int  # positions [start, end) of the row it spans
    end: int
    terms: list[tuple[int, int]] = field(default_factory=list)  # its loss terms (b, t)


class Segments:
    """The segments of one micro-batch's ``(B, T)`` mask and, after a ghost pass, their squared
    gradient norms over the hooked layers (``sq``, float64, one per segment)."""

    def __init__(self, micro_batch: int, mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> None:
        B, T = mask.shape
        if document_ids is None:
            ids = torch.arange(B).view(B, 1).expand(B, T)  # (B, T): one segment per row
            self.items = [Segment(micro_batch, b, None, 0, T) for b in range(B)]
            self.same = None  # every pair of positions of a row is in the same segment
        else:
            ids, self.items = _documents(micro_batch, document_ids.detach().cpu())
            self.same = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
        self.ids = ids.contiguous()
        for b, t in (mask != 0).nonzero().tolist():  # host sync: once per localization
            self.items[int(ids[b, t])].terms.append((b, t))
        self.sq: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.items)

    def add(self, g: torch.Tensor, x: torch.Tensor, kind: str, has_bias: bool) -> None:
        """One hooked layer's contribution: ``g`` (B, T, C_out) output gradients, ``x`` its
        (B, T, C_in) inputs (the (B, T) ids for an embedding)."""
        B, T = g.shape[:2]
        if self.sq is None:
            self.sq = torch.zeros(len(self.items), dtype=torch.float64, device=g.device)
        ids = self.ids.to(g.device)
        same = None if self.same is None else self.same.to(g.device)
        step = max(1, CHUNK // max(1, T * T))
        for r0 in range(0, B, step):
            r = slice(r0, r0 + step)
            gr = g[r].float()
            gram = gr @ gr.transpose(1, 2)  # (b, T, T): g_t . g_t'
            if kind == "embedding":
                gram.mul_(x[r][:, :, None] == x[r][:, None, :])  # rows of the same token id add up
            else:
                xr = x[r].float()
                xx = xr @ xr.transpose(1, 2)  # (b, T, T): x_t . x_t'
                gram.mul_(xx.add_(1.0) if has_bias else xx)
                del xx
            if same is not None:
                gram.mul_(same[r])
            self.sq.index_add_(0, ids[r].reshape(-1), gram.sum(-1).reshape(-1).double())

    def norms(self) -> list[float] | None:
        """Each segment's gradient norm over the hooked layers; None when no hook fired."""
        return None if self.sq is None else self.sq.clamp_min(0).sqrt().tolist()  # host sync


def _documents(micro_batch: int, docs: torch.Tensor) -> tuple[torch.Tensor, list[Segment]]:
    """Segment ids (B, T) and one ``Segment`` per (row, document id) present."""
    ids = torch.empty(docs.shape, dtype=torch.long)
    items: list[Segment] = []
    for b in range(docs.shape[0]):
        for d in torch.unique(docs[b]).tolist():
            where = (docs[b] == d).nonzero().flatten()
            ids[b, where] = len(items)
            items.append(Segment(micro_batch, b, int(d), int(where.min()), int(where.max()) + 1))
    return ids, items
