"""Lazy imports of optional backends, with an error that names the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised by test with a blocked import
        raise ImportError(
            f"{module!r} is not installed; it is needed for this backend. "
            f"Install it with: pip install 'gradloc-track[{extra}]'"
        ) from exc
