"""Is a run of tokens the junk signal fired on plainly clean text? (issue 37)

The junk signal (``spikes/junk.py``) asks whether the model rates a run of terms below chance. A model
that has seen little of a script rates clean text in it below chance as well: names in Arabic or Hebrew in
a copyright line, a CJK author list, Greek prose; and a run of one character (``################``) can
sit below chance before the model has learned to copy. Those are rare, not junk, and the model's numbers
cannot tell them apart. Their decoded text can: ``clean_text`` says why a window is plainly text (a run
of one to three characters; letters of one or two scripts, one of them not Latin, with no replacement
character, no control character and no mojibake), and the detector does not fire on it.

Kept narrow on purpose: Latin-script windows are never excused here, because random tokens of a subword
vocabulary decode to Latin word pieces ("ationthe proing") that no rule without a dictionary tells from
words; random bytes decode to replacement characters, mojibake (UTF-8 read as cp1252: ``â€™``) re-decodes.
"""
from __future__ import annotations

import unicodedata
from typing import Any, Sequence

EDGE_BYTES = 3  # a window cut inside a character: at most this many replacement characters at each end
RUN_CHARS = 3  # a window of at most this many distinct non-space characters is a run (a rule, a separator)
LETTERS = 0.6  # ... else its non-space characters must be at least this share letters (marks included)
_FAMILY = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK", "IDEOGRAPHIC": "CJK", "CJK": "CJK"}


def clean_text(text: str) -> str | None:
    """Why ``text`` (a decoded window) is plainly clean text, in words, or None when it is not."""
    text = unicodedata.normalize("NFC", _uncut(text))
    if "\ufffd" in text or any(unicodedata.category(c)[0] == "C" and c not in "\t\n\r" for c in text):
        return None  # bytes that are no UTF-8, control characters: not text
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return "whitespace"
    if len(set(chars)) <= RUN_CHARS:
        return f"a run of {''.join(sorted(set(chars)))!r}"
    if _mojibake(text):
        return None
    letters = [c for c in chars if unicodedata.category(c)[0] in "LM"]
    if len(letters) < LETTERS * len(chars):
        return None
    scripts = {_script(c) for c in letters} - {""}
    if not scripts or len(scripts) > 2 or scripts == {"LATIN"}:
        return None
    names = " and ".join(s if s == "CJK" else s.title() for s in sorted(scripts))
    return f"text in the {names} script{'s' if len(scripts) > 1 else ''}"


def _uncut(text: str) -> str:
    """The window without the pieces of a character its edges cut (a token window starts or ends inside a
    multi-byte character, whose bytes decode to replacement characters there): at most ``EDGE_BYTES`` at
    each end; replacement characters inside the window still mean bytes that are no text."""
    n = len(text)
    start = next((i for i in range(min(EDGE_BYTES, n)) if text[i] != "\ufffd"), min(EDGE_BYTES, n))
    end = n - next((i for i in range(min(EDGE_BYTES, n - start)) if text[n - 1 - i] != "\ufffd"),
                   min(EDGE_BYTES, n - start))
    return text[start:end] if text[start:end].strip() else text


def _script(c: str) -> str:
    if unicodedata.category(c)[0] == "M":
        return ""  # a combining mark belongs to the letter before it
    word = unicodedata.name(c, "").split(" ")[0]
    return _FAMILY.get(word, word)


def _mojibake(text: str) -> bool:
    """UTF-8 bytes read as cp1252 (or latin-1): encoded back and decoded as UTF-8 they make other text."""
    if text.isascii():
        return False
    for codec in ("cp1252", "latin-1"):
        try:
            again = text.encode(codec).decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            continue
        if again != text:
            return True
    return False


def decode_window(ids: Sequence[int], tokenizer: Any) -> str | None:
    """The window's text: the tokenizer's decoding, or the ids as UTF-8 bytes when every id is a byte and
    there is no tokenizer (a byte-level model); None when neither can say."""
    ids = [int(i) for i in ids]
    if tokenizer is not None:
        try:
            return str(tokenizer.decode(ids))
        except Exception:  # a tokenizer that cannot decode these ids: no text, the signal stands
            return None
    if ids and all(0 <= i < 256 for i in ids):
        return bytes(ids).decode("utf-8", errors="replace")
    return None
