"""Config keys that changed name, so an old override fails naming the new key.

0.2's ``ClipConfig`` held every clipper's fields in one flat schema, prefixed where two clippers
shared a name. Each clip option now has its own schema with the clipper's own argument names
(``clip=zclip clip.warmup_steps=25``). Hydra rejects an unknown key before the app runs, so the
app checks its command line first (``override_keys.check_overrides``); ``to_config`` and ``watch()`` name the
new key too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .errors import ConfigError


@dataclass(frozen=True)
class Renamed:
    new: str  # the key to use instead
    option: str  # the group option the key belongs to, e.g. "clip=zclip"

    def hint(self) -> str:
        return f"renamed: use {self.new} with {self.option}"


RENAMED_KEYS: dict[str, Renamed] = {
    "clip.zclip_warmup_steps": Renamed("clip.warmup_steps", "clip=zclip"),
    "clip.layer_z_thresh": Renamed("clip.z_thresh", "clip=layerclip"),
    "clip.layer_alpha": Renamed("clip.alpha", "clip=layerclip"),
    "clip.layer_warmup_steps": Renamed("clip.warmup_steps", "clip=layerclip"),
    "clip.adagc_mode": Renamed("clip.mode", "clip=adagc"),
}


def check_renamed(keys: Iterable[str]) -> None:
    """Raise ``ConfigError`` naming the new key for every dotted key that was renamed."""
    found = [f"{key} ({RENAMED_KEYS[key].hint()})" for key in keys if key in RENAMED_KEYS]
    if found:
        raise ConfigError(f"renamed config key(s): {'; '.join(found)}. Each clip option has its own schema "
                          "with the clipper's argument names (see conf/clip/)")
