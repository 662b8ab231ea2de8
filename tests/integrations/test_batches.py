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


def test_without_a_detector_the_capture_records_nothing_and_the_norms_are_the_same():
    """Issue 38: ``watch(spikes=False)`` recorded every forward (the batch, the RNG state, a hook on the
    logits' gradient) that nothing would read. It now only takes the sample columns out of the call
    (the model never sees them; no warning about unpaired columns), and the logged norms are those of a
    run with the detector on, step for step."""
    import copy
    import warnings

    import torch.nn.functional as F

    import gradloc_track
    from gradloc_track import MemoryTracker
    from gradloc_track.demo.model import TinyGPT
    from gradloc_track.integrations.sample_info import SAMPLE_INFO_KEY

    class Sees(TinyGPT):
        def forward(self, idx, **kw):
            assert not kw, kw  # the sample columns never reach the model
            return super().forward(idx)

    torch.manual_seed(0)
    proto = Sees(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_seq_len=8)
    batches = torch.randint(0, 32, (3, 2, 9), generator=torch.Generator().manual_seed(1))
    logged = {}
    for spikes in (False, True):
        model = copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tracker = MemoryTracker()
        handle = gradloc_track.watch(model, opt, tracker=tracker, spikes=spikes, console=False)
        assert handle.capture.wanted is spikes
        for b in batches:
            with warnings.catch_warnings():
                # the whole step: the pairing of columns with batches (and its warning) happens in opt.step()
                warnings.simplefilter("error")  # no "set_sample_info was called ... for 0 micro-batches"
                handle.set_sample_info(source=["a", "b"])
                logits = model(b[:, :-1], **{SAMPLE_INFO_KEY: {"row": [0, 1]}})
                recorded = list(handle.capture.batches)
                assert (len(recorded), len(handle.capture.rng_states)) == ((1, 1) if spikes else (0, 0))
                assert (logits._backward_hooks is not None) is spikes  # the logits' term-reading hook
                F.cross_entropy(logits.reshape(-1, 32), b[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        handle.finish()
        logged[spikes] = [{k: v for k, v in m.items() if k.startswith(("grad_norm/", "weight_norm/"))}
                          for _, m in tracker.metrics]
    assert len(logged[False]) == 3 and logged[False] == logged[True]
