"""The demo's data path: which samples a batch holds, and leaving out those a blocklist or the
quarantine names.

Every sample of the demo carries ``dataset_index`` (its place in the run's data stream:
``(step * world + rank) * batch_size + row``, the same for the same seed and batch layout) and
``source`` (``corpus``, or ``injected:<kind>`` for the injected outlier), as per-sample columns of
the culprit table. Its fingerprint (``sample_id``) is that of its loss-bearing ids: the targets
where the mask is set.

``SampleGate.apply`` fingerprints each sample of a batch (only when a blocklist or the quarantine
is on) and replaces a listed one, in place, by a fresh corpus window (the batch keeps its shape),
counting ``blocklist_dropped`` / ``quarantine_skipped``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..artifacts.identity import sample_fingerprint
from ..data import Blocklist, Quarantine

MAX_TRIES = 8  # replacement windows tried per left-out sample (each one is checked too)


@dataclass
class SampleGate:
    """Leaves out samples of ``blocklist`` (across runs) and of ``quarantine`` (this run)."""

    blocklist: Blocklist | None = None
    quarantine: Quarantine | None = None
    blocklist_dropped: int = 0
    left_out: list[tuple[int, int, str, str]] = field(default_factory=list)  # (step, row, fingerprint, why)

    @property
    def active(self) -> bool:
        return self.blocklist is not None or self.quarantine is not None

    def why(self, fp: str, step: int) -> str | None:
        """``blocklist`` / ``quarantine`` when the sample must go; None when it may train."""
        if self.blocklist is not None and self.blocklist.blocks(fingerprint=fp):
            self.blocklist_dropped += 1
            return "blocklist"
        if self.quarantine is not None and not self.quarantine.admit(fp, step):
            return "quarantine"
        return None

    def apply(self, step: int, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, source: list[str],
              refill: Callable[[int, int], torch.Tensor]) -> list[tuple[int, str, str]]:
        """Replace left-out samples of the batch in place (x, y, mask: (B, T)); ``refill(row, attempt)``
        gives a (T+1,) window. Returns (row, fingerprint, why) per sample left out."""
        if not self.active:
            return []
        out = []
        for b in range(x.shape[0]):
            for attempt in range(MAX_TRIES + 1):  # the sample, then each replacement, every one checked
                # host sync: the ids of one sample, only when a blocklist or the quarantine is on
                fp = sample_fingerprint(y[b][mask[b] > 0].tolist())
                why = self.why(fp, step)
                if why is None:
                    break
                if attempt == MAX_TRIES:
                    raise RuntimeError(f"step {step}, row {b}: the {why} left out {MAX_TRIES + 1} windows in a row; "
                                       f"it blocks most of the corpus. Check data.blocklist (or turn "
                                       "spikes.quarantine off)")
                out.append((b, fp, why))
                self.left_out.append((step, b, fp, why))
                window = refill(b, attempt).to(x.device)  # (T+1,)
                x[b], y[b] = window[:-1], window[1:]
                mask[b] = 1.0
                source[b] = "corpus"
        return out

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {}
        if self.blocklist is not None:
            m["data/blocklist_dropped"] = float(self.blocklist_dropped)
        if self.quarantine is not None:
            m["data/quarantine_skipped"] = float(self.quarantine.skipped)
        return m


def sample_columns(step: int, rank: int, world: int, batch_size: int, source: list[str]) -> dict[str, Any]:
    """The culprit table's per-sample columns for the demo: ``dataset_index`` and ``source``."""
    first = (step * world + rank) * batch_size
    return {"dataset_index": torch.arange(first, first + batch_size), "source": list(source)}
