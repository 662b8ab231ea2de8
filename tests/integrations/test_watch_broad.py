"""The broad rule through ``watch()`` on a real byte-level GPT (issue 37, stop 60): eight junk targets among 1024
loss terms move the global norm to z 7.4 and five of its eight layers past z 5, under ``z_thresh`` (8) times the
heavy tails' correction (1.3), and the step fires on the broad rule alone. The data is a frozen copy of this
library's own Python source (``frozen_source.txt.gz``: ``gradloc_track/spikes`` and ``monitor`` at 99317f2), which
none of the rule's tuning read (dev half: pydoc, C headers, changelogs, Perl); frozen, so later edits of the
library do not move the run. Margins: the global z 3 under its bar, the fourth layer 0.7 over ``broad_z``; the
same numbers come back with 1 or 2 threads and with ``ATEN_CPU_CAPABILITY=default``."""
from __future__ import annotations

import gzip
import warnings
from pathlib import Path

import torch

import gradloc_track
from gradloc_track.demo.model import TinyGPT

B, T, V, WEIGHT, SEED = 64, 16, 256, 64.0, 3
INJECTED = (120, 150)


def _source_bytes() -> torch.Tensor:
    raw = gzip.decompress((Path(__file__).parent / "frozen_source.txt.gz").read_bytes())
    return torch.tensor(list(raw), dtype=torch.long)


def test_eight_junk_terms_fire_on_the_broad_rule_under_the_tail_corrected_bar():
    data = _source_bytes()
    torch.manual_seed(SEED)
    model = TinyGPT(V, n_layer=4, n_head=4, d_model=32, max_seq_len=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = gradloc_track.watch(model, opt, tracker="none", console=False, locate=False)
    det = handle.monitor.detector
    g = torch.Generator().manual_seed(SEED)
    bar = zs = None
    for step in range(151):
        at = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        rows = torch.stack([data[a:a + T + 1] for a in at.tolist()])
        w = torch.ones(B, T)
        if step in INJECTED:  # a corrupted per-token weight column: 8 junk targets carry a weight of 64
            for k in torch.randperm(B, generator=g)[:8].tolist():
                t = int(torch.randint(0, T - 1, (1,), generator=g))
                rows[k, t + 1] = int(torch.randint(0, V, (1,), generator=g))
                w[k, t] = WEIGHT
        per = torch.nn.functional.cross_entropy(model(rows[:, :-1]).reshape(-1, V), rows[:, 1:].reshape(-1),
                                                reduction="none").view(B, T)
        ((per * w).sum() / w.sum()).backward()
        if step == 150:  # the global norm's usual bar this step: z_thresh x its tail factor, before the step
            bar = det.config.z_thresh * det.signals["global"].tail_factor()
        opt.step()  # watch()'s hook reads the step here
        opt.zero_grad(set_to_none=True)
        if step == 150:
            zs = det.zscores
    handle.close()
    fired = {s.step: [e.signal for e in s.events] for s in handle.spikes}
    assert [s for s in fired if s < INJECTED[0]] == []  # no false event on the clean steps before
    assert fired[120].count("global") == 1 and fired[150] == ["global"]  # one global event each, nothing else
    layers = [z for k, z in zs.items() if k != "global" and not k.startswith("@")]
    assert bar > 10.0 and det.config.broad_z < zs["global"] < bar - 2.0  # under its usual bar: only the rule reads it
    assert sum(z > det.config.broad_z for z in layers) >= det.config.broad_share * len(layers) + 1  # one to spare
