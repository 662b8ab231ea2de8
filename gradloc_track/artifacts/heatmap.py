"""Per-layer picture of a spike: tokens (around the culprits) x layers, log colour scale."""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from ..locate.result import LocateResult
from .table import decode_token


def render_layer_heatmap(result: LocateResult, ctx: Any, sample: int, path: str | Path, window: int = 24) -> Path | None:
    """Write a PNG heatmap of ``result.layer_map`` for one sample; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
    except ImportError:
        warnings.warn("gradloc-track: matplotlib is not installed, so no heatmap image is written; "
                      "pip install 'gradloc-track[plots]'")
        return None
    if result.layer_map is None or not result.layer_names:
        return None
    culprit_pos = [c.position for c in result.tokens if c.batch == sample] or [0]
    T = result.layer_map.shape[2]
    lo, hi = max(0, min(culprit_pos) - window), min(T, max(culprit_pos) + window + 1)
    data = result.layer_map[:, sample, lo:hi].clamp_min(1e-12).numpy()  # (L, W)
    labels = ["".join(ch if 32 <= ord(ch) < 127 or ord(ch) > 160 else f"\\x{ord(ch):02x}"
                      for ch in decode_token(getattr(ctx, "tokenizer", None), int(ctx.input_ids[sample, p])))
              for p in range(lo, hi)]
    fig, ax = plt.subplots(figsize=(max(6, 0.28 * (hi - lo)), 0.45 * len(result.layer_names) + 1.6), dpi=100)
    im = ax.imshow(data, aspect="auto", cmap="magma", norm=LogNorm(vmin=max(data.min(), data.max() * 1e-6),
                                                                      vmax=data.max()))
    ax.set_yticks(range(len(result.layer_names)), result.layer_names, fontsize=8)
    ax.set_xticks(range(hi - lo), labels, fontsize=7, rotation=90, family="monospace")
    for p in culprit_pos:
        if lo <= p < hi:
            ax.axvline(p - lo, color="cyan", lw=0.8, ls="--")
    ax.set_title(f"per-layer gradient contribution, sample {sample} (positions {lo}-{hi - 1})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.025, label="ghost norm")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
