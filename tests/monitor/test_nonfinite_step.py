"""A NaN step through the monitor: detected, skipped exactly (AdamW's weights and state bitwise), and
the sample that made it NaN named in the culprit table, the console's spike block, the ledger
(``gradloc-track culprits``, its blocklist) and the quarantine."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from gradloc_track import GradMonitor
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.artifacts.table_store import read_table
from gradloc_track.clip import GlobalClip
from gradloc_track.console.block import spike_block
from gradloc_track.console.culprits import SpikeView
from gradloc_track.data.quarantine import Quarantine
from gradloc_track.demo.model import TinyGPT
from gradloc_track.ledger import command
from gradloc_track.spikes import SpikeContext, SpikeDetector
from gradloc_track.trackers.local_tracker import LocalTracker

from ..clip.helpers import assert_bitwise_equal, snapshot
from ..ledger.test_command import parser

V, B, T, BAD = 32, 8, 8, (3, 5)


def step_batch(model, step: int, nan: bool):
    """(loss_fn, mask, input ids): sample 3's token 5 gets probability 0 at the NaN step (its
    ``-log p`` is Inf and the backward of log at 0 is NaN, as an RL ratio taken as log(probs))."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)

    def loss_fn(mask):
        logits = model(x)
        if nan:
            bias = torch.zeros_like(logits)
            bias[BAD[0], BAD[1], y[BAD]] = -1e4
            logits = logits + bias
        per = -torch.log(logits.softmax(-1).gather(-1, y[..., None])[..., 0])
        return (per * mask).sum() / (B * T)
    return loss_fn, torch.ones(B, T), x


def test_a_nan_step_is_skipped_exactly_and_its_sample_is_named_everywhere(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=1, n_head=2, d_model=16, max_seq_len=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = LocalTracker(tmp_path / "run")
    mon = GradMonitor(model, tracker=tracker, clipper=GlobalClip(model), optimizer=opt, log_every=100,
                      detector=SpikeDetector(), artifact_writer=SpikeArtifactWriter(tracker, images=False))
    for step in (1, 2, 3):
        loss_fn, mask, x = step_batch(model, step, nan=step == 3)
        model.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
        ctx = SpikeContext(loss_fn, mask, input_ids=x)
        stats = mon.after_backward(step, spike_context=ctx)
        before = snapshot(model, opt)
        opt.step()
    assert_bitwise_equal(snapshot(model, opt), before)  # the NaN step changed no weight, no Adam state
    assert stats.events and stats.step == 3
    found = stats.locate.nonfinite
    assert found.samples == (3,) and found.terms == (BAD,)
    # the replay makes the same NaN: a numeric cause (not irreproducible), in the search's words
    assert stats.cause == "numeric" and "sample 3's loss is Inf (token 5): its gradient is NaN" in stats.cause_detail
    tracker.finish()

    rows = read_table(tmp_path / "run")
    cells = [dict(zip(rows["columns"], r)) for r in rows["data"]]
    assert [(c["level"], c["sample"], c["position"], c["share"], c["nonfinite"]) for c in cells] == [
        ("token", 3, 5, None, True)]

    page = (tmp_path / "run" / "spikes" / "highlight" / "step_000003.html").read_text()
    assert "non-finite step: sample 3&#x27;s loss is Inf (token 5)" in page  # the localizer's note, escaped

    block = "\n".join(spike_block(SpikeView.of(stats), tmp_path / "run"))
    assert "non-finite sample 3's loss is Inf (token 5): its gradient is NaN" in block
    assert "sample 3, token 5:" in block and "(its gradient is non-finite)" in block

    out = tmp_path / "ledger"
    code = command.run(parser().parse_args(["culprits", str(tmp_path / "run"), "-o", str(out),
                                            "--export-blocklist", str(tmp_path / "block.json")]))
    ledger = json.loads((out / "culprits.json").read_text())
    (sample,) = ledger["samples"]
    assert code == 0 and sample["nonfinite"] is True and sample["sample_id"] == cells[0]["sample_id"]
    blocked = json.loads(Path(tmp_path / "block.json").read_text())["samples"]
    assert [b["sample_id"] for b in blocked] == [sample["sample_id"]]  # no share, still exported

    assert Quarantine().blame(3, stats.locate, ctx) == [sample["sample_id"]]
