"""Bring the culprits' samples to rank 0, so its artifact writer shows text from every rank.

A distributed ``LocateResult`` lists culprits on any rank, but each rank holds only its own
batch. This collective (one ``all_gather_object``, on spike events only) sends, for every row
that holds a culprit (a token, a span, a sample or packed document), its token IDS (rank 0
decodes them with its tokenizer: no strings travel), loss mask, document ids, segment ids (an RL
sample's prompt and response, shown as two blocks), ghost row and per-layer rows, and context
columns (a packed row's per-document cells as they are: one per document). Rank 0 gets a view:
a result whose culprits index the gathered rows (``batch`` = row; ``rank``, ``micro_batch`` and
``document`` kept, so the table shows them; micro-batch rows, which name no row, as they are) and
a context whose ``sample_columns`` gain ``rank_sample`` (the sample's index in that rank's batch):
the table's ``sample`` and the page's heading read it, as the console does. Other ranks get ``None``.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .result import LocateResult


def _part(x: Any, k: int | None):
    """Micro-batch ``k`` of a per-step field (a sequence of K tensors), else the field itself."""
    if isinstance(x, (list, tuple)):
        return x[k or 0]
    return x


def _row_columns(columns: Any, k: int | None, b: int, per_mb: bool) -> dict:
    """Sample ``b`` of micro-batch ``k`` of each named per-sample/per-token column, on the CPU.
    A column may be a list of python values (a source name per sample): with one micro-batch that
    list is the column itself, not a sequence of micro-batches (``per_mb`` says which)."""
    def cell(v: Any) -> Any:
        return v.detach().cpu() if isinstance(v, torch.Tensor) else v

    return {n: cell((v[k or 0] if per_mb else v)[b]) for n, v in (columns or {}).items()}


def _rows(result: LocateResult, ctx: Any, rank: int) -> list[dict] | None:
    """This rank's culprit samples as plain CPU tensors (None if they cannot be read)."""
    try:
        keys = sorted({(c.micro_batch, c.batch) for c in result.culprits if c.rank == rank and c.batch is not None},
                      key=lambda kb: (kb[0] or 0, kb[1]))
        per_mb = not isinstance(getattr(ctx, "token_mask", None), torch.Tensor)  # ctx holds K micro-batches
        out = []
        for k, b in keys:
            ids = _part(getattr(ctx, "input_ids", None), k)
            mask = _part(getattr(ctx, "token_mask", None), k)
            docs = _part(getattr(ctx, "document_ids", None), k)
            seg = _part(getattr(ctx, "segment_ids", None), k)
            first = k in (None, 0)  # the result carries this rank's ghost maps of micro-batch 0
            out.append({
                "micro_batch": k, "batch": b,
                "ids": None if ids is None else ids[b].detach().cpu(),
                "mask": None if mask is None else mask[b].detach().float().cpu(),
                "docs": None if docs is None else docs[b].detach().cpu(),
                "segments": None if seg is None else seg[b].detach().cpu(),
                "ghost": result.ghost_map[b] if first and result.ghost_map is not None else None,
                "layers": result.layer_map[:, b] if first and result.layer_map is not None else None,
                "extra": _row_columns(getattr(ctx, "extra_columns", None), k, b, per_mb),
                "sample": _row_columns(getattr(ctx, "sample_columns", None), k, b, per_mb),
            })
        return out
    except Exception as exc:  # never raise before the collective: the other ranks would wait
        warnings.warn(f"gradloc-track: rank {rank} could not read its culprit samples for the artifacts: {exc!r}")
        return None


def _not_probed(mask):
    raise RuntimeError("the gathered view of culprit rows is for display; it cannot be probed")


def _pad(rows: list[torch.Tensor | None], length: int, fill, dtype) -> torch.Tensor:
    out = torch.full((len(rows), length), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, : r.shape[-1]] = r.to(dtype)
    return out


