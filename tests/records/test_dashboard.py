"""The trend dashboard (runs/history.html): its content, escaping, links, and how headless
Chromium lays it out."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from browser import chromium
from orchestrator.records import record as rec
from orchestrator.records import report, run_store
from orchestrator.records.dashboard import render_history
from orchestrator.records.history import HistoryStore
from test_history import H200, a_run, bench

HOSTILE = 'tok<script>alert("x")</script>_per_s'


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Path:
    """A history of 24 nightly runs on a GPU host and a CPU host: a step down at run 20 on the GPU
    host (reported as a regression by that run), a reused result, one run whose directory is gone."""
    root = tmp_path_factory.mktemp("history") / "runs"
    rng = random.Random(4)
    with HistoryStore.open(root / "history.sqlite") as store:
        for i in range(24):
            gpu_speed = 1000.0 if i < 20 else 840.0
            run = a_run(i, {
                "gpu": {"bench": bench({"tiny.ar_tokens_per_s": gpu_speed, "moe_layer.int4_ms_m1": 0.12,
                                        HOSTILE: 5.0}, rng=rng), "fingerprint": H200},
                "cpu": {"bench": bench({"tiny.ar_tokens_per_s": 50.0}, rng=rng), "backend": "cpu",
                        "fingerprint": rec.Fingerprint(), "bench_status": "cached" if i == 7 else "passed"},
            })
            if i == 20:
                run["regressions"] = [{"host": "gpu", "metric": "tiny.ar_tokens_per_s", "baseline": 1000.0,
                                       "value": 840.0, "ratio": 0.84, "threshold": 0.1, "unit": "tokens/s",
                                       "better": "higher"}]
            folder = root / run["run_id"]
            if i != 3:                               # run 3's directory was cleaned away
                folder.mkdir(parents=True)
                run_store.write_run(folder, run)
                report.render_run(folder)
            store.index_run(run, folder)
        return render_history(store, root / "history.html")


def test_the_page_has_a_chart_per_metric_per_host_with_commits_bands_and_the_regression(dashboard):
    html = dashboard.read_text()
    assert html.count("<svg") == 4
    assert html.count('class="band"') >= 4 and html.count('class="limit"') >= 4
    assert 'data-commit="commit013"' in html and "commit commit013" in html        # each point's tooltip
    labels = re.findall(r'<text class="commit"[^>]*>([^<]+)</text>', html)
    assert len(labels) == 4 * 12 and all(label.startswith("commit0") for label in labels)   # every other run
    regressed = re.findall(r'<circle class="point regressed[^"]*"[^>]*data-run="([^"]+)"', html)
    assert regressed == [a_run(20, {})["run_id"]]
    link = f'<a href="{a_run(20, {})["run_id"]}/report.html">'
    assert link in html and (dashboard.parent / a_run(20, {})["run_id"] / "report.html").is_file()
    assert "report not on disk" in html                        # run 3
    assert html.count('data-run="' + a_run(7, {})["run_id"] + '"') == 3   # the CPU host's reused result is no point
    assert '<tr data-host="gpu" data-metric="tiny.ar_tokens_per_s" data-status="regressed">' in html


def test_the_page_is_self_contained_and_escapes_what_hosts_sent(dashboard):
    html = dashboard.read_text()
    assert "<script" not in html and "&lt;script&gt;" in html
    assert not re.search(r'(src|href)="(https?:)?//', html)
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_an_empty_history_says_so(tmp_path):
    with HistoryStore.open(tmp_path / "h.sqlite") as store:
        html = render_history(store, tmp_path / "history.html").read_text()
    assert "No benchmark has been recorded yet" in html


@pytest.fixture(scope="module")
def browser_dom(dashboard, tmp_path_factory) -> tuple[str, Path]:
    tmp = tmp_path_factory.mktemp("browser")
    dom = chromium(tmp, "--dump-dom", dashboard.as_uri())
    png = tmp_path_factory.getbasetemp() / "history.png"
    chromium(tmp, f"--screenshot={png}", "--window-size=1440,2000", dashboard.as_uri())
    return dom, png


def test_chromium_lays_out_every_chart_point_and_link(browser_dom):
    dom, png = browser_dom
    assert dom.count("<svg") == 4
    assert dom.count('data-regressed="true"') == 1
    assert dom.count('<circle class="point') == 24 * 3 + 23     # three GPU metrics, the CPU one less its reused run
    assert f'href="{a_run(20, {})["run_id"]}/report.html"' in dom
    assert 'data-host="gpu" data-gpu="NVIDIA H200"' in dom and 'data-host="cpu" data-gpu="no GPU"' in dom
    assert "&lt;script&gt;" in dom and "<script>alert" not in dom
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 30_000
