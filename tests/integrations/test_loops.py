"""The loops people write, with ``watch()`` as their only change: nanoGPT's ``model(x, y)``,
Accelerate's prepared optimizer under gradient accumulation, a ``torch.compile``d model."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track import MemoryTracker

from .conftest import CORRUPT, FAST, INJECT_AT, LR, STEPS, corrupted_positions, counting_batch, micro_batches, tiny_gpt2
from .nanogpt import tiny_gpt


def nanogpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's ``get_batch``: x = tokens[:, :-1], y = tokens[:, 1:] (already shifted; -1 = no loss);
    at INJECT_AT sample CORRUPT is the garbage document."""
    b = counting_batch(step, corrupt_sample=CORRUPT if step == INJECT_AT else None)
    y = b["labels"][:, 1:].masked_fill(b["labels"][:, 1:] == -100, -1)
    return b["input_ids"][:, :-1], y  # (B, T), (B, T)


def rows_of(tracker: MemoryTracker) -> list[dict]:
    table = tracker.tables["spikes/tokens"]
    return [dict(zip(table["columns"], r)) for r in table["rows"]]


@pytest.mark.parametrize("compiled", [False, True])
def test_nanogpt_loop_localizes_with_positional_targets(tmp_path, compiled):
    """``logits, loss = model(x, y)``: the call is read as ids ``idx`` and targets; probes call
    ``model(idx=x, targets=y)`` again (without targets the forward keeps the last position only).
    Compiled (``torch.compile``, dynamo's eager backend: the same wrapper and guards without inductor's code
    generation), the same tokens: the localizer runs the model eagerly, so the hooks it adds at the spike run
    (held-out tester round 5: "localizing failed: stack expects a non-empty TensorList")."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if compiled:
        model = torch.compile(model, backend="eager")
    tracker = MemoryTracker()
    handle = gradloc_track.watch(model, opt, tracker=tracker, run_dir=tmp_path, **FAST)
    for step in range(STEPS):
        x, y = nanogpt_batch(step)
        logits, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    handle.finish()
    assert [s.step for s in handle.spikes] == [INJECT_AT]
    rows = rows_of(tracker)
    assert {(r["step"], r["sample"], r["position"]) for r in rows} == {
        (INJECT_AT, CORRUPT, p) for p in corrupted_positions()}
    x, y = nanogpt_batch(INJECT_AT)
    assert {r["token_id"] for r in rows} == {int(t) for t in y[CORRUPT, : len(corrupted_positions())]}


def test_last_position_logits_name_set_loss_fn_once():
    """A loop training on ``model(x)``, whose logits hold the last position only: the loss cannot be
    rebuilt, and the warning (once) shows ``handle.set_loss_fn``; no localization is attempted."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), spikes={"warmup_steps": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = nanogpt_batch(step)
            logits, _ = model(x)  # (B, 1, V)
            F.cross_entropy(logits[:, -1], y[:, -1]).backward()
            opt.step()
            opt.zero_grad()
    handle.finish()
    said = [str(w.message) for w in caught if "gradloc-track" in str(w.message)]
    assert len(said) == 1, said
    assert "logits for 1 of the batch's 15 positions" in said[0] and "handle.set_loss_fn(" in said[0]
    assert handle.steps == 3
    # a spike's record says the same reason, not "no spike_context passed" (the user never had to pass one)
    why = handle.monitor.responder.why_not_localized(3, None)
    assert "logits for 1 of the batch's 15 positions" in why and "set_loss_fn" in why


def test_accelerate_prepared_optimizer_is_hooked_once_per_real_step(gpt2, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    k = 2
    AcceleratorState._reset_state(True)  # process-wide singletons: an earlier Trainer's settings must not leak in
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=k)
    try:
        model, opt = accelerator.prepare(gpt2, torch.optim.AdamW(gpt2.parameters(), lr=LR))
        assert type(opt).__name__ == "AcceleratedOptimizer"
        tracker = MemoryTracker()
        handle = gradloc_track.watch(model, opt, tracker=tracker, run_dir=tmp_path, **FAST)
        for step in range(STEPS):
            for mb in micro_batches(step, k):
                with accelerator.accumulate(model):
                    accelerator.backward(model(**mb).loss)
                    opt.step()  # a no-op on the first micro-batch: Accelerate skips it
                    opt.zero_grad()
        handle.finish()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert handle.steps == STEPS and [s for s, _ in tracker.series("grad_norm/global")] == list(range(STEPS))
    assert [s.step for s in handle.spikes] == [INJECT_AT]
    assert {(r["micro_batch"], r["sample"], r["position"]) for r in rows_of(tracker)} == {
        (k - 1, CORRUPT, p) for p in corrupted_positions()}


