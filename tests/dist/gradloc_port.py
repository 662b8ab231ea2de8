"""GradLoc's distributed search re-written from its published rules, and the cases it is run on.

The reference works in the official code's units, one process simulating ``W`` ranks: a probe
activates some ranks, each with a mask over its own micro-batch ``k``; an active rank's loss is
the token-MEAN of its per-term losses over ITS probe mask (verl's ``token-mean``), times ``1/K``
(gradient accumulation), and the ranks' gradients are AVERAGED over all ``W`` ranks (inactive
ranks add zero). The value of a probe is the norm of that gradient. Rules:

1. micro-batch stage: ``unit = T / sqrt(N) / sqrt(W) * sqrt(K)`` (``N`` the global term count);
   micro-batch ``i`` probed with every rank's full mask; kept when its value is above
   ``unit * sqrt(W)`` and above the best so far (ties: the first);
2. rank stage over ranks ``[0, W-1]``: split at ``mid = (l + r) // 2``, both halves probed with
   their ranks' full masks of the kept micro-batch; the larger value wins, ties to the RIGHT;
   the search gives up when the winner is below ``unit * sqrt(its rank count)``;
3. token stage on the found rank: its terms in row-major order, ranges split at ``(l + r) // 2``
   (2 probes per split, counted against the budget while 2 remain), a half of ``s`` terms kept
   when its value is above ``T / sqrt(s) / W``; single terms are hits; kept halves pushed in
   increasing value (the larger visited first).

``locate(method="gradloc")`` gets, on rank ``r``, ``loss_fn_k(mask) = sum(l * mask) / (K * n_rk)``
(the rank's own token-mean over its full mask, a FIXED normalizer) and ``threshold = T * K * W / N``.
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

B, T_LEN, V = 2, 8, 64  # per rank and micro-batch


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=16, max_seq_len=T_LEN)


# -- cases ------------------------------------------------------------------------------------
def make_cases(world: int, n: int, seed: int = 0) -> list[dict]:
    """``n`` cases on ``world`` ranks: unequal token counts (mask holes of a per-rank density),
    0-3 culprits, 1-2 micro-batches, budgets that may run out, thresholds at a fraction ``f`` of
    the level where the micro-batch stage stops (so the rank stage's give-up rule is reached);
    every fourth case copies rank 0's batch to rank 1 (and 0-1 to 2-3 on 4 ranks): exact ties."""
    rng = random.Random(1000 * world + seed)
    cases = []
    for i in range(n):
        K = rng.choice([1, 1, 2])
        culprits = [[rng.randrange(world), rng.randrange(K), rng.randrange(B), rng.randrange(T_LEN),
                     rng.uniform(8.0, 60.0)] for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        cases.append({
            "name": f"w{world}_case{i}", "seed": rng.randrange(10 ** 6), "K": K,
            "density": [rng.uniform(0.35, 0.95) for _ in range(world)], "culprits": culprits,
            "tie": i % 4 == 3, "f": rng.choice([0.05, 0.2, 0.5, 0.8, 0.95]), "budget": rng.choice([6, 12, 60]),
            "wrap": "fsdp2" if i % 5 == 4 else "ddp",
        })
    return cases


def make_data(case: dict, world: int):
    """(x, y, w, mask), each (world, K, B, T): rank r's micro-batch k is ``[r, k]``."""
    K = case["K"]
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randint(0, V, (world, K, B, T_LEN), generator=g)
    y = torch.randint(0, V, (world, K, B, T_LEN), generator=g)
    w = torch.ones(world, K, B, T_LEN)
    dens = torch.tensor(case["density"]).view(world, 1, 1, 1)
    mask = (torch.rand(world, K, B, T_LEN, generator=g) < dens).float()
    for r, k, b, t, weight in case["culprits"]:
        w[r, k, b, t] = weight
        mask[r, k, b, t] = 1.0
    if case["tie"]:
        pairs = [(0, 1)] if world < 4 else [(0, 2), (1, 3)]
        for a, b in pairs:
            for z in (x, y, w, mask):
                z[b] = z[a]
    return x, y, w, mask


def per_term(model, x, y, w):
    """(B, T) weighted per-term losses of one rank's micro-batch."""
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(x.shape) * w


def rank_loss_fns(model, case: dict, world: int, rank: int) -> tuple[list, list]:
    """Rank ``rank``'s loss_fns (its own token-mean over its full mask, / K) and masks."""
    x, y, w, mask = make_data(case, world)
    K = case["K"]

    def loss_of(k):
        norm = K * max(1.0, float(mask[rank, k].sum()))

        def loss_fn(m):
            return (per_term(model, x[rank, k], y[rank, k], w[rank, k]) * m).sum() / norm
        return loss_fn

    return [loss_of(k) for k in range(K)], [mask[rank, k].clone() for k in range(K)]


# -- the reference ------------------------------------------------------------------------------
class Reference:
    """One process, ``world`` simulated ranks, values in the official units (see the module doc)."""

    def __init__(self, case: dict, world: int) -> None:
        self.case, self.world, self.K = case, world, case["K"]
        self.model = build()
        self.x, self.y, self.w, self.mask = make_data(case, world)
        self.probes: list[tuple[int, dict]] = []  # (micro-batch, {rank: frozenset of (b, t)}), non-empty
        self.margin = math.inf  # smallest relative gap of a decision that is not an exact tie

    def terms(self, r: int, k: int) -> list[tuple[int, int]]:
        return [tuple(ix) for ix in self.mask[r, k].nonzero().tolist()]  # row-major

    @property
    def n_total(self) -> int:
        return int(self.mask.sum())

    def value(self, k: int, active: dict[int, list]) -> float:
        """Probe micro-batch ``k`` with ``active`` = {rank: its terms}; norm of the averaged gradient."""
        loss = None
        for r, terms in sorted(active.items()):
            if not terms:
                continue
            m = torch.zeros(B, T_LEN)
            for b, t in terms:
                m[b, t] = 1.0
            part = (per_term(self.model, self.x[r, k], self.y[r, k], self.w[r, k]) * m).sum() / len(terms)
            loss = part if loss is None else loss + part
        if loss is None:
            return 0.0
        self.probes.append((k, {r: frozenset(t) for r, t in active.items() if t}))
        self.model.zero_grad(set_to_none=True)
        (loss / (self.world * self.K)).backward()
        return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in self.model.parameters()
                             if p.grad is not None))

    def gap(self, a: float, b: float) -> None:
        if b > 0:
            self.margin = min(self.margin, abs(a - b) / b)

    def micro_batch_search(self, T: float) -> tuple[int, float]:
        """(kept micro-batch or -1, the per-unit threshold)."""
        W, K = self.world, self.K
        unit = T / math.sqrt(max(1, self.n_total)) / math.sqrt(W) * math.sqrt(K)
        target, best = -1, 0.0
        for i in range(K):
            v = self.value(i, {r: self.terms(r, i) for r in range(W)})
            self.gap(v, unit * math.sqrt(W))
            if v > unit * math.sqrt(W) and v > best:
                target, best = i, v
        return target, unit

    def rank_search(self, k: int, unit: float) -> tuple[int, int]:
        """(the found rank or -1, probes spent)."""
        lo, hi, used = 0, self.world - 1, 0
        while lo < hi:
            mid = (lo + hi) // 2
            v_left = self.value(k, {r: self.terms(r, k) for r in range(lo, mid + 1)})
            v_right = self.value(k, {r: self.terms(r, k) for r in range(mid + 1, hi + 1)})
            used += 2
            if v_left != v_right:  # an exact tie (identical batches) is a decision of its own: right
                self.gap(v_left, v_right)
            if v_left > v_right:
                self.gap(v_left, unit * math.sqrt(mid - lo + 1))
                if v_left < unit * math.sqrt(mid - lo + 1):
                    return -1, used
                hi = mid
            else:
                self.gap(v_right, unit * math.sqrt(hi - mid))
                if v_right < unit * math.sqrt(hi - mid):
                    return -1, used
                lo = mid + 1
        return lo, used

    def token_search(self, rank: int, k: int, T: float, budget: int) -> tuple[set, bool, int]:
        """(hits, stopped on the budget, probes spent)."""
        idx = self.terms(rank, k)
        hits, stack, used = set(), [(0, len(idx) - 1)], 0
        while used + 2 <= budget and stack:
            lo, hi = stack.pop()
            mid = (lo + hi) // 2
            segs = []
            for a, b in ((lo, mid), (mid + 1, hi)):
                v = self.value(k, {rank: idx[a: b + 1]})
                thr = T / math.sqrt(max(1, b - a + 1)) / self.world
                if b >= a:
                    self.gap(v, thr)
                segs.append((v, a, b, v > thr))
            used += 2
            if segs[0][0] != segs[1][0] and segs[1][2] >= segs[1][1]:
                self.gap(segs[0][0], segs[1][0])  # the visiting order
            push = []
            for v, a, b, keep in sorted(segs, key=lambda s: s[0]):
                if keep and a == b:
                    hits.add((rank, k, *idx[a]))
                elif keep and a < b:
                    push.append((v, a, b))
            stack += [(a, b) for _, a, b in sorted(push, key=lambda s: s[0])]
        return hits, bool(stack), used

    def run(self, T: float, budget: int) -> dict:
        """hits {(rank, k, b, t)}, probe count, budget_exhausted, the non-empty probes' masks, margin."""
        target, unit = self.micro_batch_search(T)
        hits, exhausted, rank, probes = set(), False, -1, self.K
        if target >= 0:
            rank, used = self.rank_search(target, unit)
            probes += used
            if rank >= 0:
                hits, exhausted, used = self.token_search(rank, target, T, budget)
                probes += used
        return {"hits": hits, "probes": probes, "exhausted": exhausted, "masks": list(self.probes),
                "margin": self.margin, "rank": rank, "micro_batch": target}


