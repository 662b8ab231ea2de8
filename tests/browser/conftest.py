"""Headless Chromium for the browser tests (Debian's chromium + chromium-driver)."""
from __future__ import annotations

import shutil
import time

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--run-all-compositor-stages-before-draw", "--disable-quic", "--no-first-run",
         "--disable-component-update", "--disable-sync", "--window-size=1400,1000"]


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
