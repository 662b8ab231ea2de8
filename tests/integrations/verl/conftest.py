"""verl's tests run where the ``[verl]`` extra is installed (its own venv: docs/verl.md); elsewhere
they skip with the line that installs it."""
from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed: pip install 'gradloc-track[verl]' (its own venv, see docs/verl.md)",
                allow_module_level=True)


@pytest.fixture(scope="session")
def verl_model(tmp_path_factory):
    """The tiny Qwen2 + character tokenizer directory every verl test builds its engine from."""
    from .engine_setup import write_model

    return write_model(str(tmp_path_factory.mktemp("verl_model")))


@pytest.fixture(scope="session")
def verl_runs(tmp_path_factory, verl_model):
    """``get(world) -> (per-rank results, out dir)``: one launch per world size runs its scenarios."""
    import json

    from . import worker
    from .launch import fork_ranks
    from .scenarios import scenarios

    runs: dict = {}

    def get(world: int):
        if world not in runs:
            out = tmp_path_factory.mktemp(f"verl_world{world}")
            fork_ranks(worker.main, world, (str(out), json.dumps(scenarios(world)), verl_model), timeout=480)
            runs[world] = ([json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], out)
        return runs[world]

    return get


@pytest.fixture(scope="session")
def verl_unit(tmp_path_factory, verl_model):
    """The one-process checks of ``unit_worker`` (layout, probe loss, columns), run once."""
    import json

    from . import unit_worker
    from .launch import fork_ranks

    out = tmp_path_factory.mktemp("verl_unit")
    fork_ranks(unit_worker.main, 1, (str(out), verl_model), timeout=300)
    return json.loads((out / "unit.json").read_text())
