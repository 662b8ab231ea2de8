"""Offline text data for the demos: a byte-level tokenizer and a corpus every Python has.

The default corpus is CPython's own bundled documentation (``pydoc_data.topics``): ~1 MB of
English prose that ships with the interpreter, so the demo never needs the network.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..text import ByteDecoder


class ByteTokenizer(ByteDecoder):
    """UTF-8 bytes as tokens (vocab 256): ``text.ByteDecoder``, whose ``decode`` shows a byte that is no
    character as ``\\xNN`` (every byte stays visible), also taking one id; the junk signal's clean-text check
    reads such a tokenizer's ids as bytes itself (it once read the demo's ``\\xNN`` escapes as clean ASCII)."""

    def decode(self, ids, **kwargs) -> str:
        return super().decode([ids] if isinstance(ids, int) else ids, **kwargs)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.decode([int(i)]) for i in ids]

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def load_corpus(path: str | None = None) -> str:
    """The text of ``path``, or the built-in offline corpus."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class TextBatches:
    """Deterministic random windows of a token stream: ``batch(step) -> (B, T+1) LongTensor``."""

    def __init__(self, text: str, seq_len: int, batch_size: int, seed: int = 0,
                 tokenizer: ByteTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.data = torch.tensor(self.tokenizer.encode(text), dtype=torch.long)
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"corpus has {len(self.data)} tokens; need more than train.seq_len+1={seq_len + 1}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=g)
        return torch.stack([self.data[s: s + self.seq_len + 1] for s in starts.tolist()])  # (B, T+1)

    def replacement(self, step: int, row: int, attempt: int = 0) -> torch.Tensor:
        """A fresh window for sample ``row`` of ``step`` when the data path leaves its own out
        (a blocklist, the quarantine): deterministic, independent of ``batch(step)``. (T+1,)"""
        g = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 4099 + row) * 131 + attempt + 1)
        start = int(torch.randint(0, len(self.data) - self.seq_len - 1, (1,), generator=g))
        return self.data[start: start + self.seq_len + 1]
