"""One gloo process group per world size runs every scenario of ``scenarios.all_scenarios``
(a launch costs seconds); the results are shared by the test modules of tests/dist."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import once_per_session


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory):
    """``get(world) -> {scenario name: (scenario, [per-rank result])}``, launched once per world."""
    from . import locate_worker
    from .launch import fork_ranks
    from .scenarios import all_scenarios

    runs: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in runs:
            def launch(out: Path) -> dict:
                scns = all_scenarios(world)
                fork_ranks(locate_worker.main, world, (str(out), json.dumps(scns)), timeout=300)
                return {s["name"]: (s, [json.loads((out / f"{s['name']}.rank{r}.json").read_text())
                                        for r in range(world)]) for s in scns}

            done = once_per_session(tmp_path_factory, f"dist_world{world}", launch)  # one launch per test run
            runs[world] = {name: tuple(pair) for name, pair in done.items()}
        return runs[world]

    return get
