"""What each world size runs: one injected response per scenario (a reward outlier, or stale old
log-probs), under verl's three loss aggregations. World 2 runs all of them (the issue's done-when);
worlds 1 and 4 the token-mean reward outlier."""
from __future__ import annotations

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def scenarios(world: int) -> list[dict]:
    out = [dict(name="reward", kind="reward", agg="token-mean", rank=world - 1, row=6, seed=1)]
    if world == 2:
        out.append(dict(name="stale", kind="stale", agg="token-mean", rank=0, row=1, seed=2))
        out += [dict(name=f"reward_{agg}", kind="reward", agg=agg, rank=1, row=4, seed=3 + i)
                for i, agg in enumerate(AGGS[1:])]
    return out
