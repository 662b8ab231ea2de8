"""A small hand-written GPT (nanoGPT-style) and an HF GPT-2 builder, both randomly initialised.

Used by the examples, tests and benchmarks; nothing here downloads weights.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Pre-LN GPT. ``forward(idx) -> logits (B, T, V)``; parameter names follow nanoGPT."""

    def __init__(self, vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, d_model: int = 128,
                 max_seq_len: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.max_seq_len:  # the position table ends there: say so instead of an IndexError
            raise ValueError(f"TinyGPT: rows of {T} tokens are longer than its context (model.max_seq_len="
                             f"{self.max_seq_len}): raise model.max_seq_len or pass shorter rows")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def build_model(cfg) -> nn.Module:
    """Build the model a ``ModelConfig`` names. ``hf_gpt2`` needs ``transformers``."""
    if cfg.kind == "tiny_gpt":
        return TinyGPT(cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.max_seq_len, cfg.dropout)
    if cfg.kind == "hf_gpt2":
        return HFCausalLM(cfg)
    raise ValueError(f"model.kind={cfg.kind!r} is unknown: use tiny_gpt or hf_gpt2")


class HFCausalLM(nn.Module):
    """transformers' GPT2LMHeadModel (random init) behind the same ``forward(idx) -> logits``."""

    def __init__(self, cfg) -> None:
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as exc:
            raise ImportError("model.kind=hf_gpt2 needs transformers: pip install transformers") from exc
        conf = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                          n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
                          embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=False,
                          # GPT-2's own 50256 lies outside the demo's vocabulary (transformers warned twice a run)
                          bos_token_id=None, eos_token_id=None)
        self.model = GPT2LMHeadModel(conf)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits
