"""Clean rare text is not junk (issue 37): a run the junk rule would fire on is excused when it decodes to
plainly clean text (a run of one character; letters of one or two scripts, one not Latin), never when it
holds replacement or control characters, mojibake, word-piece soup or symbol soup."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track.monitor.junk_window import window_text
from gradloc_track.spikes import SpikeContext, SpikeDetector
from gradloc_track.spikes.junk import junk_span
from gradloc_track.spikes.text_check import WindowText, clean_text, decode_window


@pytest.mark.parametrize("text,why", [
    (" محمد عبد الله الأحمد", "text in the Arabic script"),
    ("2019 محمد عبد and يوسف", "text in the Arabic and Latin scripts"),
    ("אברהם כהן, יעקב לוי", "text in the Hebrew script"),
    ("张伟 王芳 李娜 刘洋", "text in the CJK script"),
    ("ひらがな カタカナ 漢字", "text in the CJK script"),
    ("Η ενότητα επιτρέπει", "text in the Greek script"),
    # a copyright line's Malayalam name: the zero-width joiner (a format character) is part of the word
    ("\ufffdീണ്\u200d A|\ufffd", "text in the Latin and Malayalam scripts"),
    ("#" * 16, "a run of '#'"),
    ("=-=-=-=-=-=-", "a run of '-='"),
    ("            ", "whitespace"),
])
def test_clean_rare_text_is_excused(text, why):
    assert clean_text(text) == why


@pytest.mark.parametrize("text", [
    bytes(range(128, 160)).decode("utf-8", errors="replace"),  # bytes that are no UTF-8
    "â€™â€œâ€\x9dÃ©",  # UTF-8 read as cp1252
    "â€™s Ã©tÃ©",
    "ationthe proing",  # random subword pieces: Latin is never excused
    "the license grants",
    "x\x00y\x01z\x02w\x03",  # control characters
    "Ξ#Ж@ש%の&ب*",  # symbol soup of four scripts
    "aGVsbG8gd29ybGQhIQ==",
])
def test_junk_and_latin_text_are_not(text):
    assert clean_text(text) is None


def test_decode_window_uses_the_tokenizer_or_bytes():
    class Tok:
        def decode(self, ids):
            return "|".join(map(str, ids))

    assert decode_window([1, 2], Tok()) == "1|2"
    assert decode_window(list("Ωμέγα".encode()), None) == "Ωμέγα"
    assert decode_window([300, 5], None) is None  # not bytes, no tokenizer: unknown


def test_the_demo_tokenizer_is_read_as_bytes_like_the_byte_decoder():
    """The demo's ``ByteTokenizer`` shows an invalid byte as the text ``\\xff`` (printable ASCII); the
    clean-text check read random bytes through it as clean text, where a byte model without a tokenizer
    (``ByteDecoder``) reads them as U+FFFD. Every byte-level decoder is now read as bytes."""
    from gradloc_track.demo.data import ByteTokenizer
    from gradloc_track.text import ByteDecoder

    junk = [0xFF, 0xFE, 0x41, 0xC3, 0x9C, 0x80]
    assert ByteTokenizer().decode(junk) == "\\xff\\xfeAÜ\\x80"  # the display keeps every byte visible
    assert decode_window(junk, ByteTokenizer()) == decode_window(junk, ByteDecoder()) == \
        decode_window(junk, None) == "\ufffd\ufffdAÜ\ufffd"
    assert isinstance(ByteTokenizer(), ByteDecoder) and ByteTokenizer().decode(0x41) == "A"


def _detector_past_warmup() -> SpikeDetector:
    det = SpikeDetector(warmup_steps=2)
    for s in range(3):
        det.update(s, 1.0, junk_span=(-2.0, -3.0))
    return det


def test_the_detector_excuses_a_clean_run_and_fires_on_junk():
    det = _detector_past_warmup()
    asked = []
    greek = det.update(3, 1.0, junk_span=(0.5, -3.0), junk_text=lambda: asked.append(1) or "Η ενότητα επιτρέπ")
    assert greek == [] and det.metrics()["spike/junk_excused"] == 1.0
    assert det.junk_excused == ("Η ενότητα επιτρέπ", "text in the Greek script")
    junk = det.update(4, 1.0, junk_span=(0.5, -3.0), junk_text=lambda: "â€™â€œâ€")
    assert [e.signal for e in junk] == ["junk_span"] and det.metrics()["spike/junk_excused"] == 0.0
    unknown = det.update(5, 1.0, junk_span=(0.5, -3.0), junk_text=lambda: None)
    assert [e.signal for e in unknown] == ["junk_span"]  # no text known: the signal stands
    det.update(6, 1.0, junk_span=(-0.5, -3.0), junk_text=lambda: asked.append(2) or "")
    assert asked == [1]  # the text is read only when the rule would fire


def test_window_text_reads_the_largest_runs_tokens_from_the_context():
    """Two micro-batches; the largest run is in the second, row 1, from position 3: its decoded ids."""
    g = torch.Generator().manual_seed(0)
    V, T, terms = 256, 12, 4
    text = list("Ωμέγα".encode())[:terms]
    logits = [torch.randn(2, T, V, generator=g) for _ in range(2)]
    ids = [torch.randint(97, 123, (2, T), generator=g) for _ in range(2)]
    ids[1][1, 3:3 + terms] = torch.tensor(text)
    for t, tok in enumerate(text):  # the model rates these targets far below chance
        logits[1][1, 3 + t, tok] = -30.0
    parts = [junk_span(lg, t, terms=terms) for lg, t in zip(logits, ids)]
    assert [int(v) for v in parts[1].where] == [1, 3] and float(parts[1].span) > float(parts[0].span)
    ctx = SpikeContext(loss_fn=[lambda m: m.sum()] * 2, token_mask=[torch.ones(2, T)] * 2, input_ids=ids)
    assert window_text(parts, ctx, terms) == WindowText(bytes(text).decode("utf-8", errors="replace"), False)
    assert window_text(parts[1], None, terms) is None
    assert math.isfinite(float(parts[1].span))


def test_watch_excuses_clean_greek_and_fires_on_random_bytes():
    """A byte-level GPT trained on English (watch(), its own loop): a row of clean Greek, a script it never
    saw, is rated below chance like junk; its text excuses it. A row of random bytes still fires."""
    import torch.nn.functional as F

    import gradloc_track
    from gradloc_track import MemoryTracker
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    data = torch.tensor(list(load_corpus().encode()[:200_000]))
    model = TinyGPT(256, n_layer=2, n_head=2, d_model=48, max_seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), locate=False,
                                 spikes={"warmup_steps": 20, "per_layer": False})
    g = torch.Generator().manual_seed(0)

    def step(x: torch.Tensor) -> list:
        F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        return handle.last.events

    def batch() -> torch.Tensor:
        ix = torch.randint(0, len(data) - 49, (8,), generator=g)
        return torch.stack([data[i:i + 49] for i in ix])

    for _ in range(120):
        step(batch())
    greek = batch()
    greek[2] = torch.tensor(list(("Η ενότητα επιτρέπει την ανάγνωση " * 2).encode()[:49]))
    assert "junk_span" not in [e.signal for e in step(greek)]
    assert handle.monitor.detector.junk_excused[1] == "text in the Greek script"
    noise = batch()
    noise[5] = torch.randint(128, 256, (49,), generator=g)
    assert "junk_span" in [e.signal for e in step(noise)]
    handle.finish()


def test_a_window_cut_inside_a_character_is_judged_on_the_text_between_the_cuts():
    """A token window starts or ends inside a multi-byte character (byte-level tokens): the cut pieces decode
    to replacement characters at the window's edges, which made a copyright line's Hebrew name 'junk'. At
    most 3 at each end are the cut; one inside the window, or a window of nothing else, is still no text."""
    from gradloc_track.spikes.text_check import decode_window

    line = " 2006 by יובל קוהן".encode()
    cut = decode_window(list(line[:-1]), None)  # ends inside the last letter
    assert cut.endswith("\ufffd") and clean_text(cut) == "text in the Hebrew and Latin scripts"
    both = decode_window(list("Η ενότητα επιτρέπει".encode()[1:-1]), None)  # starts and ends inside a letter
    assert both[0] == both[-1] == "\ufffd" and clean_text(both) == "text in the Greek script"
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # random high bytes: replacement characters inside the window
        assert clean_text(decode_window(torch.randint(128, 256, (16,), generator=g).tolist(), None)) is None
    assert clean_text("\ufffd" * 4) is None and clean_text("Ωμέγα\ufffdΩμέγα") is None


NAMES = (" © 2007 Daniel Nylander\n © 2014 Piotr Drag\n © 2003 Dinesh Nadarajah\n © 2007 Djavan Fagundes\n"
         " © 2006 Djihed Afifi\n © 2005 Donatien Nsengimana\n © 2011 Xavier Claessens\n © 2018 Will Thompson\n"
         " © 2003 Deep Dark\n © 2009 Raivis Dejus\n © 2005 Rajesh Ranjan\n © 2004 Raphael Higino\n")


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    """A 1024-token byte-level BPE (GPT-2's kind) trained on the demo corpus; the names above are not in it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gradloc_track.demo.data import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(load_corpus()[:300_000].split("\n\n"), trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_the_tokenizer_witnesses_latin_text_it_wrote_and_not_random_ids(byte_bpe):
    """A Latin name list (a copyright file's) rated below chance is excused when the tokenizer wrote it:
    decoded and encoded again it gives the same ids. Random ids do not come back; a base64 blob does, but its
    words switch case and digits at every other character."""
    from gradloc_track.spikes.text_check import read_window, tells_random_ids

    assert tells_random_ids(byte_bpe)
    ids = byte_bpe.encode(NAMES, add_special_tokens=False)
    for lo in range(0, len(ids) - 16, 7):
        window = read_window(ids, lo, lo + 16, byte_bpe)
        assert window.tokenized and clean_text(window) == "text as its tokenizer writes it", window
        assert clean_text(window.text) is None  # without the witness Latin text is never excused
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randint(1, byte_bpe.vocab_size, (80,), generator=g).tolist()
        assert not read_window(row, 32, 48, byte_bpe).tokenized
    import base64

    blob = byte_bpe.encode(base64.b64encode(bytes(range(7, 250, 3))).decode(), add_special_tokens=False)
    window = read_window(blob, 8, 24, byte_bpe)
    assert window.tokenized and clean_text(window) is None


def test_a_tokenizer_that_rewrites_random_ids_unchanged_witnesses_nothing(tmp_path):
    """The demo's 512-token character BPE re-encodes about half of all random 16-token windows unchanged:
    its round trip tells nothing, so Latin text it wrote is not excused either."""
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.tokenizer import BpeTokenizer
    from gradloc_track.spikes.text_check import read_window, tells_random_ids

    tok = BpeTokenizer.train_or_load(load_corpus()[:100_000], 512, tmp_path)
    assert not tells_random_ids(tok)
    ids = tok.encode(NAMES)
    assert read_window(ids, 4, 20, tok) == WindowText(tok.decode(ids[4:20]), False)


def test_a_tokenizer_that_cannot_take_random_ids_back_witnesses_nothing(byte_bpe):
    """A tokenizer whose decode raises on ids it does not know (a vocab_size larger than its table) measured
    nothing at first use: its round trips of clean text are no witness either."""
    from gradloc_track.spikes.text_check import read_window, tells_random_ids

    class Partial:
        vocab_size = 2 * byte_bpe.vocab_size

        def decode(self, ids, **kw):
            if max(ids) >= byte_bpe.vocab_size:
                raise IndexError("unknown id")
            return byte_bpe.decode(ids, **kw)

        def encode(self, text, **kw):
            return byte_bpe.encode(text, **kw)

    tok = Partial()
    assert not tells_random_ids(tok)
    ids = byte_bpe.encode(NAMES, add_special_tokens=False)
    assert read_window(ids, 10, 26, tok) == WindowText(byte_bpe.decode(ids[10:26]), False)


def test_the_detector_excuses_a_name_list_and_still_fires_on_a_junk_row_beside_it(byte_bpe):
    """Issue 37: a copyright file's Latin name list rated below chance was 'junk in the data'. Row 0 holds the
    names, rated furthest below chance; row 1 random ids, rated below chance too. The names are excused, the
    junk row is the run the detector judges; the names alone do not fire."""
    names = byte_bpe.encode(NAMES, add_special_tokens=False)
    T, terms, V = 48, 16, byte_bpe.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([names[:T], names[10:10 + T], names[20:20 + T]])
    ids[1] = torch.randint(1, V, (T,), generator=g)
    logits = torch.randn(3, T, V, generator=g)
    targets = ids[:, 1:]
    for row, low in ((0, -40.0), (1, -20.0)):  # the model rates these targets below chance
        logits[row, torch.arange(T - 1), targets[row]] = low
    ctx = SpikeContext(loss_fn=lambda m: m.sum(), token_mask=torch.ones(3, T - 1), input_ids=ids[:, 1:],
                       tokenizer=byte_bpe)
    both = junk_span(logits[:, :-1], targets, terms=terms)
    margin = SpikeDetector().config.junk_margin
    assert int(both.where[0]) == 0  # the names' run is the largest
    judged = window_text(both, ctx, terms, margin=margin)
    assert not judged.tokenized and clean_text(judged) is None  # the junk row's run
    det = _detector_past_warmup()
    assert [e.signal for e in det.update(3, 1.0, junk_span=(float(both.span), -3.0), junk_text=lambda: judged)] \
        == ["junk_span"]
    alone = junk_span(logits[[0, 2], :-1], targets[[0, 2]], terms=terms)
    ctx_alone = SpikeContext(loss_fn=lambda m: m.sum(), token_mask=torch.ones(2, T - 1),
                             input_ids=ids[[0, 2], 1:], tokenizer=byte_bpe)
    text = window_text(alone, ctx_alone, terms, margin=margin)
    assert det.update(4, 1.0, junk_span=(float(alone.span), -3.0), junk_text=lambda: text) == []
    assert det.junk_excused[1] == "text as its tokenizer writes it"


def test_a_window_at_the_rows_end_cut_inside_a_character_is_still_the_tokenizers(byte_bpe):
    """A row that ends inside a Cyrillic letter (its last token one byte of it): encoded again, that byte comes
    back as the replacement character's; the window's last tokens at the row's edge are not asked to."""
    from gradloc_track.spikes.text_check import read_window

    ids = byte_bpe.encode(NAMES + " © 2014-2020 Руслан Ковальчук, Дмитрий Соколов", add_special_tokens=False)
    cuts = [k for k in range(len(ids) - 12, len(ids)) if byte_bpe.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "no token boundary inside a letter: the tokenizer merged every Cyrillic pair"
    row = ids[:cuts[0]]
    window = read_window(row, len(row) - 16, len(row), byte_bpe)
    assert window.text.endswith("\ufffd") and window.tokenized
    assert clean_text(window) is not None
