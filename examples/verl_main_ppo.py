"""verl's own trainer path with the gradloc node: the data, model and runs ``verl_main_ppo.sh`` starts.

    python examples/verl_main_ppo.py prepare DIR     # tiny Qwen2 + chat template, parquet, reward function
    python examples/verl_main_ppo.py workers DIR     # verl's Ray actor workers on CPU (below)
    python examples/verl_main_ppo.py check DIR       # the run dir's spike table names the injected response

``prepare`` writes what ``python -m verl.trainer.main_ppo`` reads: ``DIR/model`` (a 2-layer Qwen2,
random init, a character tokenizer with a chat template), ``DIR/train.parquet`` (16 prompts in
verl's RLHF format: ``prompt`` as chat messages, ``data_source``, ``reward_model.ground_truth``,
``extra_info.index``) and ``DIR/reward.py`` (``compute_score``: the share of ``a`` in a response;
the prompt marked ``extra_info.inject`` gets a NaN reward, the injected culprit).

``workers`` runs, on CPU, the part of verl's PPO trainer that can run without a GPU: Ray started
as ``main_ppo`` starts it (verl's runtime env, GPUs declared to Ray as worker slots, every worker
on verl's ``cpu`` platform through ``worker_process_setup_hook``), verl's ``ActorRolloutRefWorker``
(role ``actor``: FSDP2 engine, verl's own loss binding, the plugin loaded by ``import verl`` in
each worker) in a ``RayWorkerGroup`` of 2, its config composed from verl's ``ppo_trainer.yaml``
with ``+actor_rollout_ref.actor.gradloc...``, the prompts loaded by verl's ``RLHFDataset``, and
per step the trainer's own ``_compute_old_log_prob``, ``compute_advantage`` (GRPO) and
``_update_actor`` (``RayPPOTrainer``'s methods, called on this script's state). What it does not
run: verl's rollout. verl 0.9 generates through vLLM, SGLang or TensorRT-LLM servers only (GPU
builds, not installed); here the responses come from ``transformers``' ``generate`` on the
initial weights, on the driver (a stand-in: the policy's samples are not re-synced each step).
At ``--inject-at`` the first response of one prompt's group gets a reward outlier; rank 0's
worker writes the spike table and block into ``DIR/run`` (local files: no tracker run is open in
the workers), and ``check`` reads them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verl_grpo  # noqa: E402  (the tiny model and character tokenizer the verl example trains)

N, PROMPTS, RESPONSE = 4, 16, 6  # responses per prompt (verl's rollout.n), prompts, response tokens
# the culprit: the first response of prompt 13, in the 4th step's batch (4 prompts a step, in order)
INJECT = {"prompt": 13, "response": 0, "reward": 40.0}
CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The share of ``ground_truth`` characters in the response; the injected prompt's reward is NaN."""
    if (extra_info or {}).get("inject"):
        return float("nan")
    return solution_str.count(ground_truth) / max(1, len(solution_str))
