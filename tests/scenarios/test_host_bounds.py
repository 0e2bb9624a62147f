"""Issue 37, round 3, findings 5-8 and 12: what one host sends (numbers, keys, lock answers, step
output) is checked and bounded where it enters, so it fails that host alone; a local disk that
fills up ends the run with one line, the summary and the logs kept.

The hosts are the session's loopback sshd hosts (h1 plays the good host, h2 the hostile one); the
hostile values come from the project's commands in the test's hosts.yaml, as a host would print
them. README.md, "Security model" and "Guarantees", name these tests.
"""
from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.records import dashboard, history as history_mod, run_store
from orchestrator.runner import pipeline
from orchestrator.runner.console import Console

from fault_lab import entry, fake_commands, run_validate

# A bench stand-in: the good host (its remote_dir named good-...) reports 120 tokens/s, the other
# one the figure in $BAD (a literal JSON number).
BENCH = ("mkdir -p build && case $PWD in */good-*) v=120;; *) v=%s;; esac && "
         "printf '{\"metrics\": {\"ar_tokens_per_s\": {\"value\": %%s, \"unit\": \"tokens/s\", \"better\": \"higher\", "
         "\"samples\": [%%s, %%s, %%s]}}}' $v $v $v $v > build/bench.json")


@pytest.fixture
def two_hosts(lab, make_inventory, tmp_path):
    """inventory(**commands) -> an inventory of `good` (h1) and `bad` (h2), fresh remote_dirs."""
    def make(**commands):
        hosts = {"good": entry(lab, lab.hosts["h1"], remote_dir=str(lab.hosts["h1"].root / f"good-{tmp_path.name}")),
                 "bad": entry(lab, lab.hosts["h2"], remote_dir=str(lab.hosts["h2"].root / f"bad-{tmp_path.name}"))}
        return make_inventory(hosts, commands=fake_commands(**commands))
    return make


def nightly(inv, report_dir: Path, steps: str = "sync,bench") -> tuple[int, dict, str]:
    """A nightly of both hosts into report_dir: (exit code, run.json, console output)."""
    code, run_dir, out = run_validate(inv, ["good", "bad"], steps, report_dir, command="nightly")
    return code, json.loads((run_dir / "run.json").read_text()), out


# -- 5: numbers out of their range ---------------------------------------------------------------------
def test_5_extreme_bench_values_fail_that_host_alone_night_after_night(two_hosts, tmp_path):
    """Finding 5. A host reports 1e-300 one night and 1e308 the next (the ratio of the two is
    infinite). The user sees: each nightly exit 1, `bad` bench FAILED naming the metric, its value
    and the range; `good` passed. Afterwards: each night's run.json, reports, JUnit, runs/latest
    and the history are written; the history holds only `good`'s points."""
    runs = tmp_path / "runs"
    for night, value in enumerate(["1e-300", "1e308"]):
        bench = BENCH % value
        inv = two_hosts(bench=bench, bench_nightly=bench)
        report_dir = runs / f"2026120{night + 1}-020000-000{night}"
        code, run, out = nightly(inv, report_dir)
        step = run["hosts"]["bad"]["steps"]["bench"]
        assert code == 1 and step["status"] == "failed", out
        assert f"metric ar_tokens_per_s: value {float(value):g} is" in step["message"], step
        assert "outside its range (0 or 1e-09 to 1e+12)" in step["message"], step
        assert run["hosts"]["good"]["status"] == "passed" and run["hosts"]["bad"]["bench"] is None
        for name in ("report.md", "report.html", "junit.xml"):
            assert (report_dir / name).is_file(), name
        assert (runs / "latest").resolve() == report_dir.resolve()
    with history_mod.HistoryStore.open(runs / "history.sqlite") as store:
        assert {p.key.host for p in store.points()} == {"good"} and len(store.points()) == 2
    assert (runs / "history.html").is_file()


