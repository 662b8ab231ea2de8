"""docs/metrics.md names every key the demo run logs (layer keys as ``<layer>``), with its meaning, unit, when
it is logged and what turns it on."""
from __future__ import annotations

import re

import pytest

from ..examples.demo_run import demo_run
from .snippets import ROOT

PAGE = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
LAYERED = ("grad_norm", "weight_norm", "grad_weight_ratio", "clip/coef", "clip/threshold")


def documented() -> set[str]:
    """The keys the page's tables name (``a``, ``b/c|d`` as two, ``x``, ``y`` in one cell)."""
    keys = set()
    for line in PAGE.splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`([\w/<>.|]+)`", line.split(" | ")[0]))
    return keys


def as_documented(key: str) -> str:
    """``grad_norm/h.3`` -> ``grad_norm/<layer>``: a layer's key as the page writes it."""
    for prefix in LAYERED:
        if key.startswith(prefix + "/") and key[len(prefix) + 1:] not in ("global", "nonfinite"):
            return f"{prefix}/<layer>"
    return key


def test_every_row_has_a_meaning_a_unit_a_when_and_a_switch():
    rows = [ln for ln in PAGE.splitlines() if ln.startswith("| `")]
    assert len(rows) >= 40
    assert all(len([c for c in ln.strip("|").split(" | ") if c.strip()]) == 5 for ln in rows), rows


@pytest.mark.slow
def test_the_page_names_every_key_the_demo_logs(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.run_record import read_run_views

    view = read_run_views(demo_run(tmp_path_factory).run_dir)["mlflow"]
    logged = set(MlflowClient(view["tracking_uri"]).get_run(view["run_id"]).data.metrics)
    missing = sorted({as_documented(k) for k in logged} - documented())
    assert not missing, f"docs/metrics.md does not name {missing}"
