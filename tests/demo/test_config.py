"""The demo app's configs: the optimizer's AdamC peak is checked."""
from __future__ import annotations

import pytest


def test_optim_config_lr_max_is_validated():
    from gradloc_track.config import ConfigError
    from gradloc_track.demo.config import OptimConfig

    assert OptimConfig(adamc=True, adamc_lr_max=3e-4).adamc_lr_max == 3e-4
    for bad in (0.0, float("inf"), float("nan")):  # inf silently turned the decay off (wd * lr / inf = 0)
        with pytest.raises(ConfigError, match="optim.adamc_lr_max"):
            OptimConfig(adamc=True, adamc_lr_max=bad)
