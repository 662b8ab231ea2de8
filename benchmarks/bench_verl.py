"""Probes and seconds per localized spike in verl's FSDP2 engine at 1, 2 and 4 gloo processes.

Runs in the ``[verl]`` venv (docs/verl.md). Each world size is one launch of the verl tests' worker
(``tests/integrations/verl/worker.py``: the example's engine and batches, one engine per launch),
run one after the other, with the same scenarios on every world size: a reward outlier and stale
old log-probs on the last rank (``token-mean``), the stale response in packed micro-batches
(``use_remove_padding=True``), and a NaN advantage on one response (the non-finite search: its
rows have no share, "nan" in the table). Each spike fires on GradLoc's fixed trigger on its one step. The
table: the response named first (rank, micro-batch, response) and its share, the probes
(forward+backward passes; each a collective on every rank), the localizer's wall seconds on rank
0, and the ratio to one process in the same run.

    python benchmarks/bench_verl.py [--worlds 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scenarios(world: int) -> list[dict]:
    last = world - 1
    return [dict(name="reward", kind="reward", agg="token-mean", rank=last, row=6, seed=1),
            dict(name="stale", kind="stale", agg="token-mean", rank=last, row=1, seed=2),
            dict(name="stale packed", kind="stale", agg="token-mean", rank=last, row=3, seed=6, packed=True),
            dict(name="nan", kind="nan", agg="token-mean", rank=last, row=2, seed=4)]


def launch(world: int, root: Path, model_dir: str) -> tuple[list[dict], float]:
    from mlflow.tracking import MlflowClient

    from tests.integrations.verl import worker
    from tests.integrations.verl.launch import Ranks

    out = root / f"world{world}"
    out.mkdir()
    MlflowClient(f"sqlite:///{out}/mlflow.db").search_experiments()  # not used: no scenario tracks
    t0 = time.perf_counter()
    Ranks(worker.main, world, (str(out), json.dumps(scenarios(world)), model_dir, str(out / "mlflow.db")),
          timeout=900).wait()
    wall = time.perf_counter() - t0
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], wall


def top(ranks: list[dict], name: str) -> tuple[tuple, float]:
    named: dict = {}
    for r, res in enumerate(ranks):
        for _level, k, response, share in res[name].get("mine", []):  # a non-finite row has no share
            named[(r, k, response)] = named.get((r, k, response), 0.0) + (math.nan if share is None else share)
    if not named:
        return None, math.nan
    best = max(named, key=lambda k: -1.0 if math.isnan(named[k]) else named[k])
    return best, named[best]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args(argv)
    from tests.integrations.verl.engine_setup import write_model

    root = Path(tempfile.mkdtemp(prefix="bench-verl-"))
    try:
        model_dir = write_model(str(root / "model"))
        rows, base = [], {}
        for world in args.worlds:
            ranks, wall = launch(world, root, model_dir)
            for s in scenarios(world):
                res = ranks[0][s["name"]]
                where, share = top(ranks, s["name"])
                base.setdefault(s["name"], res["seconds"])
                rows.append((world, s["name"], where, share, res["probes"], res["seconds"],
                             res["seconds"] / base[s["name"]]))
            print(f"world {world}: launch {wall:.0f} s (engine build and every scenario's step)", flush=True)
        print("| processes | injected | named first (rank, micro-batch, response) | share | probes | seconds | "
              "vs 1 process |\n|---|---|---|---|---|---|---|")
        for world, name, where, share, probes, secs, ratio in rows:
            shown = "non-finite" if math.isnan(share) else f"{share:.0%}"
            print(f"| {world} | {name} | {where} | {shown} | {probes} | {secs:.1f} | {ratio:.1f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
