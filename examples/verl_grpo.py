"""GRPO steps of verl's FSDP actor engine with gradloc-track switched on from verl's Hydra config.

    pip install 'gradloc-track[verl]'          # its own venv: docs/verl.md
    python examples/verl_grpo.py               # 2 gloo processes on CPU, MLflow run in ./mlflow.db
    python examples/verl_grpo.py --inject stale --loss-agg-mode seq-mean-token-mean --procs 4

verl's actor engine (``FSDPEngineWithLMHead``, FSDP2) on CPU with gloo and a tiny random-init
Qwen2: no Ray and no rollout server, as verl's own engine tests do. Each step a fixed rollout batch
(prompts and responses drawn from a seed, an outcome reward on each response's last token) is
turned into Dr.GRPO advantages by verl's own ``compute_grpo_outcome_advantage``, ``old_log_probs``
by the engine's ``infer_batch``, and trained by ``engine.train_batch`` with verl's ``ppo_loss``
bound to the actor config composed from verl's ``ppo_trainer.yaml`` plus
``+actor_rollout_ref.actor.gradloc.spikes.warmup_steps=3`` and
``...gradloc.run_dir=runs/verl_grpo``: the node our ``verl.plugins`` entry point lets verl's config
carry, and the only gradloc-track lines. At ``--inject-at`` ONE response (on the last rank) gets a
reward outlier (``--inject reward``), old log-probs stale by 2.2 nats with a negative advantage
(``--inject stale``, ratio ~9, under the dual clip of 10) or a NaN advantage (``--inject nan``: the
step is skipped on every rank, the response named by the non-finite search). Rank 0 logs verl's metrics through
``verl.utils.tracking.Tracking`` into ONE MLflow run (``MLFLOW_TRACKING_URI``, default
./mlflow.db); ours ride in it (``actor/grad_norm/*``, ``actor/spike/*``), the culprit table and
highlight page land in its artifacts, and the spike block naming the response is printed with the
run's link. The run dir records that run: ``gradloc-track report runs/verl_grpo`` and
``gradloc-track culprits runs/verl_grpo`` follow it.
The tests (tests/integrations/verl) build the same engine and batches from this file.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz ?!.,")
B, P, R = 8, 5, 6  # rows per rank, prompt and response lengths
GROUP = 4  # responses per prompt (verl's rollout.n): two groups per rank


def write_model(path: str) -> str:
    """A 2-layer Qwen2 (random init, seed 0) and a character tokenizer, saved for HFModelConfig."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>"] + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_engine(model_dir: str, clip_grad: float = 1.0, lr: float = 1e-5, packed: bool = False):
    """verl's ``FSDPEngineWithLMHead`` (FSDP2, fp32) on the CPU platform, initialized. ``packed``:
    ``use_remove_padding=True`` (one packed row per micro-batch; on CPU transformers keeps the
    samples apart from the restarting position ids, where GPUs use flash-attention's varlen kernel)."""
    from gradloc_track.integrations.verl import use_cpu_platform

    use_cpu_platform()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    mc = HFModelConfig(path=model_dir, use_remove_padding=packed, enable_gradient_checkpointing=False,
                       override_config={"attn_implementation": "eager"})
    ec = FSDPEngineConfig(strategy="fsdp2", forward_only=False, use_torch_compile=False, use_dynamic_bsz=False,
                          micro_batch_size_per_gpu=2,
                          mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    oc = FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, total_training_steps=100, weight_decay=0.0)
    engine = FSDPEngineWithLMHead(model_config=mc, engine_config=ec, optimizer_config=oc,
                                  checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def actor_config(loss_agg_mode: str = "token-mean", **overrides):
    from verl.workers.config import FSDPActorConfig

    kw = dict(strategy="fsdp2", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
              kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode=loss_agg_mode, rollout_n=GROUP,
              use_dynamic_bsz=False, clip_ratio_c=10.0)
    kw.update(overrides)
    return FSDPActorConfig(**kw)


def ppo_loss_fn(config):
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=config)


@dataclass
class Inject:
    kind: str  # "reward" (outlier score) | "stale" (old log-probs made stale) | "nan" (a NaN advantage)
    rank: int
    row: int  # row in that rank's batch
    extra: dict = field(default_factory=dict)


