"""The detector's signals beyond the gradient norms (issue 26): the step's loss, its largest per-sample
loss, the optimizer's update, and the noise floor under the norms.

Each is checked against what it must do on a stream written out here: fire on the jump it exists
for, stay quiet on its own noise, and leave 0.3's detector (global + layers) untouched when off."""
from __future__ import annotations

import math
import random

import pytest

from gradloc_track.config import ConfigError, SpikeConfig
from gradloc_track.spikes import SpikeDetector


def stream(steps: int, seed: int = 0):
    """Log-normal norms (sigma 0.3, heavy as small batches are) and losses (sigma 0.03) falling slowly."""
    rng = random.Random(seed)
    for s in range(steps):
        g = math.exp(rng.gauss(0, 0.3))
        layers = {"h.0": g * 0.6 * math.exp(rng.gauss(0, 0.1)), "h.1": g * 0.8 * math.exp(rng.gauss(0, 0.1))}
        loss = (3.0 - s / steps) * math.exp(rng.gauss(0, 0.03))
        samples = [loss * math.exp(rng.gauss(0, 0.1)) for _ in range(8)]
        yield s, g, layers, loss, samples


def fired(det: SpikeDetector, edit=None, steps: int = 300, **given) -> dict[int, list[str]]:
    out = {}
    for s, g, layers, loss, samples in stream(steps):
        kw = {"loss": loss, "sample_losses": samples, **given}
        if edit is not None:
            g, layers, kw = edit(s, g, layers, kw)
        events = det.update(s, g, layers, **kw)
        if events:
            out[s] = [e.signal for e in events]
    return out


def test_a_loss_jump_the_norms_do_not_show_fires_on_the_loss():
    """3 of 8 samples junk: the batch loss 1.4x, the gradient norm within its noise."""
    def junk(s, g, layers, kw):
        if s == 200:
            kw = {**kw, "loss": kw["loss"] * 1.4}
        return g, layers, kw

    assert fired(SpikeDetector()) == {}
    assert fired(SpikeDetector(), junk) == {200: ["loss"]}
    assert fired(SpikeDetector(loss_signal=False), junk) == {}


def test_one_bad_sample_fires_on_the_largest_sample_loss():
    def bad(s, g, layers, kw):
        if s == 150:
            kw = {**kw, "sample_losses": kw["sample_losses"][:-1] + [kw["loss"] * 3]}
        return g, layers, kw

    assert fired(SpikeDetector(), bad) == {150: ["sample_loss"]}
    ev = [e for e in SpikeDetector().update(0, 1.0) if e]  # nothing without warm-up
    assert ev == []


def test_non_finite_losses_always_fire_and_never_enter():
    det = SpikeDetector()
    for s, g, layers, loss, samples in stream(100):
        nan = s in (40, 70)
        events = det.update(s, g, layers, loss=math.nan if nan else loss,
                            sample_losses=samples[:-1] + [math.inf] if nan else samples)
        assert {e.signal for e in events} == ({"loss", "sample_loss"} if nan else set())
    ref = SpikeDetector()
    for s, g, layers, loss, samples in stream(100):
        if s not in (40, 70):
            ref.update(s, g, layers, loss=loss, sample_losses=samples)
    for key in ("@loss", "@sample_loss"):  # as if the NaN steps had never been seen
        assert det.signals[key].as_tuple()[1:] == pytest.approx(ref.signals[key].as_tuple()[1:])


def memorised(steps: int, seed: int = 0):
    """A model that memorised its data: the batch loss near 0.1 and the largest sample's near 0.3, each
    moving with which rows the batch drew (log-normal, sigma 0.12 and 0.1)."""
    rng = random.Random(seed)
    for s in range(steps):
        yield s, 0.1 * math.exp(rng.gauss(0, 0.12)), 0.3 * math.exp(rng.gauss(0, 0.1))


def memorised_events(det: SpikeDetector, at: int, loss: float | None = None, sample: float | None = None):
    out = {}
    for s, batch, top in memorised(200):
        if s == at:
            batch, top = loss if loss is not None else batch, sample if sample is not None else top
        events = det.update(s, 1.0, {"h.0": 0.5}, loss=batch, sample_losses=[batch, top])
        if events:
            out[s] = [(e.signal, round(e.value - e.baseline, 3)) for e in events]
    return out


