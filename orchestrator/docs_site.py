"""The documentation site: docs/ of the checkout, built by MkDocs (Material theme) in strict mode,
so that a broken link, a missing page or a page left out of the navigation fails the build."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from .errors import KdError, UsageError

CHECKOUT = Path(__file__).resolve().parent.parent       # mkdocs.yml and docs/ live beside the package
OUTPUT_TAIL = 4000          # characters of MkDocs' output kept in an error
SITE_MARK = "search/search_index.json"     # what every build of the site writes (the Material search)


def build(out: str | None = None, checkout: Path = CHECKOUT) -> Path:
    """Build the site of `checkout` strictly into `out` (default: site/ of the checkout; a
    relative path is taken from the current directory) and return its absolute path."""
    config = checkout / "mkdocs.yml"
    if not config.is_file():
        raise UsageError(f"no documentation site here: {config} is missing (the site is built from a checkout)")
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        raise UsageError("MkDocs or its Material theme is not installed in this Python "
                         f"({sys.executable}): pip install -e '.[test]' in the checkout installs both")
    site = Path(out).resolve() if out else checkout / "site"
    _check_out(site)
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--config-file", str(config),
            "--site-dir", str(site)]
    # NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2 on every build, not a finding.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(argv, cwd=checkout, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise KdError("the documentation site did not build (strict: a warning fails it)",
                      command=" ".join(argv), exit_status=proc.returncode,
                      tail=(proc.stdout + proc.stderr)[-OUTPUT_TAIL:])
    return site


def _check_out(site: Path) -> None:
    """Refuse a destination the build would wipe without owning it: MkDocs empties its site
    folder first, so it must be missing, empty, or a site built before."""
    if site.is_symlink() or (site.exists() and not site.is_dir()):
        raise UsageError(f"--out {site}: not a folder; nothing was built")
    if site.is_dir() and any(site.iterdir()) and not (site / SITE_MARK).is_file():
        raise UsageError(f"--out {site} holds files that are not a built site (no {SITE_MARK}), which the "
                         "build would delete: give a new or empty folder; nothing was built")
