"""What each world size runs (one launch each, one engine): one injected response per scenario
under one of verl's loss aggregations, padded rows or one packed row per micro-batch.

- a reward outlier (Dr.GRPO advantages: it also moves its 3 group mates, so 24 culprit tokens and
  25 probes on 2 processes);
- stale old log-probs on one response (its 4 tokens alone: 5 probes), which the three loss
  aggregations and the packed layout use, since four processes share two cores here.

World 2 runs all of them (the issue's done-when), the stale token-mean one logged through verl's
``Tracking`` into one MLflow run; world 1 the reward outlier, padded and packed; world 4 the stale
response and the NaN advantage; world 2 also a NaN advantage (padded and packed: the non-finite
search across ranks). ``warmup``: clean steps before the injected one for the adaptive detector (0: GradLoc's
fixed trigger, set to fire, on the one step)."""
from __future__ import annotations

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def reward(world: int, **kw) -> dict:
    return dict(dict(name="reward", kind="reward", agg="token-mean", rank=world - 1, row=6, seed=1), **kw)


def stale(world: int, **kw) -> dict:
    return dict(dict(name="stale", kind="stale", agg="token-mean", rank=world - 1, row=1, seed=2), **kw)


def nan(world: int, **kw) -> dict:
    """A NaN advantage on one response of the last rank (a reward that came back NaN)."""
    return dict(dict(name="nan", kind="nan", agg="token-mean", rank=world - 1, row=2, seed=4), **kw)


def scenarios(world: int) -> list[dict]:
    if world == 1:
        return [reward(1), reward(1, name="packed", row=5, seed=6, packed=True), nan(1)]
    if world == 4:
        return [stale(4), nan(4)]
    return [reward(2, warmup=1), stale(2, rank=0, tracking=True), stale(2, name="packed", row=3, seed=6, packed=True)] \
        + [stale(2, name=f"stale_{agg}", agg=agg, seed=3 + i) for i, agg in enumerate(AGGS[1:])] \
        + [nan(2), nan(2, name="nan_packed", row=5, seed=5, packed=True)]
