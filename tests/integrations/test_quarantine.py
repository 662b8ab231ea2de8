"""``watch(..., spikes={"quarantine": True})``: the handle records each spike's culprit samples;
a data path that asks ``handle.quarantine.admit`` skips the garbage document when it comes again
(the next epoch), the skip is warned and logged, and that step does not spike."""
from __future__ import annotations

import warnings

import torch

import gradloc_track
from gradloc_track import MemoryTracker
from gradloc_track.data import record_fingerprint

from .conftest import BATCH, CORRUPT, FAST, INJECT_AT, LR, counting_batch, tiny_gpt2
from .test_sample_identity import garbage_id

AGAIN = INJECT_AT + 3  # the document comes back (a second epoch, a replay buffer)


def admitted(handle, batch: dict, step: int, index: int) -> dict:
    """The data path: every row the quarantine refuses is replaced by a clean one."""
    for b in range(batch["labels"].shape[0]):
        row = {k: v[b] for k, v in batch.items()}
        if not handle.quarantine.admit(record_fingerprint(row), step):
            clean = counting_batch(10_000 + index, 1)
            for k in batch:
                batch[k][b] = clean[k][0]
    return batch


def test_watch_quarantine_skips_the_blamed_document_when_it_comes_again():
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tracker = MemoryTracker()
    handle = gradloc_track.watch(model, opt, tracker=tracker, **{**FAST, "spikes": {**FAST["spikes"],
                                                                                    "quarantine": True}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(AGAIN + 3):
            bad = CORRUPT if step in (INJECT_AT, AGAIN) else None
            batch = admitted(handle, counting_batch(step, BATCH, bad), step, step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    handle.finish()
    assert [s.step for s in handle.spikes] == [INJECT_AT]  # blamed once; skipped, not trained on, at AGAIN
    assert handle.quarantine.blamed == {garbage_id(): INJECT_AT} and handle.quarantine.skipped == 1
    said = [str(w.message) for w in caught if "quarantine" in str(w.message)]
    assert said == [f"gradloc-track: quarantine: skipped sample {garbage_id()} (blamed for the spike at step "
                    f"{INJECT_AT}) at step {AGAIN}"]
    logged = [(s, m["data/quarantine_skipped"]) for s, m in tracker.metrics if "data/quarantine_skipped" in m]
    assert logged == [(AGAIN, 1.0)]
