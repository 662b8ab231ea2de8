"""AdaGC: adaptive per-tensor gradient clipping (Wang et al., arXiv 2502.11034).

Rules of the official PyTorch patch (``lishuai-97/AdaGC``, ``megatron-gpt2.patch``), whose
defaults we use (``lambda_rel=1.04, beta=0.99, warmup_steps=100, lambda_abs=1.0, eps=1e-6``):

- Warm-up (the first ``warmup_steps`` calls; 0 = none): ordinary global clipping,
  ``g <- g * min(1, lambda_abs / (||g|| + eps))``; each tensor's ``gamma_i`` is the running
  minimum of its *post-clip* norm, starting at its first gradient.
- Afterwards, per tensor with ``thr_i = lambda_rel * gamma_i``: if ``||g_i|| > thr_i`` then
  ``g_i <- g_i * thr_i / (||g_i|| + eps)`` (nothing happens inside the eps band below ``thr_i``),
  and ``gamma_i <- beta * gamma_i + (1 - beta) * min(||g_i||, thr_i)``.
- A tensor whose gradient is ``None`` is skipped: its state is untouched (no ``beta`` decay), and
  a tensor first seen after warm-up starts with ``gamma_i = ||g_i||`` (mixture-of-experts layers,
  frozen towers and conditional branches rely on this).

Modes (the patch's ``AdaGC``, ``AdaGC-Shard``, ``AdaGC-Global``):

- ``mode="tensor"``: one ``gamma`` per parameter tensor, from its full (all-reduced) norm.
- ``mode="shard"``: one ``gamma`` per *local shard* (FSDP2/DTensor): each rank clips its shard by
  the shard's own norm and running norm, with no communication after warm-up (warm-up's global
  clip still needs the global norm). Without sharding it equals ``"tensor"``. ``on_nonfinite``
  then acts per rank after warm-up (a rank does not see another rank's NaN): guard the optimizer
  step with a flag reduced over ranks if every rank must skip together.
- ``mode="global"``: one ``gamma`` for the global norm: warm-up keeps the running minimum of
  ``min(||g||, lambda_abs)``; afterwards the whole gradient is clipped when ``||g|| > lambda_rel *
  gamma`` and ``gamma`` follows the EMA of the clipped global norm.

State stays on the device (no host sync). Degenerate gradients never update ``gamma``: a
non-finite tensor, and a tensor whose gradient is exactly zero (``mode="global"``: a zero total),
which is treated like a missing one. The official code would take a zero into the warm-up's
running minimum (``gamma = 0``: after warm-up every gradient of that tensor is scaled to exactly 0,
for good) or decay ``gamma`` towards 0 after warm-up; on every stream without exact zeros the two
are equal (``tests/clip/test_adagc.py``).
"""
from __future__ import annotations

from typing import Any

import torch

from ..config._validate import check
from ..config.clip import AdaGCConfig
from ..grouping import saved_without_wrapper
from ..norms import all_reduce_sq_norms, sq_norms
from .checkpoint import check_state
from .clipper import Clipper


