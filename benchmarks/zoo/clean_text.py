"""What the clean steps that fired were made of: the text of their largest-loss sample (``--events``).

A clean twin's batch is rebuilt from the family's stream (the same seed and step give the same
batch), and the sample whose recorded loss is the largest is shown, decoded, with the signals that
fired: the held-out zoo's false events, in words, for whoever tunes the detector on ``dev``.
"""
from __future__ import annotations

from .record import RunRecord


def stream_of(r: RunRecord):
    """(the run's batch stream, a decoder of token ids) as the family built them."""
    import torch

    if r.family in ("loop", "loop64"):
        from .loop import LoopSetting
        from .sources import text
        from .streams import Windows

        s = LoopSetting.of(r.family, r.source, False)
        ids = torch.tensor(list(text(s.source).encode("utf-8")), dtype=torch.long)
        return Windows(ids, s.seq_len, s.batch, r.seed), lambda t: bytes(t.tolist()).decode("utf-8", "replace")
    from .trainer import TrainerSetting, make_data

    data = make_data(TrainerSetting.of(r.family, r.source, False), r.seed)
    return data.stream, data.tok.decode


def describe(r: RunRecord, width: int = 160) -> list[str]:
    """One line per event of a clean run: step, signals, the largest-loss sample's text."""
    if not any(s.fired for s in r.steps) or r.family == "grpo":
        return []
    stream, decode = stream_of(r)
    out = []
    for s in r.steps:
        if not s.fired:
            continue
        b = stream.clean(s.step)
        k = max(range(len(s.sample_losses or [0])), key=lambda i: (s.sample_losses or [0])[i])
        shown = decode(b.y[k][b.mask[k] > 0])
        out.append(f"{r.family} {r.source} seed {r.seed} step {s.step} [{', '.join(s.fired)}] cause {s.cause}: "
                   f"sample {k}: {shown[:width]!r}")
    return out