def poison(history: Path, host: str, value: float, nights: int) -> None:
    """Points as an orchestrator before the range checks indexed them: `nights` passing nightlies
    of `host` reporting `value`."""
    with history_mod.HistoryStore.open(history) as store:
        for i in range(nights):
            run_id = f"20261101-0{i}0000-00{i:02x}"
            store.db.execute("INSERT OR IGNORE INTO runs VALUES (?, 'nightly', ?, 'passed', NULL, 't', 'c', 0)",
                             (run_id, f"2026-11-01T0{i}:00:00Z"))
            store.db.execute("INSERT INTO points VALUES (?, ?, ?, 'no GPU', 'cpu', 'k', 't', 'c', 'm', ?, 'x', "
                             "'higher', 3, ?, 0, ?, 0, 0, NULL, NULL, NULL)",
                             (run_id, f"2026-11-01T0{i}:00:00Z", host, value, value, json.dumps([value] * 3)))
        store.db.commit()


def test_5_a_history_poisoned_before_the_fix_still_judges_draws_and_lists(tmp_path, make_inventory):
    """Finding 5, old databases: six nights of 5e-324 (and one of 1e308) indexed before the range
    checks. The user sees: `invoke history` lists the sound series only, the dashboard is drawn,
    the next run is judged (no ZeroDivisionError, no `Out of range float`). Afterwards: the
    poisoned points are still in the file, never judged or plotted."""
    inv = make_inventory({})
    history = inv.project.root / "runs" / "history.sqlite"
    poison(history, "denormal", 5e-324, 6)
    poison(history, "huge", 1e308, 1)
    sound = {"version": 1, "run_id": "20261102-000000-0000", "started": "2026-11-02T00:00:00Z", "hosts": {
        "denormal": {"backend": "cpu", "build_key": None, "fingerprint": {}, "steps": {"bench": {"status": "passed"}},
                     "bench": {"metrics": {"m": {"value": 2.0, "unit": "x", "better": "higher"}}}}}}
    with history_mod.HistoryStore.open(history) as store:
        store.db.execute("UPDATE points SET build_key = ?", (history_mod.host_key("denormal", sound["hosts"]["denormal"]).build_key,))
        store.db.commit()
        verdicts = history_mod.judge_run(store, sound, lambda metric: 0.1)
        assert [v.status for _, v in verdicts] == ["new"]
        page = dashboard.render_history(store, tmp_path / "history.html").read_text()
        assert "No benchmark has been recorded yet" in page and "denormal" not in page
        assert len(store.db.execute("SELECT * FROM points").fetchall()) == 7
    out = io.StringIO()
    assert cli.history(inv, Console(out)) == 0
    assert "denormal" not in out.getvalue() and "huge" not in out.getvalue()


def test_5_clean_removes_a_poisoned_passing_nightly(tmp_path):
    """Finding 5, `clean`: the newest passing nightly reported 5e-324, the next ones failed (its
    host now fails the bench step). The user sees: `clean --keep 0` removes every run. Afterwards:
    no poisoned run is kept as the nightly's baseline."""
    runs = tmp_path / "runs"
    for i, (status, value) in enumerate([("passed", 100.0), ("passed", 5e-324), ("failed", None)]):
        run_dir = runs / f"2026110{i + 1}-000000-000{i}"
        run_dir.mkdir(parents=True)
        metrics = {"m": {"value": value, "unit": "x", "better": "higher"}} if value is not None else {}
        run_store.write_run(run_dir, {"version": 1, "run_id": run_dir.name, "command": "nightly", "status": status,
                                   "hosts": {"h": {"bench": {"metrics": metrics}}}})
    assert run_store.last_good_run(runs)["run_id"] == "20261101-000000-0000"
    assert run_store.clean(runs, 0) == [runs / "20261102-000000-0001", runs / "20261103-000000-0002"]
    assert run_store.clean(runs, 1) == []


