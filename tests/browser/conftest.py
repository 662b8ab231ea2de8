"""Headless Chromium for the browser tests (Debian's chromium + chromium-driver)."""
from __future__ import annotations

import shutil
import time

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
# No --run-all-compositor-stages-before-draw: with it the renderer hung (execute_script and
# screenshots timed out after 10 s) in about 1 run in 6 of the report-page test; 0 in 30 without.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-quic", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
         "--disable-renderer-backgrounding", "--disable-backgrounding-occluded-windows"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        pytest.skip(NO_BROWSER)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:  # fresh profile
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def wait_for(driver, condition, timeout=90.0, what="page"):
    """Poll ``condition()`` until truthy (pages render asynchronously); its value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception:
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def save_screenshot(driver, path, attempts: int = 4) -> None:
    """Screenshot ``path``, retrying the renderer's 10 s capture timeout.

    On a loaded 2-core CI box chromedriver sometimes gives up on the capture after 10 s
    ("Timed out receiving message from renderer") although the page is fully rendered; the
    next try succeeds. The last failure is re-raised so a page that never renders still fails.
    """
    from selenium.common.exceptions import TimeoutException

    for attempt in range(attempts):
        try:
            wait_for(driver, lambda: driver.execute_script("return document.readyState") == "complete",
                     what="document.readyState == complete")
            if driver.save_screenshot(str(path)):
                return
            raise AssertionError(f"chromedriver wrote no screenshot to {path}")
        except TimeoutException:
            if attempt == attempts - 1:
                raise
            time.sleep(2.0 * (attempt + 1))
