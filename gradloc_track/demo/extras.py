"""What an example needs beyond the core install, checked before it starts.

``need("transformers", "trl")`` raises one ImportError naming every missing module and the one
install line that brings them all (``pip install 'gradloc-track[examples]'``), instead of a bare
``ModuleNotFoundError`` half-way through an example's imports.
"""
from __future__ import annotations

import importlib.util

EXAMPLES_EXTRA = "examples"


def need(*modules: str, extra: str = EXAMPLES_EXTRA) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{', '.join(map(repr, missing))} {'is' if len(missing) == 1 else 'are'} not installed; "
                          f"this example needs {'it' if len(missing) == 1 else 'them'}. Install every example's "
                          f"dependencies with: pip install 'gradloc-track[{extra}]' (from a clone: "
                          f"pip install -e '.[{extra}]')")
