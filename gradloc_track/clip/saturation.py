"""When clipping has turned into a learning-rate cut: how often, and how hard, a clipper scales.

A clipper that scales most steps for a long stretch is no longer catching spikes: it divides the
learning rate. AdaGC does this by design once its running norm sits below the gradient norms (its
threshold grows by at most ``(lambda_rel - 1) * (1 - beta)``, ~0.04% a step): in the spike demo
every step after warm-up is clipped, to a quarter of its norm. Nothing showed it.

``ClipSaturation`` keeps, on the device (no host sync), for every step after the clipper's
warm-up: whether the step was scaled, and its coefficient ``||g after|| / ||g before||`` — as an
EMA over ``window`` steps (a running mean until then) and as totals. The monitor logs

- ``clip/saturation/clipped_fraction``: share of recent steps that were scaled (EMA)
- ``clip/saturation/mean_coef``: their mean coefficient (EMA; 1 = untouched)

and warns once (``saturation_warning``) when, after at least ``window`` steps, more than
``MOST`` of the steps were scaled with a mean coefficient below ``CUT``, naming the setting that
changes it. ``summary()`` (one host read) gives the totals since warm-up for a closing line.
"""
from __future__ import annotations

import torch

WINDOW = 50  # steps: the stretch a saturation must last before the warning (EMA memory)
MOST = 0.8  # warn when more than this share of recent steps was scaled ...
# ... with a mean coefficient below this (a 2x cut or more). AdaGC with its defaults scales ~99% of
# the steps of a stationary stream by ~0.74 for hundreds of steps after warm-up (its running norm
# starts at the warm-up's minimum): the metrics show that; the warning is kept for a real cut
CUT = 0.5
KEYS = ("clip/saturation/clipped_fraction", "clip/saturation/mean_coef")

class ClipSaturation:
    def __init__(self, device: torch.device, window: int = WINDOW) -> None:
        self.window = window
        self.steps = 0  # host: steps counted (after the clipper's warm-up)
        self.ema = torch.zeros(2, device=device)  # [clipped, coef]
        self.total = torch.zeros(2, device=device)  # sums of the same since warm-up

    def add(self, sq_norms: torch.Tensor, coefs: torch.Tensor, ok: torch.Tensor) -> None:
        """One step: ``sq_norms`` (n,) finite squared norms before clipping, ``coefs`` 0-d or (n,);
        a step that is not ``ok`` (non-finite: skipped) counts as the running average."""
        if coefs.dim() == 0:  # one coefficient: the global norm scales by it
            coef = coefs
        else:
            pre = sq_norms.sum()
            coef = torch.where(pre > 0, ((sq_norms * coefs * coefs).sum() / pre.clamp_min(1e-30)).sqrt(), 1.0)
        x = torch.where(ok, torch.stack([(coef < 1.0 - 1e-6).float(), coef.float()]), self.ema)  # (2,)
        self.steps += 1
        w = max(1.0 / self.steps, 1.0 / self.window)  # running mean, then an EMA over ``window`` steps
        self.ema = self.ema + (x - self.ema) * w  # new tensors: a ClipResult holding the last ones keeps them
        self.total = self.total + x

    def values(self) -> torch.Tensor:
        """(2,) device: the EMA clipped fraction and mean coefficient (what the monitor packs)."""
        return self.ema

    def summary(self) -> dict[str, float]:
        """Totals since warm-up: ``steps``, ``clipped_fraction``, ``mean_coef`` (one host read)."""
        if self.steps == 0:
            return {"steps": 0, "clipped_fraction": 0.0, "mean_coef": 1.0}
        clipped, coef = (self.total / self.steps).tolist()  # host sync: once, for a closing summary
        return {"steps": self.steps, "clipped_fraction": clipped, "mean_coef": coef}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "ema": self.ema.clone(), "total": self.total.clone()}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:  # a checkpoint from before 0.3: start counting now
            return
        self.steps = int(state["steps"])
        self.ema, self.total = (state[k].to(self.ema.device).clone() for k in ("ema", "total"))


def saturation_warning(kind: str, steps: int, clipped_fraction: float, mean_coef: float,
                       window: int = WINDOW) -> str | None:
    """The one-time warning's text when clipping has become a learning-rate cut, else None."""
    if steps < window or clipped_fraction <= MOST or mean_coef >= CUT:
        return None
    from ..config.clip import CLIP_SCHEMAS, ClipConfig

    fix = CLIP_SCHEMAS.get(kind, ClipConfig).LOOSEN  # what to change: said on the option's schema
    return (f"clip={kind} scaled {clipped_fraction:.0%} of the last ~{window} steps, "
            f"to {mean_coef:.2f}x their norm on average: clipping has turned into a {1 / max(mean_coef, 1e-6):.1f}x "
            f"learning-rate cut rather than a spike guard (clip/saturation/* show it). If that is not what you "
            f"want, {fix}.")


NO_WARMUP = frozenset({"global"})  # clippers with a fixed threshold from the first step


def saturation_line(kind: str, summary: dict[str, float]) -> str | None:
    """A console summary line (after warm-up), or None when the clipper saw no step after warm-up."""
    if kind == "none" or summary["steps"] == 0:
        return None
    # a fixed threshold has no warm-up: its share counts every step, the start-up transient's too (its large
    # early gradients), so it reads higher than a table over the settled clean steps
    when = "over every step (no warm-up: the start-up transient included)" if kind in NO_WARMUP else "after its warm-up"
    line = (f"clip={kind} {when}: {summary['clipped_fraction']:.0%} of "
            f"{summary['steps']} steps clipped, mean coefficient {summary['mean_coef']:.2f}")
    if summary["clipped_fraction"] > MOST and summary["mean_coef"] < CUT:
        line += f" — a {1 / max(summary['mean_coef'], 1e-6):.1f}x learning-rate cut, not a spike guard"
    return line
