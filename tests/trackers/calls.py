"""The same calls sent to every backend adapter, read back from what each wrote."""
from __future__ import annotations

import struct
from pathlib import Path

HTML = "<html><body><p style='color:red'>&lt;b&gt; culprit</p></body></html>"


def png(path: Path) -> Path:
    """A 1x1 PNG written by hand (no imaging dependency)."""
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")
    path.write_bytes(raw)
    return path


def exercise(tracker, tmp_path, events=3):
    tracker.log_params({"lr": 0.001, "model": {"d": 32}.__repr__(), "long": "x" * 9000, "bad key!": 1,
                        "unset": None})
    for step in range(5):
        tracker.log_metrics({"grad_norm/global": 1.0 + step, "grad_norm/h.0": 0.5 * step}, step)
    for e in range(events):
        tracker.log_table("spikes/tokens", ["step", "token", "grad_norm"], [[10 + e, f"t{e}", 1.5 * e],
                                                                           [10 + e, f"u{e}", 0.5]], 10 + e)
    tracker.log_html("spikes/highlight", HTML, 9 + events)
    tracker.log_image("spikes/heatmap", png(tmp_path / "h.png"), 9 + events)
    # what the artifact writer sends at each spike: the count as a metric at its step, and as a tag
    tracker.log_metrics({"spike_count": 3.0}, 9 + events)
    tracker.set_tags({"spike_count": "3"})
    tracker.set_tags({"spike_count": "2"})  # an older count arriving late (a replay): never lowers it
    tracker.finish("success")
