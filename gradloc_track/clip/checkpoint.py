"""Which clipper a ``state_dict`` belongs to, checked before one is loaded.

A checkpoint's clip state is only meaningful to the clipper that wrote it: AdaGC's per-tensor
``gamma`` means nothing to ZClip (it was ``KeyError: 'stats'``), and LayerClip's per-layer
statistics loaded into ZClip gave statistics of the wrong shape. Every state now carries its
``kind``; a state written before that is told apart by its keys.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config.errors import ConfigError

STATELESS = ("global", "none")  # nothing but a step count: either loads the other's state


def state_kind(state: Mapping[str, Any]) -> str:
    """The kind of clipper that wrote ``state``: its ``kind``, else what its keys say."""
    if isinstance(state.get("kind"), str):
        return state["kind"]
    if "gamma" in state:
        return "adagc"
    stats = state.get("stats")
    if isinstance(stats, Mapping):
        mean = stats.get("mean")
        return "layerclip" if getattr(mean, "dim", lambda: 0)() > 0 else "zclip"
    return "global"


def check_state(clipper: Any, state: Any) -> None:
    """``ConfigError`` naming both clippers and the fix, unless ``state`` is ``clipper``'s kind's."""
    name, mine = type(clipper).__name__, type(clipper).kind
    if not isinstance(state, Mapping):
        raise ConfigError(f"{name}.load_state_dict(state): state is a {type(state).__name__}, not a clipper's "
                          "state_dict(); pass what the clipper's state_dict() returned")
    kind = state_kind(state)
    if kind == mine or (kind in STATELESS and mine in STATELESS):
        return
    raise ConfigError(f"{name}.load_state_dict: the checkpoint holds the state of a clip={kind} clipper, not of "
                      f"clip={mine}; resume with the clipper that wrote it (clip={kind}), or start {name} afresh "
                      "by not loading the checkpoint's clip state")
