"""The RL example: the stale-logprob response is detected and its tokens are named."""
from __future__ import annotations

from gradloc_track.artifacts import read_table

from .load import load_example


def test_stale_logprob_response_is_detected_and_localized(tmp_path):
    out = load_example("rl_grpo").main(["--steps", "45", "--inject-step", "40", "--tracker", "none",
                               "--out-dir", str(tmp_path), "--threads", "1"])
    inj = out["injected"]
    assert inj["step"] == 40 and 40 in out["events_at"]
    culprits = out["localized"][40]
    assert culprits, "the localizer named no token at the injected step"
    assert all(b == inj["sample"] and p in inj["positions"] for b, p in culprits)
    table = read_table(tmp_path, "spikes/tokens")
    cols = table["columns"]
    assert {"advantage", "ratio", "logprob", "reward"} <= set(cols)
    rows = [dict(zip(cols, r)) for r in table["data"] if r[0] == 40]
    assert all(r["ratio"] > 100 for r in rows)  # the e^6 importance ratio is what the table shows
    events = read_table(tmp_path, "spikes/events")
    cause = [dict(zip(events["columns"], r)) for r in events["data"] if r[0] == 40][0]
    # issue 37: the culprit's importance ratio carries the step, so the cause is off_policy, not data
    assert cause["cause"] == "off_policy" and "importance ratio of" in cause["cause_detail"]
