"""One table for several runs of the demo app: a multirun's jobs (``-m clip=none,adagc``) and
``examples/clip_compare.py``'s clippers, compared on what matters.

Each row is one run's ``summary.json`` (``examples/train_lm.py``'s ``summarize``): the spikes its
detector fired on, the share of the injected spikes the clipper scaled, how far the worst one reached
the optimizer (``spike_held``: its post-clip norm over the median post-clip norm of a clean step), how
often and how hard the clipper scaled the clean steps, and the final loss. A clipper that scales most
clean steps has turned into a learning-rate cut; one that scales most spikes and few clean steps is a
spike guard: the verdict column says which.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

LR_CUT = 0.5  # a clipper that scales more than this share of the clean steps acts on the learning rate
GUARD = 0.5  # ... else one that scales at least this share of the injected spikes guards against them

HEADER = ("| run | spikes detected | spikes clipped | worst spike after clipping (x a clean step) "
          "| clean steps clipped | mean coefficient | final loss | verdict |")


def verdict(kind: str | None, s: dict[str, Any]) -> str:
    """``learning-rate cut (2.8x)``, ``spike guard``, ``lets spikes through``, ``no clipping`` or ``-``."""
    if kind == "none":
        return "no clipping"
    clipped, coef = s.get("clean_clipped_fraction"), s.get("clean_mean_coef")
    if clipped is not None and coef is not None and clipped > LR_CUT:
        return f"learning-rate cut ({1 / max(coef, 1e-6):.1f}x)"
    spikes = s.get("spike_clipped_fraction")
    if spikes is None:
        return "-"
    return "spike guard" if spikes >= GUARD else "lets spikes through"


def _cell(s: dict[str, Any], key: str, fmt: str) -> str:
    value = s.get(key)
    return "-" if value is None else format(value, fmt)


def row(label: str, kind: str | None, s: dict[str, Any]) -> str:
    """One run's row (``s``: its summary)."""
    spikes = s.get("events_at")
    found = f"{len(spikes)}" if spikes is not None else _cell(s, "spike_events", ".0f")
    held = _cell(s, "spike_held", ".2f") + ("x" if s.get("spike_held") is not None else "")
    return (f"| {label} | {found} | {_cell(s, 'spike_clipped_fraction', '.0%')} | {held} | "
            f"{_cell(s, 'clean_clipped_fraction', '.0%')} | {_cell(s, 'clean_mean_coef', '.2f')} | "
            f"{_cell(s, 'final_loss', '.4f')} | {verdict(kind, s)} |")


def comparison_table(runs: Sequence[tuple[str, str | None, dict[str, Any]]]) -> str:
    """The Markdown table of ``(label, clip kind, summary)`` rows."""
    return "\n".join([HEADER, "|---|---|---|---|---|---|---|---|", *(row(*r) for r in runs)])


def clip_kind(run_dir: Path) -> str | None:
    """The run's ``clip.kind``, from the ``config.yaml`` the app wrote (None without one)."""
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(cfg), "clip.kind")


def _overrides(job_dir: Path) -> list[str]:
    """The job's command-line overrides, as Hydra recorded them (``.hydra/overrides.yaml``)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def _job_number(job_dir: Path, sweep_dir: Path) -> int:
    """The job's number: the head of its folder's name under the sweep (``3_clip=adagc``)."""
    head = job_dir.relative_to(sweep_dir).parts[0].split("_", 1)[0]
    return int(head) if head.isdigit() else 0


def sweep_rows(sweep_dir: Path) -> list[tuple[str, str | None, dict[str, Any]]]:
    """Every job of a multirun under ``sweep_dir`` with a ``summary.json``, in job order, labelled by the
    overrides that differ between the jobs (``clip=adagc``: what the sweep swept)."""
    jobs = sorted((p.parent for p in sweep_dir.rglob("summary.json")),
                  key=lambda d: (_job_number(d, sweep_dir), str(d)))
    overrides = [_overrides(d) for d in jobs]
    common = set.intersection(*map(set, overrides)) if overrides else set()
    labels = [" ".join(o for o in ovr if o not in common) or f"job {_job_number(d, sweep_dir)}"
              for d, ovr in zip(jobs, overrides)]
    return [(label, clip_kind(d), json.loads((d / "summary.json").read_text(encoding="utf-8")))
            for label, d in zip(labels, jobs)]
