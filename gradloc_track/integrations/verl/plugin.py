"""verl's plugin hook: loaded by verl itself on ``import verl`` (entry point ``verl.plugins``).

Two small, idempotent patches, both inert unless the actor config carries a ``gradloc`` node:

- verl's actor configs (``ActorConfig`` and its FSDP/Megatron/... subclasses) accept a ``gradloc``
  keyword: ``+actor_rollout_ref.actor.gradloc.clip=adagc`` would otherwise fail in verl's
  ``omega_conf_to_dataclass`` (a frozen dataclass with no such field). The node is validated by
  our schemas right there (in the driver, at start-up: the app's errors) and kept on the config
  object, which verl binds to its loss function (``partial(ppo_loss, config=actor_config)``);
- ``BaseEngine.train_batch`` asks, once per engine, whether the loss function's config has an
  enabled node; if so the engine trains through a ``GradLocSession`` from then on, else verl's own
  ``train_batch`` runs untouched. Only the FSDP engine is supported; another engine with the node
  warns once and trains as verl does.

Why here: the node lives in verl's own Hydra config and reaches the worker processes with it;
verl imports its plugins in every process (driver and Ray workers), so nothing but the config
switches it on. ``VERL_USE_EXTERNAL_PLUGINS=none`` turns the plugin off.
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

from .options import NODE, gradloc_options, node_of

log = logging.getLogger(__name__)
SESSION = "_gradloc_session"
PATCHED = "__gradloc_patched__"


def _accepting_node(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        node = kwargs.pop(NODE, None)
        if node is not None:
            gradloc_options(node)  # fail now, with the app's error, not in a worker mid-run
        init(self, *args, **kwargs)
        object.__setattr__(self, NODE, node)

    setattr(__init__, PATCHED, True)
    return __init__


def accept_node() -> None:
    """Let verl's actor config classes take the ``gradloc`` keyword."""
    from verl.workers.config import actor

    classes = [c for c in vars(actor).values() if isinstance(c, type) and issubclass(c, actor.ActorConfig)]
    for cls in classes:
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, PATCHED, False):
            cls.__init__ = _accepting_node(init)


def session_for(engine: Any, loss_function: Any) -> Any:
    """The engine's ``GradLocSession`` (made on first use), or None to train as verl does."""
    cached = engine.__dict__.get(SESSION)
    if cached is not None:
        return cached or None
    opts = gradloc_options(node_of(loss_function))
    session = False
    if opts is not None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        if isinstance(engine, FSDPEngine):
            from .session import GradLocSession

            session = GradLocSession(engine, opts)
        else:
            warnings.warn(f"gradloc-track: the {NODE} node is set but {type(engine).__name__} is not verl's FSDP "
                          "engine (the one supported): training as verl does", UserWarning, stacklevel=3)
    engine.__dict__[SESSION] = session
    return session or None


def route_train_batch() -> None:
    """``BaseEngine.train_batch`` through the engine's session when there is one."""
    from verl.workers.engine.base import BaseEngine

    original = BaseEngine.train_batch
    if getattr(original, PATCHED, False):
        return

    @functools.wraps(original)
    def train_batch(self, data, loss_function):
        session = session_for(self, loss_function)
        if session is None:
            return original(self, data, loss_function)
        return session.train_batch(data, loss_function)

    setattr(train_batch, PATCHED, True)
    BaseEngine.train_batch = train_batch


def install() -> None:
    try:
        accept_node()
        route_train_batch()
    except Exception as exc:  # verl swallows plugin errors at debug level: say it where users look
        warnings.warn(f"gradloc-track: the verl plugin could not install ({exc!r}); the {NODE} node has no effect",
                      UserWarning, stacklevel=2)


install()
