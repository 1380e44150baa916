"""A real headless Chromium for the HTML report tests (selenium + Debian's ``chromium`` and ``chromedriver``).

:func:`open_browser` returns a driver, or skips the test with the reason when chromium, chromedriver or
selenium is not installed here (``.ci/run`` installs them).  :func:`load` opens a page from ``file://``
and waits for the report's script to finish (``body[data-ready]``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from repro_tools.report.screenshot import find_chromium


def open_browser(width: int = 1300, height: int = 1400):
    """A headless Chromium driven by chromedriver; the test is skipped when one of them is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    binary, driver = find_chromium(), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--window-size={width},{height}", "--allow-file-access-from-files"):
        opts.add_argument(a)
    opts.binary_location = binary
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


def load(driver, page: Path, timeout: float = 30.0) -> float:
    """Open ``page`` and wait until the report's script has drawn it; the seconds that took."""
    t0 = time.perf_counter()
    driver.get(Path(page).resolve().as_uri())
    while driver.execute_script("return document.body && document.body.getAttribute('data-ready')") != "1":
        if time.perf_counter() - t0 > timeout:
            raise AssertionError(f"{page}: the report's script did not finish in {timeout} s; console: "
                                 f"{driver.get_log('browser')}")
        time.sleep(0.02)
    return time.perf_counter() - t0


def script_errors(driver) -> list:
    """SEVERE console messages (script errors) the page logged."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
