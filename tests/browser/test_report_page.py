"""The offline report in a real browser: nested event pages render under the page's CSP."""
from __future__ import annotations

import pytest

from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.config import TrackerConfig
from gradloc_track.report import build_report
from gradloc_track.trackers import make_tracker

from ..artifacts.cases import make_case
from .conftest import CHROMIUM, DRIVER, NO_BROWSER, save_screenshot, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=NO_BROWSER)]
HOSTILE = "<img src=x onerror=document.title='pwned'><script>document.title='pwned'</script>"


def test_report_renders_culprits_in_sandboxed_frames_and_runs_nothing(browser, tmp_path):
    from selenium.webdriver.common.by import By

    class Tok:  # culprit 520 decodes to markup that would run script if it were not escaped
        def decode(self, ids):
            return HOSTILE if ids[0] == 999 else chr(ids[0])

    events, result, ctx = make_case()
    ctx.input_ids[1, 520] = 999
    ctx.tokenizer = Tok()
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path / "run")
    writer = SpikeArtifactWriter(tracker, tmp_path / "run", window=10)
    for step in (12, 40):
        writer.write(step, events, result, ctx)
    tracker.finish()
    page = tmp_path / "report.html"
    page.write_text(build_report(tmp_path / "run"))

    browser.get(page.as_uri())
    frames = wait_for(browser, lambda: browser.find_elements(By.TAG_NAME, "iframe"), what="the event frames")
    assert len(frames) == 2
    seen = []
    for frame in frames:
        browser.switch_to.frame(frame)
        try:
            # the culprits in the visible context window (the collapsed full text holds copies)
            seen.append(wait_for(browser, lambda: [s.text for s in browser.find_elements(
                By.CSS_SELECTOR, "div.meta + div.text > span.c")], what="culprit spans"))
            assert browser.find_elements(By.CSS_SELECTOR, "img, script") == []  # markup stayed text
        finally:
            browser.switch_to.default_content()
    from gradloc_track.artifacts.highlight import MAX_TOKEN_CHARS

    shown = HOSTILE if len(HOSTILE) <= MAX_TOKEN_CHARS else (
        HOSTILE[:MAX_TOKEN_CHARS] + f"\u2026[+{len(HOSTILE) - MAX_TOKEN_CHARS} chars]")  # long tokens are cut, visibly
    assert seen == [["e", shown]] * 2  # the hostile token is shown as text, verbatim
    assert browser.title == "run - gradloc-track spike report"  # not 'pwned': nothing ran
    imgs = browser.find_elements(By.TAG_NAME, "img")
    assert len(imgs) == 2 and all(browser.execute_script("return arguments[0].naturalWidth", i) > 100 for i in imgs)
    out = tmp_path / "report.png"
    save_screenshot(browser, out)
    print(f"screenshot: {out}")
