"""A package's public names, resolved on first use (PEP 562 ``__getattr__``).

Importing the package then imports none of its modules: ``gradloc_track.data`` hands out
``load_blocklist`` without importing the torch wrappers beside it, so the CLI's readers start
without torch.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``exports`` maps each public name to the module defining it."""
    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
