"""Command builders as data: the exact command line or argv each step sends, and that values
reach the host literally (nothing from the inventory is ever executed)."""
from __future__ import annotations

import io
import json
import os
import shlex
import signal
import threading

import pytest

from orchestrator import doctor, host as host_scripts, inventory, ownership, remote, state, sync
from orchestrator.runner import console, parallel
from orchestrator.host import client
from orchestrator.inventory import Host
from orchestrator.connectors.local import LocalTransport
from orchestrator.connectors.paramiko import SshTransport

CT200 = Host(name="ct200", transport="ssh", remote_dir="/root/kdtree-engine", address="ct200", user="root",
             cuda_home="/usr/local/cuda-13.0", python="/root/venv_sglang211/bin/python", arch="sm_120", gpus=8,
             known_hosts="/repo/known_hosts")
ENV = 'umask 077 && exec env -i HOME="$HOME" USER="$USER" LOGNAME="$LOGNAME" LANG="${LANG:-C.UTF-8}" LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"'
GUARD = "bash -c " + shlex.quote(remote.GUARD) + " kdtree-step"


def test_step_command():
    owned = "bash -c " + shlex.quote(ownership.CHECK + 'kd_owned "$1"') + " kdtree-owner /root/kdtree-engine"
    assert remote.step_command(CT200, "bash scripts/build.sh", 900) == (
        f"{owned} && cd -- /root/kdtree-engine && {ENV} PATH=/usr/local/cuda-13.0/bin:\"$PATH\" "
        "CUDA_HOME=/usr/local/cuda-13.0 PYTHON=/root/venv_sglang211/bin/python KD_BACKEND=auto KD_ARCH=sm_120 "
        f"{GUARD} 10 900 bash -c 'bash scripts/build.sh'")


def test_wrap_quotes_every_value_once():
    assert remote.wrap(["echo", "a b", "$(x)"], timeout=1.5, cwd="/srv/with space", env={"K": "it's"}) == (
        f"cd -- '/srv/with space' && {ENV} PATH=\"$PATH\" 'K=it'\"'\"'s' "
        f"{GUARD} 10 1.5 echo 'a b' '$(x)'")
    assert remote.wrap(["cat"], timeout=3, reads_stdin=True) == f'{ENV} PATH="$PATH" setsid -w timeout -k 10 3 cat'
    assert remote.wrap(["true"], timeout=None) == f'{ENV} PATH="$PATH" true'
    with pytest.raises(ValueError):
        remote.wrap(["true"], timeout=1, env={"A;B": "x"})


def test_hostile_values_reach_the_command_literally(tmp_path):
    canary = tmp_path / "canary"
    hostile = f"$(touch {canary}); `touch {canary}` | touch {canary} \n-x 'q\""
    local = LocalTransport(Host(name="local", transport="local", remote_dir=str(tmp_path)))
    for command in (remote.wrap(["printf", "%s", hostile], timeout=5, cwd=str(tmp_path)),
                    remote.wrap(["bash", "-c", 'printf "%s" "$KD_ARCH"'], timeout=5, env={"KD_ARCH": hostile})):
        assert local.run(command, timeout=10).tail == hostile
    assert not canary.exists()


def test_the_ssh_config_resolves_targets_and_jump_hosts(tmp_path, monkeypatch):
    config = tmp_path / "ssh_config"
    config.write_text("Host gpu7\n  HostName gpu7.lab.example\n  Port 2200\n  User ops\n  IdentityFile /keys/gpu\n"
                      "  ProxyJump admin@gate:2222,inner\n\nHost *\n  User fallback\n")
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(config))
    from orchestrator.connectors import paramiko as connection, ssh_common
    host = Host(**{**CT200.__dict__, "address": "gpu7", "user": None, "port": None, "identity": "/keys/id"})
    assert ssh_common.jump_hops(host) == ["admin@gate:2222", "inner"]
    assert ssh_common.jump_hops(Host(**{**host.__dict__, "jump": "ops@bastion:2222"})) == ["ops@bastion:2222"]
    assert ssh_common.hop_parts("admin@gate:2222") == ("gate", "admin", 2222)
    assert ssh_common.hop_parts("inner") == ("inner", None, None)
    target = connection._Target.of(ssh_common.paramiko_config(), "gpu7", None, None, "/keys/id")
    assert (target.hostname, target.port, target.user, target.key_files) == \
        ("gpu7.lab.example", 2200, "ops", ["/keys/id", "/keys/gpu"])
    target = connection._Target.of(ssh_common.paramiko_config(), "gpu7", "root", 22, None)    # the inventory wins
    assert (target.port, target.user) == (22, "root")
    other = connection._Target.of(ssh_common.paramiko_config(), "elsewhere", None, None, None)
    assert (other.hostname, other.port, other.user, other.key_files) == ("elsewhere", 22, "fallback", [])


