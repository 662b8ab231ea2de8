"""The attribution table: one row per culprit at its level (token, span, sample, micro-batch) with the
unit's text, the most useful columns first, ids when there is no tokenizer."""
from __future__ import annotations

import pytest

from gradloc_track.artifacts import attribution_table, render_highlight_html

from .cases import DOC, HOSTILE, T_LEVELS, TEXT, T, levels_case, make_case


def test_table_rows_describe_the_culprits(spike):
    events, result, ctx = spike
    cols, rows = attribution_table(7, events, result, ctx)
    assert cols[:12] == ["step", "level", "token", "share", "grad_norm", "sample", "position", "end", "top_layers",
                         "signal", "z", "token_id"]  # the most useful first
    assert cols[-2:] == ["advantage", "reward"]
    (row,) = rows
    r = dict(zip(cols, row))
    assert (r["step"], r["sample"], r["position"], r["token_id"], r["token"]) == (7, 2, 30, 200, HOSTILE)
    assert r["grad_norm"] == pytest.approx(result.tokens[0].grad_norm)
    assert 0.5 < r["share"] <= 1.0
    assert r["advantage"] == 2 * T + 30 and r["reward"] == 0.5
    assert r["signal"] == "global" and r["z"] == 9.5
    assert r["top_layers"].count(":") == 3


def test_a_row_says_whether_the_steps_data_made_it(spike):
    """``data_fault``: from the step's events (``monitor.outcome.data_fault``), None when the caller did not say."""
    import dataclasses

    events, result, ctx = spike
    for fault in (True, False, None):
        cols, rows = attribution_table(7, [dataclasses.replace(e, data_fault=fault) for e in events], result, ctx)
        assert dict(zip(cols, rows[0]))["data_fault"] is fault
    # a numeric step: only its non-finite rows are the data's fault (this finite row beside them is not)
    cols, rows = attribution_table(7, [dataclasses.replace(e, cause="numeric", data_fault=True) for e in events],
                                   result, ctx)
    assert dict(zip(cols, rows[0]))["data_fault"] is False and not result.culprits[0].nonfinite


def test_without_tokenizer_ids_are_shown_escaped():
    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    ctx.tokenizer = None
    cols, rows = attribution_table(12, events, result, ctx)
    tid = int(ctx.input_ids[0, 3])
    assert dict(zip(cols, rows[0]))["token"] == f"<{tid}>"
    assert f"&lt;{tid}&gt;" in render_highlight_html(12, events, result, ctx)


def test_table_has_a_row_per_culprit_at_its_level_with_the_units_text():
    events, result, ctx = levels_case()
    cols, rows = attribution_table(12, events, result, ctx)
    assert cols[:3] == ["step", "level", "micro_batch"] and "end" in cols and cols[-1] == "reward"
    got = [dict(zip(cols, r)) for r in rows]
    assert [(r["level"], r["micro_batch"], r["sample"], r["position"], r["end"]) for r in got] == [
        ("sample", 1, 1, 0, T_LEVELS), ("micro_batch", 2, None, None, None), ("token", 0, 0, 4, 5),
        ("token", 0, 0, 5, 6)]
    doc, mb, tok = got[0], got[1], got[2]
    assert doc["token"] == DOC[: T_LEVELS - 1].decode() and doc["token_id"] is None  # its loss terms' text
    assert doc["share"] == 0.6 and doc["reward"] == 1.0 and doc["top_layers"].startswith("h.0:")
    assert mb["token"] == "" and mb["reward"] is None
    assert tok["token"] == chr(TEXT[4]) and tok["token_id"] == TEXT[4] and tok["reward"] == 0.0
