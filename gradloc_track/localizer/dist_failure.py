"""Rank-local failures during a distributed localization, turned into one collective decision.

A probe is a collective (DDP all-reduces in backward, FSDP2 gathers in forward and reduces in
backward). If one rank's ``loss_fn`` raised (an OOM, a bad batch) and that rank simply left the
search, its next collective (the training step's all-reduce) would pair with a peer's probe
collective: the peers hang, or a step's averaged gradient mixes in a probe's. So each rank runs
its local part of a probe with failures CAUGHT, and before the next collective every rank learns,
by one small all-reduce of a flag, whether any rank failed; then all leave together, each raising
``LocateAborted`` that names the failed rank and its error. The flag costs one 4-byte
all-reduce and one host sync per agreement; the messages are gathered only when one is set.

What cannot be agreed on: a failure INSIDE a collective (DDP's backward all-reduce, FSDP2's
forward all-gathers or backward reduce-scatters) leaves the peers waiting in that collective
until the process group's timeout, as in any DDP/FSDP step (``docs/distributed.md``).
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

R = TypeVar("R")
_MAX_MESSAGE = 400  # an OOM message runs to a kilobyte; a warning line needs its head


class LocateAborted(RuntimeError):
    """A distributed localization stopped on EVERY rank because one rank failed (its message names
    the rank and its error; on that rank the original exception is the ``__cause__``). Gradients,
    RNG and modes are restored; the process group is in step, so training can go on."""


def aborted(where: str, failed: list[str]) -> LocateAborted:
    """The error every rank raises: where the search stopped, and each failed rank's error."""
    return LocateAborted(f"localization aborted on every rank ({where}): " + "; ".join(failed))


def attempt(fn: Callable[[], R]) -> tuple[R | None, Exception | None]:
    """``(fn(), None)``, or ``(None, the exception)``: a rank-local failure is held until the
    ranks agree (``agree``). BaseException (Ctrl-C, SystemExit) is not held: it ends the process."""
    try:
        return fn(), None
    except Exception as exc:  # held, not swallowed: ``agree`` raises it on every rank
        return None, exc


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


def agree(where: str, device: torch.device, group, failure: Exception | None = None, problem: str = "") -> None:
    """Every rank calls this at the same point; all raise together or none does.

    ``failure``: an exception this rank caught (every rank raises ``LocateAborted``);
    ``problem``: an input error found here, e.g. a loss that cannot be back-propagated (every
    rank raises ``ValueError``, as for the inputs checked before the first probe).
    """
    flag = torch.tensor([int(failure is not None or bool(problem))], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):  # host sync: every rank must take the same branch before the next collective
        return
    raise_together(where, group, failure, problem)


def raise_together(where: str, group, failure: Exception | None, problem: str) -> None:
    """Gather every rank's failure and problem (one all_gather) and raise the same error on all."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (describe(failure) if failure is not None else "", problem), group=group)
    failed = [f"rank {r}: {f}" for r, (f, _) in enumerate(every) if f]
    if failed:
        raise aborted(where, failed) from failure
    raise ValueError(f"{where}: " + "; ".join(f"rank {r}: {p}" for r, (_, p) in enumerate(every) if p))
