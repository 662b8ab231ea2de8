"""Each term's loss and excess over chance (``spikes/term_stats.py``), both routes against a brute-force
per-term loop: from the log-probabilities the model's own cross-entropy saved, and from the logits in
blocks. The graph route is taken only for a cross-entropy over the very logits the model returned."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc_track.spikes.term_stats as ts
from gradloc_track.integrations.step_losses import detector_losses
from gradloc_track.spikes.junk import junk_span
from gradloc_track.spikes.sample_loss import sample_losses


def brute(logits: torch.Tensor, target: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per row: -log p_target and its excess over the mean loss of every token the model could emit."""
    losses, excess = [], []
    for z, t in zip(logits.double(), target):
        ok = torch.isfinite(z)
        logp = z - torch.logsumexp(z[ok], 0)
        losses.append(-float(logp[t]))
        excess.append(-float(logp[t]) + float(logp[ok].mean()))
    return losses, excess


@pytest.fixture
def flat():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(10, 13, generator=g) * 4
    z[3, [2, 7]] = -math.inf  # a vocabulary mask on one row
    return z, torch.randint(0, 13, (10,), generator=g).clamp(max=6)


@pytest.mark.parametrize("block", [None, 13, 3 * 13])
def test_from_the_logits_against_a_loop(flat, block, monkeypatch):
    z, t = flat
    if block:
        monkeypatch.setattr(ts, "CPU_BLOCK", block)  # 1 and 3 positions a block
    got = ts.term_stats(z, t, log_probs=False)
    want_loss, want_excess = brute(z, t)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)


def test_from_log_probs_is_the_same(flat):
    z, t = flat
    got = ts.term_stats(torch.log_softmax(z, -1), t, log_probs=True)
    want_loss, want_excess = brute(z, t)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)


def test_bf16_logits_and_strided_rows_are_read_without_a_whole_copy(flat):
    z, t = flat
    z3 = torch.nan_to_num(z, neginf=-30.0).bfloat16().view(2, 5, 13)
    got = ts.term_stats(z3[:, :-1], t.view(2, 5)[:, :-1], log_probs=False)  # (2, 4, 13), not viewable flat
    want_loss, want_excess = brute(z3[:, :-1].float().reshape(-1, 13), t.view(2, 5)[:, :-1].reshape(-1))
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-4)
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-4)


class NanoGPT(torch.nn.Module):
    """``model(x, y) -> (logits, loss)`` with a plain cross-entropy, nanoGPT's way (``ignore_index=-1``)."""

    def __init__(self, V: int = 17, d: int = 8, shifted: bool = False) -> None:
        super().__init__()
        self.emb, self.head, self.shifted = torch.nn.Embedding(V, d), torch.nn.Linear(d, V), shifted

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.emb(x)))  # (B, T, V)
        if self.shifted:  # the HF-before-4.46 way: the last position's logits left out
            return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-1)


def _case(shifted: bool):
    torch.manual_seed(0)
    model = NanoGPT(shifted=shifted)
    x = torch.randint(0, 17, (3, 9))
    y = torch.randint(0, 17, (3, 9))
    if not shifted:
        y[1, :4] = -1  # a masked prompt
    return model, x, y


@pytest.mark.parametrize("shifted", [False, True])
def test_the_models_own_loss_gives_the_same_terms_as_its_logits(shifted):
    model, x, y = _case(shifted)
    logits, loss = model(x, y)
    saved = ts.saved_log_probs(loss, logits)
    assert saved is not None and saved.log_probs.shape[-1] == 17
    tgt = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], 1) if shifted else y.masked_fill(y < 0, -100)
    from_graph = detector_losses(logits, tgt, x, samples=True, junk_terms=3, output=(logits, loss))
    from_logits = detector_losses(logits.detach(), tgt, x, samples=True, junk_terms=3)
    assert float(from_graph[0]) == pytest.approx(float(from_logits[0]), abs=1e-5)
    assert float(from_graph[1].span) == pytest.approx(float(from_logits[1].span), abs=1e-5)
    assert float(from_graph[1].mean) == pytest.approx(float(from_logits[1].mean), abs=1e-5)
    per = F.cross_entropy(logits.detach().transpose(1, 2), tgt.clamp(min=0), reduction="none")
    want = sample_losses(per, tgt != -100, x, tgt).max()
    assert float(from_graph[0]) == pytest.approx(float(want), abs=1e-5)
    assert float(from_logits[1].span) == pytest.approx(float(junk_span(logits.detach(), tgt, x, terms=3).span),
                                                       abs=1e-6)


