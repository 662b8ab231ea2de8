"""The monitored parameters: which tensors, how they group into layers, how the clipper's map.

Built at construction and rebuilt when a parameter's ``requires_grad`` flips or a parameter joins the model
(checked on syncing steps only: one pass over the flags there, nothing on other steps). A rebuild that fails its
checks leaves the set as it was.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..config.monitor import RESERVED_LAYER_NAMES
from ..grouping import LayerGrouping
from ..norms import trainable_params

log = logging.getLogger(__name__)


_registered = [0]  # parameters registered on any module since the hook went in (a version, nothing more)
_hooked = [False]


def _count(module: torch.nn.Module, name: str, param: Any) -> None:
    _registered[0] += 1


def _watch_registrations() -> int:
    """Install (once per process) torch's global parameter-registration hook that bumps ``_registered``; the
    count now."""
    if not _hooked[0]:
        _hooked[0] = True
        torch.nn.modules.module.register_module_parameter_registration_hook(_count)
    return _registered[0]


class ParamSet:
    """Names, tensors and layer grouping of the trainable parameters, with their metric keys."""

    def __init__(self, model: torch.nn.Module, config: Any, clipper: Any, warn_once: Callable[[str, str], None]):
        self.model, self.config, self.clipper, self._warn_once = model, config, clipper, warn_once
        self.scan()

    def scan(self) -> None:
        """(Re)build everything that depends on which parameters require grad."""
        named = trainable_params(self.model)
        if not named:
            raise ValueError("GradMonitor: the model has no parameters with requires_grad=True")
        names = [n for n, _ in named]
        grouping = LayerGrouping.build(names, self.config.group_by, self.config.groups or None)
        layers = grouping.layers
        clash = RESERVED_LAYER_NAMES.intersection(layers)
        if clash:
            raise ValueError(f"GradMonitor: layer name(s) {sorted(clash)} would clash with grad_norm/global or "
                             "grad_norm/nonfinite; rename them with monitor.groups={name: regex}")
        # every check passed: only now replace the monitored set (a failed rescan changes nothing)
        self.names, self.params, self.grouping = names, [p for _, p in named], grouping
        # the requires_grad pattern of every parameter: compared on syncing steps to pick up
        # parameters unfrozen (or frozen) after the monitor was built
        self._all_params = list(self.model.parameters())
        self._flags = [p.requires_grad for p in self._all_params]
        self._version = _watch_registrations()
        self.layer_keys = [f"grad_norm/{lay}" for lay in layers]
        self.tensor_keys = [f"grad_norm/tensor/{n}" for n in self.names]
        self.weight_keys = ["weight_norm/global"] + [f"weight_norm/{lay}" for lay in layers]
        self.ratio_keys = [f"grad_weight_ratio/{lay}" for lay in layers]
        # the order packing.add_norms sends them in (one vector a step)
        self.grad_keys = ["grad_norm/global"] + self.layer_keys + self.tensor_keys
        self.grad_weight_keys = self.grad_keys + self.weight_keys + self.ratio_keys
        self.clip_index = self._clipper_index()
        self._clip_index_t: torch.Tensor | None = None  # the same index on the gradients' device
        # clip metrics are grouped over the clipper's own tensors when they differ from ours
        self.clip_grouping = self.grouping if self.clip_index is None else LayerGrouping.build(
            list(self.clipper.names), self.config.group_by, self.config.groups or None)

    def changed(self) -> bool:
        """Did any parameter's requires_grad flip, or a parameter join the model, since the last scan? (syncing
        steps only: O(#params) flags; the model's parameters are listed again only when some module, anywhere,
        registered a parameter since: a counter bumped by torch's registration hook)"""
        if _registered[0] != self._version:
            self._version = _registered[0]
            if [id(p) for p in self.model.parameters()] != [id(p) for p in self._all_params]:
                return True  # a parameter added mid-run (round 10: never monitored, its spikes never localized)
        return [p.requires_grad for p in self._all_params] != self._flags

    def rescan(self, step: int) -> list[str]:
        """Pick up parameters unfrozen (and drop ones frozen) after the monitor was built; the names taken in."""
        before = set(self.names)
        adopt = getattr(self.clipper, "adopt", None)
        if adopt is not None:  # the clipper takes the newly trainable tensors too (LayerClip cannot: warned below)
            try:
                adopt(self.model)
            except Exception as exc:  # never kill training: the warning below says what is not clipped
                log.warning("gradloc-track: the clipper could not take the newly trainable parameters: %r", exc)
        try:
            self.scan()
        except ValueError:  # every parameter frozen for now: keep the last set, look again later
            self._flags = [p.requires_grad for p in self._all_params]
            self._version = -1  # a parameter added meanwhile is looked for again at the next syncing step
            return []
        added = [n for n in self.names if n not in before]
        removed = sorted(before - set(self.names))
        log.info("gradloc-track: step %d: now monitoring %d newly trainable parameter(s) %s%s", step, len(added),
                 added[:8], f"; no longer monitoring {removed[:8]}" if removed else "")
        return added

    def _clipper_index(self) -> Any:
        """How the clipper's tensors map onto the monitored ones.

        None: the same tensors in the same order (the norms are handed over as they are); a list
        of indices: the clipper holds a subset (it was built while some parameters were frozen);
        ``"own"``: it holds tensors the monitor does not (it computes its own norms).
        """
        names = self.clipper.names if self.clipper is not None else None
        if names is None or list(names) == self.names:
            return None
        unclipped = sorted(set(self.names) - set(names))
        if unclipped:
            self._warn_once("unclipped", f"parameter(s) {unclipped[:8]}{' ...' if len(unclipped) > 8 else ''} are "
                            f"monitored but not clipped: the {type(self.clipper).__name__} was built while they "
                            "were frozen and keeps per-layer statistics of the layers it had. Build the clipper "
                            "(or watch()) again after unfreezing them, or use clip='adagc', 'zclip' or 'global', "
                            "which take them in.")
        pos = {n: i for i, n in enumerate(self.names)}
        return [pos[n] for n in names] if all(n in pos for n in names) else "own"

    def clip(self, grad_sq: torch.Tensor) -> Any:
        """Run the clipper on its own tensors' norms (handed over, never recomputed when they match)."""
        if self.clipper is None:
            return None
        index = self.clip_index
        if index is None:
            return self.clipper.clip(grad_sq)
        if index == "own":
            return self.clipper.clip()
        t = self._clip_index_t
        if t is None or t.device != grad_sq.device:  # once: a host->device copy waits for the device
            t = self._clip_index_t = torch.as_tensor(index, device=grad_sq.device)
        return self.clipper.clip(grad_sq[t])
