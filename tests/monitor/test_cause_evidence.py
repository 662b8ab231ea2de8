"""Each cause rule on a real step: a TinyGPT trained with AdamW under ``GradMonitor``, then one step
that is broken the way the rule describes (a garbled sample, a NaN loss, a learning-rate jump, a bit
flipped in ``.grad``, a decayed second moment, a lost optimizer state). The step's events, its
``spikes/events`` row and the console block must name the cause; clean steps name none."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.artifacts.events import EVENT_COLUMNS
from gradloc_track.trackers.naming import EVENTS_KEY
from gradloc_track.config import LocateConfig
from gradloc_track.demo.model import TinyGPT
from gradloc_track.monitor.cause_evidence import LrHistory
from gradloc_track.spikes import SpikeContext, SpikeDetector

V, B, T, WARM = 64, 8, 16, 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean text: a repeating pattern with a little noise, the same stream every run."""
    g = torch.Generator().manual_seed(step)
    base = (torch.arange(T + 1)[None] * 3 + torch.randint(0, 4, (B, 1), generator=g)) % (V // 2)
    return base[:, :-1].clone(), base[:, 1:].clone()


class Run:
    """A small training run whose next step can be broken."""

    def __init__(self, tmp_path) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT(V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.tracker = MemoryTracker()
        self.mon = GradMonitor(self.model, tracker=self.tracker, optimizer=self.opt, log_every=10 ** 6,
                               detector=SpikeDetector(warmup_steps=WARM, transient_fall=0.0),  # past its transient
                               locate_config=LocateConfig(max_events=100),
                               artifact_writer=SpikeArtifactWriter(self.tracker, run_dir=tmp_path))
        self.step = 0
        for _ in range(WARM + 8):
            stats = self.train()
            assert not stats.events and stats.cause is None

    def train(self, x=None, y=None, mask=None, loss_scale=1.0, after_backward=None, backward_scale=1.0):
        cx, cy = batch(self.step)
        x, y = (cx, cy) if x is None else (x, y)
        mask = torch.ones(B, T) if mask is None else mask
        weights = mask / mask.sum(1, keepdim=True) / B  # per-sample averaging: a short answer weighs more

        def loss_fn(keep):
            per = F.cross_entropy(self.model(x).reshape(B * T, V), y.reshape(-1), reduction="none").view(B, T)
            return (per * weights * keep).sum() * loss_scale

        self.opt.zero_grad(set_to_none=True)
        loss = loss_fn(mask)
        (loss * backward_scale if backward_scale != 1.0 else loss).backward()  # a multiplier the replay lacks
        if after_backward is not None:
            after_backward(self)
        with torch.no_grad():
            per = F.cross_entropy(self.model(x).reshape(B * T, V), y.reshape(-1), reduction="none").view(B, T)
        samples = (per * mask).sum(1) / mask.sum(1)
        stats = self.mon.after_backward(self.step, spike_context=SpikeContext(loss_fn, mask, input_ids=y),
                                        loss=loss.detach(), sample_losses=samples)
        self.opt.step()
        self.step += 1
        return stats

    def last_event_row(self) -> dict:
        table = self.tracker.tables[EVENTS_KEY]
        assert table["columns"] == EVENT_COLUMNS
        return dict(zip(EVENT_COLUMNS, table["rows"][-1]))


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def check(r: Run, stats, cause: str) -> str:
    """The cause on the step, its events, its ``spikes/events`` row and (localized) its highlight page."""
    assert stats.events, "the broken step must fire"
    assert stats.cause == cause, stats.cause_detail
    assert all(e.cause == cause and e.cause_detail == stats.cause_detail for e in stats.events)
    row = r.last_event_row()
    assert (row["step"], row["cause"], row["cause_detail"]) == (stats.step, cause, stats.cause_detail)
    pages = [h for key, step, h in r.tracker.html if step == stats.step and "highlight" in key]
    if stats.locate is not None and pages:
        assert f"cause <b>{cause}</b>" in pages[-1]
    return stats.cause_detail


def test_a_garbled_sample_is_data(run):
    x, y = batch(run.step)
    mask = torch.ones(B, T)
    mask[3, :13] = 0  # a prompt without loss, then a 3-token answer of tokens never seen
    y[3, 13:] = torch.tensor([V - 1, V - 2, V - 3])
    detail = check(run, run.train(x, y, mask), "data")
    assert "sample 3" in detail and "of the step's squared gradient norm" in detail


def test_a_non_finite_loss_is_numeric(run):
    detail = check(run, run.train(loss_scale=math.inf), "numeric")
    assert "nan" in detail.lower() or "inf" in detail.lower()


def test_a_loss_multiplied_at_one_step_is_loss_scale_not_unexplained(run):
    # the loss backpropagated 100x while the batch and the loss_fn the localizer replays are ordinary
    detail = check(run, run.train(backward_scale=100.0), "loss_scale")
    assert "the gradient in .grad is 100x the one the batch's own loss gives" in detail
    assert "the loss was multiplied by 100 at this step" in detail


def test_a_factor_the_run_always_had_is_its_normalization_not_a_scaled_loss(run):
    """The scale of each localized step is kept: a loss_fn off by 100x from the training loss on every step
    (its replay scale 100 at an earlier spike named otherwise) makes a later step at 100x no loss_scale."""
    first = run.train(backward_scale=100.0)
    assert first.cause == "loss_scale" and run.mon.responder.replay_scales == []  # a scaled loss: not the usual
    run.mon.responder.replay_scales.append(100.0)  # as if an earlier spike of this run had been at 100x
    for _ in range(30):  # back to ordinary steps (the detector's running mean recovers)
        run.train()
    second = run.train(backward_scale=100.0)
    assert second.events and second.cause != "loss_scale", second.cause_detail


def test_a_learning_rate_jump_is_schedule(run):
    for g in run.opt.param_groups:
        g["lr"] *= 30
    stats = run.train()
    detail = check(run, stats, "schedule")
    assert "rose 30x" in detail and "0.003 -> 0.09" in detail
    if [e.signal for e in stats.events] == ["update"]:
        not_localized_for_the_update(stats)


def flip_bit(r: Run) -> None:
    """Bit 30 of one gradient element (an exponent bit): what silent data corruption looks like."""
    g = r.model.h[0].mlp.fc.weight.grad
    bits = g.view(torch.int32)
    bits[0, 0] ^= 1 << 30


def test_a_flipped_bit_in_grad_is_irreproducible(run):
    detail = check(run, run.train(after_backward=flip_bit), "irreproducible")
    assert "does not reproduce" in detail and "hardware fault" in detail


def test_a_flipped_bit_is_irreproducible_when_a_clipper_zeroed_the_step(tmp_path):
    """The HF callback clips (Trainer's max_grad_norm): a non-finite .grad is zeroed before the localizer
    compares, yet the replay it ran is finite, and the step's norm was not."""
    from gradloc_track.clip import GlobalClip

    r = Run(tmp_path)
    r.mon.clipper = GlobalClip(r.model, max_norm=1.0)  # the same run, now clipped as Trainer clips
    stats = r.train(after_backward=lambda run: run.model.h[0].mlp.fc.weight.grad.view(-1)[0].fill_(math.inf))
    assert check(r, stats, "irreproducible") and "finite, the one in .grad is not" in stats.cause_detail


def decay_second_moment(r: Run) -> None:
    """One tensor's second moment decayed (as a rarely updated row's does over thousands of steps)."""
    st = r.opt.state[r.model.lm_head.weight]
    st["exp_avg_sq"].mul_(1e-6)


def not_localized_for_the_update(stats) -> None:
    """A step only the update fired on names no rows: the rows carrying most of an ordinary gradient are no
    culprits of it (held-out tester: clean rows were named there, for quarantine and surgery to act on)."""
    assert stats.locate is None and stats.outcome.locate is None
    assert stats.outcome.not_localized.startswith("only the optimizer's update fired")


def test_a_decayed_second_moment_under_a_normal_gradient_is_optimizer(run):
    stats = run.train(after_backward=decay_second_moment)
    assert [e.signal for e in stats.events] == ["update"]  # the gradient is ordinary
    assert "optimizer's update" in check(run, stats, "optimizer")
    not_localized_for_the_update(stats)


def test_a_lost_optimizer_state_under_a_clean_batch_is_optimizer(run):
    """A resume that loads the weights and not the optimizer: Adam's first step moves every element by lr."""
    stats = run.train(after_backward=lambda r: r.opt.state.clear())
    assert [e.signal for e in stats.events] == ["update"]  # the gradient and the loss are ordinary
    assert "optimizer's update" in check(run, stats, "optimizer")
    not_localized_for_the_update(stats)


def test_lr_history_reads_the_largest_rise_over_groups():
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1}, {"params": [q], "lr": torch.tensor(0.2)}])
    h = LrHistory(opt)
    h.advance()
    assert h.pair() == (None, None)  # one step seen: nothing to compare
    opt.param_groups[0]["lr"] = 0.3
    opt.param_groups[1]["lr"].fill_(1.0)  # a tensor lr changed in place: the clone keeps the old value
    h.advance()
    assert h.pair() == pytest.approx((1.0, 0.2))


