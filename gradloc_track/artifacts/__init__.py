"""Spike artifacts people can browse: attribution table, highlighted text, layer heatmap."""
from .heatmap import render_layer_heatmap
from .highlight import render_highlight_html
from .table import attribution_table
from .table_store import read_table
from .artifact_writer import SpikeArtifactWriter

__all__ = ["attribution_table", "render_highlight_html", "render_layer_heatmap", "SpikeArtifactWriter", "read_table"]
