"""Localization results the artifact tests render: a constructed two-sample case (``make_case``), a
real localization of one culprit token whose text is hostile markup (``real_spike``), and culprits
at every level over two micro-batches (``levels_case``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import Culprit, CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext, SpikeEvent

LAYERS = ["wte", "h.0", "h.1", "lm_head"]


def make_case(T=600, culprits=((1, 40), (1, 520)), pad_from=560):
    """Two samples of text; sample 1 has two culprits far apart and trailing padding (id 0, no loss)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 20).encode()
    ids = torch.tensor([list(text[:T]), list(text[7:7 + T])])  # (B, T)
    mask = torch.ones(2, T)
    ids[1, pad_from:] = 0
    mask[1, pad_from:] = 0.0
    ghost = torch.full((2, T), 1e-3)  # (B, T)
    layer_map = torch.full((len(LAYERS), 2, T), 1e-4)  # (L, B, T)
    toks = []
    for k, (b, p) in enumerate(culprits):
        ghost[b, p] = 10.0 ** (1 - k)
        layer_map[:, b, p] = torch.tensor([0.1, 2.0, 0.5, 3.0]) / (k + 1)
        toks.append(CulpritToken(b, p, grad_norm=5.0 / (k + 1), score=float(ghost[b, p]), share=0.6 - 0.2 * k,
                                 layer_norms=dict(zip(LAYERS, layer_map[:, b, p].tolist()))))
    result = LocateResult(toks, probes=9, method="auto", threshold=0.25, total_norm=6.0, layer_names=LAYERS,
                          ghost_map=ghost, layer_map=layer_map)
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=ByteTokenizer())
    events = [SpikeEvent(12, "global", 6.0, 1.2, 8.0, 5.0)]
    return events, result, ctx


B, T, V = 3, 40, 256
HOSTILE = "<script>alert(1)</script>\"'&"


class HostileTokenizer:
    """Token 200 decodes to markup; everything else to a letter."""

    def decode(self, ids):
        return "".join(HOSTILE if i == 200 else ("\n" if i == 10 else chr(97 + i % 26)) for i in ids)


def real_spike():
    """Events, a real localization of one hostile culprit token in a TinyGPT batch, and its context."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(97, 123, (B, T), generator=g)
    y[2, 30] = 200
    y[2, 28] = 10  # a newline next to the culprit
    w = torch.ones(B, T)
    w[2, 30] = 80.0  # the culprit, whose text is hostile markup

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)

    mask = torch.ones(B, T)
    result = gradloc_track.locate(model, loss_fn, mask)
    ctx = SpikeContext(loss_fn, mask, input_ids=y, tokenizer=HostileTokenizer(),
                       extra_columns={"advantage": torch.arange(B * T, dtype=torch.float).view(B, T)},
                       sample_columns={"reward": torch.tensor([0.0, 1.0, 0.5])})
    events = [SpikeEvent(7, "global", 5.0, 1.0, 9.5, 5.0), SpikeEvent(7, "h.1", 3.0, 0.5, 7.0, 6.0)]
    return events, result, ctx


T_LEVELS = 24


DOC = b"<b>garbage & more</b>..."[:T_LEVELS]  # hostile markup: must come out escaped


TEXT = b"the quick brown fox jumps over the lazy dog"


def levels_case():
    """Culprits at every level over two micro-batches of byte text (``T_LEVELS`` positions a row):
    a whole document (a SAMPLE, hostile markup), TOKENS, a MICRO-BATCH."""
    T = T_LEVELS
    ids = [torch.tensor([list(TEXT[:T]), list(TEXT[5:5 + T])]), torch.tensor([list(TEXT[9:9 + T]), list(DOC)])]
    masks = [torch.ones(2, T), torch.ones(2, T)]
    masks[1][1, -1] = 0.0  # the document's last position has no loss term
    doc = Culprit("sample", 2.0, 0.6, micro_batch=1, batch=1, start=0, end=T, n_terms=T - 1,
                  layer_norms={"h.0": 1.5, "lm_head": 1.0})
    mb = Culprit("micro_batch", 0.5, 0.1, micro_batch=2, n_terms=48)
    toks = [CulpritToken(0, p, grad_norm=1.0, share=0.1, layer_norms={"h.0": 0.5}, micro_batch=0) for p in (4, 5)]
    ghost = [torch.full((2, T), 1e-3), torch.full((2, T), 1e-3), None]
    result = LocateResult(toks, probes=9, method="auto", threshold=0.3, total_norm=3.0, layer_names=["h.0"],
                          micro_batch_norms=[1.0, 2.0, 0.5], ghost_maps=ghost, layer_maps=[None] * 3,
                          culprits=[doc, mb] + toks, notes=["a note from the localizer"])
    ctx = SpikeContext(loss_fn=[lambda m: m.sum()] * 3, token_mask=masks + [torch.ones(2, T)],
                       input_ids=ids + [ids[0]], tokenizer=ByteTokenizer(),
                       sample_columns={"reward": [torch.tensor([0.0, 1.0])] * 3})
    return [SpikeEvent(12, "global", 6.0, 1.2, 8.0, 5.0)], result, ctx
