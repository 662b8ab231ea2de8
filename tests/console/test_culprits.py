"""A culprit in words: its text, level and share (a sample, an RL completion by group and reward shown by
its completion, a packed document), counted by unit and level."""
from __future__ import annotations

import torch

from gradloc_track.console import SpikeView, culprit_count, spike_summary
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import Culprit, CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext

from tests.artifacts.cases import levels_case

from .cases import EVENT, printed


def test_console_block_names_the_sample_and_the_micro_batch(tmp_path):
    events, result, ctx = levels_case()
    text = printed(SpikeView(12, events, result, ctx), tmp_path)
    # the whole sample's text is its loss-bearing tokens (the last position has no loss term)
    assert "micro-batch 1, sample 1, the whole sample: '<b>garbage & more</b>" in text and "(60% of" in text
    assert "micro-batch 2: the whole micro-batch (no sample or token in it stands out)" in text
    assert "micro-batch 0, sample 0, tokens 4-5" in text
    lines = [ln for ln in text.splitlines() if "culprits" in ln or ln.startswith("             ")]
    assert "(60% of" in lines[0]  # largest share first


def test_an_rl_completion_is_named_by_group_index_and_reward_and_shows_the_completion_not_the_prompt(tmp_path):
    """TRL's GRPO rows (and rl_grpo.py's) carry group/index/reward: the block names the completion, and its
    text is the completion's loss-bearing tokens, not the padded prompt before it."""
    tok = ByteTokenizer()
    B, P, C = 4, 6, 5
    ids = torch.zeros(B, P + C, dtype=torch.long)  # the prompt is padding (id 0) on the left
    ids[2, P:] = torch.tensor(tok.encode("oops!"))
    mask = torch.zeros(B, P + C)
    mask[:, P:] = 1.0
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=tok,
                       sample_columns={"group": torch.tensor([0, 0, 1, 1]), "index": torch.tensor([0, 1, 0, 1]),
                                       "reward": torch.tensor([0.5, 0.25, 0.125, 1.0])})
    row = Culprit("sample", 3.0, 0.97, batch=2, start=0, end=P + C, n_terms=C)
    view = SpikeView(30, [EVENT], LocateResult([], 4, "auto", 0.1, 3.0, culprits=[row]), ctx)
    text = printed(view, tmp_path)
    assert "culprits   completion 0 of group 1, reward 0.125 (sample 2), the whole completion: 'oops!'  (97% of" \
        in text and "\\x00" not in text
    assert spike_summary([view], tmp_path)[1].startswith("  step 30: 1 completion: completion 0 of group 1")


def test_a_packed_document_is_named_and_counted(tmp_path):
    tok = ByteTokenizer()
    ids = torch.tensor([list(b"abcdefgh\xc3\xa2\xc3\xa2xyuv")])  # (1, 16): documents 0 | 1 | 2
    docs = torch.tensor([[0] * 8 + [1] * 4 + [2] * 4])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(1, 16), input_ids=ids, tokenizer=tok, document_ids=docs)
    rows = [Culprit("sample", 2.0, 0.95, batch=0, start=7, end=12, document=1, n_terms=4),
            CulpritToken(0, 14, grad_norm=0.1, share=-0.0007)]  # a row pulling against the spike reads 0%
    view = SpikeView(50, [EVENT], LocateResult(rows[1:], 4, "auto", 0.1, 2.0, culprits=rows), ctx)
    text = printed(view, tmp_path)
    assert "culprits   document 1 (sample 0), the whole document: 'ââ'  (95% of" in text
    assert "document 2 (sample 0), token 14: 'u'  (0% of" in text and "-0%" not in text
    assert culprit_count(view) == "2 documents (1 whole, 1 token)"
