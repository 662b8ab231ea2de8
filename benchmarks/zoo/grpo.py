"""The ``grpo`` family: the spike zoo's TRL family (``trl.py``: ``GRPOTrainer`` on a tiny GPT-2 with
``GradLocCallback``, its RL defaults) under the held-out zoo's split.

``pydoc`` prompts are the spike zoo's (the first six words of pydoc paragraphs); ``licences``
prompts are the first six words of licence and copyright paragraphs, and the held-out rows (the
KL of the harm) are licence text. The tokenizer is the family's own (the demo's 512-token BPE,
trained on pydoc: characters it never saw are ``<unk>``, as a real policy's tokenizer would leave
them). The records are the TRL family's, renamed into the held-out zoo (family ``grpo``, the
split's cause, every step scored).
"""
from __future__ import annotations

import torch

from . import trl
from .record import RunRecord
from .sources import documents
from .split import KINDS, known_cause

MAX_PROMPT = 40  # tokens: the policy's context is 64 and a completion 12 (upper-case licence words cost many)


def setting(quick: bool) -> trl.TRLSetting:
    return trl.TRLSetting.quick() if quick else trl.TRLSetting()


def context(source: str, s: trl.TRLSetting) -> tuple:
    bpe, rows, prompts = trl.context(s)
    if source == "pydoc":
        return bpe, rows, prompts
    text = "\n\n".join(documents(source, "eval"))
    ids = torch.tensor(bpe.encode(text))
    rows = ids[: (len(ids) // 33) * 33].view(-1, 33)[:8]  # (8, 33) held-out licence text
    prompts = []
    for doc in documents(source):
        for para in doc.split("\n\n"):
            words = para.split()
            prompt = " ".join(words[:6])
            if len(words) >= 8 and len(bpe.encode(prompt)) <= MAX_PROMPT:
                prompts.append(prompt)
    return bpe, rows, prompts[:2000]


def run(kind: str, seed: int, source: str, s: trl.TRLSetting, ctx: tuple) -> RunRecord:
    rec = trl.run(kind, seed, s, *ctx)
    rec.family, rec.source, rec.cause, rec.warmup = "grpo", source, known_cause(kind), 0
    rec.aftermath = KINDS[kind].aftermath if kind in KINDS else 0
    if kind in ("clean", "converged"):
        rec.twin = kind
    return rec


def finish(runs: list[RunRecord]) -> None:
    """The clean twin's held-out loss at the scenario runs' last step (their final gap), per source."""
    for source in {r.source for r in runs}:
        trl.finish([r for r in runs if r.source == source])
