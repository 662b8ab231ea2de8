"""LM batches as the integrations capture them (``integrations/batches.py``): the step's own normaliser
(``num_items_in_batch``) kept, packed rows split into documents by their position ids."""
from __future__ import annotations

import torch

from gradloc_track.integrations.batches import LMBatch


def test_lm_batch_keeps_num_items_in_batch():
    ids = torch.zeros(2, 4, dtype=torch.long)
    b = LMBatch.from_call((), {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(6)})
    assert int(b.num_items) == 6


def test_packed_rows_become_documents_from_position_ids():
    ids = torch.arange(12).view(2, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    b = LMBatch.from_call((), {"input_ids": ids, "position_ids": pos})
    assert b.document_ids().tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert LMBatch.from_call((), {"input_ids": ids, "position_ids": pos[1:].expand(2, 6)}).document_ids() is None


def test_a_byte_level_model_without_a_tokenizer_reads_as_bytes():
    """A held-out tester, stop 55: every culprit of a 256-id model (GPT-2 config, bytes as tokens) read
    ``'<10><56><46>...'`` in the console, the table and the pages; the bytes are the text."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gradloc_track.demo.model import TinyGPT
    from gradloc_track.integrations.batches import resolve_tokenizer
    from gradloc_track.text import ByteDecoder, decode_token, decode_tokens

    hf = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    hand = TinyGPT(vocab_size=256, n_layer=1, n_head=2, d_model=16, max_seq_len=16)  # no config: its embedding
    for model in (hf, hand):
        assert isinstance(resolve_tokenizer(model), ByteDecoder)
    assert resolve_tokenizer(TinyGPT(vocab_size=64, n_layer=1, n_head=2, d_model=16, max_seq_len=16)) is None
    given = object()
    assert resolve_tokenizer(hand, given) is given  # the caller's tokenizer first
    dec = ByteDecoder()
    ids = list("8. Litigation \u00e2\u20ac\u2122".encode())
    assert decode_tokens(dec, ids) == "8. Litigation \u00e2\u20ac\u2122" and decode_token(dec, 56) == "8"
    # a byte that is no character on its own keeps its value (one id at a time: the table, the pages)
    assert decode_tokens(dec, [0xE3, 0xF9]) == "\\xe3\\xf9" and decode_token(dec, 0xE2) == "\\xe2"
    # the junk check reads the bytes itself: random bytes are replacement characters there, as without a decoder
    from gradloc_track.spikes.text_check import decode_window

    assert decode_window([0xE3, 0xF9], dec) == decode_window([0xE3, 0xF9], None) == "\ufffd\ufffd"
    assert decode_window([], dec) is None

    class PosFirst(torch.nn.Module):  # a position table of 256 rows before a 500-token embedding (review)
        def __init__(self):
            super().__init__()
            self.pos, self.tok = torch.nn.Embedding(256, 8), torch.nn.Embedding(500, 8)
            self.head = torch.nn.Linear(8, 500)

    assert resolve_tokenizer(PosFirst()) is None
