"""The non-finite search under ``torch.distributed``: the rank, micro-batch, sample and tokens that
made the step's gradient NaN/Inf, the same finding on every rank.

Called by ``distributed.py`` on every rank, in lockstep, when the probes' sum is not finite (a NaN
advantage or reward on one rank: the most common RL blow-up). The single-process search
(``nonfinite.py``: term-loss map, then ``isfinite`` halving over the samples, then over a named
sample's terms) runs unchanged over a GLOBAL view of each micro-batch (``NonfiniteView``): its
rows are every rank's rows of that micro-batch, numbered in rank order, so a set of samples is
probed on every rank at once (``DistProber``: each rank runs the micro-batch with its share of the
mask, zeros where it owns none), and every decision reads the probe's state AGREED by one
all-reduce (``agreed_inspect``: a NaN in one shard of an FSDP2 gradient is seen by every rank).

Per micro-batch one scan probe (``scan``) keeps the mask as a leaf that requires grad, as the
single-process term-loss map does: each rank reads its own terms' losses from ``d loss / d mask``
and the loss its forward computed; one ``all_gather_object`` brings every rank's rows, documents,
term losses and loss to every rank. A micro-batch whose every probe is non-finite (a NaN that
reaches the gradient through the mask, ``0 x NaN``) names the ranks whose own forward gave a
non-finite loss, as micro-batch rows. Every named sample is placed back on its rank and own row.

Costs: one probe per micro-batch, then the halving's (about ``2 k log2 n`` for ``k`` bad samples
among ``n`` of every rank), each followed by one 3-number all-reduce.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..norms import local_part
from . import nonfinite
from . import nonfinite_words as words
from .dist_probe import DistProber
from .nonfinite import NonfiniteFinding, NonfiniteSample, grad_flags, read_flags
from .probe import BudgetExhausted, Grads
from .result import Culprit, CulpritToken, LocateResult


def agreed_inspect(prober: DistProber, g: Grads) -> tuple[str, float]:
    """``nonfinite.inspect`` of the FULL gradient, the same on every rank (one all-reduce of 3 numbers:
    NaN seen, Inf seen, the largest finite element)."""
    flags = grad_flags(g).to(prober.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=prober.group)
    return read_flags(flags)


def agreed_finite(prober: DistProber, tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor: finite on every rank (one all-reduce; sharded tensors are finite when every shard is)."""
    if not tensors:
        return []
    bad = torch.stack([(~torch.isfinite(local_part(t).detach())).any() for t in tensors]).to(prober.device,
                                                                                          torch.int32)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=prober.group)
    return [not v for v in bad.tolist()]  # host sync: once


@dataclass
class _Rank:
    """One rank's part of one micro-batch, as the scan gathered it."""

    rank: int
    rows: list[int]  # its rows that hold loss terms
    width: int
    kept: list[list[int]]  # per row, the positions of its loss terms
    docs: list[list[int]] | None  # per row, the document id of every position
    losses: list[list[float]] | None  # per row, the loss of each kept term (None: no map)
    loss: float  # the loss its own forward computed (full mask)


def scan(prober: DistProber, k: int) -> tuple[Grads, float, torch.Tensor | None]:
    """Micro-batch ``k``, every rank's full mask, the mask a leaf that requires grad: (the gradient,
    this rank's loss, this rank's (B, T) term-loss map or None when loss_fn gives the mask none)."""
    held: dict = {}
    fn = prober.loss_fns[k]

    def with_leaf(mask: torch.Tensor) -> torch.Tensor:
        held["leaf"] = leaf = mask.detach().clone().requires_grad_(True)
        held["loss"] = loss = fn(leaf)
        return loss

    prober.loss_fns[k] = with_leaf
    try:
        g = prober.run({k: prober.masks[k]})
    finally:
        prober.loss_fns[k] = fn
    loss = held.get("loss")
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else math.nan  # host sync: once per micro-batch
    grad = held["leaf"].grad if "leaf" in held else None
    if grad is None:
        return g, value, None
    full = prober.masks[k].double()
    return g, value, torch.where(full != 0, grad.detach().double() * full, torch.zeros_like(full))


