"""The RL example: the stale-logprob response is detected and its tokens are named."""
from __future__ import annotations

import importlib.util

from gradloc_track.artifacts import read_table

from ..conftest import ROOT


def load_example():
    spec = importlib.util.spec_from_file_location("rl_grpo", ROOT / "examples" / "rl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stale_logprob_response_is_detected_and_localized(tmp_path):
    out = load_example().main(["--steps", "45", "--inject-step", "40", "--tracker", "none",
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
