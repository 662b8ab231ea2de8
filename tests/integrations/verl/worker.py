"""One rank of the verl tests: the engine, a session per scenario, verl's metric path, JSON out.

Each scenario trains ``warmup + 1`` steps through ``engine.train_batch`` (the session's), the last
with one injected response; the worker records what the tests check: the culprits (identical on
every rank?), the RL columns at the culprit against verl's own tensors, the gradients before and
after the monitor (bitwise), the probes and seconds, and on rank 0 the metrics verl's path logs
through ``verl.utils.tracking.Tracking`` (one MLflow run) and the spike block printed. The engine,
the batches and verl's metric path are the example's (``engine_setup``).
"""
from __future__ import annotations

import io
import json
import os

import torch
import torch.distributed as dist

from . import engine_setup as S


def _grads(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        g = p.grad
        g = getattr(g, "_local_tensor", g)
        out.append(None if g is None else g.detach().clone())
    return out


def _culprit_rows(res, captured, batches, rank) -> list:
    """For each culprit token on this rank: its RL columns and verl's tensors at that place."""
    out = []
    ctx = captured.get("ctx")
    if ctx is None:
        return out
    for c in res.tokens:
        if c.rank not in (None, rank):
            continue
        k = c.micro_batch or 0
        mb = batches[k]
        row, pos = mb.response_token(c.batch, c.position)
        col = {n: float((v[k] if isinstance(v, (list, tuple)) else v)[c.batch, c.position])
               for n, v in ctx.extra_columns.items()}
        j = pos
        ref = {n: float(mb.data[key][row, j]) for n, key in
               (("advantage", "advantages"), ("old_logprob", "old_log_probs"), ("ref_logprob", "ref_log_prob"))}
        out.append({"mb": k, "row": row, "j": j, "cols": col, "verl": ref,
                    "uid": str(list(mb.data["uid"])[row]) if "uid" in mb.data.keys() else None})
    return out


def run_scenario(engine, scn: dict, rank: int, out_dir: str, tracking) -> dict:
    import gradloc_track.integrations.verl.session as session_mod
    from gradloc_track.integrations.verl import attach

    sess = attach(engine, {"spikes": {"warmup_steps": scn.get("warmup", 2)}, "tracker": "auto",
                           "locate": {"budget": 64}})
    sess.stream = io.StringIO()
    captured: dict = {}
    real_ctx = session_mod.spike_context

    def capturing(*a, **k):
        captured["batches"] = a[1]
        captured["ctx"] = real_ctx(*a, **k)
        return captured["ctx"]

    session_mod.spike_context = capturing
    real_step = sess.handle.step
    grads: dict = {}

    def step(*a, **k):
        grads["before"] = _grads(engine)
        stats = real_step(*a, **k)
        grads["after"] = _grads(engine)
        return stats

    sess.handle.step = step
    loss_fn = S.ppo_loss_fn(S.actor_config(scn["agg"]))
    world = dist.get_world_size()
    inject_at = scn.get("warmup", 2) + 1
    logged = []
    try:
        for t in range(inject_at + 1):
            inj = S.Inject(scn["kind"], scn["rank"] % world, scn["row"]) if t == inject_at else None
            td = S.make_batch(engine, 100 * scn["seed"] + t, rank, inj)
            with engine.train_mode():
                outputs = engine.train_batch(td, loss_function=loss_fn)
            metrics = S.step_metrics(outputs)  # verl's worker + trainer path
            if rank == 0 and tracking is not None:
                tracking.log(data=metrics, step=scn["step0"] + t)
            logged.append(sorted(metrics))
    finally:
        session_mod.spike_context = real_ctx
        sess.finish()
    st = sess.last
    res = st.locate
    same = all(torch.equal(a, b) for a, b in zip(grads["before"], grads["after"]) if a is not None)
    out = {"events": len(st.events), "localized": res is not None, "not_localized": st.not_localized,
           "grads_equal": same, "metric_keys": logged[-1], "block": sess.stream.getvalue()}
    if res is not None:
        out.update(tokens=[[c.rank, c.micro_batch, c.batch, c.position, c.grad_norm] for c in res.tokens],
                   culprits=[[c.level, c.rank, c.micro_batch, c.batch, c.start, c.end] for c in res.culprits],
                   probes=res.probes, seconds=res.wall_time_s,
                   step_check=None if res.step_check is None else
                   [res.step_check.replayed, res.step_check.residual, res.step_check.norm_ratio],
                   rows=_culprit_rows(res, captured, captured.get("batches"), rank))
    return out


def main(rank: int, world: int, port: str, out_dir: str, scenarios: str, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), WANDB_MODE="offline",
                      MLFLOW_TRACKING_URI=f"sqlite:///{out_dir}/mlflow.db")
    torch.set_num_threads(1)  # one thread per rank: the ranks share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = S.build_engine(model_dir)
        tracking = None
        if rank == 0:
            from verl.utils.tracking import Tracking

            tracking = Tracking(project_name="gradloc-verl-test", experiment_name=f"world{world}",
                                default_backend=["mlflow"])
        results = {}
        for i, scn in enumerate(json.loads(scenarios)):
            scn["step0"] = 10 * i
            results[scn["name"]] = run_scenario(engine, scn, rank, out_dir, tracking)
        if tracking is not None:
            import mlflow

            results["_run_id"] = mlflow.active_run().info.run_id
            tracking.finish()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