def test_compiled_model_logs_the_eager_models_names():
    """``torch.compile`` wraps the model (``OptimizedModule``, parameters under ``_orig_mod.``): the
    monitor, the clippers and ``watch()`` report the eager names. backend="eager": the real
    dynamo wrapper, without inductor's minutes of code generation on a CPU."""
    from gradloc_track.clip import AdaGC, LayerClip

    eager = tiny_gpt()
    compiled = torch.compile(eager, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"
    assert next(n for n, _ in compiled.named_parameters()).startswith("_orig_mod.")
    names = gradloc_track.GradMonitor(eager).names
    assert gradloc_track.GradMonitor(compiled).names == names and not any("_orig_mod" in n for n in names)
    for cls in (AdaGC, LayerClip):
        assert list(cls(compiled).names) == list(cls(eager).names)

    keys = []
    for model in (eager, compiled):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = MemoryTracker()
        with gradloc_track.watch(model, opt, tracker=tracker, clip="layerclip", per_tensor=True):
            x, y = nanogpt_batch(0)
            model(x, y)[1].backward()
            opt.step()
        keys.append(sorted(tracker.keys()))
    assert keys[0] == keys[1] and "grad_norm/transformer.h.0" in keys[0]
    # a layer in warm-up has no threshold in force (not logged); its coefficient is, under the eager name
    assert "clip/coef/transformer.h.0" in keys[0]


def test_calls_are_read_by_the_forwards_own_names():
    """Where the ids and targets are, however the loop passed them; a probe replays the same names."""
    from gradloc_track.integrations.batches import LMBatch
    from gradloc_track.integrations.calls import call_model, forward_signature

    x, y = nanogpt_batch(0)
    model = tiny_gpt()
    sig = forward_signature(model)
    for args, kwargs in [((x, y), {}), ((x,), {"targets": y}), ((), {"idx": x, "targets": y})]:
        b = LMBatch.from_call(args, kwargs, sig)
        assert (b.style, b.ids_name, b.targets_key) == ("kwargs", "idx", "targets")
        assert torch.equal(b.input_ids, x) and torch.equal(b.target_ids, y)
        assert call_model(model, b)[0].shape == (*x.shape, 64)  # replayed with targets: every position

    class Star(torch.nn.Module):  # a forward(*args) wrapper: positions are all there is
        def forward(self, *args, **kwargs):
            return model(*args, **kwargs)

    b = LMBatch.from_call((x, y), {}, forward_signature(Star()))
    assert (b.style, b.targets_key) == ("positional", 1) and torch.equal(b.target_ids, y)
    tgt, mask, _ = b.targets()
    assert torch.equal(tgt, y.masked_fill(y < 0, -100)) and torch.equal(mask, (y >= 0).float())
    hf = LMBatch.from_call((x,), {"attention_mask": torch.ones_like(x)}, forward_signature(tiny_gpt2()))
    assert (hf.style, hf.ids_name, hf.target_ids) == ("kwargs", "input_ids", None)
    assert hf.attention_mask is not None


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
def test_a_prompt_masked_loop_on_ids_alone_rebuilds_its_loss_terms_only(autocast):
    """SFT in a plain loop: the model gets ids alone (``model(x[:, :-1])``), the prompt is masked in labels it
    never sees (``-100``). The terms are read from the logits' gradient: the rebuilt loss has exactly the user's
    terms and targets, and equals the user's loss (before, every position was a term and the replay counted
    the prompts: the step check called a data spike irreproducible). Rows: no prompt, short and long prompts,
    everything masked."""
    from gradloc_track.demo.model import TinyGPT
    from gradloc_track.integrations.batches import MicroBatchCapture, lm_loss_fns

    torch.manual_seed(0)
    model = TinyGPT(32, n_layer=1, n_head=2, d_model=16, max_seq_len=16)
    capture = MicroBatchCapture(model)
    tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(1))
    x, labels = tokens[:, :-1], tokens[:, 1:].clone()
    for row, prompt in enumerate([0, 3, 9, 16]):
        labels[row, :prompt] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, 32), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    (batch,), _ = capture.take()
    capture.remove()
    tgt, mask, _ = batch.targets()
    assert torch.equal(mask.bool(), labels != -100)
    assert torch.equal(tgt[mask.bool()], labels[labels != -100])
    (loss_fn,), (full,), _ = lm_loss_fns(model, [batch])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        rebuilt = loss_fn(full)
    assert float(rebuilt) == pytest.approx(float(loss), rel=1e-5)