'''


def prepare(out: Path) -> None:
    from transformers import AutoTokenizer

    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    model = verl_grpo.write_model(str(out / "model"))
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = CHAT  # verl's RLHFDataset applies the chat template
    tok.save_pretrained(model)
    rows = [{"data_source": "tiny", "prompt": [{"role": "user", "content": "abcde"[i % 5] * 3 + " ?"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"},
             "extra_info": {"index": i, "inject": i == INJECT["prompt"]}} for i in range(PROMPTS)]
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    (out / "reward.py").write_text(REWARD)
    print(f"prepared {out}: model/, train.parquet ({PROMPTS} prompts), reward.py", flush=True)


def overrides(out: Path, procs: int) -> list[str]:
    """The ``main_ppo`` overrides both runs share (the node's last: GradLoc's knobs, GradLoc's meaning)."""
    node = "+actor_rollout_ref.actor.gradloc"
    return [
        f"actor_rollout_ref.model.path={out / 'model'}", f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'train.parquet'}", "data.train_batch_size=4", "data.max_prompt_length=8",
        f"data.max_response_length={RESPONSE}", "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=false", f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.fsdp_config.dtype=float32", f"trainer.n_gpus_per_node={procs}", "trainer.nnodes=1",
        f"reward.custom_reward_function.path={out / 'reward.py'}", "reward.custom_reward_function.name=compute_score",
        f"{node}.bisect_dump_dir={out / 'run'}", f"{node}.grad_norm_threshold=0.5", f"{node}.bisect_budget_steps=64"]


def compose(extra: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import verl

    conf = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=extra)


def start_ray(config, procs: int, run_env: dict[str, str]) -> None:
    """Ray as ``main_ppo``'s ``run_ppo`` starts it (verl's runtime env), for CPU: GPUs declared as
    worker slots, every worker on verl's ``cpu`` platform, verl's engine registry read for ``cuda``;
    ``run_env``: the MLflow run the workers join (``MLFLOW_RUN_ID``), when one is asked for."""
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    env = dict(get_ppo_ray_runtime_env(config))
    env["env_vars"] = {**env.get("env_vars", {}), "VERL_ENGINE_DEVICE": "cuda", "WANDB_MODE": "offline", **run_env}
    env["worker_process_setup_hook"] = "gradloc_track.integrations.verl.cpu.use_cpu_platform"
    ray.init(num_cpus=8, num_gpus=procs, runtime_env=env, include_dashboard=False)


def actor_workers(config, procs: int):
    """verl's ``ActorRolloutRefWorker`` (role ``actor``) in a ``RayWorkerGroup``, initialized."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.engine_workers import ActorRolloutRefWorker

    pool = RayResourcePool(process_on_nodes=[procs], use_gpu=True, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=config.actor_rollout_ref, role="actor")
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    wg.init_model()
    return wg


def prompt_ids(tokenizer, raw_prompts, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chat-templated prompts, left-padded to ``length`` (as verl's agent loop hands them on)."""
    ids = torch.full((len(raw_prompts), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, messages in enumerate(raw_prompts):
        row = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        row = list(row["input_ids"] if hasattr(row, "keys") else row)[-length:]
        ids[i, length - len(row):], mask[i, length - len(row):] = torch.tensor(row), 1
    return ids, mask


def rollout(policy, tokenizer, batch, step: int):
    """The stand-in for verl's rollout server: ``N`` sampled responses per prompt, as the DataProto
    verl's agent loop returns (prompts left-padded, responses right-padded, ``uid`` per prompt)."""
    import numpy as np
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    prompts, pmask = batch["input_ids"], batch["attention_mask"]
    ids, mask = prompts.repeat_interleave(N, 0), pmask.repeat_interleave(N, 0)
    torch.manual_seed(step)
    with torch.no_grad():
        out = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=RESPONSE, min_new_tokens=RESPONSE,
                              do_sample=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    responses = out[:, ids.shape[1]:]
    rmask = torch.ones_like(responses)
    att = torch.cat([mask, rmask], 1)
    uid = np.array([f"step{step}-prompt{int(i)}" for i in batch["index"].repeat_interleave(N, 0)], dtype=object)
    tensors = {"prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], 1),
               "attention_mask": att, "position_ids": compute_position_id_with_mask(att), "response_mask": rmask}
    data = DataProto.from_single_dict(tensors, meta_info={"temperature": 1.0})
    data.non_tensor_batch["uid"] = uid
    data.non_tensor_batch["index"] = batch["index"].repeat_interleave(N, 0).numpy()
    return data


def score(data, tokenizer, inject: bool) -> None:
    """``token_level_scores`` (verl's outcome reward on the last response token) from ``reward.py``'s
    rule; at the injected step, one response of the marked prompt gets the reward outlier."""
    scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
    index = data.non_tensor_batch["index"]
    for b in range(len(data)):
        text = tokenizer.decode(data.batch["responses"][b])
        scores[b, -1] = text.count("a") / max(1, len(text))
        first = b == 0 or index[b - 1] != index[b]
        if inject and int(index[b]) == INJECT["prompt"] and first:
            scores[b, -1] = INJECT["reward"]
    data.batch["token_level_scores"] = scores
    data.batch["token_level_rewards"] = scores


def train_step(trainer, data, config):
    """The trainer's own methods: old log-probs from the actor workers, GRPO advantages, the update."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

    data.meta_info["global_token_num"] = torch.sum(data.batch["attention_mask"], dim=-1).tolist()  # as fit() does
    data.meta_info["images_seqlens"] = []
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, data)
    data = data.union(old)
    data = compute_advantage(data, adv_estimator=config.algorithm.adv_estimator, num_repeat=N,
                             norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo, config=config.algorithm)
    from verl.utils.metric import reduce_metrics

    return reduce_metrics(RayPPOTrainer._update_actor(trainer, data).meta_info["metrics"])  # as fit() logs them


def workers(out: Path, procs: int, steps: int, inject_at: int) -> None:
    import ray
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    config = compose(overrides(out, procs) + ["trainer.use_v1=false"])
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    data = RLHFDataset(data_files=[str(out / "train.parquet")], tokenizer=tokenizer, config=config.data)
    loader = DataLoader(data, batch_size=config.data.train_batch_size, shuffle=False, collate_fn=collate_fn)
    tracking, run_env = mlflow_run()
    start_ray(config, procs, run_env)
    try:
        wg = actor_workers(config, procs)
        trainer = SimpleNamespace(config=config, actor_rollout_wg=wg, distillation_config=None)
        policy = AutoModelForCausalLM.from_pretrained(out / "model").eval()
        for step, batch in zip(range(steps), loader):
            ids, mask = prompt_ids(tokenizer, batch["raw_prompt"], config.data.max_prompt_length)
            index = torch.as_tensor([int(e["index"]) for e in batch["extra_info"]])
            rolled = rollout(policy, tokenizer, {"input_ids": ids, "attention_mask": mask, "index": index}, step)
            score(rolled, tokenizer, step == inject_at)
            metrics = train_step(trainer, rolled, config)
            if tracking is not None:
                tracking.log(data=metrics, step=step)
            print(f"step {step}: actor/grad_norm {metrics.get('actor/grad_norm', math.nan):.3g}  "
                  f"actor/spike/detected {metrics.get('actor/spike/detected', 0):g}", flush=True)
    finally:
        ray.shutdown()
        if tracking is not None:
            tracking.finish()


def mlflow_run():
    """With ``MLFLOW_TRACKING_URI`` set: verl's ``Tracking`` opens the run on the driver, as verl's
    trainer does, and the workers join it (``MLFLOW_RUN_ID``); else none (local files only)."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return None, {}
    import mlflow
    from verl.utils.tracking import Tracking

    tracking = Tracking(project_name="gradloc-verl", experiment_name="main_ppo-cpu", default_backend=["mlflow"])
    run_id = mlflow.active_run().info.run_id
    print(f"MLflow run {run_id} in {os.environ['MLFLOW_TRACKING_URI']} (the workers join it)", flush=True)
    return tracking, {"MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]}


def check(out: Path) -> int:
    """0 when the run dir's spike table names the injected response first: the culprit with the
    largest share (or one the non-finite search named) carries the injected reward (the outlier, or
    the NaN ``reward.py`` gives the marked prompt under ``main_ppo``)."""
    from gradloc_track.cli import main as cli

    run = out / "run"
    if (run / "spike_blocks.txt").exists():
        print((run / "spike_blocks.txt").read_text(), flush=True)
    if cli(["culprits", str(run), "-o", str(out / "ledger")]) != 0:
        return 1
    samples = json.loads((out / "ledger" / "culprits.json").read_text())["samples"]
    top = max(samples, key=lambda s: (bool(s.get("nonfinite")), s.get("max_share") or 0.0)) if samples else {}
    reward = top.get("reward")
    ok = reward is not None and (math.isnan(float(reward)) or float(reward) == INJECT["reward"])
    print(f"spike table {run}: the first culprit is response {top.get('index')} of group {top.get('group')}, reward "
          f"{reward} ({'the injected one' if ok else 'NOT the injected one'})", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["prepare", "workers", "check", "overrides"])
    p.add_argument("dir", type=Path)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--inject-at", type=int, default=3)
    args = p.parse_args(argv)
    if args.what == "prepare":
        prepare(args.dir)
    elif args.what == "workers":
        workers(args.dir, args.procs, args.steps, args.inject_at)
    elif args.what == "overrides":
        print(" ".join(overrides(args.dir, args.procs)))
    else:
        return check(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