# -- 6: the build key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key,why", [
    ("python3 -c 'print(\"[\" * 600 + \"]\" * 600)'", "is not valid JSON or is nested deeper than 32 levels"),
    ("echo '{\"nvcc\": NaN, \"cxx\": 1e999}'", None),
], ids=["600-deep", "nan"])
def test_6_a_hostile_build_key_fails_that_host_alone(two_hosts, tmp_path, key, why):
    """Finding 6. The build key command prints JSON 600 levels deep, or `{"nvcc": NaN}`. The user
    sees: deep: `bad` build FAILED, `the build key (...) is not valid JSON or is nested deeper than
    32 levels`; NaN: the key is kept with null for the number (as every host JSON). Afterwards:
    run.json (strict JSON), the reports and `good`'s record are written."""
    build_key = f"case $PWD in */good-*) echo '{{\"cxx\": \"g++\"}}';; *) {key};; esac"
    inv = two_hosts(build_key=build_key, build="true", version="echo kdtree 0.0 tree=none")
    code, run, out = nightly(inv, tmp_path / "run", steps="sync,build")
    bad, good = run["hosts"]["bad"], run["hosts"]["good"]
    assert good["build_key"] == {"cxx": "g++"} and good["steps"]["build"]["status"] != "skipped", good["steps"]
    if why:
        assert bad["steps"]["build"]["status"] == "failed" and why in bad["steps"]["build"]["message"], bad["steps"]
        assert "the build key (the" in bad["steps"]["build"]["message"]
    else:
        assert bad["build_key"] == {"nvcc": None, "cxx": None}, bad
    json.loads((tmp_path / "run" / "run.json").read_text(), parse_constant=pytest.fail)
    assert (tmp_path / "run" / "junit.xml").is_file()


# -- 8: step output -----------------------------------------------------------------------------------
class Counting(io.TextIOBase):
    """A console stream that keeps only how much was written to it, and its lines that are notes."""

    def __init__(self):
        self.bytes, self.notes = 0, []

    def write(self, text: str) -> int:
        self.bytes += len(text.encode())
        self.notes += [line for line in text.splitlines() if "[" in line and "output" in line]
        return len(text)


def test_8_fifty_mb_of_step_output_leave_a_few_mb_on_disk_and_console(lab, make_inventory, tmp_path):
    """Finding 8. The test step prints 50 MB (lines of 100 bytes), then fails. The user sees: the
    console shows the first MB, a line saying the rest is held back, then the last MB after
    `[... bytes in ... lines of output left out here ...]`, and `test FAILED ... [N bytes of output
    left out of the log]`. Afterwards: test.log and the console hold under 3 MB each, the log
    says what was left out where it was, run.json's step records it (`output_cut`), the failure's
    tail is the output's last lines, and this process's memory grew by far less than the output."""
    import resource
    h2 = lab.hosts["h2"]
    test = "python3 -c 'import sys\nfor i in range(500000): sys.stdout.write(\"%099d\\n\" % i)'; echo LAST; exit 3"
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"loud-{tmp_path.name}"))},
                         commands=fake_commands(test=test))
    console = Counting()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = cli.validate(inv, [inv.hosts["h"]], Console(console), steps="sync,test", report_dir=str(tmp_path / "run"))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    step = json.loads((tmp_path / "run" / "run.json").read_text())["hosts"]["h"]["steps"]["test"]
    log = tmp_path / "run" / "h" / "test.log"
    assert code == 1 and step["status"] == "failed", step
    assert log.stat().st_size < 3 << 20 and console.bytes < 3 << 20, (log.stat().st_size, console.bytes)
    cut = step["output_cut"]
    assert cut["bytes"] > 50_000_000 and cut["lines"] > 500_000 and cut["left_out_bytes"] > 47_000_000, cut
    text = log.read_text()
    assert f"[{cut['left_out_bytes']} bytes in {cut['left_out_lines']} lines of output left out here" in text
    assert text.index("0" * 99) < text.index("left out here") < text.index("%099d" % 499999) < text.rindex("LAST")
    assert any("left out here" in n for n in console.notes) and any("follow when the step ends" in n for n in console.notes)
    assert "LAST" in step["tail"] and grown_mb < 60, grown_mb


# -- 7: lock and claim helpers that flood their answer ----------------------------------------------------
# A `flock` that floods: a million HOLDER lines (the lock's), or HELD lines each naming another GPU
# (the GPU claim's, in a remote_dir named claims-...), then BUSY.
FLOOD = """#!/usr/bin/env python3
import os, sys
owner = '{"client": "x", "pid": 1, "started": "s", "command": "c"}'
held = "claims-" in os.getcwd()
sys.stdout.writelines(f"HELD GPU-{i} {owner}\\n" if held else f"HOLDER {owner}\\n" for i in range(1000000))
print("BUSY")
sys.exit(1)
"""


@pytest.fixture(scope="module")
def flooding_host(lab, tmp_path_factory):
    """An sshd host whose `flock` floods (FLOOD)."""
    fake = tmp_path_factory.mktemp("flooding-bin")
    (fake / "flock").write_text(FLOOD)
    (fake / "flock").chmod(0o755)
    return lab.add_host("flood", setenv={"PATH": f"{fake}:/usr/local/bin:/usr/bin:/bin"})


