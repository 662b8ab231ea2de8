"""TRL's GRPOTrainer and SFTTrainer with GradLocCallback: the rebuilt loss is TRL's, and the culprit is named.

The loss checks run TRL's own ``compute_loss`` on a batch TRL built (generation, rewards,
advantages, old log-probs) and compare it, and its gradient, with the rebuilt ``loss_fn`` under
the full mask, for every loss type, with dropout on (the recorded RNG state replays it).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from gradloc_track.localizer.probe import restore_rng

from ..examples.load import load_example
from .trl_setup import LETTERS, char_tokenizer, gpt2, grpo_trainer, sft_trainer, vowel_reward

pytest.importorskip("trl")

# (loss_type, trainer attributes, args attributes): TRL 1.16's loss types and the options on top of them
VARIANTS = [
    ("grpo", {}, {}), ("bnpo", {}, {}), ("dr_grpo", {}, {}), ("dapo", {}, {}), ("cispo", {"epsilon_high": 5.0}, {}),
    ("sapo", {}, {}), ("luspo", {"importance_sampling_level": "sequence"}, {}), ("vespo", {}, {}),
    ("grpo", {"beta": 0.04}, {"use_bias_correction_kl": True}), ("dapo", {"beta": 0.04}, {"delta": 1.2}),
    ("grpo", {"importance_sampling_level": "sequence"}, {}), ("dapo", {"top_entropy_quantile": 0.5}, {}),
    ("dapo", {"entropy_coef": 0.01, "_entropy_bonus_enabled": True}, {}),
    ("bnpo", {"off_policy_mask_threshold": 0.05}, {}),
]


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """A GRPOTrainer, one batch it built, made harder: old log-probs off-policy (the clip acts both ways),
    a reference model's log-probs (the KL term), advantages that do not sum to zero per group."""
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    tmp = tmp_path_factory.mktemp("grpo")
    bpe, tok = char_tokenizer(tmp / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = grpo_trainer(tmp, tok, model)
        model.train()
        trainer.current_gradient_accumulation_steps = 2  # set by train(): normalisers divide by it
        tagger = GRPOAdapter(trainer, model)  # tags rows with reward / group / index as TRL builds the batch
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        tagger.remove()
    g = torch.Generator().manual_seed(0)
    old = inputs["old_per_token_logps"]
    inputs["old_per_token_logps"] = old + 0.3 * torch.randn(old.shape, generator=g)
    inputs["ref_per_token_logps"] = old + 0.2 * torch.randn(old.shape, generator=g)
    inputs["advantages"] = inputs["advantages"] + 0.3
    return trainer, model, inputs


def grads(model, loss) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def set_attrs(obj, values: dict) -> dict:
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    return old


IDS = [f"{t}-{'-'.join(a) or 'plain'}" for t, a, _ in VARIANTS]


@pytest.mark.parametrize("loss_type,attrs,args", VARIANTS, ids=IDS)
def test_grpo_rebuilt_loss_is_trls(grpo, loss_type, attrs, args):
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    trainer, model, inputs = grpo
    saved, saved_args = set_attrs(trainer, {"loss_type": loss_type, **attrs}), set_attrs(trainer.args, args)
    adapter = GRPOAdapter(trainer, model)
    try:
        theirs = trainer.compute_loss(model, inputs)  # TRL's own, through our wrapper (dropout on)
        g_theirs = grads(model, theirs)
        ctx = adapter.context()
        restore_rng(ctx.rng_state)
        ours = ctx.loss_fn(ctx.token_mask)
        g_ours = grads(model, ours)
    finally:
        adapter.remove()
        set_attrs(trainer, saved), set_attrs(trainer.args, saved_args)
    assert "compute_loss" not in vars(trainer)  # the wrapper is gone
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5, abs=1e-7)
    assert float((g_ours - g_theirs).norm() / g_theirs.norm()) < 1e-4


