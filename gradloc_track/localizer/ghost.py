"""Per-position, per-layer gradient-norm map from ONE backward pass ("ghost norms").

For a linear map ``y_s = W x_s + b`` the weight gradient is ``sum_s g_s x_s^T``; one position's
contribution has norm exactly ``||g_s|| * ||x_s||`` (Goodfellow 2015; Li et al. 2022), and the
bias's is ``||g_s||``. Embeddings: ``||g_s||``. Capturing ``||x_s||`` in a forward hook and
``||g_s||`` from a hook on the output gives the map without per-example gradients. For the
output head it is exact per loss term; for inner layers it is per *position* (a position also
carries gradient from later terms through attention), which is why ``auto`` confirms candidates
with exact probes. Per SEGMENT (a sample, or a document of a packed row) the same backward gives
exact norms (``segments.py``): positions of other rows never feed a row's terms, and the map of
the LAST hooked module of the forward (the output head), exact per term, goes to
``Segments.head`` (windows inside a sample are chosen on it: no attention leaks into it).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..grouping import layer_of, own_name, wrapper_prefix
from .segments import Segments
from .threshold import adaptive_threshold  # noqa: F401  (its home before threshold.py)


def _is_linear_like(m: torch.nn.Module) -> str | None:
    if isinstance(m, torch.nn.Linear):
        return "linear"
    if isinstance(m, torch.nn.Embedding):
        return "embedding"
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf"):  # transformers GPT-2: y = x @ W + b
        return "linear"
    return None


class GhostMap:
    """Context manager that records per-position contribution norms during one backward."""

    def __init__(self, model: torch.nn.Module, group_by: str = "block",
                 shape: tuple[int, int] | None = None, segments: Segments | None = None) -> None:
        self.model = model
        self.segments = segments  # per-segment squared norms go to ``segments.sq`` when given
        self.expected = tuple(shape) if shape is not None else None
        self.group_by = group_by
        self.handles: list = []
        self.sq: dict[str, torch.Tensor] = {}  # layer -> (B, T) squared contribution norms
        self.shape: tuple[int, int] | None = None
        self.other_shapes: set[tuple[int, ...]] = set()  # (B, T) of the layers left out: not the mask's
        self.calls = 0  # hooked modules run so far in the forward: the last one is the output head

    def __enter__(self) -> "GhostMap":
        prefix = wrapper_prefix(self.model)  # DDP's module.: the layer names the metrics use
        for name, m in self.model.named_modules():
            kind = _is_linear_like(m)
            if kind is None or not any(p.requires_grad for p in m.parameters(recurse=False)):
                continue
            layer = layer_of(own_name(f"{name}.weight", prefix), self.group_by) if name else "root"
            has_bias = getattr(m, "bias", None) is not None and m.bias.requires_grad
            self.handles.append(m.register_forward_hook(self._hook(layer, kind, has_bias)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, layer: str, kind: str, has_bias: bool) -> Callable:
        def forward_hook(module, inputs, output):
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if output.dim() < 2:
                return
            x = inputs[0].detach()  # (B, T, C_in), or the (B, T) ids of an embedding
            # held only until the hook has run: the graph keeps the hook (and what it holds) to the
            # end of backward, while autograd frees each saved input as it goes
            held = {"x": x if self.segments is not None else None,
                    "x_norm": None if kind == "embedding" else x.float().norm(dim=-1)}  # (B, T)
            self.calls += 1
            order = self.calls

            def grad_hook(g: torch.Tensor) -> None:
                if not held:
                    return
                x, x_norm = held.pop("x"), held.pop("x_norm")
                g_norm = g.detach().float().norm(dim=-1)  # (B, T)
                if kind == "embedding":
                    contrib = g_norm.pow(2)
                else:
                    contrib = (g_norm * x_norm).pow(2) + (g_norm.pow(2) if has_bias else 0.0)
                # per (batch, position) only: broadcast outputs (a (1, T, C) position
                # embedding) mix samples and cannot be attributed, so they are left out
                if contrib.dim() != 2 or (self.expected and tuple(contrib.shape) != self.expected):
                    if contrib.dim() == 2:
                        self.other_shapes.add(tuple(contrib.shape))
                    return
                self.shape = tuple(contrib.shape)
                prev = self.sq.get(layer)
                self.sq[layer] = contrib if prev is None else prev + contrib
                if self.segments is not None:
                    self.segments.add(g.detach(), x, kind, has_bias)
                    # the head's hook runs first in backward, before any checkpointed recompute
                    if order == self.calls and self.segments.head is None:
                        self.segments.head = contrib

            output.register_hook(grad_hook)

        return forward_hook

    def result(self, layer_order: list[str]) -> tuple[torch.Tensor, list[str]]:
        """(L, B, T) per-layer norms, rows in ``layer_order`` (layers with no hooked module dropped)."""
        names = [lay for lay in layer_order if lay in self.sq] + [lay for lay in self.sq if lay not in layer_order]
        if not names and not self.other_shapes and self.expected is not None:
            # no layer the map can read (adapters of raw nn.Parameters, no Linear/Embedding): an empty map, so
            # the search goes by exact probes alone (round 10: every localization failed, bisection too)
            return torch.zeros((0, *self.expected)), []
        if not names:
            seen = ", ".join(str(s) for s in sorted(self.other_shapes)) or "none per position"
            raise ValueError(f"no layer of the model sees the token mask's {self.expected} positions (its layers see "
                             f"{seen}): give token_mask (and input_ids) one entry per position of the model's "
                             "forward, 0 where there is no loss term (a shifted loss has none at the last position: "
                             "token_mask[:, -1] = 0), and slice the logits inside loss_fn")
        return torch.stack([self.sq[n].sqrt().cpu() for n in names]), names