def test_the_graph_route_is_taken_only_for_a_cross_entropy_over_these_logits():
    model, x, y = _case(False)
    logits, loss = model(x, y)
    other = model.head(torch.ones(3, 9, 8))  # logits of another forward
    assert ts.saved_log_probs(loss, other) is None
    assert ts.saved_log_probs((logits ** 2).mean(), logits) is None  # not a cross-entropy
    weighted = F.cross_entropy(logits.view(-1, 17), y.view(-1).clamp(min=0), weight=torch.rand(17))
    assert ts.saved_log_probs(weighted, logits) is None  # class weights: not each term's loss
    assert ts.saved_log_probs(loss.detach(), logits) is None
    loss.backward()  # the saved tensors are freed
    assert ts.saved_log_probs(loss, logits) is None


def test_a_vocabulary_mask_in_the_models_loss_stays_out_of_the_mean():
    model, x, y = _case(False)
    logits = model.head(torch.tanh(model.emb(x)))
    masked = logits.masked_fill(torch.arange(17) == 16, -math.inf)  # id 16 can never be emitted
    y = y.clamp(max=15)  # and is no target
    loss = F.cross_entropy(masked.view(-1, 17), y.view(-1), ignore_index=-1)
    saved = ts.saved_log_probs(loss, masked)
    got = ts.term_stats(saved.log_probs, saved.target.clamp(min=0), log_probs=True)
    want_loss, want_excess = brute(masked.detach().view(-1, 17), y.view(-1).clamp(min=0))
    assert torch.isfinite(got.excess).all()
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)


def test_targets_outside_the_vocabulary_and_bad_shapes_name_the_fix():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    targets[1, 2] = 9
    with pytest.raises(ValueError, match="targets hold an id >= the logits' vocabulary size 7"):
        junk_span(logits, targets)
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        junk_span(logits, targets.clamp(max=6), torch.zeros(2, 4, dtype=torch.long))


@pytest.fixture
def device_route(monkeypatch):
    """The accelerator's route on CPU tensors: no host read of the sums but the first one per vocabulary
    size, blocks of 3 positions, 2 rows summed again a block."""
    monkeypatch.setattr(ts, "_on_host", lambda t: False)
    monkeypatch.setattr(ts, "_MASKING", {})
    monkeypatch.setattr(ts, "DEVICE_BLOCK", 3 * 13)
    monkeypatch.setattr(ts, "FIX_MIN", 2)
    monkeypatch.setattr(ts, "FIX_PART", 1000)


def _first_read_unmasked(t: torch.Tensor) -> None:
    """The run's first read holds no mask: the device route then sums each row once (module doc)."""
    ts.term_stats(torch.randn(4, 13), t[:4], log_probs=False)
    assert ts._MASKING == {("cpu", 13): False}


@pytest.mark.parametrize("log_probs", [False, True])
def test_the_device_route_sums_masked_rows_again_without_a_host_read(flat, device_route, log_probs):
    z, t = flat
    _first_read_unmasked(t)
    z = z.clone()
    z[5, 0] = -math.inf  # two masked rows in one block of rows 3-5: both are summed again
    src = torch.log_softmax(z, -1) if log_probs else z
    got = ts.term_stats(src, t, log_probs=log_probs)
    want_loss, want_excess = brute(z, t)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)


def test_the_device_route_counts_masked_rows_beyond_its_budget_as_at_chance(flat, device_route):
    z, t = flat
    _first_read_unmasked(t)
    z = z.clone()
    z[4:6, 1] = -math.inf  # rows 3, 4 and 5 masked, one block: the first two are summed again
    got = ts.term_stats(z, t, log_probs=False)
    want_loss, want_excess = brute(z, t)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)  # losses are exact whatever the mask
    assert got.excess[[3, 4]].tolist() == pytest.approx(want_excess[3:5], abs=1e-5)
    assert float(got.excess[5]) == 0.0  # left over: at chance, never junk, never NaN
    keep = [i for i in range(10) if i != 5]
    assert got.excess[keep].tolist() == pytest.approx([want_excess[i] for i in keep], abs=1e-5)


