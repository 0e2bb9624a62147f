"""`invoke exec` (issue 39): one command on the selected hosts, run as the user runs it (`python -m
invoke exec ...` and the `kdtree-orch` program, in a subprocess) against the session's loopback
sshd hosts h1 and h2 and the local host. Each run is a run directory with one step `exec` per host.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fault_lab import MARK
from orchestrator import cli
from orchestrator.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
# Words a shell would take apart or expand: each must reach the host's command as one argument.
TRICKY = ["it's 'a b'", "", "$HOME", "*", "a  b", "`id`", ";", '"', "\\", "x -- y", "--"]
PROGRAMS = {"invoke": [sys.executable, "-m", "invoke"],
            "kdtree-orch": [sys.executable, "-c", "from orchestrator.program import main; main()"]}


def run_exec(inv, *args: str, program: str = "invoke", env: dict | None = None) -> subprocess.CompletedProcess:
    """`invoke exec --inventory INV ARGS...` (or kdtree-orch's) from the repo, as a user types it."""
    return subprocess.run([*PROGRAMS[program], "exec", "--inventory", str(inv.path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def latest_run(inv) -> tuple[Path, dict]:
    run_dir = (inv.path.parent / "runs" / "latest").resolve()
    return run_dir, json.loads((run_dir / "run.json").read_text())


def summary_row(stdout: str, host: str) -> list[str]:
    """The cells of `host`'s row in the summary table."""
    return next(line.split(None, 4) for line in stdout.splitlines() if line.split()[:1] == [host])


def lab_hosts(lab, make_inventory, **entries) -> object:
    """An inventory of lab hosts (name -> entry overrides) and the local host."""
    hosts = {name: lab.inventory_entry(lab.hosts[name], **extra) for name, extra in entries.items()}
    return make_inventory({**hosts, "local": {"transport": "local", "remote_dir": "unused"}})


@pytest.mark.parametrize("argv, remainder, words", [
    (["invoke", "exec", "-H", "a", "--", "echo", "it's 'a b'"], None, ("echo", "it's 'a b'")),
    (["kdtree-orch", "exec", "--", "printf", "%s", "--", ""], "printf %s -- ", ("printf", "%s", "--", "")),
    (["invoke", "exec", "-H", "a"], None, None),
    (["invoke", "exec", "--"], "", None),
    (["invoke", "exec", "--", "rm", "x"], "echo x", None),      # not the words Invoke parsed: nothing runs
])
def test_the_words_after_the_first_double_dash_are_the_command(argv, remainder, words):
    if words is None:
        with pytest.raises(UsageError):
            cli.command_words(argv, remainder)
    else:
        assert cli.command_words(argv, remainder) == words


@pytest.mark.parametrize("value, seconds", [(None, cli.EXEC_TIMEOUT), ("2.5", 2.5), ("0", None), ("-1", None),
                                            ("nan", None), ("inf", None), ("soon", None)])
def test_timeout_is_a_positive_number_of_seconds(value, seconds):
    if seconds is None:
        with pytest.raises(UsageError):
            cli.parse_timeout(value)
    else:
        assert cli.parse_timeout(value) == seconds


def test_quotes_and_spaces_reach_the_command_as_typed_on_ssh_and_local_hosts(lab, make_inventory):
    """`invoke exec -H h1 -H local -- printf '%s|' WORDS...`: each word arrives whole and literal
    (no shell expansion, no splitting), the output comes back byte for byte, prefixed per host, in
    the console and each host's log; exit 0 and a run record of one passed step exec per host."""
    inv = lab_hosts(lab, make_inventory, h1={})
    proc = run_exec(inv, "-H", "h1", "-H", "local", "--", "printf", "%s|\\n", *TRICKY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = "".join(f"{w}|\n" for w in TRICKY).splitlines()
    run_dir, run = latest_run(inv)
    for host in ("h1", "local"):
        shown = [line.split(" | ", 1)[1] for line in proc.stdout.splitlines()
                 if line.startswith(f"[{host.ljust(5)}] exec      | ")][1:]     # after the `$ command` line
        assert shown == expected, proc.stdout
        assert (run_dir / host / "exec.log").read_text().splitlines()[1:] == expected
        assert run["hosts"][host]["steps"]["exec"]["status"] == "passed"
        assert summary_row(proc.stdout, host)[1:3] == ["passed", "-"]
    assert run["command"] == "exec" and run["status"] == "passed"


def test_the_issues_example_runs_nvidia_smi_with_its_flags_on_a_gpu_host(gpu_lab, lab, make_inventory):
    """`invoke exec -H g1 -- nvidia-smi --query-gpu=... --format=...` on a loopback host whose PATH
    has a stand-in nvidia-smi (it answers only the exact flags nvidia-smi takes): one line per GPU."""
    host, fake = gpu_lab
    fake.set(2, name="NVIDIA RTX PRO 6000 Blackwell")
    try:
        inv = make_inventory({"g1": lab.inventory_entry(host)})
        proc = run_exec(inv, "-H", "g1", "--", "nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader")
    finally:
        fake.set(1)         # the session fixture's state, for the other modules' tests
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[g1] exec      | 0, NVIDIA RTX PRO 6000 Blackwell\n[g1] exec      | 1, NVIDIA RTX PRO 6000 Blackwell\n" \
        in proc.stdout


def test_the_console_entry_takes_the_words_as_typed_and_escapes_hostile_output(lab, make_inventory):
    """`kdtree-orch exec -- ...` on the local host (the default selection): quotes survive, and a
    host's escape sequences, carriage returns, bells and NULs are shown as visible escapes, never
    sent to the terminal or the log."""
    inv = lab_hosts(lab, make_inventory)
    hostile = "\x1b[2J\x1b]0;owned\x07red\rover\x00nul\u202eevil"
    proc = run_exec(inv, "--", "printf", "%s\\n%b\\n", "it's 'a b'", hostile.replace("\x00", "\\0"),
                    program="kdtree-orch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[local] exec      | it's 'a b'\n" in proc.stdout
    escaped = "\\x1b[2J\\x1b]0;owned\\x07red\\rover\\x00nul\\u202eevil"
    assert f"[local] exec      | {escaped}\n" in proc.stdout
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202e]", proc.stdout + proc.stderr)
    run_dir, _ = latest_run(inv)
    log = (run_dir / "local" / "exec.log").read_text()
    assert escaped in log.splitlines() and "\x1b" not in log


def test_a_failing_host_beside_a_passing_one_exits_1_and_the_summary_names_both(lab, make_inventory):
    """The same command passes on h1 (a warm connection) and fails on h2 (Paramiko): exit 1, h2's
    failure does not stop h1, the summary names both; h2's exit status 124, given by the command
    itself long before its timeout, is a failure, not a timeout; run.json, junit.xml and report.md
    agree (report.md does not say `no GPU` of hosts it never probed)."""
    marker = f"exec-marker-{secrets.token_hex(4)}"
    (lab.hosts["h1"].home / marker).write_text("present\n")
    try:
        inv = lab_hosts(lab, make_inventory, h1={"persist": 60}, h2={})
        proc = run_exec(inv, "-H", "h1", "-H", "h2", "--", "bash", "-c", f'cat "$HOME/{marker}" || exit 124')
    finally:
        (lab.hosts["h1"].home / marker).unlink()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[h1] exec      | present" in proc.stdout
    assert summary_row(proc.stdout, "h1")[1:4] == ["passed", "-", "passed"]
    assert summary_row(proc.stdout, "h2")[1:4] == ["FAILED", "-", "failed"]
    assert "exec: exited with 124" in summary_row(proc.stdout, "h2")[4]
    run_dir, run = latest_run(inv)
    assert run["status"] == "failed"
    assert run["hosts"]["h1"]["status"] == "passed"
    step = run["hosts"]["h2"]["steps"]["exec"]
    assert (step["status"], step["message"], step["log"]) == ("failed", "exited with 124", "h2/exec.log")
    assert "No such file or directory" in step["tail"]
    cases = {(c.get("classname"), c.get("name")): c.find("failure") is not None
             for c in ET.parse(run_dir / "junit.xml").getroot().iter("testcase")}
    assert cases == {("h1", "step.exec"): False, ("h2", "step.exec"): True}
    # exec probes nothing: the report does not claim the hosts have no GPU
    rows = [line for line in (run_dir / "report.md").read_text().splitlines() if line.startswith("| **h")]
    assert len(rows) == 2 and all("| not probed |" in row and "no GPU" not in row for row in rows), rows


def test_a_timeout_stops_everything_the_command_started_on_the_host(lab, make_inventory):
    """`--timeout 1` on a command whose processes sleep, one of them in a session of its own: the
    host's timeout fires, the step is `timeout`, exit 1, and nothing of it is left running."""
    mark = f"9{MARK}"
    inv = lab_hosts(lab, make_inventory, h1={})
    start = time.monotonic()
    proc = run_exec(inv, "-H", "h1", "--timeout", "1", "--", "bash", "-c",
                    f"sleep 3{mark} & (setsid sleep 4{mark} &); sleep 5{mark}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - start < 20
    _, run = latest_run(inv)
    step = run["hosts"]["h1"]["steps"]["exec"]
    assert (step["status"], step["message"]) == ("timeout", "timed out after 1 s")
    assert summary_row(proc.stdout, "h1")[1:4] == ["FAILED", "-", "timeout"]
    deadline = time.monotonic() + 5         # a loaded machine may take a moment to reap them
    while (left := subprocess.run(["pgrep", "-af", f"sleep [345]{mark}"], capture_output=True, text=True).stdout) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == ""


def test_a_secret_reaches_the_command_and_is_redacted_everywhere(lab, make_inventory):
    """A host's secret_env reaches the command (its length shows) and never shows: the console, the
    log, run.json (the failure's tail included) and the reports say [REDACTED]."""
    secret = f"exec-secret-{secrets.token_hex(8)}"
    inv = lab_hosts(lab, make_inventory, h2={"secret_env": ["KD_EXEC_SECRET"]})
    proc = run_exec(inv, "-H", "h2", "--", "bash", "-c",
                    'echo "length ${#KD_EXEC_SECRET}"; echo "token: $KD_EXEC_SECRET" >&2; exit 3',
                    env={"KD_EXEC_SECRET": secret})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"length {len(secret)}" in proc.stdout and "token: [REDACTED]" in proc.stdout
    run_dir, run = latest_run(inv)
    assert "token: [REDACTED]" in run["hosts"]["h2"]["steps"]["exec"]["tail"]
    assert "token: [REDACTED]" in (run_dir / "h2" / "exec.log").read_text()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"run.json", "report.md", "report.html", "junit.xml", "exec.log"} <= {p.name for p in written}
    for path in written:
        assert secret not in path.read_text(errors="replace"), path
    assert secret not in proc.stdout + proc.stderr


@pytest.mark.parametrize("args, named", [
    (["-H", "nosuch", "--", "true"], "unknown host 'nosuch'"),
    (["--", "true"], "unknown host 'local'"),       # no selection: the host `local`, which this inventory lacks
    (["-H", "h1", "--timeout", "soon", "--", "true"], "--timeout: 'soon'"),
    (["-H", "h1"], "exec needs the command after --"),
])
def test_a_usage_error_exits_2_naming_what_is_wrong_and_runs_nothing(lab, make_inventory, args, named):
    inv = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"])})
    proc = run_exec(inv, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert named in proc.stderr
    assert not (inv.path.parent / "runs").exists()
