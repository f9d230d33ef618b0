"""A report opened in headless Chromium, as a user would open it: Debian's ``chromium`` and ``chromium-driver``,
driven by selenium (the ``browser`` extra). The browser tests, the report benchmark and the docs screenshot use it.

The page marks the end of its first render with ``data-rendered-ms`` on ``<body>`` (milliseconds since navigation
began), so waiting for that attribute waits for the page to be usable, and its value is the page's open time.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

INSTALL = "apt-get install chromium chromium-driver (as root; scripts/setup_system.sh does it)"


def missing() -> str | None:
    """Why no headless browser can run here, or None when one can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install 'trajlab[browser]'"
    absent = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    return f"{' and '.join(absent)} not found: {INSTALL}" if absent else None


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium session that keeps every console message; on exit the browser quits and its profile
    directory is deleted (each session has its own, a few MB).

    Raises:
        RuntimeError: the browser or selenium is missing (the message says what to install).
    """
    if reason := missing():
        raise RuntimeError(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="trajlab-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     f"--window-size={width},{height}", f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))
        try:
            yield driver
        finally:
            driver.quit()


def open_report(driver: Any, page: str | Path, *, timeout_s: float = 60.0) -> float:
    """Open a report file and wait for its first render; returns the milliseconds from navigation to rendered.

    Raises:
        TimeoutError: the page did not finish rendering (its console errors are in the message).
    """
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(Path(page).resolve().as_uri())
    try:
        rendered = WebDriverWait(driver, timeout_s).until(
            lambda d: d.find_element("tag name", "body").get_attribute("data-rendered-ms"))
    except TimeoutException:
        raise TimeoutError(f"{page} did not render in {timeout_s:.0f} s; console: {console_errors(driver)}") from None
    return float(rendered)


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call (uncaught exceptions included)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
