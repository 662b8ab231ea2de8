"""Which samples made the step's gradient (or loss) non-finite: the search ``locate`` runs on a NaN/Inf step.

Contract: ``locate`` calls ``search`` with the ``Prober`` that ran the micro-batch stage when the
probes' sum is not finite (``NonfiniteStep``, raised by the driver), and ``search_losses`` when
only a micro-batch's loss is; both return a frozen ``NonfiniteFinding`` (``LocateResult.nonfinite``;
None on a finite step) and ``culprit_rows`` makes its table rows (``nonfinite=True``, ``share``
None). Every probe goes through the ``Prober`` and counts against the budget; the caller's
``Snapshot`` restores ``.grad``, so the step is skipped exactly as its clipper decided.

Per micro-batch whose gradient is non-finite (norms are not compared: a NaN has none):
1. the term-loss map (``Prober.term_losses``, one probe): samples with an Inf/NaN loss term are
   named at once, with those terms;
2. one probe of the other samples' terms: finite, and the search is done. Else one probe with no
   term kept: non-finite means no mask makes it finite (the backward of a masked-out Inf term is
   0 x Inf = NaN; NaN weights; an overflow in the forward), said so (``where="all"`` when no
   sample's loss is non-finite);
3. otherwise halving on ``isfinite`` of the probe gradient over the samples (rows, or packed
   documents): both halves of a non-finite set are probed, about ``2 k log2 n`` probes for
   ``k`` bad samples among ``n``; inside a named sample its terms are halved the same way while
   at most ``FEW_TERMS`` of them are bad;
4. a set whose halves are both finite overflows from the SUM (fp16/bf16): ``where="sum"``, with
   each sample's largest gradient norm and element against the dtype's max. Micro-batches whose
   gradients are each finite but add up to Inf are that case too, at no probe.

Before any probe: NaN/Inf weights (``where="all"``, named) and a gradient whose elements are all
finite but whose float32 norm overflows (``"norm"``). After a finite search: ``.grad`` non-finite
while the replayed probes are finite (``"replay"``: no sample of the batch made it so).
Sentences: ``nonfinite_words.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..norms import local_part
from . import nonfinite_words as words
from .probe import BudgetExhausted, Grads, Prober
from .result import Culprit, CulpritToken, LocateResult
from .segments import Segment, Segments

WHERE = ("samples", "sum", "all", "norm", "replay")  # what ``NonfiniteFinding.where`` may say
FEW_TERMS = 8  # a sample's bad terms are named as tokens up to this many (else the sample)
MAX_SUM_PROBES = 4  # samples of an overflowing sum probed alone for the numbers (beyond those the halving did)


@dataclass(frozen=True)
class NonfiniteSample:
    """One sample named by the search: where it is, its loss and its gradient as its own probe gives them."""

    batch: int
    micro_batch: int | None = None
    document: int | None = None
    start: int = 0
    end: int = 0
    n_terms: int = 0
    loss: float | None = None  # the sum of its terms' losses in loss_fn's units (None: unknown)
    grad: str = "NaN"  # its probe's gradient: "NaN", "Inf" or "finite" ("?" when the budget ran out)
    grad_norm: float = math.nan
    terms: tuple[int, ...] = ()  # positions of its non-finite terms (empty: not narrowed)
    rank: int | None = None  # the process holding it (None: not a distributed search)


@dataclass(frozen=True)
class NonfiniteFinding:
    """What made a step non-finite. ``where``: ``"samples"`` (the samples named), ``"sum"`` (every
    sample's gradient is finite, their sum overflows the gradient's dtype), ``"all"`` (the gradient
    is non-finite whatever the mask keeps) or ``"norm"`` (every element is finite, only the norm
    overflows) or ``"replay"`` (``.grad`` is non-finite, the replayed probes are not);
    ``samples``/``terms``: rows and ``(row, position)`` of the named samples and their
    non-finite terms (``units`` adds micro-batch, document, loss, gradient); ``detail``: one
    sentence with the numbers; ``probes``: what the search spent."""

    where: str
    samples: tuple[int, ...] = ()
    terms: tuple[tuple[int, int], ...] = ()
    detail: str = ""
    units: tuple[NonfiniteSample, ...] = ()
    probes: int = 0
    budget_exhausted: bool = False

    def __post_init__(self) -> None:
        if self.where not in WHERE:
            raise ValueError(f"NonfiniteFinding.where={self.where!r}: use one of {', '.join(WHERE)}")


class NonfiniteStep(FloatingPointError):
    """The probes' sum is not finite: the norm search cannot run, ``search`` does instead."""

    def __init__(self, norms: list[float], total: Grads) -> None:
        super().__init__("the batch's gradient is not finite (NaN/Inf)")
        self.norms, self.total = norms, total