def with_threshold(case: dict, world: int) -> dict:
    """The case with GradLoc's ``T`` (a fraction ``f`` of the level where the micro-batch stage
    stops) and ``locate``'s ``threshold = T * K * W / N``."""
    ref = Reference(case, world)
    top = max(ref.value(k, {r: ref.terms(r, k) for r in range(world)}) for k in range(case["K"]))
    T = case["f"] * top * math.sqrt(ref.n_total / case["K"])
    return {**case, "T": T, "threshold": T * case["K"] * world / ref.n_total}


# -- the distributed side (runs in tests/dist/locate_worker.py's processes) ---------------------
def run_case(case: dict, rank: int, world: int) -> dict:
    """locate(method="gradloc") on this rank's share of the case; every loss_fn call recorded."""
    from gradloc_track import locate

    from .locate_worker import wrap

    model = build()
    wrapped = wrap(model, case["wrap"], world)
    fns, masks = rank_loss_fns(wrapped, case, world, rank)
    calls: list = []

    def recording(fn, k):
        def loss_fn(m):
            if torch.is_grad_enabled():
                calls.append([k, m.nonzero().tolist()])
            return fn(m)
        return loss_fn

    fns = [recording(fn, k) for k, fn in enumerate(fns)]
    one = case["K"] == 1
    res = locate(model, fns[0] if one else fns, masks[0] if one else masks, method="gradloc",
                 threshold=case["threshold"], budget=case["budget"])
    found = res.tokens + [c for c in res.below_floor if c.level == "token"]  # every hit, shown or under the floor
    return {"hits": [[c.rank, c.micro_batch or 0, c.batch, c.position] for c in found],
            "probes": res.probes, "exhausted": res.budget_exhausted, "calls": calls}
