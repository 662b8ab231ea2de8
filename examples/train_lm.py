"""Train a small GPT on CPU with gradloc-track watching the gradients.

    python examples/train_lm.py                              # MLflow store ./mlflow.db
    python examples/train_lm.py experiment=spike_demo        # inject a spike, localize it
    python examples/train_lm.py tracker=wandb clip=adagc clip.beta=0.98 train.steps=50
    python examples/train_lm.py -m clip=none,global,zclip,adagc,layerclip experiment=spike_demo

Every override is a field of gradloc_track.config.RootConfig (see conf/).
"""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from gradloc_track.config import ConfigError, register_configs, to_config
from gradloc_track.demo.train import train_lm

register_configs()
log = logging.getLogger("train_lm")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    try:
        conf = to_config(cfg)
    except ConfigError as exc:
        log.error("bad config: %s", exc)
        sys.exit(f"error: {exc}")
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    # multirun: one tracker run per job, named by its overrides, so runs compare side by side
    if str(hc.mode) == "RunMode.MULTIRUN" and hc.job.override_dirname:
        conf.run_name = f"{conf.run_name}[{hc.job.override_dirname}]" if conf.run_name else hc.job.override_dirname
    summary = train_lm(conf, run_dir, resolved_yaml=OmegaConf.to_yaml(cfg, resolve=True))
    log.info("run dir: %s", run_dir)
    log.info("summary: %s", summary)
    return summary["final_loss"]


if __name__ == "__main__":
    main()
