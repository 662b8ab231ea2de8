"""One rank of the verl tests: ONE engine per launch, every scenario of its world size, JSON out.

A scenario attaches a session to the engine and trains ``warmup + 1`` steps through
``engine.train_batch`` (the session's), the last with one injected response; the worker records
what the tests check: the culprits (identical on every rank?), the responses they name on this
rank (``mine``: mapped through this rank's own layout), the RL columns at the culprit against
verl's own tensors, the gradients before and after the monitor (bitwise), the probes and seconds,
and on rank 0 the metrics verl's path logs through ``verl.utils.tracking.Tracking`` (one MLflow
run) and the spike block printed. World 1 also runs ``unit_worker``'s checks on the same engine.
The engine, the batches and verl's metric path are the example's (``engine_setup``).
"""
from __future__ import annotations

import io
import json
import os
import time

import torch
import torch.distributed as dist

from . import engine_setup as S


def _local(t):
    return getattr(t, "_local_tensor", t).detach()


def _grads(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        g = p.grad
        g = getattr(g, "_local_tensor", g)
        out.append(None if g is None else g.detach().clone())
    return out


def _mine(res, batches, rank: int) -> list:
    """This rank's culprits as the responses they name: [level, micro_batch, response, share]."""
    out = []
    for c in res.culprits:
        if c.rank not in (None, rank) or c.batch is None:
            continue
        k = c.micro_batch or 0
        mb = batches[k]
        if c.level == "token":
            response = mb.response_token(c.batch, c.position)[0]
        else:
            response = c.document if mb.geo.packed else c.batch
        out.append([c.level, k, response, c.share])
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (a NaN step's gradient is left as backward made it)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _artifacts(st) -> dict:
    """Rank 0's culprit table and highlight page of the step, from the view its artifacts show."""
    from gradloc_track.artifacts.highlight import render_highlight_html
    from gradloc_track.artifacts.table import attribution_table

    if st.locate_view is None:
        return {}
    shown, shown_ctx = st.locate_view
    columns, rows = attribution_table(st.step, st.events, shown, shown_ctx)
    out = {"table": [dict(zip(columns, r)) for r in rows]}
    if shown_ctx.input_ids is not None:  # as the artifact writer: a page when a culprit names text
        page = render_highlight_html(st.step, st.events, shown, shown_ctx)
        out["page_parts"] = [name for name in ("prompt", "response") if f"<b>{name}</b>" in page]
    return out


def _culprit_rows(res, ctx, batches, rank) -> list:
    """For each culprit token on this rank: its RL columns and verl's tensors at that place."""
    out = []
    for c in res.tokens:
        if c.rank not in (None, rank):
            continue
        k = c.micro_batch or 0
        mb = batches[k]
        row, j = mb.response_token(c.batch, c.position)
        col = {n: float((v[k] if isinstance(v, (list, tuple)) else v)[c.batch, c.position])
               for n, v in ctx.extra_columns.items()}
        ref = {n: float(mb.data[key][row, j]) for n, key in
               (("advantage", "advantages"), ("old_logprob", "old_log_probs"), ("ref_logprob", "ref_log_prob"))}
        out.append({"mb": k, "row": row, "j": j, "cols": col, "verl": ref,
                    "uid": str(list(mb.data["uid"])[row]) if "uid" in mb.data.keys() else None})
    return out


class Spy:
    """The session's step context and gradients around its monitor, for the checks."""

    def __init__(self, sess, engine) -> None:
        import gradloc_track.integrations.verl.session as session_mod

        self.mod, self.real_ctx, self.engine = session_mod, session_mod.spike_context, engine
        self.captured: dict = {}
        self.grads: dict = {}
        real_step = sess.handle.step

        def step(*a, **k):
            self.grads["before"] = _grads(engine)
            stats = real_step(*a, **k)
            self.grads["after"] = _grads(engine)
            return stats

        real_opt = sess._optimizer_step

        def optimizer_step(stats):  # did the optimizer move the parameters (verl skips a NaN step)?
            before = [_local(p).detach().clone() for p in engine.module.parameters()]
            norm = real_opt(stats)
            self.stepped = any(not torch.equal(b, _local(p)) for b, p in zip(before, engine.module.parameters()))
            return norm

        sess._optimizer_step = optimizer_step
        self.stepped = None

        sess.handle.step = step
        session_mod.spike_context = self.capturing

    def capturing(self, *a, **k):
        self.captured["batches"] = a[1]
        self.captured["ctx"] = self.real_ctx(*a, **k)
        return self.captured["ctx"]

    def close(self) -> None:
        self.mod.spike_context = self.real_ctx


def _options(scn: dict, out_dir: str) -> dict:
    """Adaptive detection after ``warmup`` clean steps; with none, GradLoc's fixed trigger set to fire.
    A tracked scenario records verl's run in ``OUT/run`` (``gradloc.run_dir``), for report/culprits."""
    warmup = scn.get("warmup", 0)
    spikes = {"warmup_steps": warmup} if warmup else {"mode": "fixed", "per_token_threshold": 1e-6}
    run_dir = os.path.join(out_dir, "run") if scn.get("tracking") else None
    return {"spikes": spikes, "tracker": "auto", "locate": {"budget": 64}, "run_dir": run_dir}


def run_scenario(engine, scn: dict, rank: int, tracking, out_dir: str) -> dict:
    from gradloc_track.console import TrainConsole
    from gradloc_track.integrations.verl import attach

    sess = attach(engine, _options(scn, out_dir))
    sess.console = TrainConsole(stream=io.StringIO(), rich=False)  # the block rank 0 prints, kept
    spy = Spy(sess, engine)
    loss_fn = S.ppo_loss_fn(S.actor_config(scn["agg"]))
    world, inject_at = dist.get_world_size(), scn.get("warmup", 0)
    logged = []
    try:
        for t in range(inject_at + 1):
            inj = S.Inject(scn["kind"], scn["rank"] % world, scn["row"]) if t == inject_at else None
            td = S.make_batch(engine, 100 * scn["seed"] + t, rank, inj, packed=scn.get("packed", False))
            with engine.train_mode():
                outputs = engine.train_batch(td, loss_function=loss_fn)
            metrics = S.step_metrics(outputs)  # verl's worker + trainer path
            if rank == 0 and tracking is not None:
                tracking.log(data=metrics, step=scn["step0"] + t)
            logged.append(sorted(metrics))
    finally:
        spy.close()
        sess.finish()
    st, ctx, batches = sess.last, spy.captured.get("ctx"), spy.captured.get("batches")
    res = st.locate
    same = all(_same(a, b) for a, b in zip(spy.grads["before"], spy.grads["after"]) if a is not None)
    out = {"events": len(st.events), "localized": res is not None, "not_localized": st.not_localized,
           "grads_equal": same, "metric_keys": logged[-1], "block": sess.console.stream.getvalue(),
           "documents": ctx is not None and ctx.document_ids is not None,
           "normaliser": None if ctx is None else ctx.normaliser, "stepped": spy.stepped,
           "nonfinite": None if res is None or res.nonfinite is None else res.nonfinite.detail,
           **(_artifacts(st) if rank == 0 else {})}
    if res is not None:
        out.update(tokens=[[c.rank, c.micro_batch, c.batch, c.position, c.grad_norm] for c in res.tokens],
                   culprits=[[c.level, c.rank, c.micro_batch, c.batch, c.document, c.start, c.end]
                             for c in res.culprits],
                   mine=_mine(res, batches, rank), probes=res.probes, seconds=res.wall_time_s,
                   step_check=None if res.step_check is None else
                   [res.step_check.replayed, res.step_check.residual, res.step_check.norm_ratio],
                   rows=_culprit_rows(res, ctx, batches, rank))
    return out


def _tracking(world: int):
    from verl.utils.tracking import Tracking

    return Tracking(project_name="gradloc-verl-test", experiment_name=f"world{world}", default_backend=["mlflow"])


def main(rank: int, world: int, port: str, out_dir: str, scenarios: str, model_dir: str, mlflow_db: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), WANDB_MODE="offline", MLFLOW_TRACKING_URI=f"sqlite:///{mlflow_db}")
    os.environ.pop("MLFLOW_RUN_ID", None)
    torch.set_num_threads(1)  # one thread per rank: the ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        engine = S.build_engine(model_dir)
        results: dict = {"_timing": {"build": time.perf_counter() - t0}}
        if world == 1:
            from .unit_worker import unit_checks

            t = time.perf_counter()
            results["_unit"] = unit_checks(engine)
            results["_timing"]["unit"] = time.perf_counter() - t
        for i, scn in enumerate(json.loads(scenarios)):
            scn["step0"] = 10 * i
            t = time.perf_counter()
            tracking = _tracking(world) if rank == 0 and scn.get("tracking") else None  # verl's run, for this one
            results[scn["name"]] = run_scenario(engine, scn, rank, tracking, out_dir)
            if tracking is not None:
                import mlflow

                results["_run_id"] = mlflow.active_run().info.run_id
                tracking.finish()
            results["_timing"][scn["name"]] = time.perf_counter() - t
        results["_timing"]["cpu"] = time.process_time()  # this rank's CPU seconds since the fork
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