def test_one_grad_tensor_scaled_x40_without_a_clipper_is_irreproducible(run):
    """No clipper rescaled ``.grad``: one tensor 40x its replay is not "the step reproduces" (the per-tensor
    rescale allowance is a clipper's, and this monitor has none)."""
    stats = run.train(after_backward=lambda r: r.model.h[0].mlp.fc.weight.grad.mul_(40))
    detail = check(run, stats, "irreproducible")
    assert "does not reproduce" in detail and "hardware fault" in detail


def corrupt_one_element(r: Run) -> None:
    """One ``.grad`` element becomes 3.4e9: bit 30 (the exponent's top bit) flipped in an element of 1e-29,
    set here so the flip lands the same on any run. ``.grad`` and its squared norm stay finite."""
    g = r.model.h[0].mlp.fc.weight.grad.view(-1)
    g[7] = 1e-29
    g.view(torch.int32)[7] ^= 1 << 30


def test_a_flipped_bit_that_leaves_grad_finite_says_how_far_grad_is_from_the_replay(run):
    """The sentence said "differs by 9% of its norm" where .grad was 2e9 times the replay."""
    assert 3e9 < 1e-29 * 2.0 ** 128 < 4e9
    stats = run.train(after_backward=corrupt_one_element)
    detail = check(run, stats, "irreproducible")
    ratio = stats.locate.step_check.norm_ratio
    assert ratio > 10 and f"the gradient in .grad is {ratio:.3g}x the norm of the replayed one" in detail