def test_a_memorised_batch_or_row_a_fraction_of_a_nat_up_is_no_spike():
    """Held-out testers, stop 57/58: where the loss is 0.1, a clean batch at 0.18 (1.8x, z 5-6) and a row at 0.6 (2x)
    fired as ``data`` naming a clean, memorised sample. The rise floors (nats) keep them quiet; a junk row
    (a few nats) still fires, and with the floors off the same steps fire (the floors are what silence them).
    The batch here is 0.2 (2x): since loss_z_thresh 5 (stop 59) the z rule alone no longer fires on 0.18."""
    off = {"loss_min_rise": 0.0, "sample_min_rise": 0.0}
    assert memorised_events(SpikeDetector(**off), 150, loss=0.2) == {150: [("loss", pytest.approx(0.1, abs=0.01))]}
    assert memorised_events(SpikeDetector(), 150, loss=0.2) == {}
    assert memorised_events(SpikeDetector(**off), 150, sample=0.6) == {
        150: [("sample_loss", pytest.approx(0.3, abs=0.02))]}
    assert memorised_events(SpikeDetector(), 150, sample=0.6) == {}
    junk = memorised_events(SpikeDetector(), 150, loss=0.1 + 5.0 / 8, sample=5.0)  # one junk row in 8
    assert [name for name, _ in junk[150]] == ["loss", "sample_loss"] and set(junk) == {150}
    # the floor is in nats above the running mean, the value the event reports as its baseline
    assert SpikeConfig().loss_min_rise < junk[150][0][1] and SpikeConfig().sample_min_rise < junk[150][1][1]


def test_a_learning_rate_jump_fires_on_the_update_alone():
    """The gradient does not change at a learning-rate jump; the update does (10x)."""
    def lr_jump(s, g, layers, kw):
        return g, layers, {**kw, "update": 1e-3 * g * (10.0 if s == 220 else 1.0)}

    assert fired(SpikeDetector(), lr_jump) == {220: ["update"]}


def test_a_lost_optimizer_state_fires_on_the_update_above_its_ratio_whatever_its_noise():
    """Adam's first step after its state is lost moves every element by lr: the update 3-5x (spike zoo,
    ``optimizer_reset``). On an update whose noise is wide (0.5 in log space: tails that raise z_eff),
    the z-score misses it; ``update_ratio_thresh`` (3x) does not, and clean noise stays under it."""
    rng = random.Random(3)
    noisy = [math.exp(rng.gauss(0, 0.25)) for _ in range(200)]  # up to ~2x, as the zoo's clean updates

    def reset(s, g, layers, kw):
        return g, layers, {**kw, "update": 1e-3 * (4.0 if s == 180 else noisy[s % 200])}

    assert fired(SpikeDetector(), reset, steps=200) == {180: ["update"]}
    assert fired(SpikeDetector(update_ratio_thresh=None), reset, steps=200) == {}
    with pytest.raises(ConfigError, match="spikes.update_ratio_thresh"):
        SpikeConfig(update_ratio_thresh=1.0)


def test_the_noise_floor_keeps_cancelling_gradients_out():
    """Converged RL: groups whose gradients cancel leave norms of float rounding (1e-10 .. 1e-8 against
    weights of norm 30). 0.3 fired on them ("436.8x its running mean 1.74e-10" on a 7.6e-8 norm)."""
    rng = random.Random(1)
    norms = [math.exp(rng.uniform(math.log(1e-11), math.log(1e-9))) for _ in range(60)] + [7.6e-8]
    old = SpikeDetector(noise_floor=0.0)
    new = SpikeDetector()
    old_events = [e for s, g in enumerate(norms) for e in old.update(s, g, weight_norm=30.0)]
    new_events = [e for s, g in enumerate(norms) for e in new.update(s, g, weight_norm=30.0)]
    assert [e.step for e in old_events if e.signal == "global"] == [60]
    assert new_events == [] and "global" not in new.signals
    assert new.metrics()["spike/noise_floor"] == 1.0
    # a real gradient right after is judged on real gradients only
    assert new.update(61, 1e-2, weight_norm=30.0) == [] and new.metrics()["spike/noise_floor"] == 0.0
    assert [e.signal for e in new.update(62, math.nan, weight_norm=30.0)] == ["global"]  # NaN still fires


