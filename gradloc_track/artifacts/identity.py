"""A sample's identity across runs: a fingerprint of the token ids its loss was taken on.

``sample_fingerprint(ids)`` is BLAKE2b with an 8-byte digest (``digest_size=8``: not BLAKE2b-512 cut to 8
bytes, which differs) over the ids written as decimal text joined by spaces, in hex (16 characters): the same
text, tokenized alike, gets the same id in any run, whatever its batch, position or padding. The culprit
table's ``sample_id`` is the fingerprint of the culprit's sample (or, in a packed row with ``document_ids``,
its document): its loss-bearing ids, i.e. ``input_ids`` where ``token_mask`` is set. For HF-style data that is
``[t for t in labels[1:] if t != -100]`` (the terms predict the next token), so a dataset's
records can be fingerprinted offline and matched against the table.
"""
from __future__ import annotations

import hashlib
import re
from typing import Iterable, Sequence

DIGEST_BYTES = 8  # 16 hex characters: collisions become likely only around 4e9 distinct samples
FINGERPRINT = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")  # what a sample id is (always fullmatch)


def sample_fingerprint(token_ids: Iterable[int]) -> str:
    """The sample id of a sequence of loss-bearing token ids (see the module doc)."""
    text = " ".join(str(int(t)) for t in token_ids)
    return hashlib.blake2b(text.encode("ascii"), digest_size=DIGEST_BYTES).hexdigest()


def row_fingerprint(ids: Sequence[int], mask: Sequence[float] | None, documents: Sequence[int] | None = None,
                    position: int | None = None) -> str:
    """The fingerprint of one row's loss-bearing ids; with a document map and a position, of the
    document holding that position only (a packed row holds several samples)."""
    keep = range(len(ids))
    if documents is not None and position is not None:
        doc = documents[position]
        keep = [p for p in keep if documents[p] == doc]
    return sample_fingerprint(ids[p] for p in keep if mask is None or mask[p])
