"""Text as we show it: what a person reads is what the model was trained on, and nothing in it acts.

Token text is whatever the data held. Shown raw, a bidi override (U+202E) reverses what follows it
on screen, a NUL or an escape sequence vanishes or drives the terminal, and a CSV cell starting with
``=`` is a formula a spreadsheet evaluates. Every place we show text goes through here:

- ``visible_text``: control, format and separator characters (``str.isprintable`` is False: bidi
  controls, NUL and the other C0/C1 controls, zero-width characters, NBSP...) become ``\\xNN`` /
  ``\\uNNNN``; newline, tab and CR become ``↵``, ``→``, ``␍``. Printable text is returned as it is.
- ``visible_html`` / ``token_html``: the same, HTML-escaped (for the pages; newlines kept as line
  breaks after their ``↵``); a long token cut with a visible marker.
- ``csv_cell``: a cell for ``csv.writer``: numbers stay numbers; any other value is shown visibly
  and, when it starts like a formula (OWASP's CSV-injection rule: ``= + - @``, tab, CR; NUL per
  ASVS 1.2.10), prefixed with ``'`` so a spreadsheet shows it as text.

- ``decode_token`` / ``decode_tokens``: token ids to text (several decoded together, so a character split
  over byte tokens comes out whole; ``<id>`` where a tokenizer cannot decode).

The records themselves (JSON parts, the ledger's JSON) keep the exact text; only views are changed.
"""
from __future__ import annotations

import html
import json
import re
from typing import Any

#: how whitespace controls are shown (the rest of the non-printable characters are escaped)
SHOWN = {"\n": "\u21b5", "\t": "\u2192", "\r": "\u240d"}
#: first characters that make a spreadsheet evaluate a cell (OWASP CSV injection; ASVS 1.2.10 adds NUL)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\0")
MAX_TOKEN_CHARS = 80  # a longer token is cut on a page, with a visible "+N chars" marker


def escape_char(ch: str) -> str:
    """A character as its Python escape (``\\x07``, ``\\u200b``): how a character we cannot show is shown."""
    return f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"


def visible_text(text: str, newlines: bool = False) -> str:
    """``text`` with every non-printable character shown (see the module doc); ``newlines``: keep a
    line break after each ``↵`` (for pages that wrap text)."""
    if text.isprintable():  # the common case: nothing to show
        return text
    nl = SHOWN["\n"] + ("\n" if newlines else "")
    return "".join(nl if ch == "\n" else SHOWN.get(ch) or (ch if ch.isprintable() else escape_char(ch)) for ch in text)


_CUT_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]?)?$")  # a byte escape (``\xd8``, a byte tokenizer's) cut short


def quoted(text: str, limit: int) -> str:
    """``'text'`` in a line of prose (the console's culprit block, the run page's story), shown as every view
    shows text (``visible_text``: NUL, bidi overrides and other controls escaped, a newline ``↵``, a tab ``→``;
    held-out tester, stop 54: the block printed a tab as ``\\t`` where the ledger and the pages show ``→``); cut
    at ``limit`` characters, never inside a byte's ``\\xNN`` escape (stop 56: ``'…\\xb9\\xd…'``)."""
    if len(text) <= limit:
        return "'" + visible_text(text) + "'"
    cut = text[:limit]
    if "\\" in cut[-3:]:
        cut = _CUT_ESCAPE.sub("", cut)
    return "'" + visible_text(cut + "…") + "'"


def visible_html(text: str, empty: str = "\u2205") -> str:
    """``visible_text`` escaped for HTML (quotes too); ``empty`` stands for the empty string (an empty
    token would be an invisible, unclickable span)."""
    if text == "":
        return empty
    return html.escape(visible_text(text, newlines=True), quote=True)


def token_html(text: str, limit: int = MAX_TOKEN_CHARS) -> str:
    """``visible_html(text)``, cut at ``limit`` characters with a marker saying how much was left out."""
    if len(text) <= limit:
        return visible_html(text)
    return visible_html(text[:limit]) + f"<span class='cut'>…[+{len(text) - limit} chars]</span>"


def csv_cell(value: Any) -> Any:
    """One CSV cell that a spreadsheet shows and never evaluates: ``None`` -> empty, numbers as they
    are, lists and dicts as JSON, text visible and, if it starts like a formula, after a ``'``."""
    if isinstance(value, str) and value.isprintable() and not value.startswith(FORMULA_START):
        return value  # the common case, at once
    if value is None:
        return ""
    if isinstance(value, (bool, int, float)):
        return value
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = visible_text(text)
    return "'" + text if text.startswith(FORMULA_START) else text


class ByteDecoder:
    """A byte-level model's ids as text, for the culprit table, the console and the pages when no tokenizer
    was given (a held-out tester, stop 55: every culprit of a 256-id model read ``'<10><56><46>...'``): the
    ids are bytes, decoded as UTF-8, a byte that is no character on its own as ``\\xe2`` (one id at a time,
    each byte of a multi-byte character stays told apart; the junk signal's clean-text check reads the
    bytes itself, ``spikes/text_check.decode_window``, and this decoder witnesses nothing there: bytes are
    their own encoding)."""

    vocab_size = 256

    def decode(self, ids: Any, **_: Any) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="backslashreplace")

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return "ByteDecoder()"


def decode_token(tokenizer: Any, token_id: int | None) -> str:
    """One token's text; ``<id>`` when there is no tokenizer or it cannot decode the id."""
    if token_id is None:
        return ""
    if tokenizer is None:
        return f"<{token_id}>"
    try:
        return str(tokenizer.decode([int(token_id)]))
    except Exception:
        return f"<{token_id}>"


def decode_tokens(tokenizer: Any, ids: list[int]) -> str:
    """Several tokens' text, decoded together (so multi-byte characters come out whole)."""
    if tokenizer is None:
        return "".join(f"<{i}>" for i in ids)
    try:
        return str(tokenizer.decode([int(i) for i in ids]))
    except Exception:
        return "".join(decode_token(tokenizer, i) for i in ids)
