"""TRL: ``GRPOTrainer`` and ``SFTTrainer`` (packing included) with the policy objective they optimise.

``from gradloc_track.integrations.trl import GradLocCallback`` is ``integrations.hf.GradLocCallback``
(one class): on ``on_train_begin`` it finds the trainer it belongs to and, when that is TRL's
``GRPOTrainer`` or ``SFTTrainer``, rebuilds the loss TRL computes (``grpo_loss.py``, ``sft.py``)
from the batch TRL built, instead of the causal-LM cross-entropy it rebuilds for ``Trainer``.
Checked against TRL 1.16.0 (``TRL_CHECKED``).
"""
from __future__ import annotations

from ..._optional import require

require("trl", "trl")
from ..hf import GradLocCallback  # noqa: E402

TRL_CHECKED = ("1.16.0",)

__all__ = ["GradLocCallback", "TRL_CHECKED"]
