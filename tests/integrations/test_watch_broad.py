"""The broad rule through ``watch()`` on a real byte-level GPT (issue 37, stop 60): eight junk targets among 1024
loss terms move the global norm and half the layers to z 5.6-7.2, under ``z_thresh`` (8) times the heavy tails'
correction (1.43), and the step fires on the broad rule alone. The data is this library's own Python source,
which none of the rule's tuning read (dev half: pydoc, C headers, changelogs, Perl)."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

import gradloc_track
from gradloc_track.demo.model import TinyGPT

B, T, V, WEIGHT = 64, 16, 256, 64.0


def _source_bytes() -> torch.Tensor:
    root = Path(gradloc_track.__file__).parent
    return torch.tensor(list(b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))), dtype=torch.long)


def test_eight_junk_terms_fire_on_the_broad_rule_under_the_tail_corrected_bar():
    data = _source_bytes()
    torch.manual_seed(1)
    model = TinyGPT(V, n_layer=4, n_head=4, d_model=32, max_seq_len=T)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = gradloc_track.watch(model, opt, tracker="none", console=False, locate=False)
    g = torch.Generator().manual_seed(1)
    for step in range(151):
        at = torch.randint(0, len(data) - T - 1, (B,), generator=g)
        rows = torch.stack([data[a:a + T + 1] for a in at.tolist()])
        w = torch.ones(B, T)
        if step in (120, 150):  # a corrupted per-token weight column: 8 junk targets carry a weight of 64
            for k in torch.randperm(B, generator=g)[:8].tolist():
                t = int(torch.randint(0, T - 1, (1,), generator=g))
                rows[k, t + 1] = int(torch.randint(0, V, (1,), generator=g))
                w[k, t] = WEIGHT
        per = torch.nn.functional.cross_entropy(model(rows[:, :-1]).reshape(-1, V), rows[:, 1:].reshape(-1),
                                                reduction="none").view(B, T)
        ((per * w).sum() / w.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    det = handle.monitor.detector
    handle.close()
    assert [s.step for s in handle.spikes if s.step < 120] == []  # no false event on the clean steps before
    assert 150 in [s.step for s in handle.spikes]
    tail = det.config.z_thresh * 1.25  # the tail factor here is 1.43: the usual bar is above 10
    ev = next(e for e in handle.spikes if e.step == 150).events
    glob = next(e for e in ev if e.signal == "global")
    assert 5.0 < glob.z < tail  # under the tail-corrected bar: only the broad rule reads it
    layer_z = [det._z[k] for k in det.signals if not k.startswith("@") and k != "global"]
    assert sum(z > det.config.broad_z for z in layer_z) >= det.config.broad_share * len(layer_z)
