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