def test_grpo_rebuilt_loss_under_trls_default_bf16_autocast(tmp_path):
    """TRL's configs default to bf16=True (CPU included): the rebuilt loss runs under the trainer's autocast.
    The loss agrees to bf16's rounding; the gradients to bf16's ~2^-8 (TRL's fused head and the model's own
    LM head round differently in backward)."""
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    bpe, tok = char_tokenizer(tmp_path / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = grpo_trainer(tmp_path, tok, model, bf16=True, loss_type="grpo")
        model.train()
        trainer.current_gradient_accumulation_steps = 1
        adapter = GRPOAdapter(trainer, model)
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        inputs["advantages"] = inputs["advantages"] + 0.3
        theirs = trainer.compute_loss(model, inputs)
    g_theirs = grads(model, theirs)
    ctx = adapter.context()
    adapter.remove()
    restore_rng(ctx.rng_state)
    ours = ctx.loss_fn(ctx.token_mask)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-3)
    assert float((grads(model, ours) - g_theirs).norm() / g_theirs.norm()) < 2e-2


def test_one_callback_class():
    from gradloc_track.integrations import hf, trl

    assert trl.GradLocCallback is hf.GradLocCallback and trl.TRL_CHECKED == ("1.16.0",)


def test_grpo_loss_fn_adds_up_over_uneven_subsets(grpo):
    """Sum over kept terms with fixed normalisers: two halves that cut rows unevenly add up to the whole,
    loss and gradient (the localizer's contract), for the per-sequence mean of loss_type='grpo'."""
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    trainer, model, inputs = grpo
    saved = set_attrs(trainer, {"loss_type": "grpo"})
    adapter = GRPOAdapter(trainer, model)
    try:
        trainer.compute_loss(model, inputs)
        ctx = adapter.context()
    finally:
        adapter.remove()
        set_attrs(trainer, saved)
    full = ctx.token_mask
    a = full.clone()
    a[0::2] = 0  # even rows: none of their terms
    a[1::4, : full.shape[1] - 3] = 0  # rows 1, 5: only their last terms
    parts = []
    for m in (full, a, full - a):
        restore_rng(ctx.rng_state)
        loss = ctx.loss_fn(m)
        parts.append((float(loss.detach()), grads(model, loss)))
    (lf, gf), (la, ga), (lb, gb) = parts
    assert la + lb == pytest.approx(lf, rel=1e-5)
    assert float((ga + gb - gf).norm() / gf.norm()) < 1e-4


def test_grpo_two_micro_batches_localize_the_stale_row(grpo):
    """Gradient accumulation: two micro-batches recorded, the step's context holds both (one RNG state
    each); their losses sum to TRL's; the localizer names the row whose old log-probs are stale by 6
    nats, in its micro-batch."""
    import gradloc_track
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    trainer, model, inputs = grpo
    halves = [{k: v[i * 4:(i + 1) * 4] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in inputs.items()}
              for i in range(2)]
    stale = 1  # a negative advantage: PPO's clip leaves a large ratio alone
    halves[1]["advantages"] = halves[1]["advantages"].clone()
    halves[1]["advantages"][stale] = -1.0
    halves[1]["old_per_token_logps"] = halves[1]["old_per_token_logps"].clone()
    halves[1]["old_per_token_logps"][stale] -= 6.0
    saved = set_attrs(trainer, {"loss_type": "dapo"})
    adapter = GRPOAdapter(trainer, model)
    try:
        theirs = sum(float(trainer.compute_loss(model, h).detach()) for h in halves)
        ctx = adapter.context()
    finally:
        adapter.remove()
        set_attrs(trainer, saved)
    assert ctx.micro_batches == 2 and len(ctx.rng_state) == 2 and ctx.rng_state[0] is not ctx.rng_state[1]
    ours = 0.0
    for fn, m, rng in zip(ctx.loss_fn, ctx.token_mask, ctx.rng_state):
        restore_rng(rng)
        ours += float(fn(m).detach())
    assert ours == pytest.approx(theirs, rel=1e-5)
    result = gradloc_track.locate(model, ctx.loss_fn, ctx.token_mask, rng_state=ctx.rng_state)
    P = halves[1]["prompt_ids"].shape[1]
    terms = (halves[1]["completion_mask"][stale] != 0).nonzero().flatten() + P - 1
    assert {(c.micro_batch, c.batch, c.position) for c in result.tokens} == {(1, stale, int(t)) for t in terms}