def _rollout(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    prompts = torch.randint(2, len(CHARS) + 2, (B, P), generator=g)
    prompts = prompts[torch.arange(B) // GROUP * GROUP]  # GROUP responses per prompt
    responses = torch.randint(2, len(CHARS) + 2, (B, R), generator=g)
    pm = torch.ones(B, P, dtype=torch.long)
    pm[1::2, 0] = 0  # some left padding
    prompts = prompts.masked_fill(pm == 0, 0)
    rm = torch.ones(B, R, dtype=torch.long)
    rm[1, R - 2:] = 0  # a shorter response
    responses = responses.masked_fill(rm == 0, 0)
    scores = torch.zeros(B, R)
    lengths = rm.sum(-1)
    scores[torch.arange(B), lengths - 1] = torch.rand(B, generator=g)  # verl's outcome reward sits on the last token
    uid = np.array([f"s{step}r{rank}p{i // GROUP}" for i in range(B)], dtype=object)
    return prompts, responses, pm, rm, scores, uid


def make_batch(engine, step: int, rank: int, inject: Inject | None = None, packed: bool = False):
    """The TensorDict verl's trainer hands ``update_actor`` (padding removed, as ``_update_actor`` does);
    ``packed``: the model called on one packed row per micro-batch (``use_remove_padding``)."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    prompts, responses, pm, rm, scores, uid = _rollout(step, rank)
    hit = inject is not None and inject.rank == rank
    if hit and inject.kind == "reward":
        scores[inject.row] *= 0.0
        scores[inject.row, rm[inject.row].sum() - 1] = inject.extra.get("score", 40.0)
    att = torch.cat([pm, rm], 1)
    base = {"input_ids": torch.cat([prompts, responses], 1), "prompts": prompts, "responses": responses,
            "attention_mask": att, "position_ids": compute_position_id_with_mask(att), "response_mask": rm}
    dp = DataProto.from_single_dict(dict(base), meta_info={"temperature": 1.0})
    td = left_right_2_no_padding(dp.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=packed, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         calculate_entropy=True, use_fused_kernels=False)
    with torch.no_grad():
        out = engine.infer_batch(td)
    old = no_padding_2_padding(out["model_output"]["log_probs"], td).float() * rm
    adv, _ = compute_grpo_outcome_advantage(scores * rm, rm.float(), uid, norm_adv_by_std_in_grpo=False)
    if hit and inject.kind == "stale":
        adv[inject.row] = -adv[inject.row].abs() - 1.0  # PPO's clip does not bound a negative advantage's ratio
        old[inject.row] -= inject.extra.get("nats", 2.2) * rm[inject.row]  # ratio ~ e^2.2 ~ 9 (< clip_ratio_c)
    if hit and inject.kind == "nan":  # a reward that came back NaN for one response: its advantage is NaN
        adv[inject.row, rm[inject.row] != 0] = float("nan")
    batch = dict(base, old_log_probs=old, advantages=adv, ref_log_prob=old - 0.05 * rm, rollout_is_weights=rm.float(),
                 token_level_scores=scores, token_level_rewards=scores)
    dp = DataProto.from_single_dict(batch, meta_info={"temperature": 1.0})
    dp.non_tensor_batch["uid"] = uid
    td = left_right_2_no_padding(dp.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=packed, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         calculate_entropy=True, use_fused_kernels=False, global_batch_size=B * _world())
    return td


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def hydra_actor_config(overrides: list[str]):
    """verl's actor config, composed from verl's own ``ppo_trainer.yaml`` with ``overrides`` (the
    ``+actor_rollout_ref.actor.gradloc...`` node included) and converted as verl's worker does."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    import verl

    conf = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    base = [f"actor_rollout_ref.actor.ppo_mini_batch_size={B}", f"actor_rollout_ref.rollout.n={GROUP}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.clip_ratio_c=10.0"]
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=base + list(overrides))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def run_rank(rank: int, world: int, port: str, args: argparse.Namespace) -> None:
    """One rank: the engine, the actor config from verl's Hydra config, ``--steps`` steps."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # one thread per rank: they share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        engine = build_engine(write_model(args.model_dir))
        config = hydra_actor_config([f"actor_rollout_ref.actor.loss_agg_mode={args.loss_agg_mode}",
                                     "+actor_rollout_ref.actor.gradloc.spikes.warmup_steps=3",
                                     f"+actor_rollout_ref.actor.gradloc.run_dir={args.run_dir}"])
        loss_fn = ppo_loss_fn(config)  # verl's worker binds its loss exactly so
        tracking = None
        if rank == 0:
            from verl.utils.tracking import Tracking

            tracking = Tracking(project_name="gradloc-verl", experiment_name=f"grpo-{args.inject}",
                                default_backend=["mlflow"])
        inject = Inject(args.inject, world - 1, 6 if args.inject == "reward" else 1)
        for step in range(args.steps):
            td = make_batch(engine, step, rank, inject if step == args.inject_at else None)
            with engine.train_mode():
                outputs = engine.train_batch(td, loss_function=loss_fn)  # the plugin's session runs here
            metrics = step_metrics(outputs)
            if tracking is not None:
                tracking.log(data=metrics, step=step)
                print(f"step {step}: actor/grad_norm {metrics['actor/grad_norm']:.3g}", flush=True)
        session = engine.__dict__.get("_gradloc_session")
        if session:
            session.finish()  # every hook off; verl's run stays open for its Tracking to end
        if tracking is not None:
            tracking.finish()
            _say_where(args.run_dir)
    finally:
        dist.destroy_process_group()


def _say_where(run_dir: str) -> None:
    from gradloc_track.console import view_commands

    print("\n".join([f"run dir {run_dir} (the MLflow run it joined is recorded there):", *view_commands(Path(run_dir)),
                     f"  gradloc-track culprits {run_dir}    # the culprit table, across runs"]), flush=True)


def step_metrics(outputs: dict) -> dict:
    """verl's worker and trainer path for ``train_batch``'s metrics (gathered over data-parallel
    ranks, micro-batch lists flattened, ``actor/`` prefixed, reduced), with verl's own helpers."""
    from itertools import chain

    from verl.utils.metric import Metric, reduce_metrics
    from verl.utils.py_functional import rename_dict
    from verl.utils.torch_functional import allgather_dict_into_dict

    metrics = dict(outputs["metrics"])
    grad_norm = metrics.pop("grad_norm")
    flat = {k: Metric.aggregate_dp(v) if isinstance(v[0], Metric) else
            list(chain.from_iterable(x if isinstance(x, list) else [x] for x in v))
            for k, v in allgather_dict_into_dict(metrics).items()}
    flat["grad_norm"] = [grad_norm]
    return reduce_metrics(rename_dict(flat, "actor/"))


def _forked(rank: int, world: int, port: str, args: argparse.Namespace) -> None:
    code = 1
    try:
        run_rank(rank, world, port, args)
        code = 0
    except BaseException:  # os._exit below would swallow it: the rank's error, said (new-user tester round 12)
        import traceback

        print(f"rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown (gloo's static destructors)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--inject-at", type=int, default=4)
    p.add_argument("--inject", choices=["reward", "stale", "nan"], default="reward")
    p.add_argument("--loss-agg-mode", default="token-mean",
                   choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
    p.add_argument("--model-dir", default=str(Path("runs") / "verl_tiny_qwen2"))
    p.add_argument("--run-dir", default=str(Path("runs") / "verl_grpo"),
                   help="gradloc.run_dir: where rank 0 records verl's run (for gradloc-track report / culprits)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp
    import socket

    args = parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        print("error: verl is not installed in this environment: pip install 'gradloc-track[verl]' in a venv of "
              "its own (docs/verl.md)", file=sys.stderr)
        return 2
    uri = os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path('mlflow.db').resolve()}")
    os.environ.setdefault("WANDB_MODE", "offline")
    print(f"verl GRPO on {args.procs} gloo processes (CPU), MLflow store {uri}", flush=True)
    write_model(args.model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    t0 = time.time()
    procs = [ctx.Process(target=_forked, args=(r, args.procs, port, args)) for r in range(args.procs)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(900)
    bad = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
    for r in bad:
        if procs[r].is_alive():
            procs[r].kill()  # our own child, by handle
    print(f"done in {time.time() - t0:.0f} s" + (f"; ranks {bad} failed" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
