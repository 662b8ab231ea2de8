"""What the monitor needs to localize a spike in the current batch, and to show it.

The localizer takes a ``localizer.step.LocateStep``: ``LocateStep.from_context(ctx)`` is the one
place a context becomes one (the localizer's floor reads this one; this module cannot import it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

LossFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SpikeContext:
    """The current batch, as the localizer and the artifact writer see it.

    ``loss_fn(mask) -> scalar``: the training loss restricted to the loss terms selected by
    ``mask`` (same shape as ``token_mask``, 1.0 = keep) with a FIXED normalizer, so the
    gradient of a subset is the sum of its terms' gradients.

    A step of K micro-batches (gradient accumulation) passes ``loss_fn``, ``token_mask`` and
    ``input_ids`` as sequences of K (one per micro-batch, shapes may differ); the step's
    gradient is the sum of the micro-batch losses' gradients. Culprits then carry
    ``micro_batch``, an index into these sequences (``micro_batch_view`` gives one as a
    single-batch context).
    """

    loss_fn: LossFn | Sequence[LossFn]
    token_mask: torch.Tensor | Sequence[torch.Tensor]  # (B, T) 1.0 where a loss term exists
    input_ids: torch.Tensor | Sequence[torch.Tensor] | None = None  # (B, T) token ids aligned with token_mask
    tokenizer: Any = None  # anything with decode(list[int]) -> str (HF tokenizers work)
    # per-token extra columns for the attribution table, each (B, T): advantage, logprob, ...
    # (with micro-batches: each a sequence of K (B_k, T_k) tensors)
    extra_columns: Mapping[str, Any] = field(default_factory=dict)
    # per-sample extra columns, each (B,): reward, ... (with micro-batches: K (B_k,) tensors)
    sample_columns: Mapping[str, Any] = field(default_factory=dict)
    # the RNG state saved right before the training forward (``save_rng()``'s dict or
    # torch.get_rng_state()): probes replay its dropout masks. With micro-batches: a sequence of
    # K, each saved right before ITS forward (the RNG moves on between micro-batches)
    rng_state: Any = None
    # (B, T) integer id of the document each position belongs to, for rows that pack several
    # documents: the localizer then names the document, not the row (with micro-batches: K)
    document_ids: torch.Tensor | Sequence[torch.Tensor | None] | None = None
    # (B, T) integer part of the sample each position shows, -1 = not shown (padding), named by
    # ``segment_names[id]``: an RL sample's prompt and completion, a packed row's documents. The
    # highlight page shows each part as its own block (with micro-batches: K)
    segment_ids: torch.Tensor | Sequence[torch.Tensor] | None = None
    segment_names: Sequence[str] | None = None
    # what loss_fn divides by (its fixed normaliser, e.g. the step's loss-token count), when known:
    # a number or a 0-d tensor (``LocateStep.normaliser``)
    normaliser: Any = None
    # the reduced precision the training forward ran in ("float16 autocast"), when known: a non-finite
    # .grad whose fp32 replay is finite is then the precision's overflow, not a hardware fault
    precision: str | None = None
    # each sample's mean loss, (B,) or one per micro-batch, as the detector's sample signal measured it
    # (``watch()`` fills it): when that signal fires, the rows whose loss made it are named
    sample_losses: torch.Tensor | Sequence[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.token_mask, torch.Tensor) != callable(self.loss_fn):
            raise TypeError("SpikeContext: pass loss_fn as a callable with token_mask a (B, T) tensor, or both as "
                            "sequences of K (one per micro-batch)")
        if self.micro_batches is not None:
            k = len(self.token_mask)
            for name in ("loss_fn", "input_ids", "document_ids", "segment_ids"):
                val = getattr(self, name)
                if val is not None and (isinstance(val, torch.Tensor) or callable(val) or len(val) != k):
                    raise ValueError(f"SpikeContext.{name}: with {k} micro-batch masks pass a sequence of {k} "
                                     f"(one per micro-batch)")
        if self.sample_columns or self.extra_columns:
            from .columns import check_context_columns

            masks = [self.token_mask] if self.micro_batches is None else list(self.token_mask)
            check_context_columns(self.sample_columns, self.extra_columns, masks, self.micro_batches is not None)

    @property
    def micro_batches(self) -> int | None:
        """K when the step was given as micro-batches, else None."""
        return None if isinstance(self.token_mask, torch.Tensor) else len(self.token_mask)

    def token_count(self) -> torch.Tensor:
        """The number of loss terms in the step, a 0-d tensor on the masks' device (no host sync)."""
        if self.micro_batches is None:
            return self.token_mask.sum()
        return torch.stack([m.sum() for m in self.token_mask]).sum()

    def micro_batch_view(self, k: int) -> "SpikeContext":
        """Micro-batch ``k`` as a single-batch context (for renderers that index (B, T) tensors)."""
        if self.micro_batches is None:
            return self

        def pick(v):
            return v[k] if isinstance(v, (list, tuple)) else v

        return SpikeContext(loss_fn=self.loss_fn[k], token_mask=self.token_mask[k],
                            input_ids=None if self.input_ids is None else self.input_ids[k],
                            tokenizer=self.tokenizer,
                            extra_columns={n: pick(v) for n, v in self.extra_columns.items()},
                            sample_columns={n: pick(v) for n, v in self.sample_columns.items()},
                            rng_state=pick(self.rng_state), document_ids=pick(self.document_ids),
                            segment_ids=pick(self.segment_ids), segment_names=self.segment_names,
                            normaliser=self.normaliser, precision=self.precision,
                            sample_losses=pick(self.sample_losses))


def per_micro_batch(n: int) -> Callable[[list], Any]:
    """How a step of ``n`` micro-batches hands K values to ``SpikeContext`` (and ``LocateStep``): the value
    itself for one micro-batch, the list of them for several."""
    return (lambda xs: xs[0]) if n == 1 else (lambda xs: xs)


_FACTORIES_SEEN: set[Any] = set()  # shapes of zero-argument factories already checked (watch() passes one a step)


def check_spike_context(ctx: Any) -> None:
    """``spike_context`` is a ``SpikeContext`` or a zero-argument callable that builds one. Anything else would
    fail only at the first spike, inside training (a ``loss_fn(keep)`` passed there raised a bare
    ``TypeError: missing 1 required positional argument``): said at the first step instead, naming the fix."""
    if isinstance(ctx, SpikeContext):
        return
    if not callable(ctx):
        raise TypeError(f"after_backward(spike_context=...): got a {type(ctx).__name__}; pass a gradloc_track."
                        "SpikeContext(loss_fn=..., token_mask=...) or a zero-argument callable returning one")
    key = (type(ctx), getattr(ctx, "func", None), len(getattr(ctx, "args", ())),
           tuple(getattr(ctx, "keywords", None) or ()), getattr(ctx, "__code__", None))
    if key in _FACTORIES_SEEN:
        return
    import inspect

    try:
        inspect.signature(ctx).bind()
    except TypeError:
        raise TypeError(f"after_backward(spike_context=...): {getattr(ctx, '__name__', type(ctx).__name__)} takes "
                        "arguments, so it is not a context factory (a loss_fn?); pass gradloc_track.SpikeContext("
                        "loss_fn=<your loss_fn(keep)>, token_mask=<(B, T) mask>), or a zero-argument callable "
                        "returning one") from None
    except ValueError:  # no signature to read (a builtin): trusted, as before
        pass
    _FACTORIES_SEEN.add(key)
