"""The end of a multirun (``python examples/train_lm.py -m clip=none,adagc ...``): one table of its jobs.

Each job prints its own closing summary; Hydra calls ``on_multirun_end`` once every job has run, and
``SweepTable`` prints the jobs side by side (``gradloc_track.demo.compare``) with the sweep's folder.
Registered in ``conf/config.yaml`` (``hydra.callbacks.sweep_table``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from .compare import comparison_table, sweep_rows


class SweepTable(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_rows(sweep_dir)
        if not rows:  # every job failed before writing its summary: their errors said why
            return
        print(f"\nthe sweep: {len(rows)} job(s), run dirs under {sweep_dir}\n{comparison_table(rows)}", flush=True)
