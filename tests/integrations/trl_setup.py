"""Tiny TRL trainers for the tests: a character vocabulary, a 2-layer GPT-2 with dropout, a rule reward."""
from __future__ import annotations

import torch

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def char_tokenizer(cache_dir):
    """Characters as tokens (the demo BPE with no room for merges), as a transformers tokenizer too."""
    from gradloc_track.demo.tokenizer import BpeTokenizer

    text = " ".join(LETTERS[i:] + LETTERS[:i] for i in range(26))
    bpe = BpeTokenizer.train_or_load(text, 40, cache_dir=cache_dir)
    return bpe, bpe.to_transformers()


def gpt2(vocab: int, pad: int, positions: int = 64, dropout: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      bos_token_id=pad, eos_token_id=pad, pad_token_id=pad))


def vowel_reward(completions, **kwargs) -> list[float]:
    """Share of vowels: a rule reward with spread inside every group."""
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


def grpo_trainer(tmp_path, tok, model, **overrides):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = dict(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=8, num_generations=4,
               max_completion_length=6, num_iterations=2, max_steps=2, learning_rate=1e-3, report_to=[],
               save_strategy="no", use_cpu=True, disable_tqdm=True, max_grad_norm=0.0, bf16=False, seed=0)
    cfg.update(overrides)  # TRL's configs default to bf16=True, CPU included: autocast to bfloat16
    prompts = [LETTERS[i:i + 3 + i % 5] for i in range(20)]
    return GRPOTrainer(model=model, reward_funcs=vowel_reward, args=GRPOConfig(**cfg),
                       train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)


def sft_trainer(tmp_path, tok, model, docs: list[str], **overrides):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = dict(output_dir=str(tmp_path / "sft"), packing=True, max_length=48, per_device_train_batch_size=2,
               max_steps=2, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
               max_grad_norm=0.0, train_sampling_strategy="sequential", bf16=False, seed=0)
    cfg.update(overrides)
    return SFTTrainer(model=model, args=SFTConfig(**cfg), train_dataset=Dataset.from_dict({"text": docs}),
                      processing_class=tok)
