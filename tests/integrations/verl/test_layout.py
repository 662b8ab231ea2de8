"""``integrations/verl/layout.py``: the localizer's grid is verl's model call, checked against verl."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("packed", ["False", "True"])
def test_each_term_sits_where_verl_scores_its_token(verl_unit, packed):
    lay = verl_unit["layout"][packed]
    assert lay["scored_is_response"]  # the position before response token j scores token j
    assert lay["display_is_response"]  # and shows it
    assert lay["segments_response"]
    assert lay["mask_terms"] == lay["response_terms"]
    assert lay["cut_every_other"]  # narrowing touches exactly the kept terms


def test_the_grid_is_the_model_call(verl_unit):
    rows, packed = verl_unit["layout"]["False"], verl_unit["layout"]["True"]
    assert rows["shape"][0] == 2 and packed["shape"][0] == 1  # (B, L) padded rows | one packed row
    assert rows["logprob_at_term"]  # the padded call's log-probs, at the terms, are verl's sliced ones
    assert rows["docs"] is None and packed["docs"] == packed["rows"]  # packed: each sample a document
