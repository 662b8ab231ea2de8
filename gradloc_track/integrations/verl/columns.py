"""The RL columns of a verl step, read from verl's own tensors (nothing recomputed).

Per token (at the localizer's (B, P+R) positions): ``advantage`` (``advantages``),
``logprob`` (the training forward's ``log_probs``), ``old_logprob`` (``old_log_probs``),
``ratio`` (``exp(logprob - old_logprob)``, the importance ratio PPO clips), ``ref_logprob``
(``ref_log_prob``, with a KL term), ``rollout_is_weight`` (``rollout_is_weights``) and
``entropy`` when verl computed them. Per sample: ``reward`` (the sequence score verl logs:
``token_level_scores`` summed over the response, else ``token_level_rewards``), ``group``
(verl's ``uid``: the prompt the response answers), ``index`` (the response's index among its
group's rows on this rank) and, under torch.distributed, ``rank``. A packed micro-batch is ONE
row holding its responses as documents (document ``b`` = the micro-batch's response ``b``): its
per-sample columns are that row's one cell, a value per document (``document_columns``), so its
culprits carry their response's rank, reward, group and index as padded rows' do.
"""
from __future__ import annotations

from typing import Any

import torch

from .layout import MicroBatch

TOKEN = {"advantages": "advantage", "old_log_probs": "old_logprob", "ref_log_prob": "ref_logprob",
         "rollout_is_weights": "rollout_is_weight"}
REWARD = ("token_level_scores", "token_level_rewards")
INDEX_KEY = "gradloc_index"  # added to verl's batch before its split: the row's index in its group


def group_index(uids: list) -> torch.Tensor:
    """(B,) the index of each row among the rows of its group (same uid), in batch order."""
    seen: dict = {}
    out = []
    for u in uids:
        out.append(seen.get(u, 0))
        seen[u] = out[-1] + 1
    return torch.tensor(out, dtype=torch.long)


def uids(data: Any) -> list | None:
    """verl's ``uid`` per row (a NonTensorStack in the TensorDict), as a list, or None."""
    if "uid" not in data.keys():
        return None
    value = data["uid"] if not hasattr(data, "get_non_tensor") else data.get_non_tensor("uid", None)
    if value is None:
        return None
    return list(value.tolist() if hasattr(value, "tolist") else value)  # python strings: no device transfer


def _response_outputs(mb: MicroBatch, name: str) -> torch.Tensor | None:
    """A per-token output of the training forward in the (B, R) response layout (verl's own slicing)."""
    from verl.workers.utils.padding import no_padding_2_padding

    value = mb.outputs.get(name)
    if value is None:
        return None
    return no_padding_2_padding(value, mb.data).float()


def token_columns(mb: MicroBatch) -> dict[str, torch.Tensor]:
    """Per-token columns, (B, P+R) float each."""
    data, cols = mb.data, {}
    for key, name in TOKEN.items():
        if key in data.keys() and isinstance(data[key], torch.Tensor):
            cols[name] = data[key].float()
    lp = _response_outputs(mb, "log_probs")
    if lp is not None:
        cols["logprob"] = lp
        if "old_logprob" in cols:
            cols["ratio"] = torch.exp(lp - cols["old_logprob"])
    ent = _response_outputs(mb, "entropy")
    if ent is not None:
        cols["entropy"] = ent
    mask = mb.response_mask()
    return {k: mb.to_positions(v * mask) for k, v in cols.items()}


def sample_columns(mb: MicroBatch, rank: int | None) -> dict[str, Any]:
    """Per-sample columns, (B,) tensors or lists."""
    data, cols = mb.data, {}
    for key in REWARD:
        if key in data.keys() and isinstance(data[key], torch.Tensor):
            cols["reward"] = data[key].float().sum(-1)
            break
    ids = uids(data)
    if ids is not None:
        cols["group"] = [str(u) for u in ids]
        if INDEX_KEY in data.keys():
            cols["index"] = data[INDEX_KEY]
    if rank is not None:
        cols["rank"] = torch.full((data["responses"].shape[0],), rank, dtype=torch.long)
    return cols


def document_columns(mb: MicroBatch, rank: int | None) -> dict[str, Any]:
    """Per-sample columns of a packed micro-batch: one row whose cell holds one value per document
    ((1, B) tensors, a list of one list)."""
    return {k: v.unsqueeze(0) if isinstance(v, torch.Tensor) else [list(v)]
            for k, v in sample_columns(mb, rank).items()}