def grad_state(g: Grads) -> str:
    """``"NaN"`` if any element is NaN, else ``"Inf"`` if any is infinite, else ``"finite"``."""
    return inspect(g)[0]


def inspect(g: Grads) -> tuple[str, float]:
    """(``grad_state``, the largest finite element's magnitude), in one host transfer."""
    return read_flags(grad_flags(g))


def grad_flags(g: Grads) -> torch.Tensor:
    """(3,) float64 on the gradient's device, no host sync: NaN seen, Inf seen, the largest finite element's
    magnitude (zeros for no tensor); a rank's, to all-reduce with MAX (``dist_nonfinite.agreed_inspect``)."""
    rows = [torch.stack([t.isnan().any().double(), t.isinf().any().double(),
                         t.detach().abs().nan_to_num(0.0, 0.0, 0.0).amax().double() if t.numel() else
                         torch.zeros((), dtype=torch.float64, device=t.device)]) for t in g]
    return torch.stack(rows).amax(0) if rows else torch.zeros(3, dtype=torch.float64)


def read_flags(flags: torch.Tensor) -> tuple[str, float]:
    """``grad_flags`` read: (``grad_state``, the largest finite element's magnitude)."""
    nan, inf, amax = flags.tolist()  # host sync: once per probe, on a non-finite step only
    return ("NaN" if nan else "Inf" if inf else "finite"), amax


@dataclass
class _MicroBatch:
    """What the search found in one micro-batch."""

    named: list[NonfiniteSample] = field(default_factory=list)
    sums: list[list[Segment]] = field(default_factory=list)
    all_bad: bool = False  # non-finite with no term kept


def _same(i: int, u: NonfiniteSample) -> NonfiniteSample:
    return u


