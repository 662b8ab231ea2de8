"""Is a run of tokens the junk signal fired on plainly clean text? (issue 37)

The junk signal (``spikes/junk.py``) asks whether the model rates a run of terms below chance. A model
that has seen little of a script rates clean text in it below chance as well: names in Arabic or Hebrew in
a copyright line, a CJK author list, Greek prose; and a run of one character (``################``) can
sit below chance before the model has learned to copy. Those are rare, not junk, and the model's numbers
cannot tell them apart. Their decoded text can: ``clean_text`` says why a window is plainly text (a run
of one to three characters; letters of one or two scripts, one of them not Latin, with no replacement
character, no control character and no mojibake), and the detector does not fire on it.

Latin-script text needs one more witness, because random tokens of a subword vocabulary decode to Latin
word pieces ("ationthe proing") that no rule without a dictionary tells from words: the tokenizer itself.
Text is what a tokenizer *writes*: encoding the decoded window (with a few tokens of context on each side)
gives back the same ids. Random ids almost never do ("ation" + "the" is encoded "at" + "ionthe", or a merge
across the seam), ids from another vocabulary never. A window the tokenizer wrote is excused when it is made
of words (``word_shaped``): a base64 blob or a hex dump is tokenized text too, but its words switch between
upper case, lower case and digits at every other character, which names, prose and code do not. Random
bytes decode to replacement characters, mojibake (UTF-8 read as cp1252: ``â€™``) re-decodes.
"""
from __future__ import annotations

import random
import re
import unicodedata
import weakref
from typing import Any, NamedTuple, Sequence

EDGE_BYTES = 3  # a window cut inside a character: at most this many replacement characters at each end
RUN_CHARS = 3  # a window of at most this many distinct non-space characters is a run (a rule, a separator)
LETTERS = 0.6  # ... else its non-space characters must be at least this share letters (marks included)
CONTEXT = 32  # tokens decoded on each side of a window for the tokenizer's round trip (``tokenizer_wrote``)
EDGE = 4  # ... of which this many at each end may come back merged otherwise (a word the stretch cuts)
CALIBRATION = 64  # random stretches a tokenizer must re-encode changed (all but one) to witness text
_TELLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> tells_random_ids
# a tokenized window is words when none of its words switches class (lower -> upper, letter <-> digit) more
# than this: the most in any 16-token window of the dev half's pydoc text ('C0A80001', '0x2a;  oct: 0o52');
# docs/benchmarks.md, "the junk witness"
SWITCHES = 3
_WORD = re.compile(r"[^\W_]+")
# control, surrogate, private-use and unassigned code points are no text; format characters (Cf) are: the
# zero-width joiner inside a Malayalam or Devanagari word, a soft hyphen
_NOT_TEXT = frozenset({"Cc", "Cs", "Co", "Cn"})
_FAMILY = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK", "IDEOGRAPHIC": "CJK", "CJK": "CJK"}


class WindowText(NamedTuple):
    """A junk run's decoded text, and whether its ids are what the tokenizer makes of that text
    (``tokenizer_wrote``; False when unknown: no tokenizer, a byte-level model)."""

    text: str
    tokenized: bool = False


def clean_text(text: str | Sequence[Any], tokenized: bool = False) -> str | None:
    """Why ``text`` (a decoded window, or a ``WindowText``: a recorded one may come back as a list) is
    plainly clean text, in words, or None when it is not. ``tokenized``: the window's ids are the
    tokenizer's own encoding of it (``tokenizer_wrote``), the witness Latin-script text needs."""
    if not isinstance(text, str):
        text, tokenized = str(text[0]), bool(text[1]) if len(text) > 1 else tokenized
    text = unicodedata.normalize("NFC", _uncut(text))
    if "\ufffd" in text or any(unicodedata.category(c) in _NOT_TEXT and c not in "\t\n\r" for c in text):
        return None  # bytes that are no UTF-8, control characters: not text
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return "whitespace"
    if len(set(chars)) <= RUN_CHARS:
        return f"a run of {''.join(sorted(set(chars)))!r}"
    if _mojibake(text):
        return None
    letters = [c for c in chars if unicodedata.category(c)[0] in "LM"]
    scripts = scripts_of(letters)
    if tokenized:  # the tokenizer's witness: Latin letters and digits count, when they are words
        words = [c for c in chars if c.isalnum() or unicodedata.category(c)[0] == "M"]
        if len(words) < LETTERS * len(chars) or len(scripts) > 2 or not word_shaped(text):
            return None
        if scripts <= {"LATIN"}:
            return "text as its tokenizer writes it"
    elif len(letters) < LETTERS * len(chars) or not scripts or len(scripts) > 2 or scripts == {"LATIN"}:
        return None
    names = " and ".join(s if s == "CJK" else s.title() for s in sorted(scripts))
    return f"text in the {names} script{'s' if len(scripts) > 1 else ''}"


def scripts_of(letters: Sequence[str]) -> set[str]:
    return {_script(c) for c in letters} - {""}


