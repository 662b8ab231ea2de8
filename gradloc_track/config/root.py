"""The root config of the example apps, composed from the groups."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ._validate import check, check_types
from .clip import ClipConfig
from .monitor import MonitorConfig
from .spikes import LocateConfig, SpikeConfig
from .tracker import TrackerConfig
from .train import ModelConfig, OptimConfig, TrainConfig


@dataclass
class RootConfig:
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    locate: LocateConfig = field(default_factory=LocateConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run_name: Optional[str] = None
    out_dir: str = "runs"  # per-run files (spool, rendered artifacts) go under here

    def __post_init__(self) -> None:
        check_types(self, "", skip=("tracker", "monitor", "clip", "spikes", "locate", "model", "optim", "train"))
        check(self.out_dir.strip() != "", "out_dir", self.out_dir, "use a directory for per-run files (e.g. runs)")
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
              f"use at most model.max_seq_len={self.model.max_seq_len}, or raise model.max_seq_len")
