"""Fault suite (issue 8), the attacks: injection through inventory values and command-line
arguments (and names with spaces passed literally), hostile result files and endless output, and
secrets (a passphrase key through the agent, secret env) that never leak.

Every test proves one scenario of the issue against real OpenSSH sshd hosts on 127.0.0.1 (the
session `lab`, or fresh hosts of its own for anything that stops, kills or re-keys sshd) and
states in its docstring what the user sees and what must hold afterwards. Timeouts are small
(connect 3 s, keepalive 2 s, steps a few seconds) and source trees tiny. docs/guarantees.md lists
each promise with the test that proves it; the helpers are tests/fault_lab.py's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.runner.console import Console
from orchestrator.errors import InventoryError

from fault_lab import accepted, entry, fake_commands, fresh_host, invoke, processes, run_validate, tree


# -- 12: injection -----------------------------------------------------------------------------------------
def payloads(canary: Path) -> list[str]:
    """Values that would create `canary` if any shell evaluated them."""
    c = str(canary)
    return [f"$(touch {c})", f"`touch {c}`", f"x;touch {c}", f"x|touch {c}", f"x' ; touch {c}; '",
            f'x" ; touch {c}; "', f"x\ntouch {c}", f"x && touch {c}", f"-oProxyCommand=touch {c}",
            f"x -oProxyCommand=touch {c}", f"x$IFS;touch$IFS{c}"]


INJECTABLE = ["address", "user", "remote_dir", "python", "cuda_home", "rsync_path", "arch", "jump", "identity",
              "known_hosts", "host_key"]


def test_12_injection_through_inventory_values_is_rejected(lab, make_inventory, tmp_path):
    """Scenario 12, inventory: host and group names, and every host value that reaches a command
    line (address, user, remote_dir, python, cuda_home, rsync_path, arch, jump, identity,
    known_hosts, host_key) with
    `$(...)`, backticks, `;`, `|`, quotes, a newline, `&&`, a leading '-' or an option after a space.
    The user sees: exit code 2 and a message naming the file, the host and the key (a path made only
    of harmless characters, e.g. `/srv/-oProxyCommand=touch x`, is a legal path and is passed
    literally, quoted once). Afterwards: the canary file does not exist and the host authenticated
    no session for the refused inventory."""
    canary = tmp_path / "canary"
    h1 = lab.hosts["h1"]
    sessions = accepted(h1)
    for key in INJECTABLE:
        for value in payloads(canary):
            base = entry(lab, h1, remote_dir=str(h1.root / "inj"))
            if key in ("python", "cuda_home", "rsync_path", "remote_dir", "identity", "known_hosts"):
                value = "/srv/" + value         # absolute, so that only the payload is wrong
            try:
                make_inventory({"h": {**base, key: value}})
            except InventoryError as e:
                assert f"host 'h': key '{key}'" in str(e), (key, value, str(e))
            else:       # accepted only as a path of harmless characters, which is quoted once wherever it goes
                assert key in ("remote_dir", "python", "cuda_home", "rsync_path", "identity", "known_hosts") and \
                    re.fullmatch(r"[A-Za-z0-9 ._/+,:@=-]+", value) and not value.startswith("-"), (key, value)
    for value in payloads(canary):              # host names and group names
        with pytest.raises(InventoryError, match="host name may use|is not a group name"):
            make_inventory({value: entry(lab, h1)})
        with pytest.raises(InventoryError, match="is not a group name|must not"):
            make_inventory({"h": {**entry(lab, h1), "groups": [value]}})
    proc = invoke(lab, "deploy", "--inventory", str(make_inventory({"h": entry(lab, h1)}).path), "--host", "h")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = yaml_with(make_inventory, {"h": {**entry(lab, h1), "user": f"root;touch {canary}"}})
    proc = invoke(lab, "deploy", "--inventory", str(bad), "--host", "h")
    assert proc.returncode == 2 and "key 'user'" in proc.stderr
    assert not canary.exists() and accepted(h1) == sessions + 1


def yaml_with(make_inventory, hosts: dict) -> Path:
    """Write an inventory without validating it (to hand a bad one to a task)."""
    import yaml
    path = make_inventory({}).path
    data = yaml.safe_load(path.read_text())
    data["hosts"] = hosts
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_12_injection_through_command_line_arguments(lab, make_inventory, tmp_path):
    """Scenario 12, command line: --host, --group, --steps, --skip, --report-dir, --run and
    --inventory carrying the payloads. The user sees: exit code 2 naming the unknown host, group
    or step, or (a report dir) a directory with exactly that literal name. Afterwards: the canary
    file does not exist."""
    canary = tmp_path / "canary"
    inv = make_inventory({"h": entry(lab, lab.hosts["h1"], remote_dir=str(lab.hosts["h1"].root / "cli-inj"))})
    for value in payloads(canary)[:8]:
        for args in (["deploy", "--host", value], ["doctor", "--group", value], ["validate", "--host", "h", "--steps", value],
                     ["validate", "--host", "h", "--skip", value], ["report", "--run", value]):
            proc = invoke(lab, *args[:1], "--inventory", str(inv.path), *args[1:], timeout=60)
            assert proc.returncode in (1, 2), (args, proc.stdout, proc.stderr)
    report_dir = tmp_path / f"runs $(touch {canary}) ;x"
    proc = invoke(lab, "validate", "--inventory", str(inv.path), "--host", "h", "--steps", "sync",
                  "--report-dir", str(report_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (report_dir / "run.json").is_file()
    proc = invoke(lab, "deploy", "--inventory", f"{tmp_path}/$(touch {canary}).yaml")
    assert proc.returncode == 2 and "cannot read" in proc.stderr
    assert not canary.exists()


@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_12_file_names_and_a_remote_dir_with_spaces_pass_literally(lab, make_inventory, source, tmp_path, method):
    """Scenario 12, data: source files whose names carry the payloads (and a leading '-'), deployed
    to a remote_dir with spaces, with RSYNC_OLD_ARGS=1 (and RSYNC_PROTECT_ARGS=0) in the environment,
    which would make rsync split remote arguments on spaces. The user sees: the deploy passes.
    Afterwards: every file is on the host under its literal name with its content, the tree hash
    matches, and the canary does not exist."""
    canary = tmp_path / "canary"
    names = [p.replace("\n", "_nl_").replace("/", "_") for p in payloads(canary)] + ["-rf", "--delete", "a b  c", "*", "?"]
    for name in names:
        (source / "src" / name).write_text(f"content of {name}\n")
    (source / "src" / "new\nline").write_text("newline in the name\n")
    h1 = lab.hosts["h1"]
    remote = h1.root / f"spaced {method} {tmp_path.name}" / "engine dir"
    inv = make_inventory({"h": entry(lab, h1, remote_dir=str(remote),
                                     **({"rsync_path": "/nonexistent/rsync"} if method == "tar" else {}))})
    proc = invoke(lab, "deploy", "--inventory", str(inv.path), "--host", "h",
                  env={"RSYNC_OLD_ARGS": "1", "RSYNC_PROTECT_ARGS": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"with {method}" in proc.stdout
    for name in names:
        assert (remote / "src" / name).read_text() == f"content of {name}\n", name
    assert (remote / "src" / "new\nline").read_text() == "newline in the name\n"
    assert not canary.exists()
    assert sorted(p.name for p in (remote / "src").iterdir()) == sorted(p.name for p in (source / "src").iterdir())


# -- 15: hostile results ------------------------------------------------------------------------------------
HOSTILE = {
    "symlink": "ln -sf /etc/passwd build/test_results.json",
    "dir-symlink": "rm -rf build; mkdir -p ../outside; echo '{\"tests\": []}' > ../outside/test_results.json; "
                   "ln -s \"$(cd ../outside && pwd)\" build",
    "huge": "truncate -s 3G build/test_results.json",
    "fifo": "mkfifo build/test_results.json",
    "deep": "python3 -c 'print(\"[\" * 200000)' > build/test_results.json",
    "wide": "python3 -c 'import json; print(json.dumps({\"tests\": [{\"name\": \"t\" * 5000 + str(i), \"status\": "
            "\"passed\", \"message\": \"m\" * 100000} for i in range(120)]}))' > build/test_results.json",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_15_hostile_result_files_cannot_escape_or_exhaust(lab, make_inventory, tmp_path, case):
    """Scenario 15: the host answers the test step with a hostile result file: a symlink to
    /etc/passwd, its build/ directory a symlink to a directory outside remote_dir, a 3 GB (sparse) file, a FIFO, JSON nested
    200000 deep, or JSON with huge strings. The user sees: the test step FAILED with the reason
    (`is a symlink; refusing to read it`, `is larger than`, `is not a regular file`, `not valid
    JSON`) -- or, for merely large but valid content, passed with the strings cut short. Afterwards:
    nothing was written outside the run directory, every file in it is bounded, and the run (this
    process) stayed within a bounded amount of memory."""
    import resource
    h2 = lab.hosts["h2"]
    test = f"mkdir -p build; {HOSTILE[case]}; echo done"
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"hostile-{case}-{tmp_path.name}"))},
                         commands=fake_commands(test=test))
    before = tree(tmp_path / "src")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, run_dir, out = run_validate(inv, ["h"], "sync,test", tmp_path / "run")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    step = json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]["test"]
    expected = {"symlink": "is a symlink; refusing to read it", "dir-symlink": "build is a symlink",
                "huge": "is larger than", "fifo": "is not a regular file", "deep": "is not valid JSON"}.get(case)
    if expected:
        assert code == 1 and step["status"] == "failed" and expected in step["message"], step
    else:
        assert step["status"] in ("passed", "failed"), step
    assert grown_mb < 200, grown_mb
    assert tree(tmp_path / "src") == before
    for path in run_dir.rglob("*"):
        assert not path.is_symlink() and path.resolve().is_relative_to(run_dir.resolve())
        assert path.is_dir() or path.stat().st_size < 32 << 20, path


def test_15_endless_output_without_newlines_is_bounded(lab, make_inventory, tmp_path):
    """Scenario 15, logs: a step prints 64 MB without a single newline. The user sees: the command
    ends in seconds (the stand-in build then fails its version check), its log holds the first and
    last MB of the output. Afterwards: this process's memory grew by far less than the output
    (output is handled in bounded pieces, never as one growing line)."""
    import resource
    h2 = lab.hosts["h2"]
    inv = make_inventory({"h": entry(lab, h2, remote_dir=str(h2.root / f"noisy-{tmp_path.name}"))},
                         commands=fake_commands(build="head -c 64000000 /dev/zero | tr '\\0' x"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    run_dir = tmp_path / "run"
    with open(os.devnull, "w") as devnull:        # as a terminal: the console keeps nothing
        code = cli.validate(inv, [inv.hosts["h"]], Console(devnull), steps="sync,build", report_dir=str(run_dir))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert time.monotonic() - start < 60
    build = json.loads((run_dir / "run.json").read_text())["hosts"]["h"]["steps"]["build"]
    assert code == 1 and "the binary was built from tree none" in build["message"]    # past the noisy command
    assert (run_dir / "h" / "build.log").stat().st_size < 3 << 20         # its first and last MB (sink.py)
    assert build["output_cut"]["bytes"] >= 64000000
    assert grown_mb < 100, grown_mb


# -- 13: secrets ------------------------------------------------------------------------------------------
@pytest.fixture
def agent(tmp_path):
    """An ssh-agent of this test holding a passphrase-protected key (added with ssh-add through
    SSH_ASKPASS: the passphrase never passes through the orchestrator)."""
    if not (shutil.which("ssh-agent") and shutil.which("ssh-add")):
        pytest.skip("ssh-agent/ssh-add (openssh-client) are not installed")
    passphrase = f"pass-{os.urandom(6).hex()}-phrase"
    key = tmp_path / "protected_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", "protected", "-f", str(key)], check=True)
    out = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    env = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", out))
    askpass = tmp_path / "askpass"
    askpass.write_text('#!/bin/sh\nprintf "%s\\n" "$KD_TEST_PASSPHRASE"\n')
    askpass.chmod(0o700)
    try:
        subprocess.run(["ssh-add", str(key)], check=True, capture_output=True, timeout=20, stdin=subprocess.DEVNULL,
                       env={**os.environ, **env, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force",
                            "DISPLAY": "none", "KD_TEST_PASSPHRASE": passphrase})
        yield key, passphrase, env
    finally:
        os.kill(int(env["SSH_AGENT_PID"]), signal.SIGTERM)


def test_13_passphrase_key_and_secret_env_never_leak(lab, make_inventory, tmp_path, agent, monkeypatch):
    """Scenario 13. The host accepts only a passphrase-protected key, loaded into ssh-agent (the
    documented way: the orchestrator never sees a passphrase); the host's `secret_env: [KD_TOKEN]`
    hands the build a token from the orchestrator's environment (over the command's stdin). The
    token contains quotes, `$(...)` and a newline, and the build prints it. The user sees: validate
    passes; the log shows `[REDACTED]` where the token was. Afterwards: the token reached the build
    intact (its sha256 on the host); neither the token nor the passphrase appears in any file of
    the run directory (step logs, run.json, report.md, report.html, junit.xml), the console output,
    or any process's command line on either side while the run lasted; the canary does not exist."""
    key, passphrase, agent_env = agent
    canary = tmp_path / "canary"
    token = f"tok-{os.urandom(8).hex()} 'q' \"dq\" $(touch {canary})\nsecond-line-of-the-token-{os.urandom(4).hex()}"
    keyed = fresh_host(lab, "keyed")
    only = tmp_path / "authorized_keys"
    only.write_text(Path(f"{key}.pub").read_text())
    keyed.config.write_text(keyed.config.read_text().replace(f"AuthorizedKeysFile {lab.authorized_keys}",
                                                             f"AuthorizedKeysFile {only}"))
    keyed.restart()
    with open(lab.ssh_config, "a") as f:
        f.write(f"Host {keyed.name}-agent\n  HostName 127.0.0.1\n  Port {keyed.port}\n  User root\n"
                f"  IdentityFile {key}\n  IdentitiesOnly yes\n\n")
    build = ('echo "token is $KD_TOKEN"; mkdir -p build; printf %s "$KD_TOKEN" | sha256sum > build/token.sha; '
             'sleep 2; echo "the token was $KD_TOKEN" >&2; exit 3')
    inv = make_inventory({"k": {**entry(lab, keyed, remote_dir=str(keyed.root / "engine")),
                                "address": f"{keyed.name}-agent", "secret_env": ["KD_TOKEN"]}},
                         commands=fake_commands(build=build))
    for name, value in agent_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KD_TOKEN", token)
    secrets = [token, *token.splitlines(), passphrase]
    seen, running = [], threading.Event()

    def watch():
        while not running.is_set():
            seen.extend(line for line in processes(r".") if any(s in line for s in secrets))
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code, run_dir, out = run_validate(inv, ["k"], "sync,build", tmp_path / "run")
    finally:
        running.set()
        watcher.join()
    assert code == 1, out            # the build exits 3 after printing the token twice
    assert (keyed.root / "engine" / "build" / "token.sha").read_text().split()[0] == \
        __import__("hashlib").sha256(token.encode()).hexdigest()
    assert seen == []
    log = (run_dir / "k" / "build.log").read_text()
    assert "token is [REDACTED]" in log and "the token was [REDACTED]" in log
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"run.json", "report.md", "report.html", "junit.xml", "build.log"}
    for path in files:
        text = path.read_text(errors="replace")
        for secret in secrets:
            assert secret not in text, (path, secret)
    for secret in secrets:
        assert secret not in out
    assert not canary.exists()
    # a secret that is not set: refused before anything runs (exit 2), naming host and variable
    monkeypatch.delenv("KD_TOKEN")
    from orchestrator.errors import UsageError
    with pytest.raises(UsageError, match="host 'k': secret_env KD_TOKEN is not set"):
        run_validate(inv, ["k"], "sync,build", tmp_path / "run2")


def test_13_secret_env_names_are_validated(lab, make_inventory):
    """Scenario 13, inventory: `secret_env` lists variable names; anything else, or a variable the
    orchestrator sets itself, is refused with exit code 2 naming the host and the key."""
    for bad, why in ((["KD_TOKEN; touch x"], "not an environment variable name"), (["PATH"], "set by the orchestrator"),
                     ("KD_TOKEN", "must be a list"), (["-x"], "must not start with '-'")):
        with pytest.raises(InventoryError, match=re.escape(why)) as e:
            make_inventory({"h": {**entry(lab, lab.hosts["h1"]), "secret_env": bad}})
        assert "host 'h': key 'secret_env'" in str(e.value)
