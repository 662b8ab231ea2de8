"""One verl micro-batch as the localizer sees it: the positions of verl's own model call.

verl's actor batch has padding removed (``input_ids`` nested: row ``b`` holds its ``p_b`` real
prompt tokens then its ``r_b`` real response tokens), and its per-token RL tensors
(``response_mask`` = ``loss_mask``, ``old_log_probs``, ``advantages``, ...) are (B, R), aligned
with the response. The engine calls the model on

- (B, L) rows, right-padded to the micro-batch's longest, with ``use_remove_padding=False``;
- (1, N) one packed row of all N tokens (``cu_seqlens``/position ids keep the samples apart) with
  ``use_remove_padding=True``: each sample is then a document of that row (``document_ids``).

The localizer's view is that grid, so the ghost pass's per-position activations line up with it.
The log-prob at position ``t`` scores token ``t+1`` (verl rolls the ids by one), so the loss term
of response token ``j`` sits at position ``p_b - 1 + j`` and each position shows the token it
scores (as the causal-LM capture does). ``narrowed(keep)`` is the micro-batch with the loss masks
cut to the kept terms: the ONLY change a probe makes to verl's batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rl_columns import COMPLETION, PROMPT

SEGMENT_NAMES = ("prompt", "response")
MASKS = ("response_mask", "loss_mask")  # the loss masks verl's losses read: both are cut alike
NEEDED = ("input_ids", "prompts", "responses", "attention_mask", "response_mask")


def unsupported(data: Any) -> str | None:
    """Why this batch cannot be probed (None: it can)."""
    missing = [k for k in NEEDED if k not in data.keys()]
    if missing:
        return (f"the batch has no {missing} (verl's PPO actor batch has them; an SFT batch with nested loss masks "
                "is not probed yet)")
    if any(data[k].is_nested for k in NEEDED[1:]):
        return "the batch's prompt/response tensors are nested (verl's PPO actor batch has them padded)"
    if not data["input_ids"].is_nested:
        return "the batch's input_ids are not nested (verl's engine takes them with padding removed)"
    return None


@dataclass
class Geometry:
    shape: tuple[int, int]  # the model call's (rows, positions)
    term_at: torch.Tensor  # (B, R) flat index into the grid of response token j's loss term
    real: torch.Tensor  # (B, R) bool: response token j exists
    starts: torch.Tensor  # (B,) flat index of each sample's first position
    lengths: torch.Tensor  # (B,) p_b + r_b
    prompt_lengths: torch.Tensor  # (B,) p_b

    @property
    def packed(self) -> bool:
        return self.shape[0] == 1 and self.starts.numel() > 1

    def grid_of_flat(self, flat: torch.Tensor, fill) -> torch.Tensor:
        """verl's (N,) flat per-token values on the grid (padding = ``fill``)."""
        out = torch.full(self.shape, fill, dtype=flat.dtype, device=flat.device)
        view = out.view(-1)
        offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])
        for b in range(self.lengths.numel()):  # B rows, on spikes only: a few host reads of offsets
            view[self.starts[b]:self.starts[b] + self.lengths[b]] = flat[offsets[b]:offsets[b + 1]]
        return out


