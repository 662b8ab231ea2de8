"""``demo/model``: the hand-written GPT's shapes, parameter names and count (the formula written out),
its causality (a later token never changes an earlier position's logits), its GPT-2 init, and
``build_model``'s choices and errors."""
from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest
import torch

from gradloc_track.demo.config import ModelConfig
from gradloc_track.demo.model import TinyGPT, build_model


def small(**kw) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**{"vocab_size": 17, "n_layer": 2, "n_head": 2, "d_model": 8, "max_seq_len": 6, **kw})


def test_logits_are_b_t_v():
    assert small()(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, 17)
    assert small()(torch.zeros(1, 6, dtype=torch.long)).shape == (1, 6, 17)  # the full context


def test_parameter_names_follow_nanogpt_and_their_count_the_formula():
    V, L, D, S = 17, 2, 8, 6
    m = small()
    block = 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + 2 * D + (D * 4 * D + 4 * D) + (4 * D * D + D)
    assert sum(p.numel() for p in m.parameters()) == V * D + S * D + L * block + 2 * D + D * V
    names = [n for n, _ in m.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and names[-3:] == ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
    assert "h.1.attn.qkv.weight" in names and "h.0.mlp.proj.bias" in names


def test_a_later_token_never_changes_an_earlier_positions_logits():
    m = small().eval()
    ids = torch.randint(0, 17, (2, 6), generator=torch.Generator().manual_seed(1))
    base = m(ids)
    for t in range(6):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 17
        out = m(changed)
        assert torch.equal(out[:, :t], base[:, :t]), t  # causal: bitwise the same before t
        assert not torch.allclose(out[:, t], base[:, t])  # and the token itself matters


def test_gpt2_init_scales_the_residual_projections():
    torch.manual_seed(0)
    m = TinyGPT(vocab_size=64, n_layer=8, n_head=4, d_model=128, max_seq_len=8)
    proj = torch.cat([p.flatten() for n, p in m.named_parameters() if n.endswith("proj.weight")])
    other = torch.cat([p.flatten() for n, p in m.named_parameters() if n.endswith(("qkv.weight", "fc.weight"))])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert other.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.all(p == 0) for n, p in m.named_parameters() if n.endswith(".bias") and "ln" not in n)
    assert torch.all(m.ln_f.weight == 1)


def test_dropout_only_while_training():
    m = small(dropout=0.5)
    ids = torch.zeros(2, 6, dtype=torch.long)
    m.eval()
    assert torch.equal(m(ids), m(ids))
    m.train()
    assert not torch.equal(m(ids), m(ids))


def test_a_sequence_longer_than_the_context_names_max_seq_len():
    with pytest.raises(ValueError, match=r"7 tokens.*model\.max_seq_len=6"):
        small()(torch.zeros(1, 7, dtype=torch.long))


def test_build_model_builds_what_the_config_names():
    cfg = ModelConfig(vocab_size=11, n_layer=1, n_head=2, d_model=4, max_seq_len=5)
    m = build_model(cfg)
    assert isinstance(m, TinyGPT) and m.wte.num_embeddings == 11 and len(m.h) == 1 and m.max_seq_len == 5
    with pytest.raises(ValueError, match=r"model.kind='rnn' is unknown: use tiny_gpt or hf_gpt2"):
        build_model(SimpleNamespace(kind="rnn"))


def test_hf_gpt2_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match="model.kind=hf_gpt2 needs transformers: pip install transformers"):
        build_model(ModelConfig(kind="hf_gpt2", n_layer=1, n_head=1, d_model=4))


def test_hf_gpt2_has_no_special_token_ids_outside_its_vocabulary(caplog):
    """Held-out tester, stop 64: ``model=hf_gpt2`` kept GPT-2's bos/eos id 50256 in a 256-token vocabulary, and
    transformers warned twice a run that it "may result in unexpected behavior"."""
    pytest.importorskip("transformers")
    m = build_model(ModelConfig(kind="hf_gpt2", vocab_size=256, n_layer=1, n_head=1, d_model=4, max_seq_len=8))
    conf = m.model.config
    assert conf.bos_token_id is None and conf.eos_token_id is None and conf.vocab_size == 256
    assert "within the vocabulary" not in caplog.text
