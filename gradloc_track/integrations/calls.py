"""How a training forward was called, by argument name, so a probe can call the model the same way.

A forward call is bound to the model's own ``forward`` signature, so the token ids and targets are
found whatever the loop wrote: HF's ``model(input_ids=ids, labels=labels)``, nanoGPT's
``logits, loss = model(x, y)`` (``forward(idx, targets=None)``: ``targets`` are already shifted,
``-1`` = no loss), ``model(ids)``. A probe replays the call with the same names (nanoGPT's forward
returns logits over all positions only when given targets) and reads the logits from whatever the
forward returns (``.logits``, a ``(logits, loss)`` tuple, a tensor). When the output has no logits
for every position (a forward that keeps the last position), the per-term loss cannot be rebuilt:
the message shows ``handle.set_loss_fn``.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

IDS_NAMES = ("input_ids", "idx", "tokens", "input", "inputs", "x")  # a causal LM's token-id argument
# targets already aligned with the positions (the term at t is targets[:, t]), as nanoGPT's
TARGET_NAMES = ("targets", "target", "y")

SET_LOSS_FN_HINT = (
    "give the step's per-term loss yourself before optimizer.step(), e.g. for targets y (-1 = no loss) and "
    "logits (B, T, V) over every position: n = (y != -1).sum(); handle.set_loss_fn(lambda keep: "
    "(F.cross_entropy(model(x, y)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction='none') "
    "* keep.flatten()).sum() / n, token_mask=(y != -1).float(), input_ids=y)")


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """The model's own forward signature (through ``torch.compile``'s wrapper); None if unreadable."""
    forward = getattr(getattr(model, "_orig_mod", model), "forward", None)
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def arguments_by_name(sig: inspect.Signature | None, args: tuple, kwargs: dict) -> dict[Any, Any]:
    """The call's arguments keyed by parameter name; positional ones the signature cannot name
    (``forward(*args)``, positional-only) keep their index as key."""
    if not args:  # keywords only (the HF way): already named, nothing to bind
        return dict(kwargs)
    if sig is None:
        return {**dict(enumerate(args)), **kwargs}
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:  # not a call this forward takes: read it as given
        return {**dict(enumerate(args)), **kwargs}
    out: dict[Any, Any] = {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            out.update({index + i: v for i, v in enumerate(value)})
        else:
            out[index if kind is inspect.Parameter.POSITIONAL_ONLY else name] = value
    return out


def find_key(named: dict, names: tuple[str, ...], fits) -> Any:
    """The first of ``names`` whose value ``fits``; None when none does."""
    return next((n for n in names if fits(named.get(n))), None)


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """Call ``model`` on the batch the way training called it (targets only if training passed them)."""
    args: list = []
    kw: dict[str, Any] = {}
    if batch.style == "kwargs":
        kw[batch.ids_name] = batch.input_ids
    else:
        args.append(batch.input_ids)
    if batch.attention_mask is not None:
        kw["attention_mask"] = batch.attention_mask
    if getattr(batch, "position_ids", None) is not None:  # packed rows: each document's positions restart
        kw["position_ids"] = batch.position_ids
    if batch.target_ids is not None and batch.targets_key is not None:  # (None: training did not pass them)
        if isinstance(batch.targets_key, int):
            args.append(batch.target_ids)  # position 1, right after the ids (the only positional form read)
        else:
            kw[batch.targets_key] = batch.target_ids
    return model(*args, **kw)


def logits_in(out: Any) -> Any:
    """The logits of a forward's output: ``.logits``, the first 3-D float tensor of a tuple, or ``out``."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor) and o.dim() == 3 and o.is_floating_point()),
                    out[0] if out else None)
    return out


def unusable_output(out: Any, ids: torch.Tensor) -> str | None:
    """Why the per-term loss cannot be rebuilt from this output for ``ids`` (B, T); None when it can."""
    logits = logits_in(out)
    if not (isinstance(logits, torch.Tensor) and logits.dim() == 3):
        return (f"the model returned {type(out).__name__}, not logits (B, T, V), an output with .logits or a "
                "(logits, loss) tuple, so the per-term loss cannot be rebuilt from its outputs")
    if tuple(logits.shape[:2]) != tuple(ids.shape):
        return (f"the model returned logits for {logits.shape[1]} of the batch's {ids.shape[1]} positions (a "
                "forward that keeps only the last position, as nanoGPT's does without targets), so the per-term "
                "loss cannot be rebuilt from its outputs")
    return None


def logits_of_call(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The logits (B, T, V) of replaying the batch's call; a clear error naming ``set_loss_fn`` when
    the model's output has none for every position."""
    out = call_model(model, batch)
    why = unusable_output(out, batch.input_ids)
    if why is not None:
        raise ValueError(f"gradloc-track: {why}: {SET_LOSS_FN_HINT}")
    return logits_in(out)