class _Search:
    """The search's state over one prober. ``inspect``: ``inspect`` or, under torch.distributed, its
    value agreed by every rank; ``place(i, sample)``: a sample named in micro-batch ``i``, in the
    caller's numbering (its rank and own row under torch.distributed; itself in one process)."""

    def __init__(self, prober: Prober, labelled: bool, documents: list | None,
                 inspect: Callable[[Grads], tuple[str, float]] = inspect,
                 place: Callable[[int, NonfiniteSample], NonfiniteSample] = _same) -> None:
        self.prober, self.labelled = prober, labelled
        self.inspect, self.place = inspect, place
        self.docs = documents or [None] * prober.k
        # (i, row, document) -> (state, norm, largest element) of the sample's own probe
        self.single: dict[tuple, tuple[str, float, float]] = {}
        self.empty: dict[int, bool] = {}  # micro-batch -> non-finite with no term kept
        self.exhausted = False

    def state(self, i: int, terms: list[tuple[int, int]]) -> tuple[str, float, float]:
        """(``grad_state``, norm, largest finite element) of the probe keeping ``terms``."""
        g = self.prober.probe_terms(i, terms)
        state, amax = self.inspect(g)
        out = state, self.prober.norm(g), amax
        del g
        return out

    def units_state(self, i: int, units: list[Segment]) -> str:
        st = self.state(i, [t for u in units for t in u.terms])
        if len(units) == 1:
            self.single[(i, units[0].batch, units[0].document)] = st
        return st[0]

    def all_bad(self, i: int) -> bool:
        """The micro-batch's gradient with no term kept is non-finite (cached)."""
        if i not in self.empty:
            try:
                g = self.prober.probe(i, torch.zeros_like(self.prober.masks[i]))
            except ValueError:  # loss_fn(zeros) holds no graph: nothing reaches the gradient
                self.empty[i] = False
            else:
                self.empty[i] = self.inspect(g)[0] != "finite"
        return self.empty[i]

    def halve(self, i: int, items: list, terms_of, cap: int | None = None) -> tuple[list, list[list], bool]:
        """(bad items, sets whose halves are both finite, stopped) over ``items`` known non-finite
        together; ``terms_of(items)`` -> their terms. Stops (True) when a split leaves both halves
        non-finite and the micro-batch is non-finite with no term kept, or past ``cap`` bad items. When
        the budget runs out, what was found so far (``exhausted`` set)."""
        bad, sums, stack = [], [], [list(items)]
        while stack:
            S = stack.pop()
            if len(S) == 1:
                bad.append(S[0])
                continue
            if cap is not None and len(bad) + len(stack) + 1 > cap:
                return bad, sums, True
            halves = [S[: len(S) // 2], S[len(S) // 2:]]
            try:
                states = [self.items_state(i, h, terms_of) for h in halves]
            except BudgetExhausted:
                self.exhausted = True
                return bad, sums, False
            if all(s != "finite" for s in states) and cap is None and self.all_bad(i):
                return bad, sums, True
            if all(s == "finite" for s in states):
                sums.append(S)
            stack += [h for h, s in zip(halves[::-1], states[::-1]) if s != "finite"]
        return bad, sums, False

    def items_state(self, i: int, items: list, terms_of) -> str:
        if terms_of is None:
            return self.units_state(i, items)
        return self.state(i, terms_of(items))[0]

    def sample(self, i: int, u: Segment, tmap: TermMap, terms: tuple[int, ...]) -> NonfiniteSample:
        """The named sample, its loss from the term map and its own probe's gradient (one probe when
        the halving did not probe it alone)."""
        key = (i, u.batch, u.document)
        if key not in self.single:
            try:
                self.single[key] = self.state(i, u.terms)
            except BudgetExhausted:
                self.exhausted = True
                self.single[key] = ("?", math.nan, math.nan)
        state, norm, _ = self.single[key]
        return self.place(i, NonfiniteSample(u.batch, i if self.labelled else None, u.document, u.start, u.end,
                                             len(u.terms), tmap.loss(u), state, norm, terms))

    def label(self, i: int, u: Segment) -> str:
        """``words.label`` of a sample (a ``Segment`` of micro-batch ``i``), placed."""
        p = self.place(i, NonfiniteSample(u.batch, i if self.labelled else None, u.document))
        return words.label(p.batch, p.micro_batch, p.document, p.rank)


class TermMap:
    """One micro-batch's samples with their losses and non-finite loss terms, from ``Prober.term_losses``
    (one probe, then two host transfers: every sample's loss, every bad term)."""

    def __init__(self, prober: Prober, i: int, segments: Segments) -> None:
        self.units = [u for u in segments.items if u.terms]
        self._index = {id(u): j for j, u in enumerate(segments.items)}
        self.losses: list[float] | None = None  # per segment, in loss_fn's units (None: no map)
        self.bad: dict[int, list[int]] = {}  # segment index -> positions of its non-finite terms
        losses = prober.term_losses(i)
        if losses is None:
            return
        per_unit = torch.zeros(len(segments), dtype=torch.float64, device=losses.device)
        per_unit.index_add_(0, segments.ids.to(losses.device).reshape(-1), losses.reshape(-1))
        self.losses = per_unit.tolist()  # host sync: once per micro-batch, on a non-finite step
        for b, t in (~torch.isfinite(losses)).nonzero().tolist():  # host sync: once per micro-batch
            self.bad.setdefault(int(segments.ids[b, t]), []).append(t)

    def loss(self, u: Segment) -> float | None:
        return None if self.losses is None else self.losses[self._index[id(u)]]

    def bad_terms(self, u: Segment) -> tuple[int, ...]:
        return tuple(sorted(self.bad.get(self._index[id(u)], []))) if self.losses is not None else ()


def _micro_batch(s: _Search, i: int) -> _MicroBatch:
    """Steps 1-3 of the module doc in micro-batch ``i`` (its gradient is non-finite)."""
    out = _MicroBatch()
    tmap = TermMap(s.prober, i, Segments(i, s.prober.masks[i], s.docs[i]))
    lossy = [u for u in tmap.units if tmap.bad_terms(u)]
    rest = [u for u in tmap.units if not tmap.bad_terms(u)]
    out.named = [s.sample(i, u, tmap, tmap.bad_terms(u)) for u in lossy]
    if lossy and (not rest or s.units_state(i, rest) == "finite"):
        return out
    if lossy and s.all_bad(i):
        out.all_bad = True
        return out
    bad, out.sums, out.all_bad = s.halve(i, rest, None)
    if out.all_bad:
        return out
    for u in bad:
        out.named.append(s.sample(i, u, tmap, _narrow(s, i, u)))
    return out


def _narrow(s: _Search, i: int, u: Segment) -> tuple[int, ...]:
    """The sample's non-finite terms by halving, when at most ``FEW_TERMS`` (else ``()``)."""
    if len(u.terms) == 1:
        return (u.terms[0][1],)
    was = s.exhausted
    bad, sums, stopped = s.halve(i, u.terms, list, cap=FEW_TERMS)
    return () if stopped or sums or s.exhausted != was else tuple(sorted(t for _, t in bad))


def search(prober: Prober, step: NonfiniteStep, labelled: bool, documents: list | None,
           names: list[str]) -> NonfiniteFinding:
    """The finding for a step whose probes' sum is non-finite (``step``: each micro-batch's norm and
    the sum); ``names``: the trainable tensors' names, in the prober's order."""
    start = prober.count
    s = _Search(prober, labelled, documents)
    if grad_state(step.total) == "finite":
        return NonfiniteFinding("norm", detail=_norm_overflow(step.total), probes=0)
    weights = _bad_weights(prober, names)
    if weights:  # every probe is NaN, whatever the mask: no sample to name
        return NonfiniteFinding("all", detail=weights, probes=0)
    bad_mbs = [i for i, n in enumerate(step.norms) if not math.isfinite(n)]
    if not bad_mbs:
        return NonfiniteFinding("sum", detail=_micro_batch_sum(step, names), probes=0)
    found: list[_MicroBatch] = []
    try:
        for i in bad_mbs:
            found.append(_micro_batch(s, i))
    except BudgetExhausted:
        s.exhausted = True
    sums = [(i, S) for i, mb in zip(bad_mbs, found) for S in mb.sums]
    sum_text = _sum_detail(s, sums, _overflow(step.total, names)) if sums else ""
    return _finding(s, found, sum_text, start)


def _finding(s: _Search, found: list[_MicroBatch], sum_text: str, start: int,
             extra: tuple[str, ...] = ()) -> NonfiniteFinding:
    """The finding from the micro-batches' searches; ``extra``: sentences a caller adds (under
    torch.distributed: the ranks whose forward gives a non-finite loss)."""
    named = [u for mb in found for u in mb.named]
    all_bad = any(mb.all_bad for mb in found)
    parts = [words.sample_sentence(u) for u in named]
    if all_bad:
        parts.append(words.ALL_BAD_NAMED if named else words.ALL_BAD)
    parts += list(extra)
    if sum_text:
        parts.append(sum_text)
    if s.exhausted:
        parts.append(words.budget_ran_out(s.prober.budget))
    where = "samples" if named else "all" if all_bad else "sum" if sum_text else "samples"
    return NonfiniteFinding(where, tuple(u.batch for u in named),
                            tuple((u.batch, t) for u in named for t in u.terms), "; ".join(parts) or
                            "no sample isolated", tuple(named), s.prober.count - start, s.exhausted)


def search_losses(prober: Prober, micro_batches: list[int], labelled: bool, documents: list | None) -> NonfiniteFinding:
    """A step whose gradient is finite but whose loss is not (a ``-inf`` logit under a log-softmax):
    the samples with non-finite loss terms, from the term-loss map (one probe per micro-batch) and
    one probe per named sample for its gradient."""
    start = prober.count
    s = _Search(prober, labelled, documents)
    named: list[NonfiniteSample] = []
    try:
        for i in micro_batches:
            tmap = TermMap(prober, i, Segments(i, prober.masks[i], s.docs[i]))
            named += [s.sample(i, u, tmap, tmap.bad_terms(u)) for u in tmap.units if tmap.bad_terms(u)]
    except BudgetExhausted:
        s.exhausted = True
    text = "; ".join(words.sample_sentence(u) for u in named) or "the loss is non-finite but no loss term is"
    return NonfiniteFinding("samples", tuple(u.batch for u in named),
                            tuple((u.batch, t) for u in named for t in u.terms), text, tuple(named),
                            prober.count - start, s.exhausted)


def _bad_weights(prober: Prober, names: list[str]) -> str:
    """Which trainable tensors hold NaN/Inf, in words ('' when none)."""
    # local parts: FSDP2 on a 1-rank mesh holds DTensors (the whole tensor), which .tolist() refuses
    flags = torch.stack([torch.isfinite(local_part(p).detach()).all() for p in prober.params]).tolist()  # host sync
    bad = [n for n, ok in zip(names, flags) if not ok]
    return words.bad_weights(bad) if bad else ""


def _overflow(total: Grads, names: list[str], finite: list[bool] | None = None) -> tuple[str, float, str]:
    """(the dtype the sum overflows, its max, the tensors that overflowed); ``finite``: each tensor's
    flag when the caller has it (agreed by every rank under torch.distributed)."""
    if finite is None:
        finite = [bool(torch.isfinite(t).all()) for t in total]  # host sync per tensor
    bad = [(n, t.dtype) for n, t, ok in zip(names, total, finite) if not ok]
    dtype = bad[0][1] if bad else total[0].dtype
    return str(dtype).replace("torch.", ""), torch.finfo(dtype).max, words.names([n for n, _ in bad])


def _sum_detail(s: _Search, sums: list[tuple[int, list[Segment]]], overflow: tuple[str, float, str]) -> str:
    """Each sample of an overflowing sum probed alone (at most ``MAX_SUM_PROBES``): the largest norm
    and element against the dtype's max; ``overflow``: ``_overflow``'s answer."""
    best, probed = (0.0, 0.0, None), 0
    try:
        for i, S in sums:
            for u in S:
                key = (i, u.batch, u.document)
                if key not in s.single:
                    if probed >= MAX_SUM_PROBES:
                        continue
                    s.single[key] = s.state(i, u.terms)
                    probed += 1
                _, norm, amax = s.single[key]
                if amax > best[1]:
                    best = (norm, amax, (i, u))
    except BudgetExhausted:
        s.exhausted = True
    seen = sum(1 for i, S in sums for u in S if (i, u.batch, u.document) in s.single)
    alone = ""
    if best[2] is not None:
        i, u = best[2]
        alone = words.largest_alone(seen, s.label(i, u), *best[:2])
    return words.sum_overflow(sum(len(S) for _, S in sums), *overflow, sorted({len(S) for _, S in sums}), alone)


def _norm_overflow(total: Grads) -> str:
    top = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in total)  # host sync per tensor
    return words.norm_overflow(top, str(total[0].dtype).replace("torch.", ""))


def _micro_batch_sum(step: NonfiniteStep, names: list[str]) -> str:
    return words.micro_batch_sum(step.norms, *_overflow(step.total, names))


def culprit_rows(finding: NonfiniteFinding) -> list[Culprit | CulpritToken]:
    """The finding's table rows: a sample's non-finite terms as tokens when a few (at most
    ``FEW_TERMS``, or a quarter of its terms), else the sample; ``share`` None, ``nonfinite`` True."""
    rows: list[Culprit | CulpritToken] = []
    for u in finding.units:
        if u.terms and len(u.terms) <= max(FEW_TERMS, u.n_terms // 4):
            rows += [CulpritToken(batch=u.batch, position=t, grad_norm=math.nan, micro_batch=u.micro_batch,
                                  rank=u.rank, nonfinite=True) for t in u.terms]
        else:
            rows.append(Culprit("sample", u.grad_norm, None, micro_batch=u.micro_batch, batch=u.batch, start=u.start,
                                end=u.end, document=u.document, n_terms=u.n_terms, rank=u.rank, nonfinite=True))
    return rows


def as_result(prober: Prober, step: NonfiniteStep, method: str, labelled: bool, documents: list | None,
              names: list[str]) -> LocateResult:
    """The localizer's result on a non-finite step: the finding, its rows, no threshold, no step check
    (``.grad`` is NaN too); ``probes`` counts the micro-batch stage's and the search's."""
    finding = search(prober, step, labelled, documents, names)
    rows = culprit_rows(finding)
    tokens = [c for c in rows if isinstance(c, CulpritToken)]
    total = math.sqrt(float(prober.sq_per_tensor(step.total).sum()))  # host sync: once
    return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=math.nan, total_norm=total,
                        layer_names=list(prober.grouping.layers), notes=[f"non-finite step: {finding.detail}"],
                        micro_batch_norms=list(step.norms) if labelled else [],
                        ghost_maps=[None] * prober.k if labelled else [],
                        layer_maps=[None] * prober.k if labelled else [], culprits=rows, nonfinite=finding,
                        budget_exhausted=finding.budget_exhausted)


def attach_losses(result: LocateResult, prober: Prober, micro_batches: list[int], labelled: bool,
                  documents: list | None) -> None:
    """A finite gradient with a non-finite loss in ``micro_batches``: the finding and its rows join
    the norm search's result (nothing when every loss is finite)."""
    if not micro_batches:
        return
    finding = search_losses(prober, micro_batches, labelled, documents)
    result.nonfinite = finding
    rows = culprit_rows(finding)
    result.tokens = list(result.tokens) + [c for c in rows if isinstance(c, CulpritToken)]
    result.culprits = list(result.culprits) + rows
    result.probes = prober.count
    result.notes.append(f"non-finite loss, finite gradient: {finding.detail}")


def attach_replay(result: LocateResult, grads: list[torch.Tensor | None] | None, names: list[str],
                  precision: str | None = None, *, distributed: bool = False, group: object = None,
                  device: torch.device | None = None) -> None:
    """``.grad`` holds NaN/Inf while the replayed probes are finite: no sample of the batch made it
    so; the finding says that (the norm search's culprits describe the replayed step). ``precision``: the
    reduced precision the training forward ran in, whose overflow the replay does not share.
    ``distributed``: a collective over ``group`` (None: the default group), which every rank calls with the
    same names: each tensor's local part (a shard's) is read and the flags combined on ``device`` (the
    backend's), so every rank finds the same (held-out tester, stop 56: the multi-process search never
    attached it, and a NaN step's replay rows read as plain culprits; under FSDP2 a NaN in one rank's shard)."""
    if result.nonfinite is not None or (not grads and not distributed):  # (the same on every rank: lockstep)
        return
    grads = list(grads or [None] * len(names))
    if not distributed:
        held = [(n, g) for n, g in zip(names, grads) if g is not None]
        if not held:
            return
    else:  # every name on every rank (a rank without a tensor's gradient counts it finite): one shape to reduce
        held = list(zip(names, grads))
    dev = device or next((g.device for _, g in held if g is not None), torch.device("cpu"))
    try:
        flags = torch.stack([torch.ones((), dtype=torch.bool, device=dev) if g is None else
                             torch.isfinite(local_part(g.to_dense() if g.is_sparse else g)).all().to(dev)
                             for _, g in held])
    except Exception:  # noqa: BLE001 - never leave the collective on one rank: unread counts as finite
        if not distributed:
            raise
        flags = torch.ones(len(held), dtype=torch.bool, device=dev)
    if distributed:
        import torch.distributed as dist

        ok = flags.to(torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # a collective: every rank, the same names
        flags = ok.bool()
    bad = [n for (n, _), ok in zip(held, flags.tolist()) if not ok]  # host sync: once per localization
    if not bad:
        return
    result.nonfinite = NonfiniteFinding("replay", detail=words.replay(bad, result.total_norm, precision))
    result.notes.append(f"non-finite .grad, finite replay: {result.nonfinite.detail}")