def _local_part(prober: DistProber, k: int, docs: torch.Tensor | None, tmap: torch.Tensor | None,
                loss: float) -> tuple:
    """This rank's part of micro-batch ``k`` as plain python values (for ``all_gather_object``)."""
    mask = prober.masks[k].detach().cpu() != 0
    rows = [b for b in range(mask.shape[0]) if bool(mask[b].any())]
    kept = [mask[b].nonzero().flatten().tolist() for b in rows]  # host sync: once per localization
    d = None if docs is None else [docs[b].detach().cpu().tolist() for b in rows]
    lv = None if tmap is None else [tmap[b].cpu()[kept_b].tolist() for b, kept_b in zip(rows, kept)]
    return rows, int(mask.shape[1]), kept, d, lv, loss


class NonfiniteView:
    """The ``DistProber`` as ``nonfinite._Search`` sees a prober: micro-batch ``k``'s rows are every
    rank's rows of ``k`` (``parts[k]``, in rank order), its mask ``(rows, widest)``, its term-loss
    map the ranks' maps side by side; a probe of global terms runs on every rank."""

    def __init__(self, prober: DistProber, parts: list[list[_Rank]]) -> None:
        self.dist, self.parts = prober, parts
        self.rows = [[(p.rank, b) for p in ps for b in p.rows] for ps in parts]  # k -> global row -> (rank, b)
        self.masks, self.docs, self.maps = [], [], []
        for ps in parts:
            width = max([p.width for p in ps] + [1])
            n = sum(len(p.rows) for p in ps)
            mask, tmap = torch.zeros(n, width), torch.zeros(n, width, dtype=torch.float64)
            docs = torch.zeros(n, width, dtype=torch.long) if any(p.docs is not None for p in ps) else None
            row = 0
            for p in ps:
                for j, kept in enumerate(p.kept):
                    mask[row, kept] = 1.0
                    if p.losses is not None:
                        tmap[row, kept] = torch.tensor(p.losses[j], dtype=torch.float64)
                    if docs is not None and p.docs is not None:
                        docs[row, : len(p.docs[j])] = torch.tensor(p.docs[j])
                        docs[row, len(p.docs[j]):] = -1
                    row += 1
            self.masks.append(mask)
            self.docs.append(docs)
            self.maps.append(tmap if all(p.losses is not None for p in ps) else None)

    @property
    def k(self) -> int:
        return len(self.masks)

    @property
    def count(self) -> int:
        return self.dist.count

    @property
    def budget(self) -> int:
        return self.dist.budget

    def to_dist(self, i: int, terms) -> list[tuple[int, int, int, int]]:
        """Global ``(row, t)`` of micro-batch ``i`` as ``(rank, i, b, t)`` (what ``DistProber`` probes)."""
        return [(self.rows[i][row][0], i, self.rows[i][row][1], t) for row, t in terms]

    def probe_terms(self, i: int, terms) -> Grads:
        if not terms:  # no term kept: micro-batch i still runs on every rank, each with a zero mask
            return self.dist.run({i: torch.zeros_like(self.dist.masks[i])})
        return self.dist.run({i: self.dist.global_mask_of(i, self.to_dist(i, terms))})

    def probe(self, i: int, mask: torch.Tensor) -> Grads:
        idx = (mask != 0).nonzero().tolist()
        return self.probe_terms(i, [tuple(x) for x in idx])

    def norm(self, g: Grads) -> float:
        return self.dist.norm(g)

    def term_losses(self, i: int) -> torch.Tensor | None:
        """The scan's map (no new probe: the scan ran it)."""
        return self.maps[i]

    def inspect(self, g: Grads) -> tuple[str, float]:
        return agreed_inspect(self.dist, g)

    def place(self, i: int, u: NonfiniteSample) -> NonfiniteSample:
        """A sample named on a global row, on its rank and own row."""
        r, b = self.rows[i][u.batch]
        return dataclasses.replace(u, rank=r, batch=b)


def _gather_parts(prober: DistProber, docs: list | None, held: list[tuple]) -> list[list[_Rank]]:
    """Every rank's part of every micro-batch (one ``all_gather_object``); ``held``: per micro-batch
    this rank's (loss, term-loss map) from its scan."""
    mine = [_local_part(prober, k, (docs or [None] * prober.k)[k], tmap, loss) for k, (loss, tmap) in
            enumerate(held)]
    every: list = [None] * dist.get_world_size(prober.group)
    dist.all_gather_object(every, mine, group=prober.group)
    return [[_Rank(r, *every[r][k]) for r in range(len(every))] for k in range(prober.k)]