def word_switches(text: str) -> int:
    """The most class switches inside one word of ``text`` (letters and digits: lower -> upper, letter <->
    digit; a capital before lower case is none). Prose and names 0, ``0x2a`` and ``C0A80001`` 3, a run of
    base64 about one every other character."""
    most = 0
    for word in _WORD.findall(text):
        cls = [_char_class(c) for c in word]
        most = max(most, sum(1 for a, b in zip(cls, cls[1:]) if a != b and (a, b) != ("U", "L")))
    return most


def word_shaped(text: str) -> bool:
    return word_switches(text) <= SWITCHES


def _char_class(c: str) -> str:
    return "D" if c.isdigit() else "U" if c.isupper() else "L" if c.islower() else "O"


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


def read_window(row: Sequence[int], lo: int, hi: int, tokenizer: Any) -> WindowText | None:
    """The window ``row[lo:hi]`` decoded (``decode_window``), with the tokenizer's round trip
    (``tokenizer_wrote``); None when its text is unknown."""
    row = [int(i) for i in row]
    text = decode_window(row[lo:hi], tokenizer)
    if text is None:
        return None
    return WindowText(text, tokenizer is not None and tokenizer_wrote(row, lo, hi, tokenizer))


def tokenizer_wrote(row: Sequence[int], lo: int, hi: int, tokenizer: Any) -> bool:
    """Is ``row[lo:hi]`` what ``tokenizer`` makes of its text? The window and up to ``CONTEXT`` tokens on each
    side are decoded and encoded again, and must come back unchanged but for ``EDGE`` tokens at each end of
    that stretch (a word its edge cuts; at the row's edge, the window's own first or last tokens). Only for a
    tokenizer that can tell (``tells_random_ids``); False when it cannot say (no ``encode``, an error)."""
    if not tells_random_ids(tokenizer):
        return False
    return bool(_round_trip([int(i) for i in row], lo, hi, tokenizer))


def tells_random_ids(tokenizer: Any) -> bool:
    """Does ``tokenizer`` reject random ids? A stretch of random ids as long as ``tokenizer_wrote`` reads
    must come back changed on all but one of ``CALIBRATION`` draws (seeded; measured once per tokenizer, a
    few milliseconds). A small vocabulary with few merges re-encodes random soup unchanged too often
    (the demo's 512-token character BPE: about half of the 16-token windows), and a byte-level model's bytes
    are their own encoding: neither witnesses anything."""
    try:
        return _TELLS[tokenizer]
    except (KeyError, TypeError):  # not measured yet, or not weakly referable (measured each time)
        pass
    vocab = getattr(tokenizer, "vocab_size", None)
    try:
        vocab = int(vocab if vocab is not None else len(tokenizer))
    except TypeError:
        vocab = 0
    rng = random.Random(0)
    n, passed = 2 * CONTEXT + 16, 0
    for _ in range(CALIBRATION if vocab > 256 else 0):  # bytes are their own encoding: no witness
        row = [rng.randrange(vocab) for _ in range(n)]
        back = _round_trip(row, CONTEXT, CONTEXT + 16, tokenizer)
        if back is None:  # it cannot take these ids back: nothing measured, nothing witnessed
            passed = CALIBRATION
            break
        passed += back
    tells = vocab > 256 and passed <= 1
    try:
        _TELLS[tokenizer] = tells
    except TypeError:
        pass
    return tells


def _round_trip(row: list[int], lo: int, hi: int, tokenizer: Any) -> bool | None:
    """Do the window's ids come back (``tokenizer_wrote``)? None: the tokenizer could not say (an error)."""
    a, b = max(0, lo - CONTEXT), min(len(row), hi + CONTEXT)
    try:
        again = _encode_plain(tokenizer, _decode_exact(tokenizer, row[a:b]))
    except Exception:  # a tokenizer without a round trip: no witness, the window is not excused
        return None
    # the stretch less EDGE tokens at each end: the window's own first or last tokens where it touches the row's
    # edge (a character the row cuts comes back as the replacement character's bytes)
    inner = row[min(lo, a + EDGE) if lo - a >= EDGE else a + EDGE:max(hi, b - EDGE) if b - hi >= EDGE else b - EDGE]
    n = len(inner)
    return n > 0 and any(again[i:i + n] == inner for i in range(len(again) - n + 1))


def _decode_exact(tokenizer: Any, ids: list[int]) -> str:
    try:  # HF tokenizers tidy spaces before punctuation by default, which no encoder undoes
        return str(tokenizer.decode(ids, clean_up_tokenization_spaces=False))
    except TypeError:
        return str(tokenizer.decode(ids))


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    try:  # no BOS / EOS added around the window
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in getattr(ids, "ids", ids)]


def decode_window(ids: Sequence[int], tokenizer: Any) -> str | None:
    """The window's text: the tokenizer's decoding, or the ids as UTF-8 bytes when every id is a byte and
    there is no tokenizer (a byte-level model); None when neither can say."""
    from ..text import ByteDecoder

    ids = [int(i) for i in ids]
    if not ids:  # no window: nothing to read, nothing excused
        return None
    if tokenizer is not None and not isinstance(tokenizer, ByteDecoder):  # the display's bytes: read them below
        try:
            return str(tokenizer.decode(ids))
        except Exception:  # a tokenizer that cannot decode these ids: no text, the signal stands
            return None
    if ids and all(0 <= i < 256 for i in ids):
        return bytes(ids).decode("utf-8", errors="replace")
    return None
