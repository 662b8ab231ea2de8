"""Units the data signals point at are culprits with their exact share, whatever that share is: rows whose
labels leaked, runs the model rates below chance (``localizer/flagged.py``, ``monitor/data_flags.py``)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gradloc_track.localizer.flagged import Flag
from gradloc_track.monitor.data_flags import data_flags
from gradloc_track.spikes import SpikeEvent
from gradloc_track.spikes.junk import LEAKED, LEAKED_COLUMN, junk_span


def _event(signal: str) -> SpikeEvent:
    return SpikeEvent(3, signal, 1.0, 0.5, 9.0, 2.0)


def test_only_the_signals_that_fired_flag_units():
    ctx = SimpleNamespace(sample_columns={LEAKED_COLUMN: [torch.tensor([1.0, 0.5]), [None, LEAKED]]},
                          input_ids=None, tokenizer=None)
    # never the whole answer, even with no norm fired: structural, on every step a leaked row is in, and its loss
    # is ~0, so a loss that jumped beside it is another row's (review, stop 51: the 90% row went unnamed)
    assert data_flags([_event("leaked_labels")], ctx, None, 4, 0.1) == (
        Flag(0, 0, reason="leaked labels (targets equal to their inputs)"),
        Flag(1, 1, reason="leaked labels (targets equal to their inputs)"))
    assert data_flags([_event("global")], ctx, None, 4, 0.1) == ()  # the leak did not fire: nothing named
    assert data_flags([_event("leaked_labels")], None, None, 4, 0.1) == ()


def test_a_junk_run_is_flagged_over_the_windows_nearer_chance_than_learned_text():
    """Row 1 holds 6 terms the model rates far below chance (positions 3-8) among terms it rates 3 nats above
    chance, as a model that has learned does: with runs of 4, every window holding one of them averages above
    -0.5 (halfway from learned text at junk.LEARNED to chance), so the flag runs from window 0 to window 8's
    end (12), the windows' means computed by hand from the terms' excess. Row 0 never clears the margin."""
    g = torch.Generator().manual_seed(0)
    V, T, terms = 64, 14, 4
    ids = torch.randint(0, V, (2, T), generator=g)
    targets = torch.randint(0, V, (2, T), generator=g)
    logits = torch.zeros(2, T, V)
    for b in range(2):
        logits[b, torch.arange(T), targets[b]] = 3.0 * V / (V - 1)  # excess -3: mean z - z_t
    logits[1, torch.arange(3, 9), targets[1, 3:9]] = -8.0  # excess 8 - 8/64 at positions 3..8
    junk = junk_span(logits, targets, terms=terms)
    excess = torch.full((T,), -3.0)
    excess[3:9] = 8.0 - 8.0 / V
    windows = [float(excess[s:s + terms].mean()) for s in range(T - terms + 1)]
    near = [s for s, m in enumerate(windows) if m > -0.5]
    assert max(windows) > 0.1 and len([m for m in windows if m > 0.1]) < len(near)  # the margin alone: fewer
    ctx = SimpleNamespace(sample_columns={}, input_ids=ids, tokenizer=None)
    (flag,) = data_flags([_event("junk_span")], ctx, junk, terms, 0.1)
    assert (flag.micro_batch, flag.row, flag.start, flag.end) == (0, 1, near[0], near[-1] + terms) == (0, 1, 0, 12)
    # no gradient norm fired: the run is the step's answer (held-out tester, stop 51: beside junk flags a clean
    # '####' banner carrying 47% of an ordinary gradient was named by its share)
    assert flag.alone
    (with_norm,) = data_flags([_event("global"), _event("junk_span")], ctx, junk, terms, 0.1)
    assert not with_norm.alone
    assert data_flags([_event("loss")], ctx, junk, terms, 0.1) == ()


def _oracle_shares(model, forward, rows):
    """Brute force: each row's loss terms' gradient against the step's, <g_row, g> / ||g||^2."""
    m = copy.deepcopy(model)

    def grads(row=None):
        m.zero_grad()
        ce = forward(m)  # (B, T) per-term losses, float64
        (ce.sum() if row is None else ce[row].sum()).div(ce.numel()).backward()
        return torch.cat([p.grad.double().flatten() for p in m.parameters() if p.grad is not None])

    g = grads()
    return {r: float(grads(r) @ g / (g @ g)) for r in rows}