class AdaGC(Clipper):
    """``AdaGC(model, lambda_rel=1.04, beta=0.99, ...)``: the fields of ``AdaGCConfig`` by name, or
    ``AdaGC(model, AdaGCConfig(...))``; ``process_group`` for the norms' all-reduce."""

    Schema = AdaGCConfig

    def __init__(self, model: torch.nn.Module, config: AdaGCConfig | None = None, *, process_group: Any = None,
                 **options: Any) -> None:
        super().__init__(model, config, process_group=process_group, **options)
        self.lambda_rel, self.beta, self.lambda_abs, self.eps = (float(self.lambda_rel), float(self.beta),
                                                                 float(self.lambda_abs), float(self.eps))
        self.one_threshold = self.mode == "global"  # AdaGC-Global: one threshold, logged as clip/threshold/global
        device = self.params[0].device
        shape = () if self.mode == "global" else (len(self.params),)
        self.gamma = torch.zeros(shape, device=device)  # running norm; meaningful where ``seen``
        self.seen = torch.zeros(shape, dtype=torch.bool, device=device)  # has had a gradient

    def _adopt(self, index: list[int | None], names: list[str]) -> bool:
        """Each kept tensor its running norm; a new one none yet (lazily initialised at its first gradient)."""
        if self.mode == "global":  # one running norm of the whole gradient: other tensors, a total anew (round 11)
            if any(j is None for j in index) or len(index) != len(self.names):
                self.seen = torch.zeros_like(self.seen)  # re-initialised from the next step's total
            return True
        gamma, seen = _reindexed(self.gamma, self.seen, index)
        stashed = getattr(self, "_stashed", None)  # a checkpoint's running norms of tensors trainable again
        if stashed:
            for i, (j, n) in enumerate(zip(index, names)):
                if j is None and n in stashed:
                    gamma[i], seen[i] = stashed.pop(n)  # once: frozen and unfrozen again later starts fresh
        self.gamma, self.seen = gamma, seen
        return True

    @property
    def in_warmup(self) -> bool:
        return self.steps < self.warmup_steps

    warming_up = in_warmup

    @property
    def single_coef(self) -> bool:
        """One coefficient for every tensor in the next clip(): the global mode, and every warm-up
        (a global clip); a fused optimizer then applies it (``clip.handoff``)."""
        return self.mode == "global" or self.in_warmup

    def clip(self, sq_norms: torch.Tensor | None = None):
        if self.mode == "shard":
            sq_norms = None  # the shard rule needs local norms, whatever the caller measured
        return super().clip(sq_norms)

    def _sq_norms(self, grads):
        local = sq_norms(grads)  # (n,) local shards
        if self.mode != "shard":
            return all_reduce_sq_norms(local, grads, self.process_group)
        if self.in_warmup:  # warm-up's global clip needs the global norm: the only collective
            self._global_sq = all_reduce_sq_norms(local, grads, self.process_group).sum()
        return local  # per-shard state: no communication

    def _coefs(self, norms, finite):
        # (n,) a usable gradient: present, finite (non-finite norms arrive as 0) and non-zero
        self._usable = norms > 0
        self._warm_ok = None
        if self.in_warmup:
            return self._warmup_coefs(norms)
        if self.mode == "global":
            return self._global_coefs(norms)
        g0 = torch.where(self.seen, self.gamma, norms)  # (n,) a tensor's first gradient starts its state
        thr = self.lambda_rel * g0
        hit = norms > thr  # strictly above: nothing is scaled inside the eps band
        self._clipped = torch.where(hit, thr, norms)
        self._g0 = g0
        coef = torch.where(hit, thr / (norms + self.eps), 1.0)
        return torch.where(self.seen | self._usable, thr, float("inf")), coef

    def _warmup_coefs(self, norms):
        """Warm-up: global clipping at ``lambda_abs``; remember each tensor's post-clip norm."""
        if self.mode == "shard":  # clip by the global norm, keep each shard's own post-clip norm
            total = self._global_sq.sqrt()
            self._warm_ok = torch.isfinite(total)  # a non-finite gradient on another rank
            total = torch.where(self._warm_ok, total, 0.0)
        else:
            total = norms.pow(2).sum().sqrt()  # () global norm of the present, finite gradients
        coef = (self.lambda_abs / (total + self.eps)).clamp(max=1.0)  # ()
        if self._warm_ok is not None:
            coef = torch.where(self._warm_ok, coef, 0.0)
        self._post = norms * coef  # (n,) post-clip norms
        self._total_clipped = total.clamp(max=self.lambda_abs)
        thr = torch.full_like(norms, self.lambda_abs)
        self._global_threshold = thr[0]  # a global clip is in force (the metrics show it as such)
        return thr, coef

    def _global_coefs(self, norms):
        """AdaGC-Global after warm-up: one gamma for the global norm."""
        total = norms.pow(2).sum().sqrt()  # ()
        g0 = torch.where(self.seen, self.gamma, total)  # lazy initialisation
        thr = self.lambda_rel * g0
        hit = total > thr
        self._clipped = torch.where(hit, thr, total)
        self._g0 = g0
        coef = torch.where(hit, thr / (total + self.eps), 1.0)
        reported = torch.where(self.seen | (total > 0), thr, float("inf"))  # a zero total is no sample
        return reported.expand_as(norms), coef

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        # tensors with a usable gradient this step (``finite_t`` also carries the skip rule). A zero
        # gradient (an all-masked batch, loss * 0, a dead unit) is treated like a missing one: it
        # would set the warm-up's running minimum to 0 for good (every later gradient scaled to 0)
        ok = self._usable & finite_t  # (n,)
        if self._warm_ok is not None:
            ok = ok & self._warm_ok
        if self.mode == "global":
            ok = ok.any()
            if self.in_warmup:
                new = torch.where(self.seen, torch.minimum(self.gamma, self._total_clipped), self._total_clipped)
            else:
                new = self.beta * self._g0 + (1 - self.beta) * self._clipped
        elif self.in_warmup:
            new = torch.where(self.seen, torch.minimum(self.gamma, self._post), self._post)
        else:
            new = self.beta * self._g0 + (1 - self.beta) * self._clipped
        self.gamma = torch.where(ok, new, self.gamma)
        self.seen = self.seen | ok

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).kind, "steps": self.steps, "gamma": self.gamma.detach().clone(),
                "seen": self.seen.clone(), "names": list(self.names), "mode": self.mode,
                "shapes": [list(p.shape) for p in self.params],
                "saturation": self.saturation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self, state)
        saved = list(state.get("names", self.names))
        if saved != self.names:
            saved = saved_without_wrapper(saved, current=self.names)
        per_tensor = self.mode != "global" and state.get("mode", "tensor") == self.mode
        # the same model with other tensors trainable: one name set holds the other (another model's does not)
        nested = set(saved) <= set(self.names) or set(self.names) <= set(saved)
        shapes = dict(zip(saved, state.get("shapes") or ()))
        same = bool(shapes) and all(shapes.get(n) == list(p.shape) for n, p in zip(self.names, self.params)
                                    if n in shapes)  # another model's '0.weight' is another shape
        if saved != self.names and not (per_tensor and nested and same):
            raise ValueError("AdaGC.load_state_dict: the checkpoint's parameter names differ from the model's")
        check(state.get("mode", "tensor") == self.mode, "AdaGC.mode", self.mode,
              f"the checkpoint was written with mode={state.get('mode', 'tensor')!r}: build AdaGC with that mode")
        self.steps = int(state["steps"])
        self.saturation.load_state_dict(state.get("saturation"))
        gamma = state["gamma"].to(self.gamma.device).clone()
        # checkpoints before 0.2 marked "no value yet" with inf and had no ``seen``
        seen = state["seen"].to(self.gamma.device).clone() if "seen" in state else torch.isfinite(gamma)
        gamma = torch.where(seen, gamma, torch.zeros_like(gamma))
        if saved != self.names:  # the same model with other tensors trainable (gradual unfreezing): by name
            self._stashed = {n: (gamma[j], seen[j]) for j, n in enumerate(saved)}  # kept for adopt()
            at = {n: j for j, n in enumerate(saved)}
            gamma, seen = _reindexed(gamma, seen, [at.get(n) for n in self.names])
        self.gamma, self.seen = gamma, seen


def _reindexed(gamma: torch.Tensor, seen: torch.Tensor, index: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor running state for a new tensor list: entry ``i`` is the old ``index[i]``'s, or none yet (None)."""
    pos = torch.tensor([-1 if j is None else j for j in index], device=gamma.device)
    known = pos >= 0
    return torch.where(known, gamma[pos.clamp(min=0)], 0.0), known & seen[pos.clamp(min=0)]
