"""Realistic data outliers injected at a known step (the spike demos).

``garbled_span`` (the spike demo's default): one sample of the batch is replaced by an
instruction-tuning pair whose answer is garbled: ordinary prose as the prompt (no loss, as SFT
masks prompts) and an answer that is nothing but mojibake (``â€™``, a curly apostrophe decoded
with the wrong charset; repeated to fill ``span`` tokens), then padding. Under per-sample loss
averaging (``train.loss_norm=sample``, the SFT default of many trainers) each of the answer's
few loss tokens weighs ``T / span`` times a normal token, and characters the model never saw
have near-zero probability: the global grad norm jumps ~3x, pinned on the mojibake.
``short_garbage_doc``: a nearly empty document — ``span`` bytes of garbage, the rest padding.
``corrupt_span``: garbage inside an otherwise normal sequence (token-mean loss: usually *not* a
spike — useful to see that the detector stays quiet).
"""
from __future__ import annotations

import torch

PAD_ID = 0  # byte 0 never occurs in the text corpus; the BPE's <pad> is its first special token, id 0 too
INJECT_KINDS = ("garbled_span", "short_garbage_doc", "corrupt_span")
PROSE_TOKENS = 40  # prose (the prompt) kept before the junk answer in ``garbled_span``


def max_span(kind: str, seq_len: int) -> int:
    """The most loss tokens ``kind`` can corrupt in a row of ``seq_len``: ``garbled_span`` keeps at
    least one token of prose and the answer's first target; ``corrupt_span`` starts mid-row."""
    if kind == "garbled_span":
        return seq_len - 2
    if kind == "corrupt_span":
        return seq_len - seq_len // 2
    return seq_len - 1


def inject(kind: str, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sample: int, span: int,
           seed: int = 1234, junk_ids: list[int] | None = None) -> list[int]:
    """Corrupt ``sample`` of the batch in place; returns the positions of the corrupted loss terms.

    x, y: (B, T) inputs and targets; mask: (B, T) float loss mask. ``junk_ids``: the tokens of
    the repeated junk (``garbled_span`` only); ``seed``: the random garbage of the other kinds.
    Padding is ``PAD_ID`` (both demo tokenizers' id 0).
    """
    B, T = x.shape
    if not 0 <= sample < B:
        raise ValueError(f"train.inject.sample={sample} is outside the batch (batch_size={B})")
    if not 1 <= span <= max_span(kind, T):
        raise ValueError(f"train.inject.span={span} does not fit train.seq_len={T}: use 1 to {max_span(kind, T)}")
    if kind == "garbled_span":
        if not junk_ids:
            raise ValueError("train.inject.text encodes to no tokens: use a non-empty string such as '&nbsp;'")
        prose = min(PROSE_TOKENS, T - span - 1)  # >= 1 (max_span)
        row = torch.full((T + 1,), PAD_ID, dtype=x.dtype)  # (T+1,) the new document, padded
        row[:prose + 1] = torch.cat([x[sample, :prose], y[sample, prose - 1: prose]])
        junk = torch.tensor(junk_ids, dtype=x.dtype).repeat(span // len(junk_ids) + 1)[:span]
        row[prose + 1: prose + 1 + span] = junk
        x[sample], y[sample] = row[:-1], row[1:]
        mask[sample].zero_()
        mask[sample, prose: prose + span] = 1.0  # the prose is the prompt: no loss, as SFT masks prompts
        return list(range(prose, prose + span))  # targets are the junk tokens
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randint(0xC0, 0x100, (span + 1,), generator=g)  # bytes never seen in ASCII text
    if kind == "short_garbage_doc":
        x[sample].fill_(PAD_ID)
        y[sample].fill_(PAD_ID)
        mask[sample].zero_()
        x[sample, : span] = garbage[:span]
        y[sample, : span] = garbage[1: span + 1]
        mask[sample, : span] = 1.0
        return list(range(span))
    if kind == "corrupt_span":
        start = T // 2
        x[sample, start: start + span] = garbage[:span]
        y[sample, start: start + span] = garbage[1: span + 1]
        return list(range(start, start + span))
    raise ValueError(f"train.inject.kind={kind!r} is unknown: use one of {', '.join(INJECT_KINDS)}")
