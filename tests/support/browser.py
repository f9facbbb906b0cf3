"""Headless Chromium for the playground's browser tests and its screenshot: Debian's ``chromium`` and
``chromium-driver``, driven by Selenium. Without the background-networking flags Chromium's own connections
(updates, sync, field trials) are refused by a closed network and slow every page down."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")
MISSING = ("headless Chromium is not installed: the playground's browser tests need Debian's chromium and "
           "chromium-driver (apt-get install -y chromium chromium-driver; .ci/run installs them where apt-get "
           "is available)")


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) executables, or None when either is absent."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator["WebDriver"]:  # noqa: F821
    """A fresh headless Chromium (its own empty profile); self-signed certificates are accepted (the HTTPS
    test serves one)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_chromium()
    if found is None:
        raise RuntimeError(MISSING)
    browser, driver = found
    with tempfile.TemporaryDirectory(prefix="mindserve-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = browser
        for flag in (*FLAGS, f"--user-data-dir={Path(profile)}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        options.accept_insecure_certs = True
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, for the tests
        session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
        try:
            yield session
        finally:
            session.quit()
