"""A culprit in words: its text, level and share (a sample, an RL completion by group and reward shown by
its completion, a packed document), counted by unit and level."""
from __future__ import annotations

from types import SimpleNamespace

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


def _who(ctx, *at):
    return SpikeView(1, [EVENT], None, ctx).who(*at)


def test_who_indexes_a_steps_micro_batches():
    """A step's own context holds one entry per micro-batch (its token_mask a list), python groups too."""
    ctx = SimpleNamespace(sample_columns={"group": [["a"], ["b", "c"]], "index": [torch.tensor([0]),
                                                                               torch.tensor([0, 1])]},
                          token_mask=[torch.ones(1, 4), torch.ones(2, 4)])
    assert _who(ctx, 1, 1) == ("completion 1 of group c (micro-batch 1, sample 1)", "completion")


def test_who_calls_a_response_what_the_context_calls_it():
    """verl's contexts name their parts ("prompt", "response"), and its groups are uid strings."""
    ctx = SimpleNamespace(sample_columns={"group": ["g0", "g1"], "index": torch.tensor([0, 3]),
                                          "reward": torch.tensor([0.5, 40.0])}, token_mask=torch.ones(2, 8),
                          segment_names=("prompt", "response"))
    assert _who(ctx, None, 1) == ("response 3 of group g1, reward 40 (sample 1)", "response")


def test_who_in_a_gathered_view_names_the_rank_and_the_sample_there():
    """Under torch.distributed rank 0's view is one flat batch: row 0 is sample 6 of rank 1."""
    ctx = SimpleNamespace(sample_columns={"rank": torch.tensor([1]), "rank_sample": torch.tensor([6])},
                          token_mask=torch.ones(1, 8))
    assert _who(ctx, 2, 0) == ("rank 1, micro-batch 2, sample 6", "sample")
    assert _who(ctx, 2, 0, 4) == ("document 4 (rank 1, micro-batch 2, sample 6)", "document")
    ctx.sample_columns.update(group=["u"], index=torch.tensor([2]))
    assert _who(ctx, 2, 0)[0] == "completion 2 of group u (rank 1, micro-batch 2, sample 6)"


def test_a_token_run_of_byte_tokens_reads_as_text_not_as_byte_escapes(tmp_path):
    """The HF Trainer and Lightning examples tokenize bytes: a run of culprit tokens is decoded together, so
    'â€™' (8 bytes) reads as the characters, not as '\\xc3\\xa2...' (each byte decoded alone)."""
    tok = ByteTokenizer()
    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[1, 2:10] = torch.tensor(tok.encode("\u00e2\u20ac\u2122"))
    toks = [CulpritToken(1, p, grad_norm=1.0, share=0.1) for p in range(2, 10)]
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(2, 12), input_ids=ids, tokenizer=tok)
    text = printed(SpikeView(60, [EVENT], LocateResult(toks, 4, "auto", 0.1, 2.0), ctx), tmp_path)
    assert "culprits   sample 1, tokens 2-9: '\u00e2\u20ac\u2122'  (80% of" in text and "\\x" not in text


def _rl_view(rows):
    """Completion 1 of group 0: stale by 6 nats on its 3 loss-bearing tokens (ratio e^6)."""
    tok = ByteTokenizer()
    B, P, C = 2, 4, 3
    ids = torch.zeros(B, P + C, dtype=torch.long)
    ids[1, P:] = torch.tensor(tok.encode("12\n"))
    mask = torch.zeros(B, P + C)
    mask[:, P:] = 1.0
    logp = torch.full((B, P + C), -0.5) * mask
    old = logp - 6.0 * torch.tensor([[0.0], [1.0]]) * mask
    extra = {"advantage": torch.ones(B, P + C), "logprob": logp, "old_logprob": old, "ratio": (logp - old).exp() * mask}
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=tok, extra_columns=extra,
                       sample_columns={"group": torch.tensor([0, 0]), "index": torch.tensor([0, 1]),
                                       "reward": torch.tensor([1.0, 0.0])})
    return SpikeView(50, [EVENT], LocateResult([r for r in rows if r.level == "token"], 4, "auto", 0.1, 3.0,
                                               culprits=rows), ctx)