@dataclass
class MicroBatch:
    """A micro-batch verl's ``forward_step`` trained on, the RNG state right before its forward,
    and the per-token outputs of that forward (``log_probs``, ``entropy``: verl's own, detached)."""

    data: Any  # TensorDict, as forward_backward_batch handed it to forward_step
    rng: dict
    outputs: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def geo(self) -> Geometry:
        from verl.utils import tensordict_utils as tu

        data = self.data
        ids, P = data["input_ids"], data["prompts"].shape[1]
        B, R = data["responses"].shape
        # on spikes only (the context is built then): the model call's shapes, read on the host
        lengths = ids.offsets().diff().to(torch.long)
        rlen = data["attention_mask"][:, P:].sum(-1).to(lengths.device)
        plen = lengths - rlen
        packed = tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True)
        if packed:
            starts, shape = ids.offsets()[:-1].to(torch.long), (1, int(lengths.sum()))  # host sync: the width
        else:
            width = int(lengths.max())  # host sync: the grid's width
            starts, shape = torch.arange(B, device=lengths.device) * width, (B, width)
        j = torch.arange(R, device=lengths.device)
        real = j.unsqueeze(0) < rlen.unsqueeze(1)
        term_at = torch.where(real, starts.unsqueeze(1) + plen.unsqueeze(1) - 1 + j.unsqueeze(0), 0)
        return Geometry(shape, term_at, real, starts, lengths, plen)

    def response_mask(self) -> torch.Tensor:
        """(B, R) float: 1 where a response token carries a loss term."""
        return self.data["response_mask"].float()

    def to_positions(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """A (B, R) response-aligned tensor on the grid, each value at its loss term's position."""
        g = self.geo
        out = torch.full(g.shape, fill, dtype=x.dtype, device=x.device)
        out.view(-1)[g.term_at[g.real]] = x[g.real.to(x.device)]
        return out

    def token_mask(self) -> torch.Tensor:
        """The grid's loss terms, 1.0 where one sits."""
        return self.to_positions(self.response_mask())

    def display_ids(self) -> torch.Tensor:
        """The token each position scores (the next one); a sample's last position repeats its own."""
        flat = self.data["input_ids"].values()
        shown = torch.roll(flat, -1)
        last = self.data["input_ids"].offsets()[1:] - 1
        shown[last] = flat[last]
        return self.geo.grid_of_flat(shown, 0)

    def segment_ids(self) -> torch.Tensor:
        """PROMPT / COMPLETION for the token each position shows, -1 for padding and a sample's end."""
        g = self.geo
        seg = [torch.cat([torch.full((int(p) - 1,), PROMPT), torch.full((int(n - p),), COMPLETION),
                          torch.full((1,), -1)]) for p, n in zip(g.prompt_lengths, g.lengths)]
        return g.grid_of_flat(torch.cat(seg).long(), -1)

    def document_ids(self) -> torch.Tensor | None:
        """With one packed row: the sample each position belongs to (the localizer's documents)."""
        g = self.geo
        if not g.packed:
            return None
        flat = torch.repeat_interleave(torch.arange(g.lengths.numel()), g.lengths.cpu())
        return g.grid_of_flat(flat.long(), -1)

    def response_token(self, row: int, position: int) -> tuple[int, int]:
        """(sample, j): the response token whose loss term sits at grid (``row``, ``position``)."""
        g = self.geo
        hit = ((g.term_at == row * g.shape[1] + position) & g.real).nonzero()
        if hit.numel() == 0:
            raise ValueError(f"no loss term at ({row}, {position})")
        b, j = hit[0].tolist()  # host sync: one culprit
        return b, j

    def narrowed(self, keep: torch.Tensor) -> Any:
        """The micro-batch with its loss masks cut to the kept terms (``keep``: the grid), and every
        other response-aligned float tensor (``advantages``, ``old_log_probs``, ...) zero where the
        cut mask is: a masked-out term then contributes nothing even when verl's tensor holds NaN
        there (verl masks by multiplying, and ``0 x NaN`` is NaN), so the non-finite search can
        tell responses apart. Finite values contribute nothing there either way."""
        g = self.geo
        cut = (keep.reshape(-1)[g.term_at.to(keep.device)] != 0) & g.real.to(keep.device)  # (B, R)
        data = self.data.copy()  # shallow: every other tensor is verl's own
        for name in data.keys():
            value = data[name]
            if not isinstance(value, torch.Tensor) or value.is_nested or value.shape != cut.shape:
                continue
            if name in MASKS:
                data[name] = value * cut.to(device=value.device, dtype=value.dtype)
            elif value.is_floating_point():
                data[name] = torch.where(cut.to(value.device), value, torch.zeros_like(value))
        return data
