"""Quarantine within one run: a sample blamed for a spike is skipped when it comes again.

Opt-in (``spikes.quarantine=true``). The monitor finds the culprits; only the data path can leave
a sample out, so the skip happens where the batch is made: after a spike, ``blame(step, result,
ctx)`` records the culprits' fingerprints; the loader then asks ``admit(fingerprint, step)`` per
sample (or wraps its stream in ``BlockedIterableDataset(stream, quarantine)``). Each skip is
counted and reported to ``on_skip``.

What it cannot do: the step that blamed the sample has already trained on it (that is what the
clipper is for); it only knows samples blamed in THIS run (``state_dict``, inside the handle's, carries
them across a resume; no memory across runs: a ledger's blocklist is that); it matches content, so a
sample that comes back altered (another truncation, other padding in its loss terms) is a new sample.
"""
from __future__ import annotations

from typing import Any, Callable

from ..artifacts.identity import row_fingerprint

OnSkip = Callable[[str, "int | None", int], None]  # (fingerprint, step now, step it was blamed at)


def _lists(t: Any) -> Any:
    """A tensor (or a sequence of them) as nested lists: one host sync per tensor, once per event."""
    if isinstance(t, (list, tuple)):
        return [_lists(x) for x in t]
    return t.tolist() if hasattr(t, "tolist") else t


class Quarantine:
    """Fingerprints of this run's blamed samples; ``admit`` says no to them and counts it."""

    def __init__(self, on_skip: OnSkip | None = None) -> None:
        self.blamed: dict[str, int] = {}  # fingerprint -> step it was first blamed at
        self.skipped = 0
        self.on_skip = on_skip

    def blame(self, step: int, result: Any, ctx: Any, rank: int | None = None) -> list[str]:
        """Record the culprit samples of one localized spike (``result`` with its ``ctx``); returns
        their fingerprints. From the monitor pass ``*stats.blamed_rows`` (under torch.distributed every
        rank's culprits, on every rank; None when the step's rows are not the data's fault: blame nothing),
        or ``(stats.locate, ctx)`` with ``rank``: its result lists every rank's culprits but ``ctx`` holds
        this rank's batch only."""
        if result is None or ctx is None or getattr(ctx, "input_ids", None) is None:
            return []
        per_mb = isinstance(ctx.input_ids, (list, tuple))  # K micro-batches of (B, T), as the table reads them
        ids, mask = _lists(ctx.input_ids), _lists(getattr(ctx, "token_mask", None))
        docs = _lists(getattr(ctx, "document_ids", None))
        found = []
        for c in result.culprits:
            if c.batch is None or (rank is not None and c.rank not in (None, rank)):
                continue
            pick = (lambda v: v[c.micro_batch]) if per_mb and c.micro_batch is not None else (lambda v: v)
            fp = row_fingerprint(pick(ids)[c.batch], None if mask is None else pick(mask)[c.batch],
                                 None if docs is None else pick(docs)[c.batch], c.start)
            self.blamed.setdefault(fp, step)
            found.append(fp)
        return sorted(set(found))

    def blocks(self, fingerprint: str | None = None, index: Any = None) -> bool:
        """The ``Blocklist`` question (for ``BlockedIterableDataset``): blamed earlier in this run?"""
        return fingerprint is not None and fingerprint in self.blamed

    def admit(self, fingerprint: str, step: int | None = None) -> bool:
        """False (and one skip counted, ``on_skip`` told) for a sample blamed earlier in this run."""
        if fingerprint not in self.blamed:
            return True
        self.skipped += 1
        if self.on_skip is not None:
            self.on_skip(fingerprint, step, self.blamed[fingerprint])
        return False

    def __len__(self) -> int:
        return len(self.blamed)

    def state_dict(self) -> dict[str, Any]:
        """The blamed samples and the skip count, for a resumed run to keep skipping them (held-out tester,
        stop 55: a resume forgot them, and the blamed sample trained again)."""
        return {"blamed": dict(self.blamed), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.blamed = {str(fp): int(step) for fp, step in state.get("blamed", {}).items()}
        self.skipped = int(state.get("skipped", 0))


def logging_quarantine(tracker: Any = None) -> Quarantine:
    """A quarantine that logs its skips: one warning, at the first (a warning per skip would be one
    per sample of every later epoch, each message kept by the warnings registry: 100k skips were
    +87 MB), and ``data/quarantine_skipped`` (the running count) to ``tracker`` at each step the
    data path names (``watch(..., spikes={"quarantine": True})``)."""
    import warnings

    q = Quarantine()
    said = [False]  # this process's first skip is said (a resumed run's count starts where the saved one was)

    def on_skip(fp: str, step: int | None, blamed_at: int) -> None:
        if not said[0]:  # the later skips are counted in the metric, not said
            said[0] = True
            warnings.warn(f"gradloc-track: quarantine: skipped sample {fp} (blamed for the spike at step {blamed_at})"
                          + (f" at step {step}" if step is not None else ""), RuntimeWarning)
        if tracker is not None and step is not None:
            tracker.log_metrics({"data/quarantine_skipped": float(q.skipped)}, step)

    q.on_skip = on_skip
    return q
