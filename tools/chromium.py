"""Headless Chromium for the status page: its rendered DOM and a screenshot.

Used by scripts/screenshot_status.py and by the DOM test. Needs Debian's
`chromium` (apt-get install -y chromium), another Chromium or Chrome on PATH,
or CHROMIUM=/path/to/binary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

INSTALL = "apt-get install -y chromium"
CHROMIUM_ENV = "CHROMIUM"
BINARIES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str | None:
    """The browser to run: $CHROMIUM, else the first of BINARIES on PATH."""
    explicit = os.environ.get(CHROMIUM_ENV)
    if explicit:
        return explicit
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def chromium_args(binary: str, profile: str) -> list[str]:
    # --no-sandbox: the tests run as root in a container, where the sandbox cannot start.
    return [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]


def run_chromium(extra: list[str], url: str, timeout_s: float = 60) -> str:
    """Runs headless Chromium on `url` with `extra` flags; returns its stdout.

    Raises:
        FileNotFoundError: no Chromium found (the text says how to install it).
        RuntimeError: Chromium failed; the text holds the end of its stderr.
    """
    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError(
            f"no Chromium found: install Debian's `chromium` ({INSTALL}) "
            f"or set {CHROMIUM_ENV} to a Chromium or Chrome binary"
        )
    with tempfile.TemporaryDirectory(prefix="torchft-chromium-") as profile:
        done = subprocess.run(
            [*chromium_args(binary, profile), *extra, url],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{binary} exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(url: str, timeout_s: float = 60) -> str:
    """The page's DOM after load, as Chromium serializes it."""
    return run_chromium(["--dump-dom"], url, timeout_s)


def screenshot(url: str, out: Path, width: int = 1280, height: int = 1600) -> None:
    run_chromium([f"--screenshot={out.resolve()}", f"--window-size={width},{height}"], url)
    if not out.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot at {out}")