def _forward_pieces(parts: list[list[_Rank]], bad: list[int]) -> list[tuple[int, int, float]]:
    """(rank, micro-batch, loss) of each bad micro-batch's pieces whose own forward's loss is non-finite."""
    return [(p.rank, k, p.loss) for k in bad for p in parts[k] if not math.isfinite(p.loss)]


def search(prober: DistProber, total: Grads, labelled: bool, docs: list | None,
           names: list[str]) -> tuple[NonfiniteFinding, list[tuple[int, int, float]]]:
    """The finding (the same on every rank) and the pieces (rank, micro-batch, loss) of the bad
    micro-batches whose own forward gave a non-finite loss."""
    start = prober.count
    state, top = agreed_inspect(prober, total)
    if state == "finite":
        return NonfiniteFinding("norm", detail=words.norm_overflow(top, _dtype(total))), []
    ok = agreed_finite(prober, list(prober.params))
    if not all(ok):  # every probe is NaN whatever the mask keeps: no sample to name
        return NonfiniteFinding("all", detail=words.bad_weights([n for n, f in zip(names, ok) if not f])), []
    overflow = nonfinite._overflow(total, names, agreed_finite(prober, total))
    states, norms, held = [], [], []
    try:
        for k in range(prober.k):
            g, loss, tmap = scan(prober, k)
            states.append(agreed_inspect(prober, g)[0])
            norms.append(prober.norm(g))
            held.append((loss, tmap))
            del g  # one gradient-sized buffer at a time
    except BudgetExhausted:
        return NonfiniteFinding("samples", detail=words.budget_ran_out(prober.budget), probes=prober.count - start,
                                budget_exhausted=True), []
    parts = _gather_parts(prober, docs, held)
    bad = [k for k, st in enumerate(states) if st != "finite"]
    if not bad:  # each micro-batch finite, their sum not
        return NonfiniteFinding("sum", detail=words.micro_batch_sum(norms, *overflow),
                                probes=prober.count - start), []
    view = NonfiniteView(prober, parts)
    s = nonfinite._Search(view, labelled, view.docs, inspect=view.inspect, place=view.place)
    found: list = []
    try:
        for k in bad:
            found.append(nonfinite._micro_batch(s, k))
    except BudgetExhausted:
        s.exhausted = True
    pieces = [p for k, mb in zip(bad, found) if mb.all_bad and not mb.named for p in _forward_pieces(parts, [k])]
    extra = tuple(words.forward_loss(r, k if labelled else None, v) for r, k, v in pieces)
    sums = [(k, S) for k, mb in zip(bad, found) for S in mb.sums]
    sum_text = nonfinite._sum_detail(s, sums, overflow) if sums else ""
    return nonfinite._finding(s, found, sum_text, start, extra), pieces


def _dtype(total: Grads) -> str:
    return str(total[0].dtype).replace("torch.", "") if total else "float32"


def as_result(prober: DistProber, total: Grads, method: str, labelled: bool, docs: list | None,
              names: list[str]) -> LocateResult:
    """The localizer's result on a non-finite step, identical on every rank: the finding, its rows
    (each on its rank), the micro-batch rows of ranks whose forward is non-finite, no threshold."""
    world = dist.get_world_size(prober.group)
    finding, pieces = search(prober, total, labelled, docs, names)
    rows = nonfinite.culprit_rows(finding) + [
        Culprit("micro_batch", math.nan, None, micro_batch=k, rank=r, nonfinite=True) for r, k, _ in pieces]
    tokens = [c for c in rows if isinstance(c, CulpritToken)]
    total_norm = math.sqrt(float(prober.sq_per_tensor(total).sum()))  # host sync: once
    notes = [f"non-finite step: {finding.detail}",
             f"distributed over {world} ranks; norms in the optimizer's units (averaged over ranks)"]
    return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=math.nan, total_norm=total_norm,
                        layer_names=list(prober.grouping.layers), notes=notes, culprits=rows, nonfinite=finding,
                        budget_exhausted=finding.budget_exhausted)