def test_rsync_argv(monkeypatch, make_inventory):
    inv = make_inventory({"ct200": {"address": "ct200", "remote_dir": "/root/kdtree-engine", "user": "root",
                                    "rsync_path": "/opt/rsync dir/rsync"}})
    argv = sync.rsync_argv(SshTransport(inv.hosts["ct200"]), inv.project, rsh="python3 rsh_helper.py /tmp/s")
    assert argv == [
        "rsync", "-az", "--no-owner", "--no-group", "--delete", "--stats", "--protect-args", "--chmod=go-rwx",
        "--exclude=/.kdtree/",
        "--exclude=build/", "--exclude=.git/", "--exclude=.kdtree/", "--exclude=__pycache__/", "--exclude=*.pyc",
        "--exclude=tests/refs/model_*.kdtr", "--exclude=tests/refs/manifest.json",
        "-e", "python3 rsh_helper.py /tmp/s",          # the relay over the verified connection: no system ssh
        "--rsync-path='/opt/rsync dir/rsync'", f"{inv.project.source}/", "ct200:/root/kdtree-engine/"]
    local = Host(name="local", transport="local", remote_dir="/work/.deploy/local")
    assert sync.rsync_argv(LocalTransport(local), inv.project)[-2:] == [f"{inv.project.source}/", "/work/.deploy/local/"]


def test_deploy_commands_in_order(make_inventory):
    """The lock command takes the lock and carries the sync's first and last steps (the host
    client's scripts), which it runs when told (no session of their own), the last after the
    ownership check again; each value told travels escaped, as one argument."""
    inv = make_inventory({"ct200": {"address": "ct200", "remote_dir": "/root/kdtree-engine"}})
    owner = state.Owner("client", 42, "2026-01-01T00:00:00Z", "deploy")
    steps = sync.deploy_commands(SshTransport(inv.hosts["ct200"]), inv.project, owner)
    assert [what for what, _ in steps] == [
        "host: claim remote_dir, take the lock (held until the deploy ends); it carries the sync's first and last "
        "steps (its last two arguments) and runs each when told",
        "host: told over the lock's channel: mark the sync in progress, find rsync",
        "local: transfer (a tar stream instead when the host has no rsync)",
        "host: told over the lock's channel: check remote_dir again, hash the deployed tree; when it is the local "
        "hash, write the deploy record (its last argument), clear the in-progress mark"]
    hash_line = sync.hash_line(inv.hosts["ct200"], inv.project)
    assert "setsid -w timeout -k 10 300 bash -c 'bash scripts/tree_hash.sh'" in hash_line
    marker = client._marker_text(owner).replace("orchestrator's", "orchestrator'\"'\"'s")
    begin, finish = client._held_texts()
    assert begin == host_scripts.script_text("begin_sync") and finish.endswith(host_scripts.script_text(
        "finish_sync", FINISH_TAIL=client.FINISH_TAIL)) and 'kd_owned "$1"\n' in finish
    assert steps[0][1].endswith(f"kdtree /root/kdtree-engine '{owner.to_json()}' '{marker}' exclusive 0 45 "
                                f"{shlex.quote(begin)} {shlex.quote(finish)}")
    # each value an x and its escape: the empty rsync_path an argument all the same
    assert steps[1][1] == "run 1 x" + str(owner).replace(" ", "\\x20") + " x"
    escaped = hash_line.replace("\\", "\\x5c").replace(" ", "\\x20")
    record = json.dumps({'DEPLOY': 'RECORD'}).replace(" ", "\\x20")
    assert steps[3][1] == f"run 2 xLOCAL_TREE_HASH x{escaped} x{record}"


