"""The spike zoo's smallest configuration: two demo scenarios on a one-layer model, scored, so it does
not rot; and the anchors' triggers against their published rules on hand-written streams."""
from __future__ import annotations

import math

import pytest

from .test_bench_surgery import load_benchmark


def step(i, g, loss=2.0, n=64, injected=False):
    from zoo.record import StepRecord

    return StepRecord(i, g, {"h.0": g / 2}, n, injected, loss)


def test_anchor_triggers_follow_their_published_rules():
    bench = load_benchmark("spike_zoo")  # puts benchmarks/ on the path
    from zoo import anchors

    calm = [step(i, 1.0 + 0.01 * (i % 3)) for i in range(100)]
    spike = calm[:80] + [step(80, 10.0)] + calm[81:]
    nan = calm[:80] + [step(80, math.nan, loss=math.nan)] + calm[81:]
    assert anchors.zclip(spike) == {80} and anchors.zclip(nan) == set()  # ZClip: z > 2.5; NaN > 2.5 is false
    assert anchors.olmo(spike) == {80} and anchors.olmo(nan) == {80}  # OLMo: 6 sigma after 64; NaN fails z <= 6
    assert anchors.olmo(calm[:60] + [step(60, 10.0)]) == set()  # fewer than 64 values seen
    T = anchors.gradloc_threshold([calm], warmup=0)  # the highest clean global * sqrt(n_tokens)
    assert T == 1.02 * 8 and anchors.gradloc(T)(spike) == {80} and anchors.gradloc(T)(nan) == set()
    assert bench.FAMILIES == ("demo", "hf", "trl")


@pytest.mark.filterwarnings("ignore:gradloc-track. localizing")  # a NaN step is not localized (item 4)
def test_quick_zoo_scores_two_scenarios():
    bench = load_benchmark("spike_zoo")
    from zoo import demo
    from zoo.table import Family, render

    s = demo.DemoSetting(n_layer=1, d_model=16, n_head=2, seq_len=48, steps=40, clean_steps=40, eval_batches=1,
                         scored_from=12, detector={"warmup_steps": 10})
    corpus, held = demo.context(s)
    runs = [demo.run(name, 0, s, corpus, held) for name in ("nan_sample", "bad_document", "placebo_three", "clean")]
    calib = demo.run("calibration", 1000, s, corpus, held)
    fam = bench.split("demo", runs + [calib])
    assert isinstance(fam, Family) and [r.scenario for r in fam.scenarios] == ["nan_sample", "bad_document"]
    nan = fam.scenarios[0]
    assert nan.injected_steps == demo.injection_steps(demo.SCENARIOS["nan_sample"], s)
    assert all(not math.isfinite(h.delta) for h in nan.harms)  # a NaN update is harm, whatever the held-out
    assert all(r.fired for r in nan.steps if r.injected)  # non-finite always fires
    table = render([fam])
    assert "| nan_sample | numeric | non-finite" in table
    assert "| demo, twins and placebos | " in table and "| demo, clean twins only | " in table
    caught, harmful = map(int, table.split("harmful injected steps detected: ours ")[1].split(" ")[0].split("/"))
    assert caught >= len([s for s in nan.injected_steps if s >= nan.warmup]) and harmful >= caught  # NaN: all
    # --replay --rescore: this code's detector fed the recorded inputs fires where the live one did
    assert render([fam], bench._rescorer({"warmup_steps": 10})) == table
    assert all(math.isfinite(r.final_loss) for r in runs)  # the guard skipped the NaN steps


def test_span_maxima_against_a_hand_computed_row():
    load_benchmark("spike_zoo")
    import torch
    from zoo.measure import span_maxima

    per = torch.tensor([[1.0, 2.0, 9.0, 8.0, 1.0, 1.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    valid = torch.tensor([[True] * 6 + [False] * 2, [True] * 8])
    out = span_maxima(per, valid, widths=(1, 2, 4))
    assert out["1"] == 9.0 and out["2"] == 8.5 and out["4"] == 5.0  # (2+9+8+1)/4; masked terms never enter
    assert out["c2"] == 8.5 - 5.0 / 4  # the span against the mean of the rest of its own row (1+2+1+1)/4
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8])
    assert span_maxima(per, valid, docs, widths=(2,))["2"] == 5.5  # 9 and 8 sit in two documents: (2+9)/2


def test_zoo_conflict_metric_is_the_one_adam_steps_in():
    """``adam_metric``: Adam's own step (beta1 = 0, so the update is ``lr * g * metric``) is the reference."""
    load_benchmark("spike_zoo")
    import zoo_conflict
    import torch

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.Adam(params, lr=0.1, betas=(0.0, 0.999), eps=1e-8)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        grads = [p.grad.clone() for p in params]
        metric = zoo_conflict.adam_metric(opt, params, grads)
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, b, g, w in zip(params, before, grads, metric):
            torch.testing.assert_close(b - p.detach(), 0.1 * g * w, rtol=1e-5, atol=1e-7)
    a, b = [torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 1.0])]
    assert abs(zoo_conflict.cosine(a, b) - 2 ** -0.5) < 1e-12
    assert abs(zoo_conflict.cosine(a, b, [torch.tensor([1.0, 3.0])]) - 0.5) < 1e-12  # <a,b>_w = 1, |b|_w = 2
