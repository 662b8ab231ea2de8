"""The demo's BPE tokenizer: trained once, cached, each token decoded as readable text."""
from __future__ import annotations

TEXT = "\n\n".join(f"The function number {i} returns a value and raises an error when it cannot." for i in range(300))


def test_bpe_is_trained_once_cached_and_decodes_each_token_as_text(tmp_path):
    from gradloc_track.demo.tokenizer import BpeTokenizer

    tok = BpeTokenizer.train_or_load(TEXT, 300, tmp_path)
    (cached,) = tmp_path.glob("bpe-300-*.json")
    again = BpeTokenizer.train_or_load(TEXT, 300, tmp_path)
    assert list(tmp_path.iterdir()) == [cached]
    ids = tok.encode("The function returns a value.")
    assert again.encode("The function returns a value.") == ids
    assert tok.decode(ids) == "The function returns a value."
    assert "".join(tok.convert_ids_to_tokens(ids)) == "The function returns a value."
    assert any(t.startswith(" ") and len(t) > 2 for t in tok.convert_ids_to_tokens(ids))  # subwords, not bytes
    junk = tok.encode("\u00e2\u20ac\u2122")  # mojibake of a curly apostrophe: readable token by token
    assert tok.convert_ids_to_tokens(junk) == ["\u00e2", "\u20ac", "\u2122"]
    assert tok.pad_id == 0 and tok.vocab_size <= 300