def test_the_steps_after_a_learning_rate_jump_are_its_aftermath(run):
    """Issue 37: after an lr x50 step (rightly schedule) the next steps fired as data / optimizer. Now every
    detected step of its recovery reports the jump, and says what it would have read on its own."""
    for g in run.opt.param_groups:
        g["lr"] *= 50
    jump = run.step
    assert run.train().cause == "schedule"
    for g in run.opt.param_groups:
        g["lr"] /= 50
    after = [run.train() for _ in range(12)]
    fired = [s for s in after if s.events]
    assert fired, "the thrown-off model fires after the jump (else this test tests nothing)"
    for s in fired:
        assert s.cause == "schedule" and s.cause_detail.startswith(f"aftermath of step {jump} (schedule)")
        assert all(e.cause == "schedule" for e in s.events)
    # and no row of theirs is named a culprit (held-out tester, stop 52: clean rows at 3-14% each, exported by
    # the ledger's blocklist): the rows that carry a recovering step are not its cause
    localized = [s for s in fired if s.not_localized is None or s.not_localized.startswith("aftermath")]
    assert localized, "a recovering step the localizer ran on (else this part tests nothing)"
    for s in localized:
        assert s.locate is None or not s.locate.culprits
    tokens = run.tracker.tables.get("spikes/tokens", {"columns": ["step"], "rows": []})
    at = tokens["columns"].index("step")
    assert not any(row[at] in {s.step for s in fired} for row in tokens["rows"])


def test_a_learning_rate_that_stays_raised_is_schedule(run):
    """A restart to a peak that stays there (issue 37: six 'optimizer' events, 'a second moment decayed')."""
    for g in run.opt.param_groups:
        g["lr"] *= 20
    start = run.step
    assert run.train().cause == "schedule"
    fired = [s for s in (run.train() for _ in range(30)) if s.events]
    assert fired
    for s in fired:
        assert s.cause == "schedule" and "the learning rate is still 20x what it was before step " \
            f"{start}" in s.cause_detail


