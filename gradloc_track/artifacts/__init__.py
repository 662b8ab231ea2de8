"""Spike artifacts people can browse: attribution table, highlighted text, layer heatmap.

The writers need torch; the readers (``table_store``, ``identity``) do not, so the names below
resolve on first use and ``import gradloc_track.artifacts.table_store`` stays torch-free.
"""
from __future__ import annotations

from .._lazy import lazy_names

_EXPORTS = {
    "attribution_table": "gradloc_track.artifacts.table",
    "render_highlight_html": "gradloc_track.artifacts.highlight",
    "render_layer_heatmap": "gradloc_track.artifacts.heatmap",
    "SpikeArtifactWriter": "gradloc_track.artifacts.artifact_writer",
    "read_table": "gradloc_track.artifacts.table_store",
}
__all__ = list(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