@pytest.mark.parametrize("path, is_dir, excluded", [
    ("build", True, True), ("python/build", True, True), ("build", False, False),
    ("a/__pycache__", True, True), ("x.pyc", False, True), ("a/b/x.pyc", False, True),
    ("tests/refs/model_tiny.kdtr", False, True), ("tests/refs/sub/model_tiny.kdtr", False, False),
    ("x/tests/refs/model_tiny.kdtr", False, True), ("tests/refs/expected_manifest.json", False, False),
    (".kdtree", True, True), ("src/.kdtree", True, True), ("src/main.cpp", False, False),
])
def test_exclude_matching_follows_rsync(path, is_dir, excluded):
    patterns = ["/.kdtree/", *inventory.load(os.path.join(os.path.dirname(__file__), "..", "hosts.yaml")).project.excludes]
    assert sync.is_excluded(path, is_dir, patterns) is excluded


def host_with(**kw) -> Host:
    return Host(**{"name": "h", "transport": "ssh", "remote_dir": "/srv/k", "address": "h", **kw})


@pytest.mark.parametrize("host, facts, check, status, detail", [
    (host_with(), {"rsync": ["/usr/bin/rsync"], "rsync_version": ["rsync 3.2"]}, doctor.check_rsync, "ok",
     "/usr/bin/rsync (rsync 3.2)"),
    (host_with(rsync_path="/opt/rsync"), {}, doctor.check_rsync, "warn",
     "no executable rsync at /opt/rsync: deploy falls back to a tar stream"),
    (host_with(cuda_home="/usr/local/cuda-13.0", backend="cuda"), {}, doctor.check_nvcc, "fail",
     "no nvcc under /usr/local/cuda-13.0/bin"),
    (host_with(cuda_home="/c"), {"nvcc": ["/c/bin/nvcc"], "nvcc_version": ["13.0"]}, doctor.check_nvcc, "ok",
     "/c/bin/nvcc (release 13.0)"),
    (host_with(gpus=2), {"gpu": ["NVIDIA H200, 9.0, 580.1"] * 2}, doctor.check_gpu, "ok", "2 x NVIDIA H200, 9.0, 580.1"),
    (host_with(gpus=8), {"gpu": ["NVIDIA H200, 9.0, 580.1"]}, doctor.check_gpu, "warn",
     "1 x NVIDIA H200, 9.0, 580.1 (inventory says 8)"),
    (host_with(), {}, doctor.check_gpu, "warn", "no GPU found by nvidia-smi: CPU backend"),
    (host_with(arch="sm_120"), {"gpu": ["NVIDIA H200, 9.0, 580.1"]}, doctor.check_arch, "fail",
     "inventory arch sm_120 but the GPU is sm_90"),
    (host_with(arch="sm_90"), {"gpu": ["NVIDIA H200, 9.0, 580.1"]}, doctor.check_arch, "ok", "sm_90"),
    (host_with(), {"disk_free_kb": ["524288"], "disk_path": ["/srv"]}, doctor.check_disk, "fail", "0.5 GiB free at /srv"),
    (host_with(), {"python_version": ["3.12.3"]}, doctor.check_python, "fail", "python3 3.12.3 has no numpy"),
    (host_with(), {"python_version": ["3.12.3"], "numpy_version": ["2.1.0"]}, doctor.check_python, "ok",
     "python3 3.12.3, numpy 2.1.0"),
])
def test_doctor_checks(host, facts, check, status, detail):
    assert check(host, facts) == doctor.Finding(check.__name__.removeprefix("check_"), status, detail)


def test_console_prefixes_every_line():
    out = io.StringIO()
    c = console.Console(out, width=5)
    c.host("h1")("one\ntwo")
    c.table(["host", "status"], [["h1", "ok"]])
    assert out.getvalue() == "[h1   ] one\n[h1   ] two\nhost  status\n----  ------\nh1    ok\n"


def test_parallel_collects_failures():
    hosts = [Host(name=n, transport="local", remote_dir="/srv/x") for n in ("a", "b", "c")]

    def fn(host):
        if host.name == "b":
            raise RuntimeError("boom")
        return host.name.upper()

    outcomes = parallel.run_parallel(hosts, fn, max_parallel=2)
    assert list(outcomes) == ["a", "b", "c"]
    assert [o.value for o in outcomes.values() if o.ok] == ["A", "C"]
    assert [o.summary for o in outcomes.values() if not o.ok] == ["RuntimeError: boom"]


