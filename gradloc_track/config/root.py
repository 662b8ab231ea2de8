"""The library's root config: one node per group (tracker, monitor, clip, spikes, locate).

An app adds its own groups by subclassing it (the demo's ``gradloc_track.demo.config.DemoConfig``
adds model, optim and train) and composing from its subclass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ._validate import check, check_types
from .clip import ClipConfig
from .locate import LocateConfig
from .monitor import MonitorConfig
from .spikes import SpikeConfig, check_response
from .tracker import TrackerConfig


@dataclass
class RootConfig:
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    # typed by the fields every clip option has; the option's yaml merges its own schema in
    clip: ClipConfig = field(default_factory=ClipConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    locate: LocateConfig = field(default_factory=LocateConfig)
    run_name: Optional[str] = None
    out_dir: str = "runs"  # per-run files (spool, rendered artifacts) go under here

    def __post_init__(self) -> None:
        check_types(self, "")  # the groups are dataclasses that checked themselves
        check_response(self.spikes, self.locate.enabled)
        check(self.out_dir.strip() != "", "out_dir", self.out_dir, "use a directory for per-run files (e.g. runs)")
