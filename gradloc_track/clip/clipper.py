"""Shared machinery of the clippers: the result type, non-finite handling, fused scaling.

Every clipper keeps its state (thresholds, EMAs) on the gradients' device and decides with
``torch.where``/``clamp``, so ``clip()`` never syncs to the host (``on_nonfinite="raise"`` is the
one exception: raising needs to know).

Memory traffic (what norms and clipping cost on an accelerator; ``gradloc_track.traffic``): given
the norms (the monitor's pass), ``clip()`` makes ONE fused read+write pass over the gradients, the
scaling. Beside a fused optimizer (``fused=True`` Adam/AdamW/SGD/Adagrad under a ``SkipStepGuard``
in ``fused`` mode) a single coefficient (GlobalClip, ZClip, AdaGC's global mode and warm-up) makes
no pass at all: it is handed to the optimizer as ``grad_scale`` and applied inside the kernel's
own pass (``clip.handoff``; ``ClipResult.deferred``; ``.grad`` holds the clipped values once the
step ran). A non-finite step costs nothing more when the optimizer really skips it
(``SkipStepGuard``, which ``GradMonitor(optimizer=...)``, ``watch()`` and the callbacks install):
its gradients are never used, so they are not touched. Only where no guard makes the skip real,
and with ``on_nonfinite="zero"``, a second pass zeroes the non-finite values (integer views:
``NaN * 0`` is NaN in floating point).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import defaultdict
from typing import Any, ClassVar

import torch

from ..config.clip import ClipConfig, NoClipConfig
from ..norms import global_sq_norms, trainable_params
from .checkpoint import check_state
from .handoff import StepHandoff
from .saturation import ClipSaturation

#: option name (its schema's ``KIND``) -> its clipper; each clipper class that names a ``Schema`` adds itself
CLIPPERS: dict[str, type["Clipper"]] = {}


class ClipResult:
    """What one ``clip()`` did. Tensors stay on device; the mapping/float views sync lazily, and
    the global norms are computed only when read (a non-logging step never needs them)."""

    def __init__(self, names: list[str], threshold_t: torch.Tensor, coef_t: torch.Tensor, pre_sq_t: torch.Tensor,
                 nonfinite_t: torch.Tensor, kind: str = "none") -> None:
        self.names = names
        self.threshold_t = threshold_t  # (n,) threshold in force per tensor (inf: none; global clippers: global)
        self.coef_t = coef_t  # (n,) per-tensor multiplier applied
        self.pre_sq_t = pre_sq_t  # (n,) squared norms before clipping
        self.nonfinite_t = nonfinite_t  # () bool: a non-finite gradient was seen this step
        self.kind = kind
        self.one_threshold = False  # one threshold for the whole gradient (the clipper's ``one_threshold``)
        self.saturation_t: torch.Tensor | None = None  # (2,) the clipper's running clipped fraction, mean coef
        # () set when one global threshold is in force for a per-tensor clipper (AdaGC's warm-up)
        self.global_threshold_t: torch.Tensor | None = None
        # the scale is applied by the fused optimizer's kernel in step(): until then .grad is unscaled
        self.deferred = False
        self._pre: torch.Tensor | None = None
        self._post: torch.Tensor | None = None

    @property
    def total_norm_pre_t(self) -> torch.Tensor:
        """() global norm before clipping (NaN/Inf on a non-finite step)."""
        if self._pre is None:
            self._pre = self.pre_sq_t.sum().sqrt()
        return self._pre

    @property
    def total_norm_post_t(self) -> torch.Tensor:
        """() global norm after clipping (non-finite tensors count as zeroed)."""
        if self._post is None:
            norms = self.pre_sq_t.sqrt()
            post = torch.where(torch.isfinite(norms), norms * self.coef_t, 0.0)
            self._post = post.pow(2).sum().sqrt()
        return self._post

    @property
    def thresholds(self) -> dict[str, float]:
        return dict(zip(self.names, self.threshold_t.tolist()))  # host sync

    @property
    def coefs(self) -> dict[str, float]:
        return dict(zip(self.names, self.coef_t.tolist()))  # host sync

    @property
    def total_norm(self) -> float:
        return float(self.total_norm_pre_t)  # host sync

    @property
    def total_norm_post(self) -> float:
        return float(self.total_norm_post_t)  # host sync

    @property
    def nonfinite(self) -> bool:
        return bool(self.nonfinite_t)  # host sync


class Clipper(StepHandoff):
    """Base: holds the parameters (in ``trainable_params`` order) and the non-finite policy.

    A clipper is built from its schema (``Schema``, a ``config.ClipConfig`` subclass): ``Clipper(model,
    config)``, or ``Clipper(model, **options)`` with the schema's field names (``ZClip(model,
    z_thresh=3.0)``), which builds the schema and so runs its checks (errors name ``clip.<field>``).
    Every field of the schema is an attribute of the clipper (``clipper.z_thresh``); ``config`` is the
    schema itself. A subclass that names its ``Schema`` is the clipper of that option (``CLIPPERS``).

    Subclasses implement ``_coefs(norms, finite) -> (thresholds, coefs)`` on device tensors and
    ``_update(...)`` for their running state; ``clip()`` does the rest. ``coefs`` may be 0-d
    (one coefficient for every tensor: applied with a single fused multiply) or ``(n,)``.
    A missing gradient arrives as norm 0 (as does an all-zero one): neither is a sample of the norm.
    """

    Schema: ClassVar[type[ClipConfig]] = NoClipConfig
    kind = "none"
    scales = True  # False: coefficients are always 1 (NoClip), no scale pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Schema" in cls.__dict__:  # the clipper of option ``clip=<Schema.KIND>``
            cls.kind = cls.Schema.KIND
            CLIPPERS[cls.Schema.KIND] = cls

    def __init__(self, model: torch.nn.Module, config: ClipConfig | None = None, *, process_group: Any = None,
                 **options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(self).__name__}(model=...) needs a torch.nn.Module, got {type(model).__name__}")
        self.config = config = self.configure(config, options)
        for f in dataclasses.fields(config):  # the schema's fields, as the clipper's attributes
            if f.name != "kind":
                setattr(self, f.name, getattr(config, f.name))
        #: one threshold for the whole gradient (``clip/threshold/global`` only), else per tensor or layer
        self.one_threshold = type(config).ONE_THRESHOLD
        named = trainable_params(model)
        if not named:
            raise ValueError(f"{type(self).__name__}: the model has no parameters with requires_grad=True")
        self._built_on = weakref.ref(model)  # adopt() takes in only this model's newly trainable tensors
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # (config.skip_step: how GradMonitor(optimizer=...) makes on_nonfinite="skip" exact; "off": zero only)
        self.process_group = process_group
        self.steps = 0  # python int: warm-up bookkeeping needs no device value
        # the flag and scale handed to the optimizer's step (a SkipStepGuard's; see clip.handoff)
        self._init_handoff(self.params[0].device)
        self._warned_skip = False
        self._coef_views: dict = {}  # scale_grads' reused per-tensor coefficient buffers
        self.saturation = ClipSaturation(self.params[0].device)  # how often / how hard it scales

    def adopt(self, model: torch.nn.Module) -> bool:
        """Clip the parameters ``model`` trains now: ones unfrozen (or added) since the clipper was built join it,
        each with a fresh running state, the others keep theirs. ``watch()`` builds its clipper itself, so
        'build it again' was no way out, and an unfrozen layer went unclipped (held-out tester round 10). The
        monitor calls it when its rescan finds new trainable parameters. False: nothing changed, or this
        clipper's state cannot take them (LayerClip's per-layer statistics: it says so)."""
        built_on = self._built_on() if self._built_on is not None else None
        if model is not built_on:  # a clipper built over a sub-module (or another model) keeps its own tensors
            return False
        named = trainable_params(model)
        names = [n for n, _ in named]
        if not named or (names == self.names and all(p is q for (_, p), q in zip(named, self.params))):
            return False  # the same tensors (a parameter replaced under its name is taken in too: round 11)
        old = {n: i for i, n in enumerate(self.names)}
        if not self._adopt([old.get(n) for n in names], names):
            return False
        self.names, self.params = names, [p for _, p in named]
        self._coef_views = {}
        return True

    def _adopt(self, index: list[int | None], names: list[str]) -> bool:
        """Rearrange per-tensor running state for the new tensor list ``names`` (``index``: each one's old
        position, None for a new one). No per-tensor state here (global, ZClip, none): nothing to do."""
        return True

    @classmethod
    def configure(cls, config: ClipConfig | None, options: dict[str, Any]) -> ClipConfig:
        """The schema this clipper is built from: ``config``, with ``options`` replacing its fields, or the
        schema built from ``options`` (its ``__post_init__`` checks every value, naming the field). A keyword that
        is no field is a TypeError naming the closest one, as ``watch()`` and the Hydra app name it (held-out
        tester, stop 54: ``AdaGC(m, lamda_rel=1.1)`` gave the dataclass's bare "unexpected keyword argument")."""
        names = [f.name for f in dataclasses.fields(cls.Schema)]
        unknown = [k for k in options if k not in names]
        if unknown:
            import difflib

            hints = [f"{k} (did you mean {close[0]}?)" if close else k
                     for k in unknown for close in [difflib.get_close_matches(k, names, n=1)]]
            raise TypeError(f"{cls.__name__}(model, ...): no option {', '.join(hints)}; its options are the fields "
                            f"of {cls.Schema.__name__}: {', '.join(names)}")
        if config is None:
            return cls.Schema(**options)
        if not isinstance(config, cls.Schema):
            raise TypeError(f"{cls.__name__}(model, config): config is a {type(config).__name__}; pass a "
                            f"{cls.Schema.__name__} (the schema of clip={cls.Schema.KIND}), or its fields by name")
        return dataclasses.replace(config, **options) if options else config

    @property
    def warming_up(self) -> bool:
        """Host-side: still in the warm-up (its scaling then is not what the method does in steady state)."""
        return False

    def _sq_norms(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        return global_sq_norms(grads, self.process_group)  # (n,) device

    @torch.no_grad()
    def clip(self, sq_norms: torch.Tensor | None = None) -> ClipResult:
        """Clip every ``p.grad`` in place. ``sq_norms``: per-tensor squared norms if already known."""
        grads = [p.grad for p in self.params]
        if sq_norms is None:
            sq_norms = self._sq_norms(grads)  # (n,) device
        sq_norms = sq_norms.float()
        norms = sq_norms.sqrt()  # (n,) 0 for a missing gradient
        finite_t = norms < float("inf")  # (n,) per tensor: norms are >= 0, so this is isfinite in one op
        all_finite = finite_t.all()
        if self.on_nonfinite == "raise" and not bool(all_finite):  # host sync: the error path needs it
            bad = [n for n, ok in zip(self.names, finite_t.tolist()) if not ok]
            raise FloatingPointError(f"non-finite gradient in {bad[:10]}{' ...' if len(bad) > 10 else ''}; "
                                     "set on_nonfinite='skip' or 'zero' to keep training")
        safe = torch.nan_to_num(norms, nan=0.0, posinf=0.0)  # (n,) never NaN downstream
        self._global_threshold = None
        steady = self.scales and not self.warming_up  # decided before this step advances any warm-up
        thresholds, coefs = self._coefs(safe, all_finite)
        # skip: every coefficient 0 on a bad step; zero/raise: only the non-finite tensors'
        keep = all_finite if self.on_nonfinite == "skip" else finite_t
        coefs = torch.where(keep, coefs, 0.0)
        # skip: a step with any non-finite gradient teaches the running state nothing
        update_ok = finite_t & all_finite if self.on_nonfinite == "skip" else finite_t
        self._update(safe, thresholds, coefs, update_ok, all_finite)
        self.steps += 1
        zero = self._zero_mask(keep)
        nonfinite = ~all_finite
        # a fused optimizer applies a single coefficient in its own pass (clip.handoff): no pass here
        deferred = self._hand_over(nonfinite, coefs if self.scales and zero is None else None)
        if not deferred and (self.scales or zero is not None):  # NoClip with a guard: no pass at all
            scale_grads(grads, coefs if self.scales else None, zero, self._coef_views)
        result = ClipResult(self.names, thresholds.expand_as(norms), coefs.expand_as(norms), sq_norms, nonfinite,
                            self.kind)
        result.global_threshold_t, result.deferred = self._global_threshold, deferred
        result.one_threshold = self.one_threshold
        if steady:
            self.saturation.add(safe * safe, coefs, all_finite)
            result.saturation_t = self.saturation.values()
        return result

    def _zero_mask(self, keep: torch.Tensor) -> torch.Tensor | None:
        """Which gradients must be zeroed in place (None: none, the scale pass alone).

        raise: every gradient is finite (else it raised); skip with a guard: the optimizer never
        uses a non-finite step's gradients. Otherwise zero them, and say once that zeroing is not
        skipping for optimizers that move without a gradient (unless ``skip_step="off"`` chose that)."""
        if self.on_nonfinite == "raise" or (self.on_nonfinite == "skip" and self.skip_exact):
            return None
        if self.on_nonfinite == "skip" and self.skip_step != "off" and not self._warned_skip:
            self._warned_skip = True
            # said before any non-finite step (nothing is wrong yet: held-out tester, stop 54, read it as if one were)
            warnings.warn(f"gradloc-track: {type(self).__name__}(on_nonfinite='skip') does not know the optimizer: if "
                          "a step's gradient is ever non-finite, it can only zero that step's gradients, and AdamW "
                          "(moments, weight decay) and momentum SGD would still move the weights. Make the skip exact "
                          "with gradloc_track.clip.SkipStepGuard(optimizer, clipper), or pass optimizer= to "
                          "GradMonitor (watch() and the HF/Lightning callbacks do it for you).", UserWarning,
                          stacklevel=3)
        return keep

    # -- to implement --------------------------------------------------------------------
    def _coefs(self, norms: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inf = torch.full_like(norms, float("inf"))
        return inf, torch.ones((), device=norms.device)

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).kind, "steps": self.steps, "saturation": self.saturation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self, state)
        self.steps = int(state["steps"])
        self.saturation.load_state_dict(state.get("saturation"))


# float dtype -> same-width integer dtype: multiplying the bit pattern by 0/1 zeroes or keeps a
# tensor exactly, NaN and Inf included (NaN * 0 is NaN in floating point, 0 in integers)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _scalable(g: torch.Tensor) -> torch.Tensor:
    """The dense storage to scale in place: a DTensor's local shard, a sparse COO tensor's values."""
    g = g.to_local() if hasattr(g, "to_local") else g
    return g._values() if g.layout == torch.sparse_coo else g


def scale_grads(grads: list[torch.Tensor | None], coefs: torch.Tensor | None, keep: torch.Tensor | None,
                cache: dict | None = None) -> None:
    """``g_i <- keep_i ? coef_i * g_i : 0`` for every gradient, with fused kernels, no host sync.

    ``coefs``: 0-d (one fp32 multiplier for all) or ``(n,)``, or None (zero only); ``keep``: 0-d or ``(n,)`` bool, or
    None when no gradient needs zeroing (all finite, or the step is skipped anyway). One
    ``_foreach_mul_`` per (device, dtype) group applies the fp32 coefficient to each tensor in its
    own dtype (computed in fp32, rounded once). Zeroing multiplies each tensor's integer view by
    0/1 (so NaN/Inf become exact zeros, which no floating-point op does) in one more fused call:
    no per-tensor kernels. ``cache`` (a dict kept by the caller) reuses one buffer and its
    per-tensor views for ``(n,)`` coefficients, instead of splitting a new tensor every step.
    """
    idx_all = [i for i, g in enumerate(grads) if g is not None]
    if not idx_all:
        return
    ts_all = [grads[i] for i in idx_all]
    groups = _plain_groups(idx_all, ts_all)
    if groups is None:  # DTensor / sparse gradients: group their local dense storage
        groups = defaultdict(lambda: ([], []))
        for i, g in zip(idx_all, ts_all):
            t = _scalable(g)
            idx, ts = groups[(t.device, t.dtype)]
            idx.append(i)
            ts.append(t)
    n = len(grads)
    for (dev, dtype), (idx, ts) in groups.items():
        if keep is not None:
            _zero_group(ts, keep if keep.dim() == 0 else _take(keep, idx, n, dev), dev, dtype)
        if coefs is not None:
            scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            if coefs.dim() == 0:
                torch._foreach_mul_(ts, coefs.to(device=dev, dtype=scale_dtype))
            else:
                torch._foreach_mul_(ts, _per_tensor(_take(coefs, idx, n, dev).to(scale_dtype), cache))


def _per_tensor(values: torch.Tensor, cache: dict | None) -> list[torch.Tensor]:
    """``values`` (k,) as k 0-d tensors: views of a reused buffer (one small copy per step)."""
    if cache is None:
        return list(values.unbind())
    key = (values.device, values.dtype, values.numel())
    entry = cache.get(key)
    if entry is None:
        buf = torch.empty_like(values)
        entry = cache[key] = (buf, list(buf.unbind()))
    entry[0].copy_(values)
    return entry[1]


def _zero_group(ts: list[torch.Tensor], keep: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> None:
    """Zero the tensors of one (device, dtype) group where ``keep`` (0-d or one per tensor) is False."""
    bits = _BITS.get(dtype)
    if bits is None:  # exotic dtype: per-tensor clean-up
        for t in ts:
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        return
    views = [t.view(bits) for t in ts]
    if keep.dim() == 0:
        torch._foreach_mul_(views, keep.to(device=dev, dtype=bits))
    else:
        torch._foreach_mul_(views, list(keep.to(bits).unbind()))


def _plain_groups(idx_all: list[int], ts_all: list[torch.Tensor]) -> dict | None:
    """(device, dtype) -> (indices, tensors), grouped in C++ (no per-tensor attribute reads in
    Python); None when a tensor is not a plain strided one (checked by exact type and layout)."""
    if any(type(t) is not torch.Tensor for t in ts_all) or any(t.is_sparse for t in ts_all):
        return None
    grouped = torch._C._group_tensors_by_device_and_dtype([ts_all], True)
    return {key: ([idx_all[j] for j in pos], tensors[0]) for key, (tensors, pos) in grouped.items()}


def _take(values: torch.Tensor, idx: list[int], n: int, device: torch.device) -> torch.Tensor:
    if len(idx) == n:  # every tensor in one group, in order
        return values.to(device)
    return values[torch.tensor(idx, device=values.device)].to(device)
