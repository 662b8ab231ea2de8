"""Compiled models run eagerly while a spike is localized.

The ghost pass reads each layer's contribution norms through module hooks it adds at the spike. A model
compiled before them (``torch.compile``) never runs them: dynamo skips nn-module hook guards by default, so
the compiled graph is reused and the pass saw no layer ("stack expects a non-empty TensorList"). Probes with
a mask the graph was not traced for would also recompile. ``torch.compiler.set_stance("force_eager")`` runs
every compiled function and module eagerly for the localization only; training's compiled graph is untouched.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch


def eager_models() -> Any:
    """A context in which compiled models run eagerly (a no-op on a torch without ``set_stance``)."""
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()
