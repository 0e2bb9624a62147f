"""Live progress of long steps (orchestrator/runner/progress.py): the protocol's bounds, the live line in
a pseudo-terminal, plain and rare lines when the console is not a terminal, and hostile reports
(huge numbers, control characters, a flood of lines) bounded and escaped."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.runner import pipeline, progress
from orchestrator.runner.console import Console
from orchestrator.errors import KdError

from fault_lab import fake_commands

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("line, expected", [
    ("::kdtree-progress done=3 total=20 unit=files what=compiled src/model.cpp",
     progress.Update(3, 20, "files", None, "compiled src/model.cpp")),
    ("::kdtree-progress done=2 total=6 unit=bundles bytes=13500000000 what=wrote model_k2wide_int4.kdtr",
     progress.Update(2, 6, "bundles", 13_500_000_000, "wrote model_k2wide_int4.kdtr")),
    ("::kdtree-progress done=41 unit=tests", progress.Update(41, None, "tests")),
    ("::kdtree-progress done=999999999999999 total=999999999999999 unit=bytes",
     progress.Update(10**15 - 1, 10**15 - 1, "bytes")),
    # not reports: shown as the output lines they are
    ("::kdtree-progress done=1000000000000000 unit=bytes", None),          # 16 digits
    ("::kdtree-progress done=" + "9" * 100_000 + " unit=files", None),
    ("::kdtree-progress done=5 total=4 unit=files", None),                 # more done than there is
    ("::kdtree-progress done=-1 total=4 unit=files", None),
    ("::kdtree-progress done=1 total=4 unit=Files", None),
    ("::kdtree-progress total=4 done=1 unit=files", None),                 # fields out of order
    ("::kdtree-progress done=1 unit=files extra=1", None),
    ("::kdtree-progress done=1 unit=files what=" + "x" * progress.MAX_LINE, None),   # longer than a report may be
    ("  ::kdtree-progress done=1 unit=files", None),
    ("::kdtree-progress done=1 unit=files\x1b[2J", None),
])
def test_only_well_formed_reports_within_bounds_are_progress(line, expected):
    assert progress.parse(line) == expected


def test_what_a_report_says_is_escaped_on_one_line_and_cut():
    update = progress.parse("::kdtree-progress done=1 total=2 unit=files what=\x1b]0;owned\x07 a\u202eb\tc " + "y" * 200)
    text = progress.describe(update)
    assert text.startswith("1/2 files: \\x1b]0;owned\\x07 a\\u202eb\\x09c yyy") or \
        text.startswith("1/2 files: \\x1b]0;owned\\x07 a\\u202eb c yyy"), text
    assert "\x1b" not in text and "\u202e" not in text and "\n" not in text
    assert len(text) == len("1/2 files: ") + progress.WHAT_SHOWN and text.endswith("...")
    assert progress.describe(progress.Update(3_000_000_000, 13_500_000_000, "bytes")) == "3.0 GB of 13.5 GB"
    assert progress.elapsed(42.9) == "42s" and progress.elapsed(185) == "3m05s" and progress.elapsed(3725) == "1h02m"


def test_a_million_reports_keep_one_and_write_one_log_line():
    """A host that reports a million times: the display keeps the last report only, the step's log
    gets one line (the last report, as the step ends), the console none; in seconds."""
    logged, shown = [], []
    with progress.Display(Console(io.StringIO()), live=False) as display:
        step = display.step("h", "build", logged.append, shown.append, secrets=("hunter2",))
        updates = [progress.parse(f"::kdtree-progress done={i} total=1000000 unit=files what=file {i} hunter2")
                   for i in range(999_000, 1_000_000)]        # parsing a flood: the test below, through a step
        start = time.monotonic()
        for i in range(1_000_000):
            step.report(updates[i % 1000])
        took = time.monotonic() - start
        assert step.last == progress.Update(999_999, 1_000_000, "files", None, "file 999999 hunter2")
        step.close()
    assert took < 30 and shown == [] and len(logged) == 1
    assert re.fullmatch(r"progress: \d+s: 999999/1000000 files: file 999999 \[REDACTED\]", logged[0]), logged


def local_inventory(make_inventory, tmp_path, bundles: str, **entry):
    """An inventory (tmp_path/hosts.yaml) of the local host whose bundles command is `bundles`."""
    return make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "deploy"), "gpus": 0, **entry}},
                          commands=fake_commands(bundles_key="echo k1", bundles=bundles))


# Five reports, 0.7 s apart, with an escape sequence and a secret in what they say, and a line of output each
SLOW_BUNDLES = ("for i in 1 2 3 4 5; do sleep 0.7; "
                "echo \"::kdtree-progress done=$i total=5 unit=bundles bytes=$((i * 1500000)) "
                "what=wrote model_$i.kdtr $(printf '\\033[2J') $KD_PROGRESS_TOKEN\"; echo \"output $i\"; done")


def test_progress_shows_live_in_a_terminal(make_inventory, tmp_path):
    """`invoke validate` in a pseudo-terminal: while the bundles step runs, its live line shows
    the host, the step, the elapsed time and the last report (bundles of total, bytes written,
    the escape sequence it carried shown as text, its secret redacted), redrawn in place; the reports themselves are
    never printed as lines, the step's ordinary output is, and the step's log has the last report."""
    local_inventory(make_inventory, tmp_path, SLOW_BUNDLES, secret_env=["KD_PROGRESS_TOKEN"])
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    env = {**os.environ, "TERM": "xterm", "KD_PROGRESS_TOKEN": "tok-9f3b2c7e1a"}
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "validate", "--inventory", str(tmp_path / "hosts.yaml"),
                             "--steps", "sync,bundles", "--report-dir", str(tmp_path / "run")],
                            cwd=REPO, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []             # (seconds since start, bytes)
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:         # the terminal's other end closed: the run ended
                break
            if not data:
                break
            chunks.append((time.monotonic() - start, data))
    finally:
        proc.wait(timeout=30)
        os.close(master)
    text = b"".join(d for _, d in chunks).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    ended = text.index("[local] bundles   passed")
    live = re.findall(r"\r\x1b\[2K(\[local\] bundles   \.\.\. (\d+)s: (\d)/5 bundles, ([\d.]+) MB: wrote model_\d\.kdtr "
                      r"\\x1b\[2J \[REDACTED\])", text[:ended])
    assert len(live) >= 4, text[:ended]
    # drawn again as the step goes on: its count and its elapsed time both advance
    assert {int(n) for _, _, n, _ in live} >= {2, 3, 4} and int(live[-1][1]) >= 2
    assert "| ::kdtree-progress" not in text and "\x1b[2J" not in text and "tok-9f3b2c7e1a" not in text
    assert "[local] bundles   | output 3" in text and "| progress:" not in text     # the log's lines stay there
    log = (tmp_path / "run" / "local" / "bundles.log").read_text()
    assert re.search(r"^progress: \d+s: 5/5 bundles, 7\.5 MB: wrote model_5\.kdtr \\x1b\[2J \[REDACTED\]$", log, re.M), log
    assert not re.search(r"^::kdtree-progress", log, re.M)


def test_progress_is_plain_and_rare_when_not_a_terminal(make_inventory, tmp_path, monkeypatch):
    """Not a terminal (CI): a step that reports a flood of progress (200 000 lines) for about 4 s
    shows a plain line at most every interval (1 s here; 30 s by default), none of the reports
    themselves; its log has the same lines. A malformed report is ordinary output, escaped; a
    secret a report carries is redacted."""
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 1.0)
    monkeypatch.setenv("KD_PROGRESS_TOKEN", "tok-9f3b2c7e1a")
    flood = ("yes '::kdtree-progress done=7 total=9 unit=tests what=passed 7' | head -n 200000; "
             "echo '::kdtree-progress done=12345678901234567 unit=bytes what=\x01'; "
             "for i in 1 2 3; do sleep 1; echo \"::kdtree-progress done=$((7 + i)) total=10 unit=tests what=passed "
             "with $KD_PROGRESS_TOKEN\"; done")
    inv = local_inventory(make_inventory, tmp_path, flood, secret_env=["KD_PROGRESS_TOKEN"])
    out = io.StringIO()
    start = time.monotonic()
    code = cli.validate(inv, [inv.hosts["local"]], Console(out), steps="sync,bundles", report_dir=str(tmp_path / "run"))
    took = time.monotonic() - start
    text = out.getvalue()
    assert code == 0, text
    plain = re.findall(r"^\[local\] bundles   \.\.\. \d+s: (\d+)/(\d+) tests: passed.*$", text, re.M)
    assert 1 <= len(plain) <= took / 1.0 + 1, text
    assert "| ::kdtree-progress done=7" not in text and "| progress:" not in text
    assert "[local] bundles   | ::kdtree-progress done=12345678901234567 unit=bytes what=\\x01" in text
    log = (tmp_path / "run" / "local" / "bundles.log").read_text()
    logged = re.findall(r"^progress: \d+s: (\d+)/(\d+) tests: passed", log, re.M)
    assert len(plain) <= len(logged) <= len(plain) + 1 and logged[-1] == ("10", "10"), log
    assert len(log.splitlines()) < 20
    assert "passed with [REDACTED]" in log and "passed with [REDACTED]" in text
    assert "tok-9f3b2c7e1a" not in log + text


class Collected:
    """A reporter that keeps every update with the time it came."""

    def __init__(self):
        self.updates: list[tuple[float, progress.Update]] = []

    def report(self, update: progress.Update) -> None:
        self.updates.append((time.monotonic(), update))


def test_this_machines_regeneration_reports_as_it_goes(make_inventory, tmp_path, monkeypatch):
    """The golden step's regeneration on this machine (LocalReference) passes its reports on as
    they come, not when it ends, and keeps them out of its output; past LOCAL_TIMEOUT it is
    stopped and says so."""
    regenerate = ("echo '::kdtree-progress done=0 total=2 unit=bundles what=making tiny'; echo working; sleep 1.5; "
                  "echo '::kdtree-progress done=2 total=2 unit=bundles bytes=99 what=wrote b'; "
                  "mkdir -p \"$KD_BUNDLE_DIR\" && echo '{\"bundles\": []}' > \"$KD_BUNDLE_DIR/manifest.json\"")
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "deploy")}},
                         commands=fake_commands(bundles_key="echo k1", bundles=regenerate))
    reference = pipeline.LocalReference(inv.project, tmp_path / "cache")
    collected = Collected()
    assert reference.local(collected) == {"bundles": []}
    ended = time.monotonic()
    assert [u for _, u in collected.updates] == [progress.Update(0, 2, "bundles", None, "making tiny"),
                                                 progress.Update(2, 2, "bundles", 99, "wrote b")]
    assert ended - collected.updates[0][0] >= 1.0
    monkeypatch.setattr(pipeline, "LOCAL_TIMEOUT", 1)
    slow = pipeline.LocalReference(make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "d")}},
                                                  commands=fake_commands(bundles_key="sleep 10; echo k")).project,
                                   tmp_path / "cache")
    with pytest.raises(KdError, match="the local bundles_key command timed out after 1 s"):
        slow.local()