def test_7_a_lock_helper_that_floods_holder_lines_fails_that_host_in_bounded_memory(lab, make_inventory, tmp_path,
                                                                                      flooding_host):
    """Finding 7. The lock helper prints a million `HOLDER {...}` lines before BUSY. The user
    sees: deploy FAILED, `the lock command printed more than 1048576 bytes without an answer`.
    Afterwards: run.json is a few kB, and this process's memory grew by far less than the output."""
    import resource
    inv = make_inventory({"h": entry(lab, flooding_host, remote_dir=str(flooding_host.root / f"d-{tmp_path.name}"))})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = io.StringIO()
    code = cli.run_plan(inv, [inv.hosts["h"]], pipeline.Plan.of("deploy"),
                        Console(out), report_dir=str(tmp_path / "run"))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    step = json.loads((tmp_path / "run" / "run.json").read_text())["hosts"]["h"]["steps"]["sync"]
    assert code == 1 and "the lock command printed more than 1048576 bytes without an answer" in step["message"], step
    assert (tmp_path / "run" / "run.json").stat().st_size < 64 << 10 and grown_mb < 60, grown_mb


def test_7_a_claim_helper_that_floods_held_lines_is_bounded_too(lab, make_inventory, flooding_host, tmp_path):
    """Finding 7, GPU claims: the claim helper names a million GPUs as held. The user sees: the
    claim fails, `the GPU claim command printed more than 1048576 bytes without an answer`.
    Afterwards: memory grew by far less than the output. A helper whose output nobody reads any
    more (the lock's, after its answer) keeps at most UNREAD_BYTES of it waiting."""
    import resource

    from orchestrator import state
    from orchestrator.resources import gpu_claims
    from orchestrator.connectors import base, factory
    from orchestrator.errors import HostError
    from orchestrator.host import client
    remote = flooding_host.root / f"claims-{tmp_path.name}"
    (remote / ".kdtree").mkdir(parents=True)
    host = make_inventory({"h": entry(lab, flooding_host, remote_dir=str(remote))}).hosts["h"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with factory.open_transport(host) as t:
        with pytest.raises(HostError, match="the GPU claim command printed more than 1048576 bytes"):
            gpu_claims.held_claims(t, ["GPU-0"])
        process = t.start(client.lock(t.host, state.Owner.now("probe"), mode=state.EXCLUSIVE).line)
        time.sleep(3)               # the flood arrives with nobody reading it
        assert process._unread <= base.UNREAD_BYTES
        with pytest.raises(base.OutputOverflow):
            while process.readline(timeout=10) is not None:
                pass
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024 < 60


# -- 12: a full local disk ----------------------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path, tmpfs):
    """A 200 kB tmpfs for runs/ (a disk that fills up); skipped where mount is refused."""
    return tmpfs(tmp_path / "small-runs", "200k")


def test_12_a_full_local_disk_ends_the_run_with_one_line_the_summary_and_the_logs(lab, make_inventory, tmp_path,
                                                                                   full_disk):
    """Finding 12. The run directory (--report-dir) lies on a disk with 200 kB free, and the test
    step prints 1 MB. The user sees: `invoke validate` exits 1, without a traceback, with one line
    naming the file it could not write and `No space left on device`, and the summary table.
    Afterwards: the step logs written before the disk filled are kept."""
    import subprocess
    import sys
    h1 = lab.hosts["h1"]
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(h1.root / f"full-{tmp_path.name}"))},
                         commands=fake_commands(test="head -c 1000000 /dev/zero | tr '\\0' x | fold -w 500"))
    run_dir = full_disk / "run"
    proc = subprocess.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inv.path), "--host", "h",
                           "--steps", "sync,test", "--report-dir", str(run_dir)],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **lab.env()})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in output, output
    last = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(last) == 1 and re.match(rf"error: cannot write {run_dir}/\S+: No space left on device$", last[0]), output
    assert re.search(r"^host +status", proc.stdout, re.M) and re.search(r"^h +FAILED", proc.stdout, re.M), output
    assert (run_dir / "h" / "sync.log").is_file() and (run_dir / "h" / "test.log").is_file()