def test_grpo_context_layout(grpo):
    """Terms at model positions P-1+j; display ids are the completion tokens there; prompt and completion
    segments; RL columns at the same positions; each row tagged with its reward, group and index."""
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    trainer, model, inputs = grpo
    adapter = GRPOAdapter(trainer, model)
    try:
        trainer.compute_loss(model, inputs)
        ctx = adapter.context()
    finally:
        adapter.remove()
    P, C = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    mask = inputs["completion_mask"].float()
    assert torch.equal(ctx.token_mask[:, P - 1:P + C - 1], mask) and ctx.token_mask[:, :P - 1].sum() == 0
    shown = ctx.input_ids[:, P - 1:P + C - 1]
    assert torch.equal(shown[mask.bool()], inputs["completion_ids"][mask.bool()])
    assert ctx.segment_names == ("prompt", "completion")
    assert set(ctx.segment_ids[:, P - 1:P + C - 1][mask.bool()].tolist()) == {1}
    assert set(ctx.segment_ids[:, :P - 1][inputs["prompt_mask"][:, 1:].bool()].tolist()) == {0}
    cols = ctx.extra_columns
    assert list(cols) == ["advantage", "logprob", "old_logprob", "ratio", "entropy", "ref_logprob"]
    ratio = cols["ratio"][:, P - 1:P + C - 1]
    expect = (cols["logprob"] - cols["old_logprob"]).exp()[:, P - 1:P + C - 1]
    assert torch.allclose(ratio[mask.bool()], expect[mask.bool()], rtol=1e-5)
    assert torch.equal(cols["advantage"][:, P - 1], inputs["advantages"].float())
    sc = ctx.sample_columns
    assert set(sc) == {"reward", "group", "index"}
    texts = trainer.processing_class.batch_decode(inputs["completion_ids"], skip_special_tokens=True)
    assert sc["reward"].tolist() == pytest.approx(vowel_reward(texts))  # each row's own reward, after TRL's shuffle
    pairs = {(int(g), int(i)) for g, i in zip(sc["group"], sc["index"])}
    assert pairs == {(g, i) for g in range(8 // trainer.num_generations) for i in range(trainer.num_generations)}
    for g in range(8 // trainer.num_generations):  # a group: one prompt's completions
        assert len({tuple(r.tolist()) for r in inputs["prompt_ids"][sc["group"] == g]}) == 1


def test_grpo_moe_aux_loss_is_not_localized(grpo):
    """A load-balancing loss is not a sum over tokens: the adapter says so, records nothing, the run goes on."""
    from gradloc_track.integrations.trl.grpo import GRPOAdapter

    trainer, model, inputs = grpo
    saved = set_attrs(trainer, {"aux_loss_enabled": True})
    try:
        with pytest.warns(UserWarning, match="load-balancing"):
            adapter = GRPOAdapter(trainer, model)
        assert adapter.context() is None
        adapter.remove()
    finally:
        set_attrs(trainer, saved)


def table_columns(out: Path) -> list[str]:
    from gradloc_track.artifacts import read_table

    return read_table(out, "spikes/tokens")["columns"]


def rows(out: Path) -> list[dict]:
    from gradloc_track.artifacts import read_table

    table = read_table(out, "spikes/tokens")
    return [dict(zip(table["columns"], r)) for r in table["data"]]


def test_grpo_example_names_the_stale_completion(tmp_path, monkeypatch):
    """examples/trl_grpo.py (loss_type='dapo', TRL's default): the injected completion is the culprit (a
    sample row: all its tokens are stale), with its advantage (negative), mean ratio (~e^6), reward, group, index."""
    monkeypatch.chdir(tmp_path)
    callback, injected = load_example("trl_grpo").main(
        ["--steps", "24", "--inject-at", "20", "--report-to", "none", "--out", str(tmp_path / "run")])
    assert callback.handle.finished and [s.step for s in callback.handle.spikes] == [20]
    (r,) = rows(tmp_path / "run")  # every token of the completion is stale: the culprit is the whole completion
    assert (r["step"], r["level"], r["sample"], r["token_id"]) == (20, "sample", injected["sample"], None)
    assert r["share"] > 0.9 and r["token"] and r["sample_id"]
    # per-token columns on a sample row: the mean over its loss terms (one advantage per completion)
    assert r["advantage"] == pytest.approx(injected["advantage"], rel=1e-5)
    assert 100 < r["ratio"] < 1000 and r["old_logprob"] < r["logprob"] - 5  # stale by 6 nats
    assert r["reward"] is not None and r["group"] is not None and r["index"] is not None
    page = (tmp_path / "run" / "spikes" / "highlight" / "step_000020.html").read_text()
    assert "<b>prompt</b>" in page and "<b>completion</b>" in page and "reward <b>" in page


@pytest.mark.slow
def test_grpo_example_one_mlflow_run_holds_trls_metrics_and_ours(tmp_path, mlflow_store, monkeypatch):
    """loss_type='grpo' through TRL's own MLflow run: TRL's reward/clip metrics and ours in ONE run, the table
    naming the injected completion with advantage and ratio columns."""
    from .conftest import mlflow_table

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trl-grpo")
    _, injected = load_example("trl_grpo").main(["--steps", "24", "--inject-at", "20", "--loss-type", "grpo",
                                                "--out", str(tmp_path / "run")])
    (run,) = mlflow_store.new_runs()
    metrics = run.data.metrics
    assert {"reward", "clip_ratio/region_mean", "entropy"} <= set(metrics)  # TRL's
    assert {"grad_norm/global", "spike/culprits"} <= set(metrics)  # ours
    table = mlflow_table(mlflow_store.client, run.info.run_id, tmp_path)
    found = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [(r["step"], r["level"], r["sample"]) for r in found] == [(20, "sample", injected["sample"])]
    assert all(r["advantage"] < 0 and r["ratio"] > 100 for r in found)


# -- SFT with packing -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    bpe, tok = char_tokenizer(tmp / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id, positions=128)
    docs = [(LETTERS[i % 26:] + LETTERS)[: 6 + i % 9] for i in range(40)]  # 6-14 letters: several per row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(tmp, tok, model, docs)
    model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return trainer, model, batch


def test_sft_packed_loss_is_trls_and_documents_stay_apart(sft):
    """The rebuilt loss of a packed, padding-free micro-batch is SFTTrainer's (position ids replayed: each
    document attends to itself only); the document map follows the position-id restarts."""
    from gradloc_track.integrations.trl.sft import SFTAdapter

    trainer, model, batch = sft
    assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"][0, 1:] == 0).sum() >= 2  # packed docs
    n_items = (batch["labels"][:, 1:] != -100).sum()
    adapter = SFTAdapter(trainer, model)
    try:
        theirs = trainer.compute_loss(model, dict(batch), num_items_in_batch=n_items)
        g_theirs = grads(model, theirs)
        forward = adapter.batches[0].forward  # the keyword arguments the rebuild replays
        ctx = adapter.context()
    finally:
        adapter.remove()
    restore_rng(ctx.rng_state)
    ours = ctx.loss_fn(ctx.token_mask)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-5)
    assert float((grads(model, ours) - g_theirs).norm() / g_theirs.norm()) < 1e-4
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    docs = ctx.document_ids[0].tolist()
    for d, (a, b) in enumerate(zip(starts, starts[1:] + [len(docs) + 1])):
        assert docs[a:b - 1] == [d] * (b - 1 - a)  # the term at t scores token t+1: its document
    assert torch.equal(ctx.extra_columns["document"], ctx.document_ids)
    # documents do not see each other: changing document 0's tokens leaves document 1's terms alone
    model.eval()
    with torch.no_grad():
        def doc1_logits(ids):
            out = model(**{**forward, "input_ids": ids}).logits
            return out[0, starts[1]:starts[2] - 1]

        ids = batch["input_ids"].clone()
        before = doc1_logits(ids)
        ids[0, : starts[1]] = (ids[0, : starts[1]] + 3) % model.config.vocab_size
        assert torch.allclose(doc1_logits(ids), before, atol=1e-5)
    model.train()


def test_sft_wrapped_packing_names_documents_at_their_end_of_sequence_tokens(tmp_path):
    """Held-out tester, stop 57: ``packing_strategy="wrapped"`` cuts the concatenated documents into rows with no
    position ids, so a micro-batch of one row had one "sample": a bad document carrying the whole spike read
    "unexplained: ... spread over the batch". Each end-of-sequence token now ends a document, the document map
    the localizer names units by (the rebuilt loss stays SFTTrainer's)."""
    from gradloc_track.integrations.trl.sft import SFTAdapter

    bpe, tok = char_tokenizer(tmp_path / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id, positions=128)
    docs = [(LETTERS[i % 26:] + LETTERS)[: 6 + i % 9] for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(tmp_path, tok, model, docs, packing_strategy="wrapped", per_device_train_batch_size=1)
    model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = batch["input_ids"][0].tolist()
    ends = [t for t, i in enumerate(ids) if i == tok.eos_token_id]
    assert "position_ids" not in batch and len(ends) >= 2 and len(ids) == 48  # one full row of several documents
    adapter = SFTAdapter(trainer, model)
    try:
        theirs = trainer.compute_loss(model, dict(batch))
        ctx = adapter.context()
    finally:
        adapter.remove()
    restore_rng(ctx.rng_state)
    assert float(ctx.loss_fn(ctx.token_mask).detach()) == pytest.approx(float(theirs.detach()), rel=1e-5)
    docs_of = ctx.document_ids[0].tolist()  # the term at t scores token t+1: that token's document
    want = []  # token k's document: the end-of-sequence tokens before it
    for t in range(len(ids)):
        want.append(sum(1 for e in ends if e < min(t + 1, len(ids) - 1)))
    assert docs_of == want and max(docs_of) >= 2
    assert torch.equal(ctx.extra_columns["document"], ctx.document_ids)
    # the pad token is the end-of-sequence one here: a short last row's padding ends no document (review: one
    # "document" per pad position)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        short = sft_trainer(tmp_path / "short", tok, model, [LETTERS[i:i + 8] for i in range(7)],
                            packing_strategy="wrapped", per_device_train_batch_size=2)  # rows of 48 and 15 tokens
    batch = short._prepare_inputs(next(iter(short.get_train_dataloader())))
    assert int(batch["attention_mask"][1].sum()) < 48 and tok.pad_token_id == tok.eos_token_id
    adapter = SFTAdapter(short, model)
    try:
        short.compute_loss(model, dict(batch))
        row = adapter.context().document_ids[1].tolist()
    finally:
        adapter.remove()
    assert max(row) == 2  # a piece of the row before's document, one whole document, then the padding


def test_an_sft_loss_that_is_not_rebuilt_keeps_the_adapters_reason(tmp_path):
    """Review, stop 57: a TRL door records through its adapter, not the batch capture, so the handle read every
    step as "no training forward of the watched model was recorded", the reason a spike's record would carry
    though the forward ran. The adapter's own reason (here label smoothing) is the one said."""
    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.hf import GradLocCallback

    bpe, tok = char_tokenizer(tmp_path / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id, positions=128)
    docs = [(LETTERS[i % 26:] + LETTERS)[: 6 + i % 9] for i in range(40)]
    callback = GradLocCallback(tracker=MemoryTracker(), run_dir=tmp_path / "run", console=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = sft_trainer(tmp_path, tok, model, docs, packing=False, label_smoothing_factor=0.1)
        trainer.add_callback(callback)
        trainer.train()
    assert any("label smoothing" in str(w.message) for w in caught)
    assert callback.handle.monitor.responder.no_context is None


def test_sft_keep_columns_reach_the_culprit_table(sft):
    """keep_columns' dataset index under SFTTrainer: the adapter takes it out of the inputs into the spike context's
    sample columns (held-out tester round 4: the table had no idx column, and nothing said so)."""
    from gradloc_track.integrations.sample_info import SAMPLE_INFO_KEY, strip_sample_info
    from gradloc_track.integrations.trl.sft import SFTAdapter

    trainer, model, batch = sft
    hook = strip_sample_info(model)  # as keep_columns(model, ...) does: the model never sees the column
    adapter = SFTAdapter(trainer, model)
    try:
        trainer.compute_loss(model, {**batch, SAMPLE_INFO_KEY: {"idx": [17]}})
        ctx = adapter.context()
    finally:
        adapter.remove()
        hook.remove()
    assert ctx.sample_columns == {"idx": [17]}
    assert SAMPLE_INFO_KEY not in adapter_forward_keys(ctx, model)


def adapter_forward_keys(ctx, model):
    """The keyword arguments the rebuilt loss calls the model with (a pre-hook records them)."""
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(set(k)), with_kwargs=True)
    try:
        with torch.no_grad():
            ctx.loss_fn(ctx.token_mask)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.slow
def test_sft_packing_example_names_the_corrupted_document(tmp_path, monkeypatch):
    """examples/trl_sft_packing.py: the spike at the injected step; the culprit tokens' document is the corrupted
    one (they carry a third or more of the step's squared gradient norm, other documents of the row hardly any)."""
    monkeypatch.chdir(tmp_path)
    callback, injected = load_example("trl_sft_packing").main(["--report-to", "none", "--out", str(tmp_path / "r")])
    assert [s.step for s in callback.handle.spikes] == [injected["step"]]
    found = rows(tmp_path / "r")
    share: dict[int, float] = {}
    for r in found:
        share[r["document"]] = share.get(r["document"], 0.0) + r["share"]
    top = max(share, key=share.get)
    assert top == injected["document"] and share[top] > 0.3 and share[top] >= 0.8 * sum(share.values())
    # the document's rows lie inside it (a document row spans its terms: the term before its first token included)
    assert all(injected["start"] - 1 <= r["position"] < r["end"] <= injected["end"]
               for r in found if r["document"] == top)
    assert len([c for c in table_columns(tmp_path / "r") if c == "document"]) == 1  # TRL's column is ours
    page = (tmp_path / "r" / "spikes" / "highlight" / f"step_{injected['step']:06d}.html").read_text()
    assert f"<b>document {top}</b>" in page
    assert json.loads((tmp_path / "r" / "tags.json").read_text()).get("spike_count") == "1"


def test_with_the_detector_off_sfttrainer_is_not_patched_and_its_norms_are_logged(tmp_path):
    """``spikes=False``: nothing reads TRL's micro-batches, so no adapter records them (``compute_loss`` is the
    trainer's own all through the run); the gradient norms are logged every step as with the detector on."""
    from transformers import TrainerCallback

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.hf import GradLocCallback

    bpe, tok = char_tokenizer(tmp_path / "tok")
    model = gpt2(bpe.vocab_size, tok.pad_token_id, positions=128)
    docs = [(LETTERS[i % 26:] + LETTERS)[: 6 + i % 9] for i in range(40)]
    tracker = MemoryTracker()
    callback = GradLocCallback(tracker=tracker, run_dir=tmp_path / "run", console=False, spikes=False)
    seen = []

    class Check(TrainerCallback):  # beside ours: is compute_loss patched in the middle of the run?
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(("compute_loss" in vars(trainer), callback.adapter))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(tmp_path, tok, model, docs, packing=False)
        trainer.add_callback(callback)
        trainer.add_callback(Check())
        trainer.train()
    assert seen == [(False, None), (False, None)]
    steps = sorted({s for s, _ in tracker.series("grad_norm/global")})
    assert steps == [1, 2]