def test_leaked_labels_fire_as_data_and_the_rows_are_culprits_with_their_exact_share():
    """watch() on a GPT-2 whose collator forgot to shift 3 of 8 rows' labels: a data event names them, and
    its culprits are exactly those rows (their gradient is no outlier), each share equal to the brute-force
    oracle's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradloc_track
    from gradloc_track import MemoryTracker

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=24, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker())
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 64, (8, 24), generator=g)
        labels = ids.clone()
        if step == 2:
            labels[[1, 4, 6]] = torch.roll(ids[[1, 4, 6]], 1, 1)  # the model shifts: its targets become the inputs

            def forward(m, ids=ids, labels=labels):
                logits = m(input_ids=ids).logits[:, :-1].double()
                return F.cross_entropy(logits.reshape(-1, 64), labels[:, 1:].reshape(-1),
                                       reduction="none").view(8, -1)

            want = _oracle_shares(model, forward, [1, 4, 6])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    handle.finish()
    assert [s.step for s in handle.spikes] == [2]
    (stats,) = handle.spikes
    assert "leaked_labels" in [e.signal for e in stats.events] and "labels not shifted" in stats.cause_detail
    rows = {c.batch: c for c in stats.locate.culprits}
    assert sorted(rows) == [1, 4, 6] and all(c.level == "sample" for c in rows.values())
    for b, share in want.items():  # the exact additive share (shown scaled when the culprits' exceed 1)
        got = rows[b].raw_share if rows[b].raw_share is not None else rows[b].share
        assert got == pytest.approx(share, rel=1e-3, abs=1e-6)
    assert any("named for leaked labels" in n for n in stats.locate.notes)
    assert stats.cause == "data" and "samples 1, 4, 6" in stats.cause_detail


def test_random_byte_rows_are_named_with_their_exact_share_and_the_replay_is_the_step():
    """A byte-level GPT trained on English (watch(), its own loop: ``model(x[:, :-1])``, the loss on
    ``x[:, 1:]``); two rows of random bytes: the junk signal fires, both rows are culprits at the sample
    level with the brute-force oracle's exact share, and the replay is the step (the loss's last term,
    whose target is in no input, was missing: a 2% residual called the step irreproducible)."""
    import gradloc_track
    from gradloc_track import MemoryTracker
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    data = torch.tensor(list(load_corpus().encode()[:200_000]))
    model = TinyGPT(256, n_layer=2, n_head=2, d_model=48, max_seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(),
                                 spikes={"warmup_steps": 20, "per_layer": False})
    g = torch.Generator().manual_seed(0)

    def forward(m, x):
        logits = m(x[:, :-1]).double()
        return F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)

    def step(x: torch.Tensor) -> None:
        F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    def batch() -> torch.Tensor:
        ix = torch.randint(0, len(data) - 49, (8,), generator=g)
        return torch.stack([data[i:i + 49] for i in ix])

    for _ in range(120):
        step(batch())
    noise = batch()
    noise[[2, 5]] = torch.randint(128, 256, (2, 49), generator=g)
    want = _oracle_shares(model, lambda m: forward(m, noise), [2, 5])
    step(noise)
    handle.finish()
    stats = handle.last
    assert "junk_span" in [e.signal for e in stats.events] and stats.cause == "data"
    # the loss's last term (its target x[:, 48] is in no input) is rebuilt from its gradient: the replay is the step
    assert stats.locate.step_check.replayed and stats.locate.step_check.residual < 1e-4
    rows = {c.batch: c for c in stats.locate.culprits if c.level == "sample"}
    assert {2, 5} <= set(rows)
    for b, share in want.items():  # the exact additive share (shown scaled when the culprits' exceed 1)
        got = rows[b].raw_share if rows[b].raw_share is not None else rows[b].share
        assert got == pytest.approx(share, rel=1e-3, abs=1e-6)


def test_a_context_the_flags_cannot_read_leaves_the_gradient_search_alone(monkeypatch):
    """Reading the flagged units fails (a context of another shape): a warning, and the spike is localized
    by its gradient as before, never a lost localization."""
    from gradloc_track import GradMonitor, MemoryTracker
    from gradloc_track.demo.model import TinyGPT
    from gradloc_track.monitor import responder
    from gradloc_track.spikes import SpikeContext, SpikeDetector

    def broken(*args, **kwargs):
        raise TypeError("a column of another shape")

    monkeypatch.setattr(responder, "data_flags", broken)
    torch.manual_seed(0)
    model = TinyGPT(64, n_layer=1, n_head=2, d_model=16, max_seq_len=16)
    mon = GradMonitor(model, tracker=MemoryTracker(), detector=SpikeDetector(mode="fixed", per_token_threshold=1e-6))
    x = torch.randint(0, 64, (4, 9))

    def loss_fn(mask):
        ce = F.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1), reduction="none")
        return (ce * mask.reshape(-1)).sum() / mask.numel()

    mask = torch.ones(4, 8)
    loss_fn(mask).backward()
    with pytest.warns(UserWarning, match="flagged at step 0 failed"):
        stats = mon.after_backward(0, spike_context=SpikeContext(loss_fn=loss_fn, token_mask=mask))
    assert stats.events and stats.locate is not None and stats.not_localized is None


def test_the_rows_whose_loss_fired_the_sample_signal_are_flagged_alone_when_no_norm_fired():
    """Tester round 12: two garbage rows at loss 5.1 among rows at ~2.5 fired ``loss`` and ``sample_loss`` only;
    a clean row carrying 44% of that ordinary gradient was named, quarantined and operated on, the garbage rows
    were not. The rows at ``sample_min_ratio`` x the signal's running mean or more are flagged; ``alone`` when
    no gradient norm fired; none when most of a micro-batch rose (the batch loss's business)."""
    losses = torch.tensor([5.16, 5.13, 2.66, 2.49, 2.44, 2.40, 2.62, 2.80])
    ctx = SimpleNamespace(sample_columns={}, input_ids=None, tokenizer=None, sample_losses=losses)
    fired = SpikeEvent(260, "sample_loss", 5.16, 2.95, 8.0, 1.75)
    flags = data_flags([SpikeEvent(260, "loss", 3.1, 2.6, 6.0, 1.2), fired], ctx, None, 16, 0.1, 1.5)
    assert [(f.micro_batch, f.row, f.alone) for f in flags] == [(0, 0, True), (0, 1, True)]
    with_norm = data_flags([_event("global"), fired], ctx, None, 16, 0.1, 1.5)
    assert [(f.row, f.alone) for f in with_norm] == [(0, False), (1, False)]
    ctx.sample_losses = [losses, torch.tensor([5.0])]  # a micro-batch of one row counts among the step's rows
    assert [(f.micro_batch, f.row) for f in data_flags([fired], ctx, None, 16, 0.1, 1.5)] == [(0, 0), (0, 1), (1, 0)]
    ctx.sample_losses = [losses, torch.full((8,), 5.0)]  # 10 of 16 rows rose: the batch loss's business
    assert data_flags([fired], ctx, None, 16, 0.1, 1.5) == ()
    ctx.sample_losses, ctx.document_ids = losses, torch.zeros(8, 16, dtype=torch.long)  # packed: a row's loss
    assert data_flags([fired], ctx, None, 16, 0.1, 1.5) == ()  # would name its first document, not the loud one


def test_flagged_alone_rows_are_the_answer_not_a_row_that_carries_most_of_an_ordinary_gradient():
    """The localizer's side: a row whose exact share stands out is named on its own (by its share at 3x, by its
    intensity at 10x), but not beside flags of a step that no gradient norm fired on; the flagged rows are
    named, each with its exact share (brute force: one backward of its terms)."""
    import gradloc_track
    from gradloc_track.localizer.flagged import Flag

    from .oracles import dot, grads_of, term_mask, tiny_gpt

    B, T, V = 8, 16, 64
    model = tiny_gpt(V, T)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)

    def loss_fn(mask):
        return (F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T) * w * mask
                ).sum() / (B * T)

    for weight in (3.0, 10.0):  # row 5 carries most of the step's gradient
        w[5] = weight
        model.zero_grad()
        loss_fn(torch.ones(B, T)).backward()
        total = [p.grad.detach().clone() for p in model.parameters()]
        plain = gradloc_track.locate(model, loss_fn, torch.ones(B, T))
        assert [(c.level, c.batch) for c in plain.culprits] == [("sample", 5)]
        flags = [Flag(0, 0, reason="loss", alone=True), Flag(0, 1, reason="loss", alone=True)]
        res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), flagged=flags)
        assert sorted((c.level, c.batch) for c in res.culprits) == [("sample", 0), ("sample", 1)], weight
        for c in res.culprits:
            row = grads_of(model, loss_fn(term_mask((B, T), [(c.batch, t) for t in range(T)])))
            assert (c.raw_share if c.raw_share is not None else c.share) == pytest.approx(
                dot(row, total) / dot(total, total), rel=1e-4)


