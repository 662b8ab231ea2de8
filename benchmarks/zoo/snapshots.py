"""Injected steps saved so the localizer re-runs on them alone, without training (``--relocate``).

At an injected step a family saves the model's weights before the step, the step's inputs as the
front door captured them and the RNG state right before the training forward (``save``). A
re-run (``relocate``) rebuilds the model, loads the weights, replays the forward and backward (so
``.grad`` holds the step's gradient for the localizer's step check), builds the spike context the
front door builds and calls ``gradloc_track.locate`` with the ``LocateConfig`` defaults, as the
monitor's responder does. The family module gives the rebuild and the replay
(``<family>.replay(snapshot) -> (model, spike context)``).

Snapshots are ~0.3-1.5 MB each; at most ``PER_RUN`` per run are kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PER_RUN = 3


def rng_now() -> dict:
    from gradloc_track.localizer.probe import save_rng

    return save_rng()


def path_of(root: str, rec: Any, step: int) -> Path:
    return Path(root) / f"{rec.family}-{rec.source}-{rec.scenario}-{rec.seed}-{step}.pt"


def save(root: str, rec: Any, step: int, meta: dict, model: torch.nn.Module, inputs: dict, rng: dict,
         truth: list[dict]) -> None:
    if not root or len(list(Path(root).glob(f"{rec.family}-{rec.source}-{rec.scenario}-{rec.seed}-*.pt"))) >= PER_RUN:
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"meta": {**meta, "family": rec.family, "source": rec.source, "kind": rec.scenario, "seed": rec.seed,
                         "step": step}, "state": state, "inputs": inputs, "rng": rng, "truth": truth},
               path_of(root, rec, step))


def locate_rows(model: torch.nn.Module, ctx: Any) -> tuple[list[dict] | None, Any]:
    """The localizer's rows for the step (defaults of ``LocateConfig`` and ``MonitorConfig.group_by``)."""
    from gradloc_track.config import LocateConfig
    from gradloc_track.config.monitor import MonitorConfig
    from gradloc_track.localizer import locate
    from gradloc_track.localizer.step import LocateStep

    from .culprits import rows_of

    cfg = LocateConfig()
    with torch.enable_grad():
        res = locate(model, LocateStep.from_context(ctx), method=cfg.method, budget=cfg.budget,
                     threshold=cfg.threshold, group_by=MonitorConfig().group_by)

    class _Stats:
        locate = res

    return rows_of(_Stats), res


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)
