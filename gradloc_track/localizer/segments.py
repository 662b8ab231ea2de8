"""A micro-batch's samples (rows, or the documents of packed rows) and their exact gradient norms
from the ghost pass's own backward: a ranking of samples that costs no probe.

For a linear layer ``y_t = W x_t (+ b)`` a segment's weight gradient is ``sum_t g_t x_t^T`` over
its positions, and its squared norm is ``sum_{t,t'} (g_t . g_t') (x_t . x_t')`` (the Gram form of
Li et al. 2022's ghost clipping); the bias adds ``sum_{t,t'} g_t . g_t'`` and an embedding
``sum_{t,t'} [id_t = id_t'] g_t . g_t'``. Unlike a per-position norm this is EXACT for the hooked
layers: a row's terms get no gradient through another row's positions (documents of a packed row
are exact only when attention is masked per document). Layers the hooks do not see (norms,
broadcast position embeddings) are left out, so exact probes confirm what the ranking proposes.

Per layer the cheaper of two exact forms runs (as ghost clipping chooses, Li et al. 2022): the
Gram form costs ``T^2 (C_in + C_out)`` per row, the segment's own weight gradient
``G_s^T X_s`` costs ``T C_in C_out``; a small layer over long rows takes the second. An embedding
sums its positions' output gradients per (segment, token id), ``O(B T C)``. Temporaries are
bounded by ``CHUNK`` elements whatever the model.
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
    start: int  # positions [start, end) of the row its loss terms span (the row's or document's, without any)
    end: int
    terms: list[tuple[int, int]] = field(default_factory=list)  # its loss terms (b, t)
    # its terms' output-head norms (exact per term) and their micro-batch's median; set for candidates
    head: list[float] | None = None
    head_median: float = 0.0


class Segments:
    """The segments of one micro-batch's ``(B, T)`` mask and, after a ghost pass, their squared
    gradient norms over the hooked layers (``sq``, float64, one per segment)."""

    def __init__(self, micro_batch: int, mask: torch.Tensor, document_ids: torch.Tensor | None = None,
                 terms: list[tuple[int, int]] | None = None) -> None:
        """``terms``: the mask's nonzero ``(b, t)`` in row-major order when the caller has them
        (``Prober.terms``): the same tuples are shared, not made again."""
        B, T = mask.shape
        if document_ids is None:
            ids = torch.arange(B).view(B, 1).expand(B, T)  # (B, T): one segment per row
            self.items = [Segment(micro_batch, b, None, 0, T) for b in range(B)]
            self.same = None  # every pair of positions of a row is in the same segment
        else:
            ids, self.items = _documents(micro_batch, document_ids.detach().cpu())
            self.same = ids[:, :, None] == ids[:, None, :]  # (B, T, T)
        self.ids = ids.contiguous()
        kept = mask.detach().cpu() != 0
        if terms is None:
            idx = kept.nonzero()
            terms = list(zip(idx[:, 0].tolist(), idx[:, 1].tolist()))  # host sync: once per localization
        if document_ids is None:  # terms are row-major: each row's are one slice
            counts = kept.sum(1).tolist()  # host sync: once per localization
            first = 0
            for item, n in zip(self.items, counts):
                item.terms, first = terms[first:first + n], first + n
        else:
            for bt, k in zip(terms, ids[kept].tolist()):  # host sync: once per localization
                self.items[k].terms.append(bt)
        for item in self.items:  # a unit spans its loss terms, as a flagged one does: a row's masked prompt and
            if item.terms:  # its padding are not what was blamed (held-out tester, stop 53: SFT rows read 0-128)
                item.start, item.end = item.terms[0][1], item.terms[-1][1] + 1
        self.sq: torch.Tensor | None = None
        self.head: torch.Tensor | None = None  # (B, T) squared output-head norm per position (GhostMap)
        self._kept = kept
        self._onehot: dict = {}  # device -> per row, the (D_b, T) one-hot of its segments (documents only)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, g: torch.Tensor, x: torch.Tensor, kind: str, has_bias: bool) -> None:
        """One hooked layer's contribution: ``g`` (B, T, C_out) output gradients, ``x`` its
        (B, T, C_in) inputs (the (B, T) ids for an embedding)."""
        if self.sq is None:
            self.sq = torch.zeros(len(self.items), dtype=torch.float64, device=g.device)
        if kind == "embedding":
            self._add_embedding(g, x)
        elif x.shape[-1] * g.shape[-1] <= g.shape[1] * (x.shape[-1] + g.shape[-1]):
            self._add_explicit(g, x, has_bias)
        else:
            self._add_gram(g, x, has_bias)

    def _add_embedding(self, g: torch.Tensor, ids_in: torch.Tensor) -> None:
        """Rows of the embedding's gradient are sums over positions with the same token id: per
        (segment, id) pair, the sum of those positions' output gradients, squared."""
        ids = ids_in.reshape(-1).long()
        width = ids.max() + 1  # a device scalar: no host sync
        keys, inverse = torch.unique(self.ids.to(g.device).reshape(-1) * width + ids, return_inverse=True)
        acc = torch.zeros(keys.shape[0], g.shape[-1], dtype=torch.float32, device=g.device)  # unique: syncs on CUDA
        acc.index_add_(0, inverse, g.reshape(-1, g.shape[-1]).float())
        self.sq.index_add_(0, torch.div(keys, width, rounding_mode="floor"), acc.pow(2).sum(1).double())

    def _add_explicit(self, g: torch.Tensor, x: torch.Tensor, has_bias: bool) -> None:
        """Each segment's own weight gradient ``G_s^T X_s`` (C_out, C_in), a chunk of rows at a time."""
        B, c_out, c_in = g.shape[0], g.shape[-1], x.shape[-1]
        if self.same is None:  # a segment per row
            step = max(1, CHUNK // max(1, c_out * c_in))
            for r0 in range(0, B, step):
                gr, xr = g[r0:r0 + step].float(), x[r0:r0 + step].float()
                sq = torch.bmm(gr.transpose(1, 2), xr).pow(2).sum((1, 2))  # (rows,)
                if has_bias:
                    sq = sq + gr.sum(1).pow(2).sum(1)
                self.sq[r0:r0 + sq.shape[0]] += sq.double()
            return
        for b, (first, onehot) in enumerate(self._onehots(g.device)):  # documents of row b
            gd = onehot[:, :, None] * g[b].float()[None]  # (D_b, T, C_out)
            sq = torch.matmul(gd.transpose(1, 2), x[b].float()).pow(2).sum((1, 2))  # (D_b,)
            if has_bias:
                sq = sq + gd.sum(1).pow(2).sum(1)
            self.sq[first:first + sq.shape[0]] += sq.double()

    def _onehots(self, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """Per row: (its first segment's index, (D_b, T) one-hot of its segments), cached per device."""
        if device not in self._onehot:
            out, ids = [], self.ids.to(device)
            for b in range(ids.shape[0]):
                first = int(ids[b].min())  # host sync: once per row per localization
                out.append((first, (ids[b][None, :] == torch.arange(first, int(ids[b].max()) + 1,
                                                                   device=device)[:, None]).float()))
            self._onehot[device] = out
        return self._onehot[device]

    def _add_gram(self, g: torch.Tensor, x: torch.Tensor, has_bias: bool) -> None:
        """``sum_{t,t'} (g_t . g_t') (x_t . x_t')`` per segment, from (rows, T, T) Gram blocks."""
        B, T = g.shape[:2]
        ids = self.ids.to(g.device)
        same = None if self.same is None else self.same.to(g.device)
        step = max(1, CHUNK // max(1, T * T))
        for r0 in range(0, B, step):
            r = slice(r0, r0 + step)
            gr = g[r].float()
            gram = gr @ gr.transpose(1, 2)  # (b, T, T): g_t . g_t'
            xr = x[r].float()
            xx = xr @ xr.transpose(1, 2)  # (b, T, T): x_t . x_t'
            gram.mul_(xx.add_(1.0) if has_bias else xx)
            del xx
            if same is not None:
                gram.mul_(same[r])
            self.sq.index_add_(0, ids[r].reshape(-1), gram.sum(-1).reshape(-1).double())

    def attach_head(self, seg: Segment) -> None:
        """``seg.head``/``seg.head_median`` from the ghost pass's output-head map (when it ran)."""
        if self.head is None or not seg.terms:
            return
        h = self.head.detach().cpu().clamp_min(0).sqrt()
        idx = torch.tensor(seg.terms)
        seg.head = h[idx[:, 0], idx[:, 1]].tolist()  # host sync: per candidate sample
        seg.head_median = float(h[self._kept].median())  # host sync: per candidate sample

    def release(self) -> None:
        """Drop what only the ghost pass and ``attach_head`` need (position-sized buffers held
        through the search otherwise); ``items`` and their norms stay."""
        self.ids = self.same = self.head = self._kept = None
        self._onehot = {}

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