def test_a_junk_run_goes_on_across_dips_shorter_than_a_window():
    """Held-out tester, stop 51: a row of random tokens wanders around chance, one window of it dips under the
    bar now and then, and whole random rows were named as spans 2-56 and 91-128 of 128 (then, on a step only
    the junk signal fired on, as a span only). A dip of at most one window's length does not end the run; a
    stretch of learned text longer than that does."""
    from gradloc_track.monitor.data_flags import _block

    row = torch.tensor([0.2] * 5 + [0.3] + [0.2] * 4 + [-0.8] * 3 + [0.1] * 10 + [-2.0] * 20 + [0.25] * 5)
    assert _block(row, -0.5) == (0, 9)  # the contiguous block alone
    assert _block(row, -0.5, 4) == (0, 22)  # across the 3-window dip, not across the 20 windows of learned text
    assert _block(row, -0.5, 2) == (0, 9)  # a dip longer than the gap ends it
    # a packed row's document boundary (windows across it are -inf) is never crossed, however short: the run
    # would name the clean document before the junk one (review, stop 51)
    packed = torch.tensor([-2.0] * 8 + [0.0] * 4 + [-float("inf")] * 3 + [0.5] * 6)
    assert _block(packed, -0.5, 4) == (15, 20)


def test_a_rule_of_hashes_inside_prose_is_excused_by_its_core_not_its_edges():
    """Review, stop 51: the excuse read the extended run, whose edge windows hold the prose around a '#' rule,
    so the rule the detector itself excused was flagged as junk (and, alone, named as the step's answer)."""
    prose = list(b"The quick brown fox jumps over the lazy dog and keeps on running. ")
    junk = [(7 * i + 131) % 256 for i in range(40)]  # high bytes: no text
    ids = torch.tensor([prose[:30] + junk + prose[:26], prose[:30] + [ord("#")] * 40 + [10] + prose[:25]])
    excess = torch.full((2, 96), -2.0)
    excess[0, 30:70], excess[1, 30:70] = 0.6, 0.4
    valid = torch.ones(2, 96, dtype=torch.bool)
    from gradloc_track.spikes.junk import junk_stats

    span = junk_stats(excess, valid, None, 16, None, valid.sum())
    ctx = SimpleNamespace(sample_columns={}, input_ids=ids, tokenizer=None)
    assert [f.row for f in data_flags([_event("junk_span")], ctx, span, 16, 0.1)] == [0]


