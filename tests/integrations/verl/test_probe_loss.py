"""``integrations/verl/probe_loss.py``: verl's own loss, through verl's own forward_step, is a sum
over the kept terms under every ``loss_agg_mode`` (values and gradients), and the full mask gives
exactly verl's micro-batch loss."""
from __future__ import annotations

import pytest

from .unit_worker import AGGS


@pytest.mark.parametrize("agg", AGGS)
def test_halves_add_up_to_verls_loss(verl_unit, agg):
    r = verl_unit["additivity"][agg]
    assert r["full"] == r["verl"]  # the probe with the full mask IS verl's forward_step + loss
    assert r["a"] + r["b"] == pytest.approx(r["full"], rel=1e-5, abs=1e-7)
    assert r["grad_rel"] < 1e-5  # gradients of the halves add up to the full one's

