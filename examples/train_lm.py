"""Train a small GPT on CPU with gradloc-track watching the gradients.

    python examples/train_lm.py                              # MLflow store ./mlflow.db
    python examples/train_lm.py experiment=spike_demo        # inject a spike, localize it
    python examples/train_lm.py tracker=wandb clip=adagc clip.beta=0.98 train.steps=50
    python examples/train_lm.py -m clip=none,global,zclip,adagc,layerclip experiment=spike_demo

Every override is a field of gradloc_track.config.RootConfig (see conf/).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from gradloc_track.config import ConfigError, register_configs, to_config
from gradloc_track.demo.train import train_lm

register_configs()
HYDRA_ONLY = {".hydra", "train_lm.log"}  # what Hydra itself puts in a run dir before main() runs


def swept_run_name(base: str | None, job_overrides: list[str], argv: list[str]) -> str:
    """``spike_demo[clip=adagc]``: the run name plus only the overrides this multirun sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(
        [a for a in argv if "=" in a and not a.startswith("-")]) if o.is_sweep_override()}
    parts = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    label = ",".join(parts)
    return f"{base}[{label}]" if base and label else (base or label or "run")


def remove_if_empty(run_dir: Path, out_dir: Path) -> None:
    """A failed attempt leaves no run dir holding nothing but Hydra's own files (nor empty parents)."""
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= HYDRA_ONLY:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != out_dir and out_dir in parent.parents and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    out_dir = Path(cfg.out_dir).resolve()
    try:
        conf = to_config(cfg)
    except ConfigError as exc:
        remove_if_empty(run_dir.resolve(), out_dir)
        sys.exit(f"error: {exc}")  # printed once, by sys.exit
    # multirun: one tracker run per job, named by the swept overrides, so runs compare side by side
    if str(hc.mode) == "RunMode.MULTIRUN":
        conf.run_name = swept_run_name(conf.run_name, list(hc.overrides.task), sys.argv[1:])
    try:
        summary = train_lm(conf, run_dir, resolved_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    except Exception:
        remove_if_empty(run_dir.resolve(), out_dir)
        raise
    return summary["final_loss"]


if __name__ == "__main__":
    main()
