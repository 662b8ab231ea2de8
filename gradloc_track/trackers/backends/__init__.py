"""The tracker backends, one file each, and their registry (``BACKENDS``; ``base.Backend`` says what
an entry does). Importing this package imports every module in it, so a backend is registered by
being here: adding one is its file (and its ``conf/tracker/<name>.yaml``). No module imports an SDK
when it is imported.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Iterable

from .base import BACKENDS, Backend, NoSpikeEvents, OnOpen, ReportSourceError, RunFiles, SpikeReader

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["BACKENDS", "Backend", "NoSpikeEvents", "OnOpen", "ReportSourceError", "RunFiles", "SpikeReader",
           "backend", "title", "views_of"]


def backend(name: str) -> Backend | None:
    """The registered backend ``name`` (None for ``none``, ``memory`` or a name no backend has)."""
    return BACKENDS.get(name)


def title(name: str) -> str:
    """How people call backend ``name`` (``W&B``); the name itself when no backend has it."""
    b = BACKENDS.get(name)
    return b.title if b is not None else name


def views_of(record: dict[str, Any]) -> Iterable[tuple[Backend, dict[str, Any]]]:
    """``(backend, view)`` for each backend run in ``record`` (``run_record.read_run_views``), registry order."""
    return [(b, record[name]) for name, b in BACKENDS.items() if isinstance(record.get(name), dict)]
