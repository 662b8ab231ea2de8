"""``gradloc_track.text``: the one place text is made visible and spreadsheet-safe, checked against
the Unicode categories it stands for."""
from __future__ import annotations

import unicodedata

from gradloc_track.text import csv_cell, token_html, visible_html, visible_text

HIDDEN = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")  # control, format, unassigned, separators
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


def test_every_character_of_the_hidden_categories_is_escaped_and_no_other():
    # the two first planes (every script, symbols, emoji) and the tag characters (invisible, Cf)
    planes = [*range(0x20000), *range(0xE0000, 0xE0080)]
    chars = [chr(cp) for cp in planes if chr(cp) not in "\n\t\r "]
    hidden = "".join(ch for ch in chars if unicodedata.category(ch) in HIDDEN)
    kept = "".join(ch for ch in chars if unicodedata.category(ch) not in HIDDEN)
    assert visible_text(kept) == kept
    shown = visible_text(hidden)
    assert shown.isascii() and shown.count("\\") == len(hidden)  # one escape per hidden character
    assert visible_text("\U000e0001") == "\\U000e0001"  # beyond the BMP: eight digits


def test_bidi_controls_nul_and_whitespace_controls():
    for ch in BIDI:
        assert visible_text(f"a{ch}b") == f"a\\u{ord(ch):04x}b"
    assert visible_text("x\x00y\x1b[31m") == "x\\x00y\\x1b[31m"
    assert visible_text("a\tb\r\nc") == "a\u2192b\u240d\u21b5c"  # one line on a console or in a CSV cell
    assert visible_text("a\nb", newlines=True) == "a\u21b5\nb"  # pages wrap after the arrow
    assert visible_text("plain text, é, 中文") == "plain text, é, 中文"


def test_html_is_escaped_after_the_characters_are_shown():
    assert visible_html("<b a='1'>\u202e") == "&lt;b a=&#x27;1&#x27;&gt;\\u202e"
    assert visible_html("") == "\u2205"
    assert token_html("x" * 100, limit=10) == "x" * 10 + "<span class='cut'>…[+90 chars]</span>"


def test_csv_cells_keep_numbers_and_defuse_formulas():
    assert [csv_cell(v) for v in (None, 3, -0.5, True)] == ["", 3, -0.5, True]
    assert [csv_cell(v) for v in ("=1+1", "+1", "-x", "@A1", "a=b", "")] == ["'=1+1", "'+1", "'-x", "'@A1", "a=b", ""]
    assert csv_cell(["-a", 1]) == '["-a", 1]' and csv_cell("\x00=1") == "\\x00=1"