def test_with_its_new_signals_off_the_detector_is_0_3s():
    """Loss, sample and update signals off, no floor: the same events and statistics as norms alone."""
    off = dict(loss_signal=False, sample_signal=False, update_signal=False, noise_floor=0.0)

    def spikes(s, g, layers, kw):
        if s in (100, 180):
            return g * 30, {k: v * 30 for k, v in layers.items()}, {**kw, "loss": kw["loss"] * 2}
        return g, layers, kw

    a = SpikeDetector(**off)
    b = SpikeDetector()
    with_inputs = fired(a, spikes, update=1.0, weight_norm=10.0)
    norms_only = {}
    for s, g, layers, loss, samples in stream(300):
        g, layers, _ = spikes(s, g, layers, {"loss": loss})
        ev = b.update(s, g, layers)
        if ev:
            norms_only[s] = [e.signal for e in ev]
    assert with_inputs == norms_only and list(norms_only) == [100, 180]
    assert all(set(v) == {"global", "h.0", "h.1"} for v in norms_only.values())
    assert a.state_dict() == b.state_dict()


def test_wants_names_what_the_monitor_must_compute():
    assert SpikeDetector().wants == {"loss", "sample_losses", "update", "weight_norm", "junk_span"}
    assert SpikeDetector(loss_signal=False, noise_floor=0.0, junk_signal=False).wants == {"sample_losses", "update"}
    assert SpikeDetector(mode="fixed", per_token_threshold=100.0).wants == frozenset()


def test_event_keys_name_the_metric_read():
    det = SpikeDetector(warmup_steps=3)
    for s in range(10):
        det.update(s, 1.0 + 0.01 * (s % 2), {"h.0": 0.5}, loss=2.0 + 0.01 * (s % 2), update=0.1)
    events = det.update(10, 50.0, {"h.0": 0.5}, loss=20.0, update=5.0)
    assert {e.signal: e.key for e in events} == {"global": "grad_norm/global", "loss": "loss",
                                                 "update": "update/global"}
    assert [e.is_norm for e in events] == [True, False, False]


@pytest.mark.parametrize("field,value", [("loss_min_ratio", 0.5), ("noise_floor", -1e-7), ("noise_floor", 1.0),
                                         ("loss_signal", "yes"), ("loss_min_rise", -0.1),
                                         ("sample_min_rise", float("inf"))])
def test_new_fields_are_validated_by_name(field, value):
    with pytest.raises(ConfigError, match=f"spikes.{field}"):
        SpikeConfig(**{field: value})



def test_a_signal_not_read_on_a_step_logs_no_z_score_there():
    """Held-out testers, stop 55: after a step that fired, the update is not fed to the next verdict, and
    ``spike/zscore_update`` logged the step before's z again (the same value on two steps)."""
    det = SpikeDetector(warmup_steps=3)
    for s in range(10):
        det.update(s, 1.0 + 0.01 * (s % 2), {"h.0": 0.5}, loss=2.0 + 0.01 * (s % 2), update=0.1 + 0.001 * (s % 3))
    assert {"spike/zscore_update", "spike/zscore_loss"} <= set(det.metrics())
    det.update(10, 1.0, {"h.0": 0.5}, loss=2.0)  # no update read this step
    assert "spike/zscore_update" not in det.metrics() and "spike/zscore_loss" in det.metrics()
    det.update(11, 1.0, {"h.0": 0.5}, loss=2.0, update=0.1)
    assert "spike/zscore_update" in det.metrics()


def test_a_zero_value_logs_no_z_score_either():
    """Review, stop 55: an update (or a global norm) of 0 returns before its z is computed, and the step before's
    z was logged again; a warm-up step has no z to log either."""
    det = SpikeDetector(warmup_steps=3)
    det.update(0, 1.0, {"h.0": 0.5}, loss=2.0, update=0.1)
    assert "spike/zscore_update" not in det.metrics() and "spike/zscore_loss" not in det.metrics()  # warm-up
    for s in range(1, 10):
        det.update(s, 1.0 + 0.01 * (s % 2), {"h.0": 0.5}, loss=2.0 + 0.01 * (s % 2), update=0.1 + 0.001 * (s % 3))
    assert {"spike/zscore", "spike/zscore_update"} <= set(det.metrics())
    det.update(10, 0.0, {"h.0": 0.0}, loss=2.0, update=0.0)
    assert not {"spike/zscore", "spike/ratio", "spike/zscore_update"} & set(det.metrics())
    assert "spike/zscore_loss" in det.metrics()


