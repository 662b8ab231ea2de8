"""A verl 0.9 FSDP actor engine on CPU with gloo, a tiny random-init Qwen2 and fixed rollout batches.

No Ray, no rollout server: as verl's own engine tests do, the rollout batch is made here (random
prompts and responses from a fixed seed), scored, and turned into advantages by verl's own
``compute_grpo_outcome_advantage``; ``old_log_probs`` are the engine's own (``infer_batch``),
``ref_log_prob`` the same shifted a little (a KL term that acts). ``inject`` spoils ONE response of
the global batch: a reward outlier, or stale old log-probs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

CHARS = list("abcdefghijklmnopqrstuvwxyz ?!.,")
B, P, R = 4, 5, 6  # rows per rank, prompt and response lengths
GROUP = 2  # responses per prompt


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


def build_engine(model_dir: str, clip_grad: float = 1.0, lr: float = 1e-4):
    """verl's ``FSDPEngineWithLMHead`` (FSDP2, fp32) on the CPU platform, initialized."""
    from gradloc_track.integrations.verl import use_cpu_platform

    use_cpu_platform()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    mc = HFModelConfig(path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "eager"})
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
    kind: str  # "reward" (outlier score) | "stale" (old log-probs made stale)
    rank: int
    row: int  # row in that rank's batch
    extra: dict = field(default_factory=dict)


def _rollout(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    prompts = torch.randint(2, len(CHARS) + 2, (B, P), generator=g)
    prompts = prompts[torch.arange(B) // GROUP * GROUP]  # GROUP responses per prompt
    responses = torch.randint(2, len(CHARS) + 2, (B, R), generator=g)
    pm = torch.ones(B, P, dtype=torch.long)
    pm[0::GROUP, 0] = 0  # some left padding
    pm[1::GROUP, 0] = 0
    prompts = prompts.masked_fill(pm == 0, 0)
    rm = torch.ones(B, R, dtype=torch.long)
    rm[1, R - 2:] = 0  # a shorter response
    responses = responses.masked_fill(rm == 0, 0)
    scores = torch.zeros(B, R)
    lengths = rm.sum(-1)
    scores[torch.arange(B), lengths - 1] = torch.rand(B, generator=g)  # verl's outcome reward sits on the last token
    uid = np.array([f"s{step}r{rank}p{i // GROUP}" for i in range(B)], dtype=object)
    return prompts, responses, pm, rm, scores, uid


def make_batch(engine, step: int, rank: int, inject: Inject | None = None):
    """The TensorDict verl's trainer hands ``update_actor`` (padding removed, as ``_update_actor`` does)."""
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
    tu.assign_non_tensor(td, use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         calculate_entropy=True, use_fused_kernels=False)
    with torch.no_grad():
        out = engine.infer_batch(td)
    old = no_padding_2_padding(out["model_output"]["log_probs"], td).float() * rm
    adv, _ = compute_grpo_outcome_advantage(scores * rm, rm.float(), uid, norm_adv_by_std_in_grpo=False)
    if hit and inject.kind == "stale":
        adv[inject.row] = -adv[inject.row].abs() - 1.0  # PPO's clip does not bound a negative advantage's ratio
        old[inject.row] -= inject.extra.get("nats", 2.2) * rm[inject.row]  # ratio ~ e^2.2 ~ 9 (< clip_ratio_c)
    batch = dict(base, old_log_probs=old, advantages=adv, ref_log_prob=old - 0.05 * rm, rollout_is_weights=rm.float(),
                 token_level_scores=scores, token_level_rewards=scores)
    dp = DataProto.from_single_dict(batch, meta_info={"temperature": 1.0})
    dp.non_tensor_batch["uid"] = uid
    td = left_right_2_no_padding(dp.to_tensordict())
    tu.assign_non_tensor(td, use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         calculate_entropy=True, use_fused_kernels=False, global_batch_size=B * _world())
    return td


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1
