"""``demo/gate``: the demo's sample gate replaces, in place, exactly the rows whose loss-bearing ids
(fingerprinted by hand here: BLAKE2b-8 of the masked targets) a blocklist or the quarantine names,
counts them, and the per-sample columns follow the documented ``dataset_index`` formula."""
from __future__ import annotations

import pytest

import hashlib

import torch

from gradloc_track.data import Blocklist, Quarantine
from gradloc_track.demo.gate import MAX_TRIES, SampleGate, sample_columns


def fp(ids) -> str:
    return hashlib.blake2b(" ".join(str(int(t)) for t in ids).encode(), digest_size=8).hexdigest()


def batch():
    """3 rows of 4 tokens; row 1 masks its first target (a prompt)."""
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    y = x + 1
    mask = torch.ones(3, 4)
    mask[1, 0] = 0.0
    return x, y, mask, ["corpus", "injected:garbled", "corpus"]


def window(start: int) -> torch.Tensor:
    return torch.arange(start, start + 5)  # (T+1,)


def test_an_inactive_gate_touches_nothing():
    gate = SampleGate()
    x, y, mask, source = batch()
    assert not gate.active and gate.apply(0, x, y, mask, source, lambda b, k: 1 / 0) == []
    assert torch.equal(x, batch()[0]) and gate.metrics() == {}


def test_a_blocklisted_row_is_replaced_in_place_and_counted():
    row1 = fp([7, 8, 9])  # row 1's targets where the mask is set
    gate = SampleGate(blocklist=Blocklist(fingerprints=frozenset({row1})))
    x, y, mask, source = batch()
    calls = []
    out = gate.apply(4, x, y, mask, source, lambda b, k: calls.append((b, k)) or window(100))
    assert out == [(1, row1, "blocklist")] and calls == [(1, 0)]
    assert x[1].tolist() == [100, 101, 102, 103] and y[1].tolist() == [101, 102, 103, 104]
    assert mask[1].tolist() == [1.0] * 4 and source == ["corpus", "corpus", "corpus"]
    x0, y0, _, _ = batch()
    assert torch.equal(x[[0, 2]], x0[[0, 2]]) and torch.equal(y[[0, 2]], y0[[0, 2]])  # the others untouched
    assert gate.left_out == [(4, 1, row1, "blocklist")]
    assert gate.metrics() == {"data/blocklist_dropped": 1.0}


def test_a_replacement_is_checked_too():
    row0, first_refill = fp([2, 3, 4, 5]), fp([51, 52, 53, 54])
    gate = SampleGate(blocklist=Blocklist(fingerprints=frozenset({row0, first_refill})))
    x, y, mask, source = batch()
    out = gate.apply(0, x, y, mask, source, lambda b, k: window(50 + 10 * k))
    assert out == [(0, row0, "blocklist"), (0, first_refill, "blocklist")]
    assert x[0].tolist() == [60, 61, 62, 63] and gate.blocklist_dropped == 2


def test_the_gate_gives_up_after_max_tries_replacements_and_never_trains_a_listed_sample():
    """Bounded on a hostile blocklist, and the last replacement is checked too: a listed sample
    never reaches training (it stops with an error naming the setting instead)."""
    refills = []
    gate = SampleGate(blocklist=Blocklist(fingerprints=frozenset({fp([2, 3, 4, 5])} | {
        fp(range(1 + 10 * k, 5 + 10 * k)) for k in range(20)})))
    x, y, mask, source = batch()
    with pytest.raises(RuntimeError, match="data.blocklist"):
        gate.apply(0, x, y, mask, source, lambda b, k: refills.append(k) or window(10 * k))
    assert refills == list(range(MAX_TRIES))


def test_the_last_replacement_is_admitted_when_it_is_clean():
    listed = {fp([2, 3, 4, 5])} | {fp(range(1 + 10 * k, 5 + 10 * k)) for k in range(MAX_TRIES - 1)}
    gate = SampleGate(blocklist=Blocklist(fingerprints=frozenset(listed)))
    x, y, mask, source = batch()
    out = gate.apply(0, x, y, mask, source, lambda b, k: window(10 * k))
    assert len(out) == MAX_TRIES and fp(y[0].tolist()) not in listed


def test_the_quarantine_skips_a_sample_blamed_earlier_in_the_run():
    q = Quarantine()
    row2 = fp([10, 11, 12, 13])
    q.blamed[row2] = 3
    gate = SampleGate(quarantine=q)
    x, y, mask, source = batch()
    out = gate.apply(9, x, y, mask, source, lambda b, k: window(0))
    assert out == [(2, row2, "quarantine")] and x[2].tolist() == [0, 1, 2, 3]
    assert gate.metrics() == {"data/quarantine_skipped": 1.0}


def test_the_blocklist_is_asked_before_the_quarantine():
    row0 = fp([2, 3, 4, 5])
    q = Quarantine()
    q.blamed[row0] = 0
    gate = SampleGate(Blocklist(fingerprints=frozenset({row0})), q)
    x, y, mask, source = batch()
    assert gate.apply(1, x, y, mask, source, lambda b, k: window(0))[0] == (0, row0, "blocklist")
    assert q.skipped == 0 and gate.metrics() == {"data/blocklist_dropped": 1.0, "data/quarantine_skipped": 0.0}


def test_sample_columns_follow_the_documented_stream_positions():
    cols = sample_columns(step=3, rank=1, world=2, batch_size=4, source=["corpus"] * 3 + ["injected:x"])
    first = (3 * 2 + 1) * 4  # (step * world + rank) * batch_size
    assert cols["dataset_index"].tolist() == [first, first + 1, first + 2, first + 3] == [28, 29, 30, 31]
    assert cols["source"] == ["corpus"] * 3 + ["injected:x"]
    per_rank = [sample_columns(s, r, 2, 4, ["c"] * 4)["dataset_index"].tolist() for s in range(2) for r in range(2)]
    assert sum(per_rank, []) == list(range(16))  # every position of the stream once, in order
