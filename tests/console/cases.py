"""Spike views the console tests share: sample 1's mojibake tokens, an MLflow run record."""
from __future__ import annotations

import io

import torch

from gradloc_track.console import SpikeView, TrainConsole
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext
from gradloc_track.spikes.event import SpikeEvent
from gradloc_track.trackers.run_record import record_run

EVENT = SpikeEvent(100, "global", 2.2, 0.7, 40.0, 3.2)


class Tok:
    def decode(self, ids):
        return "".join({1: "\u00e2", 2: "\u20ac", 3: "\u2122"}.get(int(i), "?") for i in ids)


def mojibake_view(step: int = 100) -> SpikeView:
    """Sample 1's tokens 4-6 ('â€™') carry 90% of the step."""
    ids = torch.zeros(4, 10, dtype=torch.long)
    ids[1, 4:7] = torch.tensor([1, 2, 3])
    toks = [CulpritToken(1, p, grad_norm=1.0, score=1.0, share=0.3, layer_norms={}) for p in (4, 5, 6)]
    result = LocateResult(toks, probes=5, method="bisect", threshold=0.1, total_norm=2.0)
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(4, 10), input_ids=ids, tokenizer=Tok())
    return SpikeView(step, [EVENT], result, ctx)


def mlflow_record(run_dir, run_id: str) -> None:
    record_run(run_dir, "mlflow", {"tracking_uri": "sqlite:////data/mlflow.db", "experiment_id": "3",
                                   "run_id": run_id, "run_name": "spike_demo"})


def printed(view, run_dir, **kw) -> str:
    out = io.StringIO()
    TrainConsole(stream=out).spike(view, run_dir, **kw)
    return out.getvalue()