def test_an_interrupt_keeps_the_outcomes_of_the_hosts_that_had_started():
    """run_parallel interrupted (SIGINT while it waits): the host not started is cancelled,
    on_interrupt runs, the started ones are waited for, and Interrupted carries what each ended
    with, a crash after the stop included (the run record then never says a step that ran was
    skipped)."""
    hosts = [Host(name=n, transport="local", remote_dir="/srv/x") for n in ("a", "b", "c")]
    both, stopped = threading.Barrier(2), threading.Event()

    def fn(host):
        if host.name == "c":
            return "c ran"
        both.wait(10)
        if host.name == "a":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            stopped.wait(10)
            return "a stopped"
        stopped.wait(10)
        raise RuntimeError("crashed after the stop")

    try:
        parallel.run_parallel(hosts, fn, max_parallel=2, on_interrupt=stopped.set)
    except parallel.Interrupted as interrupt:
        outcomes = interrupt.outcomes
    except KeyboardInterrupt:       # caught here: it must never end the test session
        pytest.fail("the interrupt left run_parallel without the hosts' outcomes")
    else:
        pytest.fail("run_parallel was not interrupted")
    assert list(outcomes) == ["a", "b"] and stopped.is_set()
    assert outcomes["a"].value == "a stopped" and outcomes["b"].summary == "RuntimeError: crashed after the stop"


def test_a_command_carries_its_timeout_stdin_and_secrets_and_the_client_deadline_follows(tmp_path, monkeypatch):
    monkeypatch.setenv("KD_TOKEN", "s3cret-value")
    host = Host(**{**CT200.__dict__, "secret_env": ("KD_TOKEN",)})
    command = remote.step(host, "bash scripts/build.sh", 900, with_secrets=True, what="build")
    assert command.line == remote.step_command(host, "bash scripts/build.sh", 900, with_secrets=True)
    assert (command.argv, command.timeout, command.what) == (("bash", "-c", "bash scripts/build.sh"), 900, "build")
    assert command.stdin == b"s3cret-value\0" and command.holds_stdin and command.secrets == ("s3cret-value",)
    assert "s3cret-value" not in command.line
    assert command.deadline == 900 + remote.KILL_AFTER + remote.CLIENT_GRACE
    assert _script("exit 0", timeout=None).deadline is None
    local = LocalTransport(Host(name="local", transport="local", remote_dir=str(tmp_path)))
    with pytest.raises(TypeError, match="carries its own timeout"):
        local.run(_script("true", timeout=5), timeout=5)
    echo = _script('cat; echo " $1"', "arg", timeout=5, stdin=b"from stdin")
    assert local.check(echo).tail == "from stdin arg\n"
    slow = remote.command(["sleep", "30"], timeout=0.5)        # host-side limit 0.5 s: exit 124, timed out
    result = local.run(slow)
    assert result.timed_out and result.exit_code == 124 and result.seconds < 5


def _script(text: str, *args: str, **options):
    """A bash script as the host client sends one: its values positional arguments."""
    return remote.command(["bash", "-c", text, "kdtree", *args], **options)