def test_a_corrupted_weight_is_one_incident_named_by_parameter_index_and_value(run):
    """Issue 37: one weight's exponent bit flipped (0.012 -> ~4e36) made every later step an event,
    'numeric, sample k's loss is NaN' for every sample, the weight never named. Now the first event names
    the parameter, index and value and says to stop and roll back; the later ones are its aftermath, not
    localized again; one warning."""
    w, name = run.model.h[1].attn.qkv.weight, "h.1.attn.qkv.weight"
    with torch.no_grad():
        w[3, 5] = 0.012
        w.view(torch.int32)[3, 5] ^= 1 << 30  # the exponent's top bit: 0.012 -> ~4e36
    assert float(w.detach()[3, 5]) > 1e30
    first = run.step
    with pytest.warns(UserWarning, match=f"a weight is absurd: {name}\\[3, 5\\] = 4"):
        stats = run.train()
    detail = check(run, stats, "numeric")
    assert detail.startswith(f"a weight is absurd: {name}[3, 5] = 4") and f"before step {first}" in detail
    # the first step is no more localized than the later ones: replayed through the weight, every sample's
    # gradient is non-finite, and naming them all put clean samples in the table and the ledger's blocklist
    # (held-out tester, stop 52)
    assert stats.locate is None and "a weight is corrupt since step" in stats.not_localized
    assert not any(step == first for _key, step, _h in run.tracker.html)  # no highlight page
    tokens = run.tracker.tables.get("spikes/tokens", {"columns": ["step"], "rows": []})
    at = tokens["columns"].index("step")
    assert not any(row[at] == first for row in tokens["rows"])  # no culprit row for the ledger to export
    later = [run.train() for _ in range(3)]
    for s in later:
        assert s.cause == "numeric" and s.cause_detail.startswith(f"aftermath of step {first} (numeric): a weight")
        assert s.locate is None and "a weight is corrupt since step" in s.not_localized
        assert run.last_event_row()["cause_detail"] == s.cause_detail
        # linked like any aftermath, so the closing lines count it apart (review, stop 55: listed as new spikes)
        assert s.outcome.cause.aftermath_of == first
    assert stats.outcome.cause.aftermath_of is None


def test_an_absurd_weight_behind_a_norm_is_named_though_the_loss_stays_finite(run):
    """Issue 37's held-out Llama/Qwen2: RMSNorm absorbs a 4e36 weight, nothing goes non-finite, and the step was
    called data. The weights are read on every detected step: the absurd one is named."""
    w = run.model.h[1].mlp.fc.weight
    with torch.no_grad():
        w[0, 0] = 4e4  # absurd against its tensor's ~0.02 rms, finite everywhere downstream
    stats = run.train()
    if not stats.events:
        stats = run.train()
    assert stats.events and stats.cause == "numeric", stats.cause_detail
    assert stats.cause_detail.startswith("a weight is absurd: h.1.mlp.fc.weight[0, 0] = 4e+04")


def test_the_off_policy_reading_takes_the_units_loss_terms_not_its_prompts_padding():
    """TRL's GRPO: a completion's row holds its prompt too, whose RL columns are padding (0). The farthest
    term from on-policy is among the completion's loss terms (ratio 403 at position 5), not a prompt's 0;
    before, the prompt's 0 won and the stale log-prob was called `data`."""
    from types import SimpleNamespace

    from gradloc_track.localizer.culprit_view import CulpritView
    from gradloc_track.localizer.result import Culprit
    from gradloc_track.monitor.cause_evidence import off_policy_reading

    ratio = torch.zeros(2, 8)
    ratio[1, 3:] = torch.tensor([1.1, 0.9, 403.0, 1.0, 1.2])
    logp, old = torch.zeros(2, 8), torch.zeros(2, 8)
    logp[1, 5], old[1, 5] = -6.31, -12.3
    mask = torch.zeros(2, 8)
    mask[1, 3:] = 1.0
    view = CulpritView(None, SimpleNamespace(extra_columns={"ratio": ratio, "logprob": logp, "old_logprob": old},
                                             token_mask=mask))
    whole = Culprit("sample", 1.0, 1.0, batch=1, start=0, end=8, n_terms=5)
    assert off_policy_reading(whole, view) == pytest.approx((403.0, -6.31, -12.3))
    span = Culprit("span", 1.0, 1.0, batch=1, start=3, end=5, n_terms=2)  # 0.9 is farther from 1 than 1.1
    assert off_policy_reading(span, view)[0] == pytest.approx(0.9)


