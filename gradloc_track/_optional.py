"""Lazy imports of optional backends, with an error that names the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says which extra provides it.

    "Not installed" only when the backend itself (or its top package) is missing: a backend that
    is there but fails on a dependency of its own names that dependency instead.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        ours = missing is None or missing == module or module.startswith(f"{missing}.")
        what = "is not installed" if ours else f"could not be imported ({exc})"
        raise ImportError(
            f"{module!r} {what}; it is needed for this backend. "
            f"Install it with: pip install 'gradloc-track[{extra}]'"
        ) from exc