def test_the_ghost_method_keeps_its_own_search_beside_flags_that_are_the_answer():
    """Review, stop 51: ``locate.method="ghost"`` names no flags, and flags that are the whole answer skipped its
    token search, so it returned nothing (then backed off as an empty result)."""
    import gradloc_track
    from tests.localizer.oracles import tiny_gpt

    B, T, V = 8, 16, 64
    model = tiny_gpt(V, T)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    w[5, 3] = 60.0

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)

    flag = Flag(0, 2, 4, 12, "a run the model rates below chance", alone=True)
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="ghost", flagged=[flag])
    assert [(c.batch, c.position) for c in res.tokens] == [(5, 3)]


def test_clean_rows_under_the_sample_signals_floor_are_not_flagged_beside_the_row_that_passed_it():
    """Review, stop 58: in a memorised run (the largest row's running mean 0.30) a garbage row at 1.30 passed
    ``spikes.sample_min_rise`` (0.8 nats) and fired; two clean rows at 0.70, +0.40 nats, were flagged beside it
    (the level read the ratio and the geometric mean, 0.63, not the floor) and named as the step's answer."""
    from gradloc_track.config import SpikeConfig
    from gradloc_track.monitor.data_flags import flag_rule
    from gradloc_track.spikes import SpikeDetector

    losses = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 1.3])
    ctx = SimpleNamespace(sample_columns={}, input_ids=None, tokenizer=None, sample_losses=losses)
    fired = SpikeEvent(150, "sample_loss", 1.3, 0.304, 9.0, 1.3 / 0.304)
    rule = flag_rule(SpikeDetector())
    assert rule == (16, 0.1, 1.5, SpikeConfig().sample_min_rise)
    assert [(f.row, f.alone) for f in data_flags([fired], ctx, None, *rule)] == [(7, True)]
    # without the floor the old level (0.63) names the clean rows too: the floor is what keeps them out
    assert [f.row for f in data_flags([fired], ctx, None, 16, 0.1, 1.5, 0.0)] == [5, 6, 7]
