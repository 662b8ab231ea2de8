"""The one-process checks of the adapter's parts on verl's real engine and batch, each against an
independent reference: the layout against verl's own ``no_padding_2_padding`` and the ids (padded
and packed), the packed model call against the padded one, the probe loss against verl's own
``forward_step`` and additivity (values and gradients) under every ``loss_agg_mode``, the
recorder against verl's micro-batch split, the RL columns against the batch's tensors. Run by
the world-1 launch (``worker.main``) on its engine; the tests (``test_layout.py`` etc.) read the JSON."""
from __future__ import annotations

import math

import torch

from . import engine_setup as S

AGGS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")


def _local(t):
    return getattr(t, "_local_tensor", t)


def _grads(engine) -> list[torch.Tensor]:
    return [_local(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(_local(p))
            for p in engine.module.parameters()]


def _record(engine, td, loss_fn):
    from gradloc_track.integrations.verl.recorder import StepRecorder

    rec = StepRecorder(engine)
    engine.optimizer_zero_grad()
    with rec.recording():
        engine.forward_backward_batch(td, loss_fn, forward_only=False)
    return rec, _grads(engine)


def layout_checks(mb, packed: bool) -> dict:
    """The grid against verl: the scored token, the log-prob verl slices, prompt/response segments."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from gradloc_track.integrations.rl_columns import COMPLETION
    from gradloc_track.integrations.verl.layout import MicroBatch

    data = mb.data.copy()
    tu.assign_non_tensor(data, use_remove_padding=packed)
    view = MicroBatch(data, mb.rng, mb.outputs)
    g = view.geo
    flat = data["input_ids"].values()
    real = g.real
    # the token a term scores, read from verl's flat ids: sample start + prompt length + j
    starts = data["input_ids"].offsets()[:-1].unsqueeze(1)
    in_flat = starts + g.prompt_lengths.unsqueeze(1) + torch.arange(real.shape[1])
    scored = flat[in_flat[real]]
    lp_padded = no_padding_2_padding(mb.outputs["log_probs"], data)  # verl's own slicing
    lp_grid = g.grid_of_flat(mb.outputs["log_probs"].values(), 0.0)
    ids = view.display_ids().reshape(-1)[g.term_at[real]]
    seg = view.segment_ids().reshape(-1)[g.term_at[real]]
    keep = torch.zeros(g.shape)
    keep.view(-1)[g.term_at[real][::2]] = 1.0
    cut = view.narrowed(keep)["response_mask"]
    return {"shape": list(g.shape), "scored_is_response": bool(torch.equal(scored, data["responses"][real])),
            "logprob_at_term": bool(torch.equal(lp_grid.reshape(-1)[g.term_at[real]], lp_padded[real])),
            "display_is_response": bool(torch.equal(ids, data["responses"][real])),
            "segments_response": bool((seg == COMPLETION).all()),
            "mask_terms": float(view.token_mask().sum()), "response_terms": float(data["response_mask"].sum()),
            "cut_every_other": bool(torch.equal(cut[real].bool(), torch.arange(int(real.sum())) % 2 == 0)),
            "docs": None if view.document_ids() is None else view.document_ids()[0, g.term_at[real]].tolist(),
            "rows": [int(b) for b in real.nonzero()[:, 0]]}


def additivity(engine, td, agg: str) -> dict:
    """verl's loss through the probe: full mask = verl's own forward_step; two halves add up."""
    from gradloc_track.integrations.verl.probe_loss import make_loss_fn
    from gradloc_track.localizer.probe import restore_rng

    loss = S.ppo_loss_fn(S.actor_config(agg))
    rec, step_grads = _record(engine, td, loss)
    mb = rec.batches[1]
    fn = make_loss_fn(engine, mb, loss)
    full = mb.token_mask()
    a = full.clone()
    idx = full.reshape(-1).nonzero().squeeze(1)
    a.view(-1)[idx[1::2]] = 0.0  # every other term: each row keeps about half of its own
    b = full - a
    out = {}
    for name, m in (("full", full), ("a", a), ("b", b)):
        engine.optimizer_zero_grad()
        restore_rng(mb.rng)
        value = fn(m)
        value.backward()
        out[name] = (float(value), _grads(engine))
    engine.optimizer_zero_grad()
    restore_rng(mb.rng)
    ref, _ = engine.forward_step(mb.data, loss_function=loss, forward_only=False)  # verl's own micro-batch loss
    gsum = [x + y for x, y in zip(out["a"][1], out["b"][1])]
    num = math.sqrt(sum(float((x - y).double().pow(2).sum()) for x, y in zip(gsum, out["full"][1])))
    den = math.sqrt(sum(float(y.double().pow(2).sum()) for y in out["full"][1]))
    return {"full": out["full"][0], "verl": float(ref), "a": out["a"][0], "b": out["b"][0], "grad_rel": num / den,
            "micro_batches": len(rec.batches), "rng": all(isinstance(x.rng, dict) for x in rec.batches),
            "outputs": sorted(rec.batches[0].outputs)}


def columns(engine, td) -> dict:
    from gradloc_track.integrations.verl.columns import sample_columns, token_columns

    rec, _ = _record(engine, td, S.ppo_loss_fn(S.actor_config()))
    mb = rec.batches[0]
    cols, samples = token_columns(mb), sample_columns(mb, None)
    g = mb.geo
    at = g.term_at[g.real]
    got = {k: v.reshape(-1)[at] for k, v in cols.items()}
    return {"advantage": bool(torch.equal(got["advantage"], mb.data["advantages"][g.real].float())),
            "old": bool(torch.equal(got["old_logprob"], mb.data["old_log_probs"][g.real].float())),
            "ratio": float((got["ratio"] - torch.exp(got["logprob"] - got["old_logprob"])).abs().max()),
            "reward": samples["reward"].tolist(), "scores": mb.data["token_level_scores"].sum(-1).tolist(),
            "group": samples["group"], "uid": [str(u) for u in list(mb.data["uid"])],
            "index": samples["index"].tolist(), "keys": sorted(cols)}


def route(engine, td, *overrides: str) -> dict:
    """verl's own ``engine.train_batch`` with a loss bound to a Hydra-composed actor config holding the
    node: the plugin (loaded by ``import verl``) sends the step through a session. ``recordings``: how
    many times the session recorded verl's micro-batches (none with the detector off)."""
    from gradloc_track.integrations.verl.recorder import StepRecorder
    from gradloc_track.integrations.verl.session import GradLocSession

    config = S.hydra_actor_config(["+actor_rollout_ref.actor.gradloc.clip=adagc", *overrides])
    recordings, recording = [], StepRecorder.recording
    StepRecorder.recording = lambda self: recordings.append(1) or recording(self)
    try:
        with engine.train_mode():
            out = engine.train_batch(td.clone(), loss_function=S.ppo_loss_fn(config))
    finally:
        StepRecorder.recording = recording
    session = engine.__dict__.get("_gradloc_session")
    res = {"session": isinstance(session, GradLocSession), "keys": sorted(out["metrics"]),
           "clip": session.opts.clip.kind if session else None, "recordings": len(recordings)}
    engine.__dict__.pop("_gradloc_session", None)
    if session:
        session.finish()
    return res


def packed_call(engine, td) -> float:
    """The packed model call (``use_remove_padding=True``: one row, position ids restarting per
    sample) against the padded one: the largest log-prob difference over the responses. On CPU
    transformers builds the block-diagonal mask from the position ids (flash-attention's varlen
    kernel on GPUs), so the packed scenarios train the same model call."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    out = {}
    for packed in (False, True):
        data = td.clone()
        tu.assign_non_tensor(data, use_remove_padding=packed)
        with torch.no_grad():
            lp = engine.infer_batch(data)["model_output"]["log_probs"]
        out[packed] = no_padding_2_padding(lp, data) * data["response_mask"]
    return float((out[True] - out[False]).abs().max())


def unit_checks(engine) -> dict:
    """Every one-process check, on the launch's engine (world 1)."""
    from gradloc_track.integrations.verl.columns import INDEX_KEY, group_index, uids

    td = S.make_batch(engine, 7, 0, S.Inject("reward", 0, 6))
    td[INDEX_KEY] = group_index(uids(td))  # what the session adds before verl's split
    rec, _ = _record(engine, td, S.ppo_loss_fn(S.actor_config()))
    return {"route": route(engine, td),
            "route_spikes_off": route(engine, td, "+actor_rollout_ref.actor.gradloc.spikes.enabled=false"),
            "layout": {str(p): layout_checks(rec.batches[0], p) for p in (False, True)},
            "packed_call": packed_call(engine, td),
            "additivity": {agg: additivity(engine, td, agg) for agg in AGGS},
            "columns": columns(engine, td)}
