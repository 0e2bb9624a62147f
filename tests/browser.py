"""Headless Chromium for tests that check rendered reports (Debian's chromium; .ci/run installs it)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium with a fresh profile under tmp_path; its standard output."""
    if not CHROMIUM:
        pytest.skip("chromium is not installed (.ci/run installs it: apt-get install chromium)")
    profile = tmp_path / "chromium-profile"
    out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def dom(tmp_path: Path, html: Path) -> str:
    """The DOM of an HTML file after Chromium loaded and laid it out."""
    return chromium(tmp_path, "--dump-dom", html.as_uri())
