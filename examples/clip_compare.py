"""Compare the clippers on the same run with repeated injected outliers; print a Markdown table.

    python examples/clip_compare.py [train.steps=300 ...]   # extra Hydra overrides for every run

Runs ``experiment=clip_compare`` once per method (tracker off), in-process, and reports for each:
the OLMo-style spike score (fraction of steps above mean + 6 sigma of the last 128) of the
gradient norm the optimizer saw (after clipping) and of the loss, the largest post-clip norm,
and the final loss (mean of the last 10 steps).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from gradloc_track.config import ConfigError, check_overrides, to_config
from gradloc_track.demo.config import DemoConfig, register_configs
from gradloc_track.trackers.quiet import quiet_backend_noise
from train_lm import train_lm  # the example app's loop, next to this file

METHODS = ["none", "global", "zclip", "adagc", "layerclip"]
CONF = Path(__file__).resolve().parents[1] / "conf"


def run_all(overrides: list[str], out: Path) -> dict[str, dict[str, float]]:
    check_overrides(overrides, DemoConfig, CONF)
    register_configs()
    results = {}
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for m in METHODS:
            cfg = to_config(compose("config", overrides=["experiment=clip_compare", f"clip={m}", "tracker=none",
                                                         *overrides]))
            results[m] = train_lm(cfg, out / m)
            print(f"clip={m}: {results[m]}", file=sys.stderr)
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| clip | grad spike score (post-clip) | loss spike score | max post-clip grad norm (after warm-up) "
             "| final loss |", "|---|---|---|---|---|"]
    for m, r in results.items():
        lines.append(f"| {m} | {r['post_clip_grad_spike_score']:.4f} | {r['loss_spike_score']:.4f} | "
                     f"{r['max_post_clip_grad_norm']:.3f} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    try:
        results = run_all(sys.argv[1:], Path(tempfile.mkdtemp(prefix="clip-compare-")))
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    print(table(results))
