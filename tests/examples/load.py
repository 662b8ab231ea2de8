"""Import an example script (``examples/<name>.py``) as a module, so tests call its functions."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from ..conftest import ROOT


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as module ``example_<name>`` (``examples/`` on the path while it loads,
    as when the script runs: ``clip_compare`` imports ``train_lm``)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return mod