def test_the_terms_read_from_the_gradient_add_up_over_backwards_and_float16_keeps_every_position():
    """Two backwards through one forward's logits (retain_graph: a cross-entropy, then a z-loss on the last 4
    positions) add up their terms; the second replaced the first's (reviewer round 9). Float16 logits underflow
    a confident term's whole gradient row to 0, so a zero says nothing there: every position stays a term
    (reading them halved a memorised batch's rebuilt loss)."""
    from gradloc_track.integrations.batches import LMBatch, watch_terms

    ids = torch.randint(0, 8, (2, 6), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float16):
        batch = LMBatch(input_ids=ids)
        logits = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        watch_terms(batch, logits)
        ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, 8), ids[:, 1:].reshape(-1))
        ce.backward(retain_graph=True)
        logits[:, -4:].float().logsumexp(-1).pow(2).mean().backward()
        _, mask, _ = batch.targets()
        if dtype == torch.float32:
            assert batch.terms.all() and mask[:, :-1].all()  # the CE's 5 positions a row, the z-loss's among them
        else:
            assert batch.terms is None and mask[:, :-1].all()
        assert (batch.last_targets != -100).all()  # the z-loss has a term at the last position


def test_a_spike_contexts_column_checks_take_every_form_the_table_reads():
    """A per-position column as B per-sample tensors or arrays was refused as '(B,)' (reviewer round 9); a lazy
    mapping (TRL's RL columns) is not computed to be checked: it costs a forward, only for a localized spike."""
    import numpy as np

    from gradloc_track.integrations.rl_columns import LazyColumns
    from gradloc_track.spikes import SpikeContext

    def never():
        raise AssertionError("computed at construction")

    mask = torch.ones(3, 5)
    ctx = SpikeContext(lambda keep: keep.sum(), mask,
                       extra_columns={"advantage": [torch.arange(5.0)] * 3, "logprob": [np.zeros(5)] * 3},
                       sample_columns={"reward": np.zeros(3), "pair": torch.zeros(3, 2)})
    assert set(ctx.extra_columns) == {"advantage", "logprob"}
    SpikeContext(lambda keep: keep.sum(), mask, extra_columns=LazyColumns(["ratio"], never))
    with pytest.raises(ValueError, match=r"extra_columns\['advantage'\]: one value per position, shape \(3, 5\)"):
        SpikeContext(lambda keep: keep.sum(), mask, extra_columns={"advantage": [torch.arange(4.0)] * 3})


def test_watch_given_the_eager_model_while_the_loop_calls_it_compiled_fullgraph():
    """Held-out tester, stop 54: ``watch(model)`` with the loop calling ``torch.compile(model, fullgraph=True)``
    died at the first step (dynamo traced watch()'s forward pre-hook into the graph: "Attempted to call function
    marked as skipped ... get_rng_state"); without fullgraph it broke the graph on a host read. The hooks now
    record nothing when traced, the norms are logged as ever, and one warning says to give watch() the compiled
    module. backend="eager": dynamo's tracing, without inductor's code generation."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    tracker = MemoryTracker()
    with pytest.warns(UserWarning, match=r"hooks traced into its graph.*watch\(torch\.compile\(model\), opt\)"):
        with gradloc_track.watch(model, opt, tracker=tracker) as handle:
            for step in range(3):
                x, y = nanogpt_batch(step)
                compiled(x, y)[1].backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    assert [s for s, _ in tracker.series("grad_norm/global")] == [0, 1, 2]
    # what a spike here would say it was not localized for (stop 57: "no spike_context passed to after_backward")
    assert handle.monitor.responder.no_context.startswith("the model's forward ran traced inside torch.compile")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_model_compiled_in_place_is_localized(when, fullgraph):
    """Review, stop 54: ``model.compile()`` compiles the module in place, so the module watch() holds runs its
    hooks inside the compiled graph; recording nothing there lost the localization that had worked. The capture
    now runs around the in-place compiled call, before or after watch(), fullgraph or not: the same tokens as
    eager, no warning, and the model's own compiled call back in place after finish()."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if when == "before":
        model.compile(backend="eager", fullgraph=fullgraph)
    compiled_call = model._compiled_call_impl
    tracker = MemoryTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "traced" warning: nothing is lost
        handle = gradloc_track.watch(model, opt, tracker=tracker, **FAST)
        if when == "after":
            model.compile(backend="eager", fullgraph=fullgraph)
            compiled_call = model._compiled_call_impl
        for step in range(STEPS):
            x, y = nanogpt_batch(step)
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        handle.finish()
    assert [s.step for s in handle.spikes] == [INJECT_AT]
    assert {(r["step"], r["sample"], r["position"]) for r in rows_of(tracker)} == {
        (INJECT_AT, CORRUPT, p) for p in corrupted_positions()}
    assert model._compiled_call_impl is compiled_call