def _sample_column(cells: list) -> Any:
    """One ``sample_columns`` column of the gathered rows: a tensor when every row's cell is a tensor
    of one shape, else a list with one cell per row (python values; a packed row's per-document
    cells as a list; None where a rank had none)."""
    if cells and all(isinstance(c, torch.Tensor) for c in cells) and len({tuple(c.shape) for c in cells}) == 1:
        return torch.stack(cells)
    if not cells:
        return torch.zeros(0)
    return [(c.item() if c.dim() == 0 else c.tolist()) if isinstance(c, torch.Tensor) else c for c in cells]


def gather_culprit_rows(result: LocateResult, ctx: Any, group=None, everywhere: bool = False
                        ) -> tuple[LocateResult | None, Any]:
    """Collective: every rank calls it; rank 0 returns ``(view_result, view_ctx)``, others ``(None, None)``,
    or the same view with ``everywhere`` (the rows reach every rank anyway: a rank's quarantine blames every
    rank's culprits, which a shuffling sampler may hand it next epoch)."""
    from ..spikes.context import SpikeContext

    rank = dist.get_rank(group)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, _rows(result, ctx, rank), group=group)
    if rank != 0 and not everywhere:
        return None, None
    where: dict[tuple, int] = {}
    flat: list[dict] = []
    for r, rows in enumerate(every):
        for row in rows or []:
            where[(r, row["micro_batch"], row["batch"])] = len(flat)
            flat.append({**row, "rank": r})
    def placed(rows: list) -> list:
        return [c if c.batch is None else dataclasses.replace(c, batch=where[(c.rank, c.micro_batch, c.batch)])
                for c in rows if c.batch is None or (c.rank, c.micro_batch, c.batch) in where]

    tokens, culprits = placed(result.tokens), placed(result.culprits)
    length = max([len(x["ids"]) for x in flat if x["ids"] is not None] + [1])
    n_layers = len(result.layer_names)
    layer_rows = [x["layers"] if x["layers"] is not None else torch.zeros(n_layers, 0) for x in flat]
    layer_map = torch.zeros(n_layers, len(flat), length)
    for i, lr in enumerate(layer_rows):
        layer_map[: lr.shape[0], i, : lr.shape[-1]] = lr
    # the table's rank / micro_batch columns come from the culprits; the row's own sample index
    # and its rank, so every reader names it "rank r, ..., sample b" (``CulpritView.who``)
    samples: dict[str, Any] = {"rank_sample": torch.tensor([x["batch"] for x in flat]),
                               "rank": torch.tensor([x["rank"] for x in flat])}
    for name in (getattr(ctx, "sample_columns", None) or {}):
        samples[name] = _sample_column([x["sample"].get(name) for x in flat])
    extras = {name: _pad([x["extra"].get(name) for x in flat], length, float("nan"), torch.float64)
              for name in (getattr(ctx, "extra_columns", None) or {})}
    has_ids = any(x["ids"] is not None for x in flat)
    # packed documents on any rank (rank 0's own batch may pack none)
    has_docs = getattr(ctx, "document_ids", None) is not None or any(x["docs"] is not None for x in flat)
    has_segments = any(x["segments"] is not None for x in flat)
    view_ctx = SpikeContext(
        loss_fn=_not_probed, token_mask=_pad([x["mask"] for x in flat], length, 0.0, torch.float32),
        input_ids=_pad([x["ids"] for x in flat], length, 0, torch.long) if has_ids else None,
        tokenizer=getattr(ctx, "tokenizer", None), extra_columns=extras, sample_columns=samples,
        segment_names=getattr(ctx, "segment_names", None),  # what the console calls an RL sample's response
        segment_ids=_pad([x["segments"] for x in flat], length, -1, torch.long) if has_segments else None,
        document_ids=_pad([x["docs"] for x in flat], length, -1, torch.long) if has_docs else None)
    ghost_map = _pad([x["ghost"] for x in flat], length, 0.0, torch.float32)
    view = dataclasses.replace(result, tokens=tokens, culprits=culprits, ghost_map=ghost_map, layer_map=layer_map)
    return view, view_ctx