def _sh(line: str, stdin: bytes = b"", **env) -> str:
    """What a command line prints when this machine's POSIX shell runs it (as a host's would),
    its stdin held open until it ends (as the transport does: a guarded command stops at its end)."""
    import subprocess
    proc = subprocess.Popen(["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, **env})
    proc.stdin.write(stdin)
    proc.stdin.flush()
    out = proc.stdout.read()
    proc.stdin.close()
    assert proc.wait(10) == 0
    return out.decode()


def test_commands_and_scripts_keep_their_argv_timeout_stdin_and_cwd(tmp_path):
    c = remote.command(["echo", "x"], timeout=7, cwd=str(tmp_path))
    assert (c.argv, c.timeout, c.stdin, c.what) == (("echo", "x"), 7, None, "command")
    assert c.line.startswith(f"cd -- {tmp_path} && umask 077 && exec env -i ")
    s = _script('echo "$0|$1|$PWD"', "a b", timeout=5, cwd=str(tmp_path), stdin=b"in", what="probing")
    assert (s.argv, s.timeout, s.stdin, s.what) == (("bash", "-c", 'echo "$0|$1|$PWD"', "kdtree", "a b"), 5, b"in",
                                                    "probing")
    assert _sh(s.line) == f"kdtree|a b|{tmp_path}\n"
    line = _script('echo "$0|$1|$PWD"', "a b", timeout=5, cwd=str(tmp_path)).line
    assert "kdtree-step" in line and _sh(line) == f"kdtree|a b|{tmp_path}\n"
    assert "kdtree-step" not in _script("cat", timeout=5, stdin=b"").line


def test_a_wrapped_command_gets_only_its_environment_and_its_secrets_from_stdin():
    line = remote.wrap(["bash", "-c", 'echo "${A-unset},${B-unset},${FOO-unset},$K,$PATH"'], timeout=None,
                       env={"K": "v w"}, path_prefix=("/opt/a", "/opt/b"), secrets=["A", "B"])
    assert "x1" not in line
    out = _sh(line, b"x1\0y\nz\0", FOO="leak")
    assert out.startswith("x1,y\nz,unset,v w,/opt/a:/opt/b:")
    with pytest.raises(ValueError, match="not an environment variable name: 'A-B'"):
        remote.wrap(["true"], timeout=5, secrets=["A-B"])
    assert remote.wrap(["true"], timeout=1.5).split()[-2:] == ["1.5", "true"]
    assert remote.wrap(["true"], timeout=2.0).split()[-2:] == ["2", "true"]


def test_every_command_runs_with_umask_077_so_nothing_it_writes_is_anyone_elses_to_read(tmp_path):
    """Issue 37 (3): what a command writes on a host (a result file with a secret, a build) is
    the user's alone, whatever umask the host's login gives."""
    for line in (remote.wrap(["bash", "-c", "umask; echo s > f; mkdir d"], timeout=None, cwd=str(tmp_path)),
                 _script("umask", timeout=5).line, remote.step_command(
                     Host(name="local", transport="local", remote_dir=str(tmp_path)), "umask", 5)):
        assert _sh(f"umask 000; {line}").splitlines()[0] == "0077", line
    assert oct((tmp_path / "f").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "d").stat().st_mode & 0o777) == "0o700"


def test_a_script_wraps_as_a_command_labelled_command_and_timeouts_stay_plain_numbers():
    """What an error calls a script or command unless told; a bound of days is written as an
    integer (the host's `timeout` and the lock's bash arithmetic read it), never as 1.8144e+06."""
    assert _script("true", timeout=5).what == remote.command(["true"], timeout=5).what == "command"
    assert remote.wrap(["true"], timeout=1814400.0).split()[-2:] == ["1814400", "true"]


def test_a_secret_of_several_lines_is_also_redacted_line_by_line_down_to_six_characters(monkeypatch):
    host = Host(**{**CT200.__dict__, "secret_env": ("TOKEN",)})
    monkeypatch.setenv("TOKEN", "abcdef\n  12345  \nabcdefg")
    assert remote.secret_strings(host) == ["abcdef\n  12345  \nabcdefg", "abcdef", "abcdefg"]


def test_a_step_gets_the_hosts_secrets_only_when_asked(monkeypatch):
    host = Host(**{**CT200.__dict__, "secret_env": ("TOKEN_A", "TOKEN_B"), "arch": "auto", "cuda_home": None})
    monkeypatch.setenv("TOKEN_A", "first-secret\nsecond-line\nshort")
    monkeypatch.setenv("TOKEN_B", "b-secret")
    plain = remote.step(host, "make", 60, env={"EXTRA": "1"})
    assert (plain.stdin, plain.holds_stdin, plain.secrets, plain.what) == (None, False, (), "command")
    assert "EXTRA=1" in plain.line
    assert "kdtree-secrets" not in plain.line and "KD_ARCH" not in plain.line and "CUDA_HOME" not in plain.line
    assert remote.host_path_prefix(host) == ()
    secret = remote.step(host, "make", 60, with_secrets=True, env={"EXTRA": "1"}, what="building")
    assert secret.stdin == b"first-secret\nsecond-line\nshort\0b-secret\0" and secret.what == "building"
    assert secret.holds_stdin and secret.secrets == ("first-secret\nsecond-line\nshort", "b-secret", "first-secret",
                                                     "second-line")
    assert " kdtree-secrets TOKEN_A,TOKEN_B " in secret.line and "EXTRA=1" in secret.line
    assert "kdtree-secrets" not in remote.step_command(host, "make", 60)
    assert remote.host_env(Host(**{**host.__dict__, "arch": "sm_90"}))["KD_ARCH"] == "sm_90"
    monkeypatch.delenv("TOKEN_B")
    with pytest.raises(remote.UsageError, match="host 'ct200': secret_env TOKEN_B is not set in the environment"):
        remote.secret_values(host)