@pytest.mark.parametrize("log_probs", [False, True])
def test_a_model_that_masks_its_vocabulary_everywhere_is_exact_on_the_device_route(device_route, log_probs):
    """Review of stop 51: a vocabulary padded to -inf on every position left all but the budget's rows at
    chance. The first read sees the mask, and every later step sums each row over its finite entries."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(30, 13, generator=g) * 3
    z[:, 10:] = -math.inf  # ids 10-12 can never be emitted
    t = torch.randint(0, 10, (30,), generator=g)
    src = torch.log_softmax(z, -1) if log_probs else z
    for _ in range(2):  # the first read, which asks the host, and a later one, which does not
        got = ts.term_stats(src, t, log_probs=log_probs)
        want_loss, want_excess = brute(z, t)
        assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)
        assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)
    assert ts._MASKING == {("cpu", 13): True}


@pytest.mark.parametrize("route", ["host", "device"])
@pytest.mark.parametrize("log_probs", [False, True])
def test_no_terms_give_empty_stats(route, log_probs, monkeypatch):
    """A micro-batch whose every label is ignored reaches the pass with no rows (the logits route raised)."""
    if route == "device":
        monkeypatch.setattr(ts, "_on_host", lambda t: False)
        monkeypatch.setattr(ts, "_MASKING", {})
    for src, tgt in ((torch.randn(0, 13), torch.zeros(0, dtype=torch.long)),
                     (torch.randn(0, 5, 13)[:, :-1], torch.zeros(0, 4, dtype=torch.long))):  # not viewable flat
        got = ts.term_stats(src, tgt, log_probs=log_probs)
        assert got.loss.shape == (0,) and got.excess.shape == (0,)


def _largest_resum(monkeypatch) -> list[int]:
    """The element counts ``_masked_mean`` is called with (its temporaries are that size, three of them)."""
    seen: list[int] = []
    inner = ts._masked_mean
    monkeypatch.setattr(ts, "_masked_mean", lambda rows: seen.append(rows.numel()) or inner(rows))
    return seen


@pytest.mark.parametrize("log_probs", [False, True])
def test_the_host_sums_masked_rows_again_a_block_at_a_time(monkeypatch, log_probs):
    """Review of stop 52: on the CPU every masked row of the batch was copied at once to be summed again
    (N x V, with its isfinite mask and where copy: 1078 MiB of peak for 256 MiB of logits, 190 before the
    batch-wide re-sum); a block of rows at a time, as the logits themselves are read."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(40, 13, generator=g) * 3
    z[:, 11:] = -math.inf  # a padded vocabulary: every row masked
    t = torch.randint(0, 11, (40,), generator=g)
    monkeypatch.setattr(ts, "CPU_BLOCK", 5 * 13)
    seen = _largest_resum(monkeypatch)
    src = torch.log_softmax(z, -1) if log_probs else z
    got = ts.term_stats(src, t, log_probs=log_probs)
    want_loss, want_excess = brute(z, t)
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)
    assert got.excess.tolist() == pytest.approx(want_excess, abs=1e-5)
    assert seen and max(seen) <= 5 * 13 and sum(seen) == 40 * 13  # every row once, a block at most at a time


def test_the_device_budget_never_passes_a_block(device_route, monkeypatch):
    """Review of stop 52: with fewer rows in a block than ``FIX_MIN`` (a vocabulary of millions) the budget
    re-summed ``FIX_MIN`` rows at once; it is at most a block's rows, as the docs say."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(12, 13, generator=g)
    t = torch.randint(0, 13, (12,), generator=g)
    _first_read_unmasked(t)
    monkeypatch.setattr(ts, "DEVICE_BLOCK", 2 * 13)  # two rows a block, FIX_MIN 2 -> raise it past a block
    monkeypatch.setattr(ts, "FIX_MIN", 5)
    z[:, 0] = -math.inf  # every row masked after the first read said none were
    seen = _largest_resum(monkeypatch)
    got = ts.term_stats(z, t, log_probs=False)
    want_loss, want_excess = brute(z, t)
    assert max(seen) <= 2 * 13
    assert got.excess[:2].tolist() == pytest.approx(want_excess[:2], abs=1e-5)  # the block's two rows, exact
    assert got.excess[2:].tolist() == [0.0] * 10  # the rest at chance
    assert got.loss.tolist() == pytest.approx(want_loss, abs=1e-5)


def test_a_host_total_that_overflows_re_sums_no_finite_row(monkeypatch):
    """The host asks one question per step, whether the rows' means add up to a finite number (issue 38: the
    per-row isfinite test was four kernels). Finite rows whose means overflow that total lead to the exact
    check, which re-sums none of them; a masked row among them is re-summed, it alone."""
    z = torch.full((8, 4), 2.0 ** 125)  # each row's sum (2^127) and mean finite; the 8 means total 2^128: inf
    t = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    seen = _largest_resum(monkeypatch)
    got = ts.term_stats(z, t, log_probs=False, loss=False)
    assert seen == [] and got.excess.tolist() == [0.0] * 8  # the plain means, untouched
    z[2, 3] = -math.inf
    got = ts.term_stats(z, t, log_probs=False, loss=False)
    assert seen == [4] and got.excess.tolist() == [0.0] * 8  # row 2's mean over its three finite entries
