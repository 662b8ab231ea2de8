"""The update signal: the norm of the step an Adam-like optimizer is about to take (issue 26).

For ``betas`` in the param groups and ``exp_avg`` / ``exp_avg_sq`` in the state (Adam, AdamW, fused
or not), at tensor granularity: ``u^2 = sum_i lr_i^2 ||m_hat_i'||^2 / (sqrt(mean(v_hat_i')) + eps_i)^2``
with ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``, Adam's bias corrections (each tensor's
own step counter) and its group's lr, betas and eps (exact for a tensor whose ``v`` is uniform), from
per-tensor sums (``||m||^2``, ``<m, g>``, ``sum v``) and the step's own squared norms,
with the gradient the step will use (after the clipper: ``ClipScale``). A tensor without state yet
(unfrozen, re-initialised, a state lost on resume) takes Adam's first step, ``lr`` per element. The
update jumps with the learning rate, when the optimizer's state is lost, and when a tensor's second
moment has decayed below a normal gradient ("Adaptive Preconditioners Trigger Loss Spikes in Adam",
2025); Adam's momentum smooths a one-step gradient spike out of it.

Cost: reading ``exp_avg`` and ``exp_avg_sq`` whole measured +3-4% of a 4-layer d=256 CPU step
(``benchmarks/bench_signals.py``), so ``||m||^2`` and ``sum v`` are carried from the step before
(``_Moments``: Adam's own recursions applied to them, exact while the optimizer steps with the
gradient seen here) and read afresh every ``RESYNC`` steps, after a non-finite step and whenever the
optimizer did not take exactly one step since, or its state changed outside that step (a step hook
counts steps and notes the state tensors' versions; an optimizer without step hooks is read afresh
every step): a step reads ``exp_avg`` and the gradient once (``<m, g>``), half the memory traffic.
A row of a tensor decaying alone (a rare token's embedding) is below its resolution; sharded
(DTensor) tensors are skipped (their local sums are not the tensor's); weight decay is left out.
``amsgrad=True``: the denominator is Adam's running max of ``v``, read with ``v`` each step for those
tensors (``v`` decaying there moves nothing: without it the signal fired on a decay AMSGrad ignores);
``maximize=True``: the step's gradient is ``-g``. NAdam and RAdam (``betas`` and the same state) get
Adam's update, an estimate of theirs.
No host read: step counters and learning rates are used where they lie, and what comes from the host
(positions, sizes, betas, counters kept on the CPU) goes to a CUDA device through pinned memory,
non-blocking (``to_device``; written for CUDA, not run on one here: no device was lent).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..norms import _is_dtensor
from ..optim_unwrap import unwrap_optimizer

RESYNC = 16  # steps between exact reads of ||m||^2 and sum(v) (a clipped or externally skipped step drifts them)


@dataclass(frozen=True)
class ClipScale:
    """What the optimizer's next step multiplies the gradient by (a clipper's per-tensor coefficients,
    in the monitored tensors' order, or one number) and whether ``.grad`` already holds it (a clip
    applied in place) or the step applies it (a fused optimizer's ``grad_scale``)."""

    coef: torch.Tensor | float = 1.0
    in_grad: bool = True

    def of(self, where: torch.Tensor, f32: dict) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(factor on the pre-clip ``||g||^2``, factor on ``<m, .grad>``) for the tensors at ``where``."""
        k = self.coef[where].to(**f32) if isinstance(self.coef, torch.Tensor) else float(self.coef)
        return k * k, (1.0 if self.in_grad else k)


NO_CLIP = ClipScale()


class AdamUpdate:
    """``norm(params, grad_sq, scale)``: the update an Adam-like ``optimizer`` is about to make (0-d,
    device), or None for other optimizers; ``remove()`` takes its step hook off."""

    def __init__(self, optimizer: Any) -> None:
        optimizer = unwrap_optimizer(optimizer)  # Accelerate's wrapper: its inner optimizer
        self.optimizer = optimizer
        self._groups_key: tuple = ()
        self.groups: dict = {}  # parameter -> its Adam-like param group (``_refresh_groups``)
        self._refresh_groups()
        self._moments: _Moments | None = None  # ||m||^2 and sum(v) after the step about to be taken
        self.optimizer_steps = 0  # steps the optimizer took (its step hook), to know the moments still hold
        self.resync = RESYNC  # steps between fresh reads of the state (1: every step, as before carrying)
        self._index: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (key, positions, sizes on device)
        self._hook = None
        if self.groups and hasattr(optimizer, "_optimizer_step_post_hooks"):  # else: read afresh every step
            self._hook = optimizer.register_step_post_hook(_StepCounter(self))

    def _refresh_groups(self) -> None:
        """Follow the optimizer's param groups: ``load_state_dict`` puts new group dicts in (a resume's lr),
        ``add_param_group`` adds one (unfrozen layers). Checked each step on the groups' identities and
        sizes, rebuilt only when they change (the map holds the old group dicts, so a new dict cannot
        take an old one's id before this check)."""
        groups = getattr(self.optimizer, "param_groups", [])
        key = tuple((id(g), len(g.get("params", ()))) for g in groups)
        if key != self._groups_key:
            self._groups_key, self.groups = key, _param_groups(self.optimizer)

    def remove(self) -> None:
        """Take the optimizer's step hook off (the handle's close)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def forget(self) -> None:
        """The step was not taken as seen (non-finite: skipped): read the state afresh next step."""
        self._moments = None

    @torch.no_grad()
    def norm(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
             scale: ClipScale | None = NO_CLIP) -> torch.Tensor | None:
        """The norm of the update Adam is about to make, at tensor granularity (0-d, device), from the
        gradient the step will use: ``grad_sq`` (per monitored tensor, as backward left it) and ``.grad``
        with ``scale``, the clipper's part. ``scale=None`` (the clip is not known here): ``.grad`` and
        ``grad_sq`` as they are, and Adam's moments are read afresh next step. A tensor without state
        yet (unfrozen, re-initialised, its state reset) takes Adam's first step, ``lr`` per element.
        No host read: step counters and learning rates kept as tensors are used where they lie."""
        dev = grad_sq.device
        f32 = dict(device=dev, dtype=torch.float32)
        self._refresh_groups()
        ts = _AdamTensors.of(params, self.groups, self.optimizer.state)
        if not ts.idx:  # no tensor has state: training's first step (nothing to compare it with: a first
            self._moments = None  # step without warm-up would only widen the signal's noise), or all of it lost
            fresh = ts.first_steps(f32) if self.optimizer_steps else None
            return None if fresh is None else fresh.sqrt()
        fresh = ts.first_steps(f32)  # 0-d: squared first steps of the tensors without state (None: none)
        c, b1, b2, bc2, eps = ts.coefficients(f32)  # (k,) each
        carried = (self._moments.carried(ts.idx, self.optimizer_steps, ts.ms + ts.vs, self.resync)
                   if self._moments is not None and self._hook is not None else None)
        if carried is None:  # read afresh: every RESYNC steps, or the optimizer moved without us
            m_sq = torch.stack([x.to(**f32) for x in torch._foreach_norm(ts.ms, 2)]) ** 2  # (k,) ||m||^2
            v_sum = torch.stack([x.to(**f32) for x in torch._foreach_norm(ts.vs, 1)])  # (k,) sum of v (v >= 0)
            age = 0
        else:
            m_sq, v_sum, age = carried
        mg = torch.stack([torch.dot(m.reshape(-1), g.reshape(-1).to(m.dtype)).to(**f32) for m, g in zip(ts.ms, ts.gs)])
        where, n = self._positions(ts, dev)
        k_sq, k_mg = (scale or NO_CLIP).of(where, f32)
        g_sq = k_sq * grad_sq[where].float()  # (k,) ||g||^2 of the gradient the step uses
        mg = k_mg * mg
        if ts.flipped:  # maximize=True: the step descends along -g, so <m, -g>
            mg = mg * to_device(_signs(len(ts.idx), ts.flipped), dev)
        m_new = b1 * b1 * m_sq + 2 * b1 * (1 - b1) * mg + (1 - b1) ** 2 * g_sq  # ||b1 m + (1 - b1) g||^2
        v_new = b2 * v_sum + (1 - b2) * g_sq  # sum of b2 v + (1 - b2) g^2
        # Adam's next moments, for the next step to start from (exact when the clip is known)
        self._moments = (None if scale is None else
                         _Moments(ts.idx, self.optimizer_steps, m_new, v_new, age + 1, ts.ms + ts.vs))
        v_den = v_new if not ts.ams else ts.amsgrad_v(v_new, b2, k_mg)
        total = (c * m_new / ((v_den / (n * bc2)).sqrt() + eps) ** 2).sum()  # lr^2 ||m_hat||^2 / (rms v_hat + eps)^2
        return (total if fresh is None else total + fresh).sqrt()

    def _positions(self, ts: "_AdamTensors", dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(k,) the tensors' monitored positions and (k,) their sizes on the device, copied from the host
        only when the set of tensors changed (they are the same step after step)."""
        key = (ts.idx, [v.numel() for v in ts.vs], dev)
        if self._index is None or self._index[0] != key:
            sizes = torch.tensor([float(k) for k in key[1]], dtype=torch.float32)
            self._index = (key, to_device(torch.tensor(ts.idx), dev), to_device(sizes, dev))
        return self._index[1], self._index[2]


@dataclass
class _AdamTensors:
    """The monitored tensors an Adam-like optimizer holds, with what the update signal reads of each."""

    idx: list[int] = field(default_factory=list)  # monitored positions of the tensors with state
    ms: list[torch.Tensor] = field(default_factory=list)  # exp_avg
    vs: list[torch.Tensor] = field(default_factory=list)  # exp_avg_sq
    gs: list[torch.Tensor] = field(default_factory=list)  # .grad
    steps: list[Any] = field(default_factory=list)  # each tensor's step counter (a number or a tensor)
    groups: list[dict] = field(default_factory=list)  # each tensor's param group
    fresh: list[tuple[torch.Tensor, dict]] = field(default_factory=list)  # (.grad, group) of tensors without state
    ams: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (j, max_exp_avg_sq) of AMSGrad tensors
    flipped: list[int] = field(default_factory=list)  # j of the tensors whose group maximizes (the step uses -g)

    @classmethod
    def of(cls, params: Sequence[torch.nn.Parameter], groups: dict, state: Any) -> "_AdamTensors":
        out = cls()
        for i, p in enumerate(params):
            group = groups.get(p)
            if group is None or p.grad is None or p.grad.is_sparse or _is_dtensor(p.grad):
                continue  # a sharded tensor's local sums are not the tensor's
            st = state.get(p)
            if not st:  # the optimizer creates its state at this step
                out.fresh.append((p.grad, group))
                continue
            if "exp_avg" not in st:  # betas, but moments under other names (bitsandbytes' state1/state2): unknown
                continue
            m, v = st["exp_avg"], st.get("exp_avg_sq")
            if (v is None or "step" not in st or _is_dtensor(v) or v.numel() == 0 or m.shape != p.grad.shape):
                continue
            if group.get("amsgrad") and st.get("max_exp_avg_sq") is not None:
                out.ams.append((len(out.idx), st["max_exp_avg_sq"]))
            if group.get("maximize"):
                out.flipped.append(len(out.idx))
            out.idx.append(i)
            out.ms.append(m)
            out.vs.append(v)
            out.gs.append(p.grad)
            out.steps.append(st["step"])
            out.groups.append(group)
        return out

    def coefficients(self, f32: dict) -> tuple[torch.Tensor, ...]:
        """(k,) each: ``lr^2 / (1 - b1^t)^2``, b1, b2, ``1 - b2^t``, eps, with each tensor's own step
        counter (t = counter + 1: the step about to be taken) and its group's lr, betas and eps."""
        t = _stack_scalars(self.steps, f32) + 1
        lr = _stack_scalars([g["lr"] for g in self.groups], f32)
        hyper = to_device(torch.tensor([[float(g["betas"][0]), float(g["betas"][1]), float(g.get("eps", 1e-8))]
                                        for g in self.groups], dtype=torch.float32), f32["device"])
        b1, b2, eps = hyper[:, 0], hyper[:, 1], hyper[:, 2]
        return lr * lr / (1 - b1 ** t) ** 2, b1, b2, 1 - b2 ** t, eps

    def amsgrad_v(self, v_new: torch.Tensor, b2: torch.Tensor, k_mg: torch.Tensor | float) -> torch.Tensor:
        """``v_new`` with AMSGrad's denominator for its tensors: ``sum max(max_exp_avg_sq, b2 v + (1 - b2) g^2)``
        elementwise, as the step takes it (a running max that never decays: a tensor whose ``v`` decayed
        does not spike its update). One read of ``v`` and of its max per such tensor, every step."""
        js = [j for j, _ in self.ams]
        sums = []
        for j, vmax in self.ams:
            g = self.gs[j].float() * (k_mg[j] if isinstance(k_mg, torch.Tensor) else k_mg)
            sums.append(torch.maximum(vmax.float(), b2[j] * self.vs[j].float() + (1 - b2[j]) * g * g).sum())
        out = v_new.clone()
        out[to_device(torch.tensor(js), v_new.device)] = torch.stack(sums).to(v_new.dtype)
        return out

    def first_steps(self, f32: dict) -> torch.Tensor | None:
        """Adam's first step on the tensors without state: ``m_hat = g``, ``v_hat = g^2``, so each element
        moves by ``lr g / (|g| + eps)``, ``lr`` where its gradient is not tiny (one pass over those
        tensors' gradients: they are rare after training's first step)."""
        if not self.fresh:
            return None
        lr = _stack_scalars([g["lr"] for _, g in self.fresh], f32)
        unit = torch.stack([(g.float() / (g.float().abs() + float(grp.get("eps", 1e-8)))).pow(2).sum().to(**f32)
                            for g, grp in self.fresh])
        return (lr * lr * unit).sum()


def _stack_scalars(values: list[Any], f32: dict) -> torch.Tensor:
    """(k,) float32 on the device from numbers or 0-d tensors (step counters, learning rates), with one
    host->device copy when they live on the host."""
    ts = [v.detach().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in values]
    if len({x.device for x in ts}) == 1:
        return to_device(torch.stack([x.float() for x in ts]), f32["device"])
    return torch.stack([x.to(**f32) for x in ts])


def _signs(k: int, flipped: list[int]) -> torch.Tensor:
    """(k,) 1, and -1 at ``flipped``."""
    out = torch.ones(k, dtype=torch.float32)
    out[flipped] = -1.0
    return out


def to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """``t`` on ``device``; from the host to a CUDA device through pinned memory, non-blocking: a copy
    from pageable memory waits for the device's queue, a host sync in every step."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class _Moments:
    """Per-tensor ``||m||^2`` and ``sum v`` as they will be after the step about to be taken (Adam's
    recursions on this step's gradient), for the next step to start from instead of reading the state."""

    idx: list[int]  # the tensors they belong to (monitored-parameter positions)
    optimizer_steps: int  # the optimizer's step count when they were made
    m_sq: torch.Tensor  # (k,)
    v_sum: torch.Tensor  # (k,)
    age: int  # steps since the last exact read
    state: list[torch.Tensor]  # the exp_avg and exp_avg_sq tensors they describe
    versions: list[int] | None = None  # their version counters right after the optimizer's step

    def stepped(self) -> None:
        """The optimizer's step just ended: note its state tensors' versions (a change after this is not its)."""
        self.versions = [t._version for t in self.state]

    def carried(self, idx: list[int], optimizer_steps: int, state: list[torch.Tensor],
                resync: int = RESYNC) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The carried moments when they still describe the optimizer's state, else None (read afresh):
        due for a fresh read, other tensors, not exactly the one step we saw, or the state changed since
        that step (loaded, reset or edited in place)."""
        if self.age >= resync or idx != self.idx or optimizer_steps != self.optimizer_steps + 1:
            return None
        if self.versions is None or any(a is not b for a, b in zip(state, self.state)):
            return None
        if any(t._version != v for t, v in zip(state, self.versions)):
            return None
        return self.m_sq, self.v_sum, self.age


class _StepCounter:
    """The optimizer's step post-hook: counts steps, holding the signal weakly (no cycle through the optimizer)."""

    def __init__(self, inputs: AdamUpdate) -> None:
        self._ref = weakref.ref(inputs)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        inputs = self._ref()
        if inputs is not None:
            inputs.optimizer_steps += 1
            if inputs._moments is not None:
                inputs._moments.stepped()


def _param_groups(optimizer: Any) -> dict[torch.nn.Parameter, dict]:
    """Each parameter's param group, for optimizers with Adam's ``betas`` (others: none)."""
    out = {}
    for group in getattr(optimizer, "param_groups", []):
        if "betas" not in group:
            continue
        for p in group["params"]:
            out[p] = group
    return out
