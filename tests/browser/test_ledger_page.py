"""The culprit ledger's page in a real browser: long text wraps inside its column (the page never
scrolls sideways), bidi controls show as escapes, nothing runs."""
from __future__ import annotations

import pytest

from gradloc_track.ledger import RunTable, collect
from gradloc_track.ledger.aggregate import views
from gradloc_track.ledger.render import to_html

from .conftest import CHROMIUM, DRIVER, NO_BROWSER, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=NO_BROWSER)]
COLS = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "source"]


def test_long_text_wraps_inside_its_column_and_nothing_runs(browser, tmp_path):
    long_word = "x" * 190 + "\u202eevil"  # no space to break at, and an RTL override
    path_name = "/very/long/" + "sweep_" * 30 + "0_clip=adagc"
    rows = [[10 * e, "sample", long_word, 0.9, 0, 0, 64, f"{i:016x}", "<script>document.title='pwned'</script>"]
            for i in range(3) for e in range(12)]
    runs = [RunTable(path_name, path_name, {"columns": COLS, "data": rows})]
    page = tmp_path / "culprits.html"
    page.write_text(to_html(views(collect(runs), "source")), encoding="utf-8")
    browser.get(page.as_uri())
    wait_for(browser, lambda: browser.execute_script("return document.readyState") == "complete")
    width = browser.execute_script("return window.innerWidth")
    assert browser.execute_script("return document.documentElement.scrollWidth") <= width  # no sideways scroll
    overflowing = browser.execute_script(
        "return [...document.querySelectorAll('td')].filter(td => td.scrollWidth > td.clientWidth + 1).length")
    assert overflowing == 0
    text = browser.execute_script("return [...document.querySelectorAll('td.text')].pop().textContent")
    assert text.endswith("\\u202eevil") and "\u202e" not in text  # shown, not obeyed
    assert browser.title == "gradloc-track culprit ledger"  # nothing ran
    assert "<script" not in page.read_text().lower()