def test_an_rl_culprit_line_shows_its_ratio_log_prob_and_old_log_prob(tmp_path):
    """TRL's GRPO, verl and rl_grpo.py put ratio / logprob / old_logprob in the culprit table: the console's
    culprit line (and the summary's) shows them, a token's value or the mean over the run / completion."""
    whole = _rl_view([Culprit("sample", 3.0, 0.97, batch=1, start=0, end=7, n_terms=3)])
    text = printed(whole, tmp_path)
    assert ("completion 1 of group 0, reward 0 (sample 1), the whole completion: '12\u21b5'  (97% of the batch's "
            "squared grad norm)  ratio 403, log-prob -0.5, old log-prob -6.5") in text
    assert spike_summary([whole], tmp_path)[1].endswith("ratio 403, log-prob -0.5, old log-prob -6.5")
    run = _rl_view([CulpritToken(1, p, grad_norm=1.0, share=0.3) for p in (4, 5)])
    assert "tokens 4-5: '12'  (60% of the batch's squared grad norm)  ratio 403, log-prob -0.5, old log-prob -6.5" \
        in printed(run, tmp_path)


def test_a_culprit_line_without_rl_columns_has_none(tmp_path):
    events, result, ctx = levels_case()
    assert "ratio" not in printed(SpikeView(12, events, result, ctx), tmp_path)


def test_a_quote_is_never_cut_inside_a_byte_escape():
    """A byte tokenizer's undecodable bytes read ``\\xd8``; a quote cut at its limit keeps each escape whole
    (held-out tester, stop 56: ``'…\\xb9\\xd…'``)."""
    from gradloc_track.text import quoted

    text = "abc" + "\\xb9\\xd8" * 10
    assert [quoted(text, n) for n in (7, 8, 9, 10, 11)] == \
        ["'abc\\xb9…'"] * 4 + ["'abc\\xb9\\xd8…'"]
    assert quoted("ab\\", 3) == "'ab\\'" and quoted("x" * 50, 10) == "'" + "x" * 10 + "…'"


def test_a_document_starting_inside_a_character_is_quoted_from_the_characters_first_byte(tmp_path):
    """Held-out tester, stop 57: a document's first token scores no term, so with a byte-level BPE (HF's
    ``tokenizers``) that split a character there the quote began with U+FFFD ('\ufffd€™Ã©...'), a string the
    user's data does not hold. It is quoted from the character's first byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["ab cd"], trainers.BpeTrainer(vocab_size=256 + 4, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = tok("xy\u2019\u2019z")["input_ids"]  # the quotes are 3 byte tokens each
    assert len(ids) == 9 and tok.decode(ids[3:]).startswith("\ufffd")  # what the block quoted before
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(1, 9), input_ids=torch.tensor([ids]), tokenizer=tok,
                       document_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]]))
    row = Culprit("sample", 2.0, 0.97, batch=0, start=3, end=9, document=1, n_terms=6)
    text = printed(SpikeView(50, [EVENT], LocateResult([], 4, "auto", 0.1, 2.0, culprits=[row]), ctx), tmp_path)
    assert "document 1 (sample 0), the whole document: '\u2019\u2019z'  (97% of" in text
    assert "\ufffd" not in text
    # a U+FFFD the text really holds (bytes EF BF BD, scraped text has them) is its first character: kept
    # (review, stop 57: the previous document's 'y' was quoted with it)
    ids = tok("xy\ufffdzzz")["input_ids"]
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(1, len(ids)), input_ids=torch.tensor([ids]), tokenizer=tok,
                       document_ids=torch.tensor([[0, 0] + [1] * (len(ids) - 2)]))
    row = Culprit("sample", 2.0, 0.97, batch=0, start=2, end=len(ids), document=1, n_terms=len(ids) - 2)
    text = printed(SpikeView(50, [EVENT], LocateResult([], 4, "auto", 0.1, 2.0, culprits=[row]), ctx), tmp_path)
    assert "the whole document: '\ufffdzzz'  (97% of" in text
