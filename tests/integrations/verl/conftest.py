"""verl's tests run where the ``[verl]`` extra is installed (its own venv: docs/verl.md); elsewhere
each module skips with the line that installs it (``requires``).

One launch per world size (1, 2, 4), forked from this process (``launch``: verl imported once),
all three side by side, each building ONE engine and running all its scenarios (``scenarios``);
world 1 also runs the one-process checks (``unit_worker``). One MLflow store is made once and
copied for each user."""
from __future__ import annotations

import shutil

import pytest

WORLDS = (4, 2, 1)  # the launches, largest first: they run side by side


@pytest.fixture(scope="session")
def verl_model(tmp_path_factory):
    """The tiny Qwen2 + character tokenizer directory every verl test builds its engine from."""
    from .engine_setup import write_model

    return write_model(str(tmp_path_factory.mktemp("verl_model")))


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An MLflow sqlite store with its tables made (the migrations take seconds): copy it, don't remake it."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(tmp_path, mlflow_template):
    """A fresh MLflow store for one test: ``sqlite:///...`` URI."""
    path = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def verl_runs(tmp_path_factory, verl_model, mlflow_template):
    """``get(world) -> (per-rank results, out dir)``: the first call starts the launches of every
    world size side by side (one each: 7 ranks), each call waits for its own."""
    import json

    from . import worker
    from .launch import Ranks
    from .scenarios import scenarios

    started: dict = {}
    runs: dict = {}

    def start() -> None:
        for world in WORLDS:
            out = tmp_path_factory.mktemp(f"verl_world{world}")
            shutil.copy(mlflow_template, out / "mlflow.db")
            args = (str(out), json.dumps(scenarios(world)), verl_model, str(out / "mlflow.db"))
            started[world] = (Ranks(worker.main, world, args, timeout=420), out)

    def get(world: int):
        if not started:
            start()
        if world not in runs:
            ranks, out = started[world]
            ranks.wait()
            runs[world] = ([json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], out)
        return runs[world]

    yield get
    for ranks, _ in started.values():
        ranks.kill()  # a run that stopped early leaves no rank behind


@pytest.fixture(scope="session")
def verl_unit(verl_runs):
    """The one-process checks of ``unit_worker`` (layout, probe loss, columns), run by the world-1 launch."""
    return verl_runs(1)[0][0]["_unit"]