def test_a_reward_outlier_reads_data_with_the_culprits_advantage():
    """GRPO with scale_rewards='none', one completion's reward 1000: its advantage (749.7) weighs its gradient.
    The cause stays data (in RL the reward is data) and says the advantage (held-out tester round 4: the line
    named the text only, which is ordinary). Only the completion's loss terms are read, not its prompt's 0s."""
    from types import SimpleNamespace

    from gradloc_track.localizer.culprit_view import CulpritView
    from gradloc_track.localizer.result import Culprit
    from gradloc_track.monitor.cause_evidence import advantage_reading
    from gradloc_track.spikes.cause import Evidence, name_cause
    from gradloc_track.spikes.event import SpikeEvent

    adv = torch.zeros(2, 8)
    adv[1, 3:] = 749.7
    mask = torch.zeros(2, 8)
    mask[1, 3:] = 1.0
    view = CulpritView(None, SimpleNamespace(extra_columns={"advantage": adv}, token_mask=mask))
    whole = Culprit("sample", 1.0, 1.0, batch=1, start=0, end=8, n_terms=5)
    assert advantage_reading(whole, view) == pytest.approx(749.7)
    assert advantage_reading(whole, CulpritView(None, SimpleNamespace(extra_columns={}, token_mask=mask))) is None
    ev = Evidence([SpikeEvent(30, "global", 280.0, 0.12, 27.0, 2333.0)], culprit_share=0.77, n_culprits=4,
                  top_culprit="completion 1 of group 1", advantage=749.7)
    cause = name_cause(ev)
    assert cause.name == "data" and "the largest culprit's advantage is 749.7 (in RL the reward is data" in cause.detail


def test_a_corrupt_weight_the_loss_hides_is_one_event_from_the_weight_norm(run):
    """Held-out tester, stop 52: an embedding row's weight at 1e36 behind LayerNorm left the loss and the
    gradient ordinary; ``weight_norm/global`` logged inf on every step and nothing was said (the weight check
    ran on detected steps only). A weight norm that is not finite scans the weights: one event, the weight
    named, its incident opened; the later steps raise nothing more."""
    run.mon.config.log_every = 1  # weight norms on every step (watch()'s default)
    with torch.no_grad():
        run.model.wte.weight[batch(run.step)[0][0, 0], 3] = 1e36  # a row the batches read
    first = run.step
    with pytest.warns(UserWarning, match=r"a weight is absurd: wte.weight\[\d+, 3\] = 1e\+36"):
        stats = run.train()
    assert math.isfinite(float(stats.metrics["weight_norm/global"])) is False
    assert [e.signal for e in stats.events] == ["weight_norm"], [e.signal for e in stats.events]
    assert stats.cause == "numeric" and stats.cause_detail.startswith("a weight is absurd: wte.weight[")
    assert stats.locate is None and "a weight is corrupt since step" in stats.not_localized
    later = [run.train() for _ in range(4)]
    assert not any(e.signal == "weight_norm" for s in later for e in s.events)  # one event, not one per step
    for s in later:  # what else fires while it stays is that incident's aftermath
        assert not s.events or s.cause_detail.startswith(f"aftermath of step {first} (numeric)")


def test_a_weight_restored_and_another_corrupted_later_is_a_second_incident(run):
    """Review of b5baf6d: a restored weight's incident ended only on a detected step, so a second corruption
    (after a checkpoint was loaded) logged weight_norm/global = inf with no event."""
    run.mon.config.log_every = 1
    row = int(batch(run.step)[0][0, 0])
    with torch.no_grad():
        run.model.wte.weight[row, 3] = 1e36
    with pytest.warns(UserWarning, match=r"wte.weight\[\d+, 3\]"):
        assert [e.signal for e in run.train().events] == ["weight_norm"]
    with torch.no_grad():
        run.model.wte.weight[row, 3] = 0.01  # restored (a checkpoint loaded into the model)
    for _ in range(3):
        run.train()
    with torch.no_grad():
        run.model.h[0].mlp.fc.weight[2, 1] = 1e36  # another one, behind ln2
    second = run.step
    with pytest.warns(UserWarning, match=r"h.0.mlp.fc.weight\[2, 1\]"):
        stats = run.train()
    assert stats.events and stats.cause_detail.startswith("a weight is absurd: h.0.mlp.fc.weight[2, 1]")
    assert f"before step {second}" in stats.cause_detail