def test_the_largest_layer_z_and_the_noise_floor_log_no_stale_z_score():
    """Review, stop 55: with every layer's norm 0, or the step under the noise floor, the step before's
    ``spike/zscore_max_layer`` (and, under the floor, ``spike/zscore`` and ``spike/ratio``) were logged again."""
    det = SpikeDetector(warmup_steps=3)
    for s in range(10):
        det.update(s, 1.0 + 0.01 * (s % 2), {"a": 0.5 + 0.01 * (s % 3), "b": 0.4})
    assert "spike/zscore_max_layer" in det.metrics()
    det.update(10, 1.05, {"a": 0.0, "b": 0.0})
    assert "spike/zscore_max_layer" not in det.metrics() and "spike/zscore" in det.metrics()
    floor = SpikeDetector(warmup_steps=3, noise_floor=1e-3)
    for s in range(10):
        floor.update(s, 1.0 + 0.01 * (s % 2), {"a": 0.5 + 0.01 * (s % 3)}, weight_norm=10.0)
    floor.update(10, 1e-6, {"a": 1e-6}, weight_norm=10.0)  # float noise: no verdict, no z
    assert not {"spike/zscore", "spike/ratio", "spike/zscore_max_layer"} & set(floor.metrics())


def test_a_layer_some_steps_do_not_reach_is_read_by_the_z_rule_only():
    """Held-out tester, stop 55: a rarely routed mixture-of-experts expert (no gradient on some steps, then 1
    token, then 30) fired the 20x ratio net 6-8 times in 250 clean steps, at z 2.5-4.6. A layer once seen at
    zero is a conditional one: the z rule, which learns its spread, reads it; a dense layer keeps the net."""
    import random

    rng = random.Random(0)
    det = SpikeDetector(warmup_steps=10)
    fired = []
    for s in range(300):
        routed = rng.choice([0] * 3 + [1] * 8 + [3] * 4 + [10] * 2 + [60])  # tokens routed to the expert (before:
        # 10 events, z 3.3-4.4 at 21-51x, as the tester's)
        expert = 0.0 if routed == 0 else 1e-3 * routed * math.exp(rng.gauss(0, 0.2))
        dense = 0.5 * math.exp(rng.gauss(0, 0.05))
        fired += [(s, e.signal) for e in det.update(s, 1.0 * math.exp(rng.gauss(0, 0.05)),
                                                    {"dense": dense, "experts.3": expert})]
    assert not [f for f in fired if f[1] == "experts.3"], fired
    assert "experts.3" in det.state_dict()["conditional"]
    again = SpikeDetector(warmup_steps=10)
    again.load_state_dict(det.state_dict())
    assert again._conditional == {"experts.3"}
    # the dense layer keeps the net: a 40x jump fires whatever its z
    assert any(e.signal == "dense" for e in det.update(300, 1.0, {"dense": 20.0, "experts.3": 0.01}))
    # a step with no gradient at all (loss * 0, an all-masked batch) marks no layer
    det.update(301, 0.0, {"dense": 0.0, "experts.3": 0.0})
    assert "dense" not in det.state_dict()["conditional"]
    # nor does step 0 of a layer behind a zero-initialised one (a zeroed head, LoRA's B: review, stop 55): it has
    # not learned yet, and keeps the net (a 40x jump at z ~5 fires)
    zero = SpikeDetector(warmup_steps=10)
    zero.update(0, 1.0, {"head": 1.0, "h.0": 0.0})
    for s in range(1, 200):
        zero.update(s, 1.0, {"head": 1.0, "h.0": 0.01 * math.exp(rng.gauss(0, 0.5))})
    assert zero.state_dict()["conditional"] == []
    assert any(e.signal == "h.0" for e in zero.update(200, 1.0, {"head": 1.0, "h.0": 0.4}))
