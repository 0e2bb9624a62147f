"""The documentation site: `invoke docs` builds it strictly (a broken link or a page left out of
the navigation fails the build, with MkDocs' own words), prints where it went, and never wipes a
folder that is not a site built before."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import docs_site
from orchestrator.errors import KdError, UsageError

REPO = Path(__file__).resolve().parent.parent


def site_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ of the checkout in a folder of their own (the GPU records left out:
    the site excludes them)."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    shutil.copy(REPO / "mkdocs.yml", copy)
    shutil.copytree(REPO / "docs", copy / "docs", ignore=shutil.ignore_patterns("gpu-reference"))
    return copy


def test_invoke_docs_builds_the_site_and_prints_its_absolute_path(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "docs", "--out", "out/site"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "out" / "site"                   # --out relative to the current directory
    assert proc.stdout.strip().splitlines()[-1] == str(site)
    assert (site / "index.html").is_file() and (site / "getting-started" / "index.html").is_file()
    assert (site / "engine" / "experiments" / "2026-12-03-w4-eighth-pass" / "index.html").is_file()
    assert not (site / "gpu-reference").exists()       # the records stay files of the checkout


@pytest.mark.parametrize("break_it, named", [
    (lambda docs: (docs / "getting-started.md").open("a").write("\n[the next step](no-such-page.md)\n"),
     "no-such-page.md"),
    (lambda docs: (docs / "guarantees.md").open("a").write("\n[the table](#no-such-heading)\n"),
     "no-such-heading"),
    (lambda docs: (docs / "orphan.md").write_text("# Orphan\n"), "orphan.md"),
], ids=["broken-link", "missing-anchor", "page-not-in-nav"])
def test_a_broken_link_or_a_page_left_out_fails_the_build_naming_it(tmp_path, break_it, named):
    copy = site_copy(tmp_path)
    assert docs_site.build(str(tmp_path / "before"), checkout=copy).is_dir()     # the copy builds as it is
    break_it(copy / "docs")
    with pytest.raises(KdError) as e:
        docs_site.build(str(tmp_path / "after"), checkout=copy)
    assert named in str(e.value) and "--strict" in str(e.value) and "exit code: 1" in str(e.value)


def test_a_folder_that_is_not_a_built_site_is_never_wiped(tmp_path):
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "mine.txt").write_text("keep me\n")
    with pytest.raises(UsageError, match="not a built site"):
        docs_site.build(str(keep), checkout=site_copy(tmp_path))
    assert (keep / "mine.txt").read_text() == "keep me\n" and [p.name for p in keep.iterdir()] == ["mine.txt"]
