"""The update signal: the norm of the step an Adam-like optimizer takes (issue 26), without a second read
of the gradients (issue 38).

For ``betas`` in the param groups and ``exp_avg`` / ``exp_avg_sq`` in the state (Adam, AdamW, fused
or not), at tensor granularity: ``u^2 = sum_i lr_i^2 ||m_hat_i'||^2 / (sqrt(mean(v_hat_i')) + eps_i)^2``
with ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``, Adam's bias corrections (each tensor's
own step counter) and its group's lr, betas and eps (exact for a tensor whose ``v`` is uniform), with
the gradient the step uses (after the clipper). A tensor without state yet (unfrozen, re-initialised,
a state lost on resume) takes Adam's first step, ``lr`` per element. The update jumps with the learning
rate, when the optimizer's state is lost, and when a tensor's second moment has decayed below a normal
gradient ("Adaptive Preconditioners Trigger Loss Spikes in Adam", 2025); Adam's momentum smooths a
one-step gradient spike out of it.

**When it is measured, and what that changes for detection.** ``||m'||^2`` needs ``<m, g>``, and no
eager op reads the gradients once for both that dot and their norms: the dot was a second read of the
gradients every step (hook 2.0 gradient sizes, the whole step with fused AdamW 4.0 instead of 3.0).
So on an ordinary step the update is measured AFTER the optimizer's step, from its state (a step
post-hook: ``||exp_avg||^2`` read, ``sum exp_avg_sq`` carried by Adam's recursion from this step's
gradient norms and read afresh every ``RESYNC`` steps, AMSGrad's ``max_exp_avg_sq`` read): exact, no
gradient read, whatever the clipper or a fused kernel's ``grad_scale`` did. It reaches the detector
with the next step's transfer: an update spike on an ordinary step fires ONE STEP LATER, under the
next step's number (a second moment that decayed over the optimizer's own steps: the step is taken
before it is seen). A step that already fired does not feed its update again (its event holds it).

A step the host can see is about to move differently is measured before it, at the SAME STEP, as
before (``norm``: ``<m, g>`` read, one more gradient read on that step only): a learning rate that
rose by ``LR_RISE`` or more since the last step (a float lr; one kept as a tensor is not read on the
host, so every step is measured before), a tensor without state (Adam's first step on it: a state
lost or reset, a layer unfrozen), a state changed outside the optimizer's step (loaded, edited: its
tensors' version counters), the optimizer having stepped without the monitor, a non-finite step
before, or a change of param groups. These are the learning-rate jump and the lost optimizer state
of the spike zoo (caught at their own step), and anything the moments carried cannot vouch for.
An optimizer without step hooks is measured before every step (``<m, g>`` every step).

A row of a tensor decaying alone (a rare token's embedding) is below its resolution; sharded (DTensor)
tensors are skipped (their local sums are not the tensor's); weight decay is left out of ``v``'s
recursion (Adam's L2 ``weight_decay`` enters its moments: ``||m'||`` measured after the step holds it,
``sum v`` is re-read every ``RESYNC`` steps). ``amsgrad=True``: the denominator is Adam's running max
of ``v`` (``v`` decaying there moves nothing); ``maximize=True``: the step's gradient is ``-g``. NAdam
and RAdam (``betas`` and the same state) get Adam's update, an estimate of theirs.
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

RESYNC = 16  # steps between exact reads of sum(v) (a clipped or externally skipped step drifts it)
LR_RISE = 1.25  # a learning rate this much above the last step's: the update is measured before the step
# (the detector's update signal needs min_ratio = 1.5x its running mean to fire: a smaller rise cannot alone)


@dataclass(frozen=True)
class ClipScale:
    """What the optimizer's next step multiplies the gradient by (a clipper's per-tensor coefficients,
    in the monitored tensors' order, or one number) and whether ``.grad`` already holds it (a clip
    applied in place) or the step applies it (a fused optimizer's ``grad_scale``)."""

    coef: torch.Tensor | float = 1.0
    in_grad: bool = True

    def of(self, where: torch.Tensor | None, f32: dict) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(factor on the pre-clip ``||g||^2``, factor on ``<m, .grad>``) for the tensors at ``where``
        (None: every monitored tensor, in order)."""
        if isinstance(self.coef, torch.Tensor):
            k = (self.coef if where is None else self.coef[where]).to(**f32)
        else:
            k = float(self.coef)
        return k * k, (1.0 if self.in_grad else k)


NO_CLIP = ClipScale()


class AdamUpdate:
    """``signal(params, grad_sq, scale)``: the update value the detector reads this step (module doc:
    measured before this step's optimizer step, or after the last one); ``norm(...)``: the update Adam
    is about to make, measured now (0-d, device), or None for other optimizers; ``remove()`` takes its
    step hook off."""

    def __init__(self, optimizer: Any) -> None:
        optimizer = unwrap_optimizer(optimizer)  # Accelerate's wrapper: its inner optimizer
        self.optimizer = optimizer
        self._groups_key: tuple = ()
        self.groups: dict = {}  # parameter -> its Adam-like param group (``_refresh_groups``)
        self._refresh_groups()
        self._tensors_key: tuple | None = None
        self._ts: _AdamTensors | None = None  # the monitored tensors as the last step saw them (``_tensors``)
        self._moments: _Moments | None = None  # ||m||^2 and sum(v) of the state after the last step measured
        self._stage: _Stage | None = None  # what this step's call left for the measurement after its step
        self._pending: tuple[int, torch.Tensor] | None = None  # (step number, update) measured after it
        self._lrs: list[Any] | None = None  # each group's lr at the last step measured
        self.optimizer_steps = 0  # steps the optimizer took (its step hook), to know the moments still hold
        self.resync = RESYNC  # steps between fresh reads of sum(v) (1: every step)
        self._hook = None
        if self.groups and hasattr(optimizer, "_optimizer_step_post_hooks"):  # else: measured before every step
            self._hook = optimizer.register_step_post_hook(_AfterStep(self))

    def _refresh_groups(self) -> None:
        """Follow the optimizer's param groups: ``load_state_dict`` puts new group dicts in (a resume's lr),
        ``add_param_group`` adds one (unfrozen layers). Checked each step on the groups' identities and
        sizes, rebuilt only when they change (the map holds the old group dicts, so a new dict cannot
        take an old one's id before this check)."""
        groups = getattr(self.optimizer, "param_groups", [])
        key = tuple((id(g), len(g.get("params", ()))) for g in groups)
        if key != self._groups_key:
            self._groups_key, self.groups = key, _param_groups(self.optimizer)
            self._moments = None  # other groups: what was carried describes other tensors

    def _tensors(self, params: Sequence[torch.nn.Parameter]) -> "_AdamTensors":
        """The monitored tensors with what the signal reads of each, found again only when that can have
        changed (step after step they are the same): other groups, a state entry added or dropped, another
        set of tensors with a gradient, a moment tensor replaced in its state entry."""
        self._refresh_groups()
        state = self.optimizer.state
        key = (id(params), len(params), self._groups_key, id(state), len(state),
               tuple(p.grad is None for p in params))
        ts = self._ts
        if ts is None or key != self._tensors_key or not ts.same_state():
            ts = self._ts = _AdamTensors.of(params, self.groups, state)
            self._tensors_key = key
        return ts

    def remove(self) -> None:
        """Take the optimizer's step hook off (the handle's close)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def forget(self) -> None:
        """The step is not taken as seen (non-finite: the guard skips it): its update is not fed, and the
        state it leaves (moments, sum v, step counters) is read afresh after it, not carried."""
        self._pending = None
        if self._stage is None:
            self._moments = None
        else:
            self._stage.v_after, self._stage.t, self._stage.fed = None, None, True

    def fired(self) -> None:
        """This step fired: its update, measured after its optimizer step, is not fed to the next step."""
        if self._stage is not None:
            self._stage.fed = True

    @torch.no_grad()
    def signal(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
               scale: ClipScale | None = NO_CLIP) -> torch.Tensor | None:
        """The update value for the detector's verdict on this step (module doc): Adam's next step,
        measured now, when the host sees this step move differently; else the update of the LAST
        optimizer step, measured after it (None when there is none to read: the first steps, or the
        last step's update was read already). Leaves what the measurement after this step needs."""
        ts = self._tensors(params)
        if self._hook is None or not self._ordinary(ts):
            return self._before_step(ts, grad_sq, scale)
        pending, self._pending = self._pending, None
        m = self._moments
        self._stage = _Stage(self.optimizer_steps, ts, self._v_after(ts, m.v_sum, grad_sq, scale), m.age + 1,
                             m.t, fed=False)
        if pending is None or pending[0] != self.optimizer_steps - 1:
            return None
        return pending[1]

    @torch.no_grad()
    def norm(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
             scale: ClipScale | None = NO_CLIP) -> torch.Tensor | None:
        """The norm of the update Adam is about to make, at tensor granularity (0-d, device), measured
        now from the gradient the step will use: ``grad_sq`` (per monitored tensor, as backward left it)
        and ``.grad`` with ``scale``, the clipper's part. ``scale=None`` (the clip is not known here):
        ``.grad`` and ``grad_sq`` as they are. A tensor without state yet (unfrozen, re-initialised, its
        state reset) takes Adam's first step, ``lr`` per element. Reads ``<m, g>``: one read of the
        gradients. No host read: step counters and learning rates kept as tensors are used where they lie."""
        return self._before_step(self._tensors(params), grad_sq, scale)

    def _ordinary(self, ts: "_AdamTensors") -> bool:
        """May this step's update be measured after its optimizer step (module doc)? No when the host
        sees it move differently: tensors without state, moments that no longer describe the state
        (stepped without us, edited, loaded, other tensors), a learning rate that rose."""
        if not ts.idx or ts.fresh or self._moments is None:
            return False
        if not self._moments.holds(ts, self.optimizer_steps):
            return False
        return not _lr_rose(self._lrs, getattr(self.optimizer, "param_groups", []))

    def _before_step(self, ts: "_AdamTensors", grad_sq: torch.Tensor, scale: ClipScale | None
                     ) -> torch.Tensor | None:
        """Adam's next step, measured before it (``norm``); stages the moments for after the step."""
        dev = grad_sq.device
        f32 = dict(device=dev, dtype=torch.float32)
        self._stage = self._pending = None
        if not ts.idx:  # no tensor has state: training's first step (nothing to compare it with: a first
            self._moments = None  # step without warm-up would only widen the signal's noise), or all of it lost
            fresh = ts.first_steps(f32) if self.optimizer_steps else None
            return None if fresh is None else fresh.sqrt()
        fresh = ts.first_steps(f32)  # 0-d: squared first steps of the tensors without state (None: none)
        where, n, b1, b2, eps = ts.constants(dev)
        mom = self._moments
        if mom is not None and self._hook is not None and mom.holds(ts, self.optimizer_steps):
            m_sq, v_sum, age, t = mom.m_sq, mom.v_sum, mom.age, mom.t
        else:  # read afresh: the moments no longer describe the state (or no step hook to follow it)
            m_sq = torch.stack(torch._foreach_norm(ts.ms, 2)).to(**f32) ** 2  # (k,) ||m||^2
            v_sum = torch.stack(torch._foreach_norm(ts.vs, 1)).to(**f32)  # (k,) sum of v (v >= 0)
            age, t = 0, ts.counters(f32)
        c, d = ts.corrections(f32, t + 1)  # (k,) lr^2 / (1 - b1^t)^2, n (1 - b2^t) of the step about to be taken
        # THE extra read of the gradients (with exp_avg): only on steps measured before their step
        mg = torch.stack([torch.dot(m.reshape(-1), g.reshape(-1).to(m.dtype)).to(**f32)
                          for m, g in zip(ts.ms, ts.grads())])
        k_sq, k_mg = (scale or NO_CLIP).of(where, f32)
        g_sq = k_sq * (grad_sq if where is None else grad_sq[where]).float()  # (k,) ||g||^2 of the step's gradient
        mg = k_mg * mg
        if ts.flipped:  # maximize=True: the step descends along -g, so <m, -g>
            mg = mg * to_device(_signs(len(ts.idx), ts.flipped), dev)
        m_new = b1 * b1 * m_sq + 2 * b1 * (1 - b1) * mg + (1 - b1) ** 2 * g_sq  # ||b1 m + (1 - b1) g||^2
        v_new = b2 * v_sum + (1 - b2) * g_sq  # sum of b2 v + (1 - b2) g^2
        if self._hook is not None:  # sum(v) for after the step (unknown when the clip is): read there
            self._stage = _Stage(self.optimizer_steps, ts, None if scale is None else v_new, age + 1, t, fed=True)
        v_den = v_new if not ts.ams else ts.amsgrad_v(v_new, b2, k_mg)
        total = (c * m_new / ((v_den / d).sqrt() + eps) ** 2).sum()  # lr^2 ||m_hat||^2 / (rms v_hat + eps)^2
        return (total if fresh is None else total + fresh).sqrt()

    def _v_after(self, ts: "_AdamTensors", v_sum: torch.Tensor, grad_sq: torch.Tensor,
                 scale: ClipScale | None) -> torch.Tensor | None:
        """(k,) ``sum v`` after this step by Adam's recursion on the gradient the step uses (None: the clip
        is not known here; read after the step)."""
        if scale is None:
            return None
        dev = grad_sq.device
        where, _, _, b2, _ = ts.constants(dev)
        g_sq = grad_sq if where is None else grad_sq[where]
        g_sq = g_sq if g_sq.dtype == torch.float32 else g_sq.float()
        if not (isinstance(scale.coef, float) and scale.coef == 1.0):
            g_sq = scale.of(where, dict(device=dev, dtype=torch.float32))[0] * g_sq
        return torch.addcmul(b2 * v_sum, 1 - b2, g_sq)

    @torch.no_grad()
    def _after_step(self) -> None:
        """The optimizer's step post-hook: ``||m||^2`` read from the state it left, ``sum v`` carried (read
        every ``resync`` steps, or when the clip was not known), and, unless this step's update was measured
        before it, the update it made, for the next step's verdict."""
        stage, self._stage = self._stage, None
        number = self.optimizer_steps
        self.optimizer_steps += 1
        if stage is None or stage.step != number:  # a step the monitor did not see: nothing vouched for
            self._moments = None
            return
        ts = stage.ts
        dev = ts.ms[0].device
        m_sq = torch.stack(torch._foreach_norm(ts.ms, 2))
        m_sq = (m_sq if m_sq.dtype == torch.float32 else m_sq.float()) ** 2  # (k,) exact: the state it left
        v_sum, age = stage.v_after, stage.age
        if v_sum is None or age >= self.resync:
            v_sum, age = torch.stack(torch._foreach_norm(ts.vs, 1)).float(), 0
        f32 = dict(device=dev, dtype=torch.float32)
        t = ts.counters(f32) if stage.t is None else stage.t + 1  # each tensor stepped once (no counter read)
        kept = m_sq if m_sq.device == v_sum.device else m_sq.to(v_sum.device)
        self._moments = _Moments(ts, self.optimizer_steps, kept, v_sum, age, t)
        self._lrs = [g.get("lr") for g in self.optimizer.param_groups]
        if not stage.fed:
            self._pending = (number, self._made(ts, m_sq, v_sum.to(dev), t, f32))

    def _made(self, ts: "_AdamTensors", m_sq: torch.Tensor, v_sum: torch.Tensor, t: torch.Tensor,
              f32: dict) -> torch.Tensor:
        """The norm of the update the optimizer just made (0-d), from the moments it left: ``t`` is each
        tensor's counter as the step left it, the denominator AMSGrad's running max where it keeps one."""
        _, _, _, _, eps = ts.constants(f32["device"])
        c, d = ts.corrections(f32, t.to(f32["device"]))
        v_den = v_sum if not ts.ams else ts.amsgrad_max(v_sum)
        return (c * m_sq / ((v_den / d).sqrt() + eps) ** 2).sum().sqrt()


def _lr_rose(before: list[Any] | None, groups: list[dict]) -> bool:
    """Did a group's learning rate rise by ``LR_RISE`` or more since the last step measured? A learning
    rate kept as a tensor is not read on the host: counted as risen (measured before every step)."""
    if before is None or len(before) != len(groups):
        return True
    for was, group in zip(before, groups):
        now = group.get("lr")
        if isinstance(now, torch.Tensor) or isinstance(was, torch.Tensor):
            return True
        if now is not None and was is not None and float(now) > LR_RISE * float(was):
            return True
    return False


@dataclass
class _AdamTensors:
    """The monitored tensors an Adam-like optimizer holds, with what the update signal reads of each."""

    params: Sequence[torch.nn.Parameter] = ()  # the monitored tensors (positions in ``idx`` index them)
    idx: list[int] = field(default_factory=list)  # monitored positions of the tensors with state
    states: list[dict] = field(default_factory=list)  # their state entries
    ms: list[torch.Tensor] = field(default_factory=list)  # exp_avg
    vs: list[torch.Tensor] = field(default_factory=list)  # exp_avg_sq
    steps: list[Any] = field(default_factory=list)  # each tensor's step counter (a number or a tensor)
    groups: list[dict] = field(default_factory=list)  # each tensor's param group
    fresh: list[tuple[int, dict]] = field(default_factory=list)  # (position, group) of tensors without state
    ams: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (j, max_exp_avg_sq) of AMSGrad tensors
    flipped: list[int] = field(default_factory=list)  # j of the tensors whose group maximizes (the step uses -g)
    distinct: list[dict] = field(default_factory=list)  # their groups, each once
    _constants: tuple | None = None  # (key, (where, sizes, b1, b2, eps)) on one device (``constants``)
    _lr_sq: tuple | None = None  # (key, (k,) lr^2) for the groups' learning rates as they are (``corrections``)

    @classmethod
    def of(cls, params: Sequence[torch.nn.Parameter], groups: dict, state: Any) -> "_AdamTensors":
        out = cls(params)
        for i, p in enumerate(params):
            group, g = groups.get(p), p.grad
            if group is None or g is None or g.is_sparse or _is_dtensor(g):
                continue  # a sharded tensor's local sums are not the tensor's
            st = state.get(p)
            if not st:  # the optimizer creates its state at this step
                out.fresh.append((i, group))
                continue
            m, v = st.get("exp_avg"), st.get("exp_avg_sq")  # betas, but moments under other names
            if m is None or v is None or "step" not in st or _is_dtensor(v) or v.numel() == 0 or m.shape != g.shape:
                continue  # (bitsandbytes' state1/state2): unknown
            if group.get("amsgrad") and st.get("max_exp_avg_sq") is not None:
                out.ams.append((len(out.idx), st["max_exp_avg_sq"]))
            if group.get("maximize"):
                out.flipped.append(len(out.idx))
            out.idx.append(i)
            out.states.append(st)
            out.ms.append(m)
            out.vs.append(v)
            out.steps.append(st["step"])
            out.groups.append(group)
        out.distinct = list({id(g): g for g in out.groups}.values())
        return out

    def same_state(self) -> bool:
        """Are the moment tensors still the ones in their state entries (none replaced by another)?"""
        return all(st.get("exp_avg") is m and st.get("exp_avg_sq") is v
                   for st, m, v in zip(self.states, self.ms, self.vs))

    def grads(self) -> list[torch.Tensor]:
        """The tensors' ``.grad`` now."""
        return [self.params[i].grad for i in self.idx]

    def constants(self, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
        """(positions (None: every monitored tensor, in order), sizes, b1, b2, eps), each (k,) on ``dev``,
        copied from the host once, again only when a group's betas or eps change."""
        key = (dev, tuple((*g["betas"], g.get("eps", 1e-8)) for g in self.distinct))
        if self._constants is None or self._constants[0] != key:
            rows = [[float(v.numel()), float(g["betas"][0]), float(g["betas"][1]), float(g.get("eps", 1e-8))]
                    for v, g in zip(self.vs, self.groups)]
            cols = to_device(torch.tensor(rows, dtype=torch.float32).T.contiguous(), dev)  # (4, k)
            where = None if self.idx == list(range(len(self.params))) else to_device(torch.tensor(self.idx), dev)
            self._constants = (key, (where, cols[0], cols[1], cols[2], cols[3]))
        return self._constants[1]

    def counters(self, f32: dict) -> torch.Tensor:
        """(k,) each tensor's step counter, on the device (read where they lie: no host read)."""
        return _stack_scalars(self.steps, f32)

    def corrections(self, f32: dict, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k,) ``lr^2 / (1 - b1^t)^2`` and ``n (1 - b2^t)`` for the step counters ``t`` (k,) of the step
        (after it) and each tensor's group's lr and betas."""
        _, n, b1, b2, _ = self.constants(f32["device"])
        return self.lr_squared(f32) / (1 - b1 ** t) ** 2, n * (1 - b2 ** t)

    def lr_squared(self, f32: dict) -> torch.Tensor:
        """(k,) each tensor's group's ``lr ** 2``, kept from step to step while the learning rates are the
        same host numbers (a schedule that moves them makes it again; one kept as a tensor: every call)."""
        lrs = [g["lr"] for g in self.distinct]
        key = (f32["device"], tuple(lrs)) if not any(isinstance(v, torch.Tensor) for v in lrs) else None
        if key is not None and self._lr_sq is not None and self._lr_sq[0] == key:
            return self._lr_sq[1]
        lr = _stack_scalars([g["lr"] for g in self.groups], f32)
        lr_sq = lr * lr
        self._lr_sq = None if key is None else (key, lr_sq)
        return lr_sq

    def amsgrad_v(self, v_new: torch.Tensor, b2: torch.Tensor, k_mg: torch.Tensor | float) -> torch.Tensor:
        """``v_new`` with AMSGrad's denominator for its tensors: ``sum max(max_exp_avg_sq, b2 v + (1 - b2) g^2)``
        elementwise, as the step takes it (a running max that never decays: a tensor whose ``v`` decayed
        does not spike its update). One read of ``v`` and of its max per such tensor."""
        sums, grads = [], self.grads()
        for j, vmax in self.ams:
            g = grads[j].float() * (k_mg[j] if isinstance(k_mg, torch.Tensor) else k_mg)
            sums.append(torch.maximum(vmax.float(), b2[j] * self.vs[j].float() + (1 - b2[j]) * g * g).sum())
        return self._with_ams(v_new, sums)

    def amsgrad_max(self, v_sum: torch.Tensor) -> torch.Tensor:
        """``v_sum`` with AMSGrad's denominator for its tensors after the step: the sum of the running max
        it left (one read of it per such tensor)."""
        return self._with_ams(v_sum, [vmax.float().sum() for _, vmax in self.ams])

    def _with_ams(self, v: torch.Tensor, sums: list[torch.Tensor]) -> torch.Tensor:
        out = v.clone()
        out[to_device(torch.tensor([j for j, _ in self.ams]), v.device)] = torch.stack(sums).to(v.dtype)
        return out

    def first_steps(self, f32: dict) -> torch.Tensor | None:
        """Adam's first step on the tensors without state: ``m_hat = g``, ``v_hat = g^2``, so each element
        moves by ``lr g / (|g| + eps)``, ``lr`` where its gradient is not tiny (one pass over those
        tensors' gradients: they are rare after training's first step)."""
        if not self.fresh:
            return None
        lr = _stack_scalars([g["lr"] for _, g in self.fresh], f32)
        unit = torch.stack([(g.float() / (g.float().abs() + float(grp.get("eps", 1e-8)))).pow(2).sum().to(**f32)
                            for g, grp in ((self.params[i].grad, grp) for i, grp in self.fresh)])
        return (lr * lr * unit).sum()


def _stack_scalars(values: list[Any], f32: dict) -> torch.Tensor:
    """(k,) float32 on the device from numbers or 0-d tensors (step counters, learning rates), with one
    host->device copy when they live on the host."""
    if all(not isinstance(v, torch.Tensor) for v in values):  # python numbers: one tensor, one copy
        return to_device(torch.tensor([float(v) for v in values], dtype=torch.float32), f32["device"])
    ts = [v.detach().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in values]
    if len({x.device for x in ts}) == 1:
        return to_device(torch.stack(ts).float(), f32["device"])
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
class _Stage:
    """What a step's call leaves for the measurement after its optimizer step."""

    step: int  # the optimizer's step number it is for (``optimizer_steps`` before that step)
    ts: _AdamTensors  # the tensors with state, as the call saw them
    v_after: torch.Tensor | None  # (k,) sum of v after the step by Adam's recursion (None: read it after)
    age: int  # steps since sum(v) was last read, after this one
    t: torch.Tensor | None  # (k,) the step counters before the step (carried: +1 a step; None: read after it)
    fed: bool  # this step's update was fed already (measured before it, or the step fired): measure no update


@dataclass
class _Moments:
    """Per-tensor ``||m||^2`` (read) and ``sum v`` (carried) of the optimizer's state after the last step
    measured, for the next step to start from instead of reading the state."""

    ts: _AdamTensors  # the tensors they describe
    optimizer_steps: int  # the optimizer's step count right after that step
    m_sq: torch.Tensor  # (k,)
    v_sum: torch.Tensor  # (k,)
    age: int  # steps since the last exact read of sum(v)
    t: torch.Tensor  # (k,) the step counters that step left
    versions: list[int] = field(default_factory=list)  # the moment tensors' version counters when measured

    def __post_init__(self) -> None:
        self.versions = [x._version for x in self.ts.ms] + [x._version for x in self.ts.vs]

    def holds(self, ts: _AdamTensors, optimizer_steps: int) -> bool:
        """Do they still describe the optimizer's state: the same tensors, no step since, and no change
        to them since (loaded, reset or edited in place)?"""
        if ts is not self.ts or optimizer_steps != self.optimizer_steps:
            return False
        return [x._version for x in ts.ms] + [x._version for x in ts.vs] == self.versions


class _AfterStep:
    """The optimizer's step post-hook, holding the signal weakly (no cycle through the optimizer)."""

    def __init__(self, inputs: AdamUpdate) -> None:
        self._ref = weakref.ref(inputs)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        inputs = self._ref()
        if inputs is not None:
            inputs._after_step()


def _param_groups(optimizer: Any) -> dict[torch.nn.Parameter, dict]:
    """Each parameter's param group, for optimizers with Adam's ``betas`` (others: none)."""
    out = {}
    for group in getattr(optimizer, "param_groups", []):
        if "betas" not in group:
            continue
        for p in group["params"]:
            out[p] = group
    return out
