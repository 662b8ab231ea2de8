"""result: the share floor (rows that are not culprits), shares kept in [0, 1] by scaling when the rest of
the step points against the culprits, the one order every search lists its rows in, and the result's dict
form carrying every row and finding."""
from __future__ import annotations

import pytest

from gradloc_track.localizer.nonfinite import NonfiniteFinding
from gradloc_track.localizer.result import SHARE_FLOOR, Culprit, CulpritToken, LocateResult, floor_rows, ranked_rows


def test_rows_under_the_floor_are_not_culprits_and_say_so():
    doc = Culprit("sample", 3.0, share=0.90, batch=2, start=0, end=10, n_terms=9)
    tok = CulpritToken(batch=0, position=4, grad_norm=0.4, share=0.04)  # 1/22 of the document: under 0.05x
    neg = CulpritToken(batch=1, position=1, grad_norm=0.1, share=-0.013)
    unknown = CulpritToken(batch=1, position=2, grad_norm=0.2)  # a ghost estimate: no share, kept as it is
    kept, below, notes = floor_rows([doc, tok, neg, unknown])
    assert kept == [doc, unknown] and below == [tok, neg]
    assert len(notes) == 1 and "2 row(s) found under the share floor (0.045" in notes[0]
    assert doc.share == 0.90 and doc.raw_share is None  # under 1: shown as it is


def test_the_absolute_floor_holds_when_every_row_is_small():
    rows = [CulpritToken(batch=0, position=p, grad_norm=1.0, share=s) for p, s in enumerate([0.004, SHARE_FLOOR / 2])]
    kept, below, _ = floor_rows(rows)
    assert [r.position for r in kept] == [0] and [r.position for r in below] == [1]


def test_culprits_that_explain_more_than_the_step_are_scaled_to_one_with_the_exact_values_kept():
    a = Culprit("sample", 2.0, share=1.008, batch=0)
    b = CulpritToken(batch=1, position=3, grad_norm=0.5, share=0.1)
    kept, below, notes = floor_rows([a, b])
    assert below == [] and sum(r.share for r in kept) == pytest.approx(1.0)
    assert (a.raw_share, b.raw_share) == (1.008, 0.1) and a.share == pytest.approx(1.008 / 1.108)
    assert "sum to 1.108; shown scaled to sum to 1 (exact in raw_share)" in notes[0]



def test_every_search_lists_its_rows_in_one_order_whatever_order_it_found_them_in():
    """Samples by share, then tokens by norm with ties by rank, micro-batch, row and position (one process and
    several once listed tied tokens differently: the driver kept discovery order), then the rows named for their
    data; a budget that ran out is said."""
    tied = [CulpritToken(batch=b, position=p, grad_norm=0.5, share=0.05, micro_batch=m, rank=r)
            for r, m, b, p in [(1, 0, 0, 2), (0, 1, 0, 0), (0, 0, 3, 1), (0, 0, 3, 0), (None, None, 0, 9)]]
    top = CulpritToken(batch=5, position=5, grad_norm=0.9, share=0.1)
    docs = [Culprit("sample", 1.0, share=s, batch=b) for b, s in [(1, 0.2), (2, None), (3, 0.3)]]
    flagged = [Culprit("sample", 0.01, share=0.001, batch=7)]
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        culprits, below, notes = ranked_rows(docs, [tied[i] for i in order] + [top], flagged, budget=None)
        assert below == [] and notes == []
        assert [c.batch for c in culprits[:3]] == [3, 1, 2]  # by share, no share last
        assert culprits[3] is top
        assert [(c.rank, c.micro_batch, c.batch, c.position) for c in culprits[4:9]] == [
            (None, None, 0, 9), (0, 0, 3, 0), (0, 0, 3, 1), (0, 1, 0, 0), (1, 0, 0, 2)]
        assert culprits[9:] == flagged
    _, _, notes = ranked_rows([], [top], [], budget=12)
    assert notes == ["the probe budget (12) ran out: the culprits listed are those confirmed so far; more may "
                     "carry the spike (raise locate.budget)"]
    assert "before any sample, span or token was confirmed" in ranked_rows([], [], [], budget=12)[2][0]


def test_the_dict_form_holds_rows_below_the_floor_and_the_non_finite_finding():
    bad = Culprit("sample", float("nan"), batch=3, nonfinite=True)
    low = CulpritToken(batch=0, position=1, grad_norm=0.1, share=0.0004)
    finding = NonfiniteFinding("samples", (3,), ((3, 5),), "sample 3's loss is Inf (token 5): its gradient is NaN")
    result = LocateResult([], probes=4, method="auto", threshold=1.0, total_norm=float("nan"), culprits=[bad],
                          below_floor=[low], nonfinite=finding)
    d = result.as_dict()
    assert d["culprits"][0]["nonfinite"] is True and d["culprits"][0]["share"] is None
    assert d["below_floor"][0]["share"] == 0.0004 and d["below_floor"][0]["level"] == "token"
    assert d["nonfinite"] == {"where": "samples", "samples": [3], "terms": [[3, 5]], "detail": finding.detail}
