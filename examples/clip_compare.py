"""Compare the clippers on the same run with repeated injected outliers; print one Markdown table.

    python examples/clip_compare.py [train.steps=300 ...]   # extra Hydra overrides for every run

Runs ``experiment=clip_compare`` once per method (tracker off), in-process: the same data, a corrupted
short document every 20 steps from step 60. Each run prints one line as it ends (its spike blocks
stay in its run dir's ``spikes/``, not on the console); the table compares the clippers on what
matters (``gradloc_track.demo.compare``): how far the injected spikes reached the optimizer (``spike
held``: the largest post-clip norm of an injected step, in multiples of a clean step's), how often and
how hard each clipper scaled the clean steps (most of them: a learning-rate cut, not a spike guard),
and the final loss (mean of the last 10 steps). Run dirs: ``runs/clip_compare/<date>_<time>/<clip>``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from gradloc_track.config import ConfigError, check_overrides, to_config
from gradloc_track.console import TrainConsole
from gradloc_track.demo.compare import comparison_table
from gradloc_track.demo.config import DemoConfig, register_configs
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.trackers.quiet import quiet_backend_noise
from train_lm import train_lm  # the example app's loop, next to this file

METHODS = ["none", "global", "zclip", "adagc", "layerclip"]
CONF = Path(__file__).resolve().parents[1] / "conf"


class ProgressOnly(TrainConsole):
    """The progress line (stderr), without the spike blocks and the closing summary: five runs of 12
    injected spikes would print 60 blocks before the table."""

    def spike(self, stats, run_dir, not_localized=None) -> None:
        pass

    def summary(self, lines) -> None:
        self.close()


def run_all(overrides: list[str], out: Path) -> dict[str, dict[str, float]]:
    check_overrides(overrides, DemoConfig, CONF)
    register_configs()
    results = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for m in METHODS:
            composed = compose("config", overrides=["experiment=clip_compare", f"clip={m}", "tracker=none", *overrides])
            s = results[m] = train_lm(to_config(composed), out / m, console=ProgressOnly(stream=sys.stderr),
                                      resolved_yaml=OmegaConf.to_yaml(composed, resolve=True))  # its config.yaml
            print(f"clip={m}: {composed.train.steps} steps in {s['seconds']:.0f} s, {s['spike_events']:.0f} spike(s) "
                  f"detected, final loss {s['final_loss']:.4f}", flush=True)
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    return comparison_table([(f"clip={m}", m, r) for m, r in results.items()])


if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    out = run_dir_for(None, "clip_compare")
    try:
        results = run_all(sys.argv[1:], out)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    print(f"\n{table(results)}\nrun dirs: {out}/<clip> (each run's spikes/, summary.json)")
