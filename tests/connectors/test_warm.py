"""Warm connections (orchestrator/connectors/openssh.py) against real sshd hosts on 127.0.0.1: kept between
runs and reused; a host restarted or rebooted between runs, a changed host key under a live
master, a stale socket, a second user, --no-persist, the socket directory's checks."""
from __future__ import annotations

import dataclasses
import io
import itertools
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli, inventory as inventory_mod, remote
from orchestrator.runner import parallel
from orchestrator.connectors import hostkeys, openssh as warm, ssh_common
from orchestrator.runner.console import Console
from orchestrator.errors import ConnectError, HostError, HostKeyError, InventoryError, UsageError
from orchestrator.connectors.factory import open_transport
from orchestrator.connectors.paramiko import SshTransport

from sshd import Hostile

_names = itertools.count(1)


def fresh(lab):
    """A host of this test alone (it gets restarted, re-keyed or rebooted)."""
    return lab.add_host(f"w{next(_names)}")


def accepted(host) -> int:
    """Connections the host's sshd authenticated."""
    return host.log().count("Accepted publickey")


def deploy(inv, name: str, persist: bool = True) -> tuple[int, str]:
    """`invoke deploy --host NAME [--no-persist]` in-process: exit code, output."""
    out = io.StringIO()
    _, hosts = cli.load_selection(str(inv.path), [name], persist=persist)
    code = cli.deploy(inv, hosts, Console(out))
    return code, out.getvalue()


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` ends (or is a zombie) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def masters(lab) -> list[Path]:
    """The live masters' sockets under the lab's control directory."""
    return [s for s in lab.control_dir.glob("*.sock") if warm.master_alive(s)]


@pytest.fixture
def warm_inventory(lab, make_inventory, tmp_path):
    """warm_inventory(host, **entry) -> an inventory with that host as `w`, persist on."""
    def make(host, **entry):
        return make_inventory({"w": lab.inventory_entry(host, **{"remote_dir": str(host.root / "engine"),
                                                                 "persist": 30, **entry})})
    return make


def test_a_warm_connection_is_kept_between_runs_and_reused(lab, warm_inventory):
    host = fresh(lab)
    inv = warm_inventory(host)
    assert isinstance(open_transport(inv.hosts["w"]), warm.WarmTransport)
    code, out = deploy(inv, "w")
    assert code == 0, out
    before = accepted(host)
    assert deploy(inv, "w")[0] == 0
    assert accepted(host) == before                 # no authentication: the master's connection
    sock = warm.socket_path(inv.hosts["w"])
    assert warm.master_alive(sock)
    assert os.stat(lab.control_dir).st_mode & 0o777 == 0o700 and os.stat(sock).st_mode & 0o077 == 0
    rows = [r for r in warm.listing() if r["socket"] == str(sock)]
    assert rows and rows[0]["alive"] and rows[0]["host"] == "w" and rows[0]["persist"] == 30
    out = io.StringIO()
    assert cli.connections(Console(out)) == 0 and re.search(rf"\bw\s+{host.name}\s+30.0 s .*Master running", out.getvalue())
    assert cli.connections(Console(io.StringIO()), close=True) == 0
    assert not sock.exists() and not any(r["socket"] == str(sock) for r in warm.listing())


def test_an_idle_master_ends_after_its_bound(lab, warm_inventory):
    host = fresh(lab)
    inv = warm_inventory(host, persist=1)
    assert deploy(inv, "w")[0] == 0
    sock = warm.socket_path(inv.hosts["w"])
    deadline = time.monotonic() + 15
    while warm.master_alive(sock) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not warm.master_alive(sock)


def test_no_persist_leaves_no_master_behind(lab, warm_inventory):
    host = fresh(lab)
    inv = warm_inventory(host)
    sock = warm.socket_path(inv.hosts["w"])
    code, _ = deploy(inv, "w", persist=False)
    assert code == 0 and not sock.exists()
    off = warm_inventory(host, **{"persist": False})
    assert isinstance(open_transport(off.hosts["w"]), SshTransport)


def test_a_host_rebooted_between_runs_gets_a_new_master(lab, warm_inventory):
    """The master's connection dies with the host (sshd restarted, its sessions killed, as a
    reboot does): the next run finds the socket dead, replaces it and succeeds, without hanging."""
    host = fresh(lab)
    inv = warm_inventory(host)
    assert deploy(inv, "w")[0] == 0
    with open_transport(inv.hosts["w"]) as t:      # the sshd process serving the master's connection
        server = int(t.check("echo $PPID", timeout=20).tail.split()[-1])
    host.restart()
    os.kill(server, 9)
    # between runs: the master has seen its connection end and left (on a loaded machine, a moment
    # after the kill; a run that starts first sends its commands over the dying master and loses them)
    sock, deadline = warm.socket_path(inv.hosts["w"]), time.monotonic() + 10
    while warm.master_alive(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    before = accepted(host)
    code, out = deploy(inv, "w")
    assert code == 0, out
    assert accepted(host) == before + 1             # one fresh (verified) connection


def test_a_stale_socket_file_is_replaced(lab, warm_inventory):
    """A master killed outright leaves its socket file; a socket nobody listens on is replaced."""
    host = fresh(lab)
    inv = warm_inventory(host)
    assert deploy(inv, "w")[0] == 0
    sock = warm.socket_path(inv.hosts["w"])
    pid = int(re.search(r"pid=(\d+)", warm._control(sock, "check")[1]).group(1))
    os.kill(pid, 9)
    assert sock.is_socket() and not warm.master_alive(sock)
    assert deploy(inv, "w")[0] == 0
    assert warm.master_alive(sock)
    pid = int(re.search(r"pid=(\d+)", warm._control(sock, "check")[1]).group(1))
    warm.stop_master(sock)
    assert not sock.exists() and gone_within(pid, 5), "stop_master left the master running"
    dead = socket.socket(socket.AF_UNIX)            # a socket file no master ever had
    dead.bind(str(sock))
    dead.close()
    assert deploy(inv, "w")[0] == 0 and warm.master_alive(sock)


def test_a_changed_host_key_under_a_live_master_fails_as_a_fresh_connection(lab, warm_inventory, source):
    """sshd re-keyed and restarted keeps the master's session open (OpenSSH does); the next run
    must still refuse the host, with the error a fresh connection gives, run nothing, and end
    the master."""
    host = fresh(lab)
    inv = warm_inventory(host)
    assert deploy(inv, "w")[0] == 0
    sock = warm.socket_path(inv.hosts["w"])
    old = host.fingerprint()
    host.new_host_key()
    assert warm.master_alive(sock)            # the old session lives on
    (source / "src" / "new.cpp").write_text("// must never arrive\n")
    code, out = deploy(inv, "w")
    assert code == 1
    assert f"HOST KEY CHANGED for {host.known_name}" in out and host.fingerprint() in out and old in out
    assert not (host.root / "engine" / "src" / "new.cpp").exists()
    assert not warm.master_alive(sock)
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        open_transport(inv.hosts["w"]).connect()


def test_a_pinned_host_key_is_checked_by_the_master(lab, warm_inventory, tmp_path):
    host = fresh(lab)
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    inv = warm_inventory(host, known_hosts=str(empty), host_key=host.fingerprint())
    assert isinstance(open_transport(inv.hosts["w"]), warm.WarmTransport)
    code, out = deploy(inv, "w")
    assert code == 0, out
    wrong = warm_inventory(host, known_hosts=str(empty), host_key="SHA256:" + "A" * 43)
    code, out = deploy(wrong, "w")
    assert code == 1 and "HOST KEY CHANGED" in out


def test_another_user_cannot_use_the_socket(lab, warm_inventory):
    """The socket directory is 0700 and ours: another uid cannot reach the master through it."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as a second user")
    host = fresh(lab)
    inv = warm_inventory(host)
    assert deploy(inv, "w")[0] == 0
    sock = warm.socket_path(inv.hosts["w"])
    other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ssh", "-o",
                            f"ControlPath={sock}", "-O", "check", "x"], capture_output=True, text=True, timeout=20)
    assert other.returncode != 0 and "Permission denied" in other.stderr


@pytest.mark.parametrize("problem", ["group-writable", "someone else's", "a symlink"])
def test_an_unsafe_socket_directory_is_refused(lab, warm_inventory, tmp_path, monkeypatch, problem):
    host = lab.hosts["h1"]
    inv = warm_inventory(host)
    unsafe = tmp_path / "ctl"
    if problem == "a symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        unsafe.symlink_to(tmp_path / "real")
    else:
        unsafe.mkdir(mode=0o700)
        os.chmod(unsafe, 0o770) if problem == "group-writable" else os.chown(unsafe, 65534, 65534)
    monkeypatch.setenv("KDTREE_CONTROL_DIR", str(unsafe))
    with pytest.raises(UsageError, match=f"control socket directory {unsafe} is .*refusing") as e:
        cli.deploy(inv, list(inv.hosts.values()), Console(io.StringIO()))
    why = {"group-writable": "open to group or others (mode 0770, not 0700)",
           "someone else's": f"owned by uid 65534, not by you (uid {os.geteuid()})", "a symlink": "a symlink"}[problem]
    assert f"control socket directory {unsafe} is {why}: refusing" in str(e.value)


def test_persist_in_the_inventory(lab, make_inventory):
    entry = lab.inventory_entry(lab.hosts["h1"])
    assert make_inventory({"a": {**entry, "persist": True}}).hosts["a"].persist == inventory_mod.DEFAULT_PERSIST
    assert make_inventory({"a": {**entry, "persist": 90}}).hosts["a"].persist == 90
    with pytest.raises(InventoryError, match="persist.*must be false, true or a number of idle seconds"):
        make_inventory({"a": {**entry, "persist": "forever"}})


def test_parallel_flag_and_the_file_descriptor_limit(monkeypatch):
    assert parallel.parse_parallel("8") == 8 and parallel.parse_parallel(None) is None
    for bad in ("0", "x", "1.5"):
        with pytest.raises(UsageError, match="--parallel"):
            parallel.parse_parallel(bad)
    import resource
    monkeypatch.setattr(resource, "getrlimit", lambda what: (256, 1024))
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: None)
    parallel.fit_fd_limit(32)                        # raised within the hard limit
    with pytest.raises(UsageError, match=r"256 hosts in flight need about 4160 file descriptors.* 60 hosts fit.*--parallel 60"):
        parallel.fit_fd_limit(256)


def test_an_early_master_is_checked_again_unless_a_client_started_well_within_its_idle_bound(tmp_path):
    """connect() re-checks a master checked early (connect_soon) unless its idle bound cannot have
    ended it since: every client notes its start (<socket>.used), and the master's idle time is
    at most the time since. None noted, a bound within IDLE_MARGIN, a time ahead of the clock: check."""
    from orchestrator.inventory import Host
    sock = tmp_path / "m.sock"
    assert not warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=600), sock)        # no client noted yet
    warm._note_use(sock)
    assert oct(os.stat(sock.with_suffix(".used")).st_mode & 0o777) == "0o600"
    assert warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=600), sock)
    assert not warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=warm.IDLE_MARGIN), sock)
    old = time.time() - 60
    os.utime(sock.with_suffix(".used"), (old, old))
    assert warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=600), sock)
    assert not warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=60), sock)
    ahead = time.time() + 60
    os.utime(sock.with_suffix(".used"), (ahead, ahead))
    assert not warm._idle_bound_far(Host(name="h", transport="ssh", remote_dir="/x", persist=600), sock)


def test_a_key_probe_that_gets_no_key_exchange_is_refused_within_its_bound(hostile):
    """A host that sends its banner and then nothing: the probe gives up at its connect bound and
    does not vouch for a master."""
    host, _ = hostile(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))
    verdict: list[bool] = []
    thread = threading.Thread(target=lambda: verdict.append(warm._Probe(host).accepted()), daemon=True)
    thread.start()
    thread.join(1 + warm.START_MARGIN + 5)
    assert not thread.is_alive(), "the key probe still waits"
    assert verdict == [False]


def disconnect_before_the_key_exchange(text: bytes):
    """A host that sends its banner and, before any key exchange, an SSH DISCONNECT ("no more
    authentication methods") saying `text`."""
    def packet(payload: bytes) -> bytes:
        pad = 8 - (len(payload) + 5) % 8
        pad += 8 if pad < 4 else 0
        return struct.pack(">IB", len(payload) + pad + 1, pad) + payload + b"\0" * pad

    def how(conn):
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.recv(256)                                  # the client's banner
        conn.sendall(packet(b"\x01" + struct.pack(">II", 14, len(text)) + text + struct.pack(">I", 0)))
    return how


@pytest.mark.parametrize("text", [b"Permission denied (publickey)",
                                  b"x\nroot@127.0.0.1: Permission denied (publickey)."])
def test_a_disconnect_saying_permission_denied_before_any_key_exchange_is_no_accepted_key(hostile, text):
    """Issue 37, finding 9: a host that answers the probe with a DISCONNECT saying what ssh says
    when it accepted the key and found no method (even on a line of its own) offered no key."""
    host, _ = hostile(disconnect_before_the_key_exchange(text), user="root")
    assert not warm._Probe(host).accepted()


def test_a_host_that_disconnects_the_probe_is_not_reached_over_the_old_master(lab, warm_inventory, source):
    """Issue 37, finding 9, as a deploy: a live master, then the host's address answers with such a
    DISCONNECT (the host replaced, or its sshd: the master's session lives on). The deploy fails
    as a fresh connection to it does, nothing arrives over the old master, and it is ended."""
    host = fresh(lab)
    inv = warm_inventory(host, timeouts={"connect": 1})
    assert deploy(inv, "w")[0] == 0
    sock = warm.socket_path(inv.hosts["w"])
    host.stop()
    assert warm.master_alive(sock)
    impostor = Hostile(disconnect_before_the_key_exchange(b"Permission denied (publickey)"), port=host.port)
    (source / "src" / "new.cpp").write_text("// must never arrive\n")
    try:
        code, out = deploy(inv, "w")
    finally:
        impostor.close()
    assert code == 1 and f"sync      FAILED  cannot reach 127.0.0.1:{host.port}: " in out, out
    assert not (host.root / "engine" / "src" / "new.cpp").exists()
    assert not warm.master_alive(sock)


def test_an_interrupted_run_opens_no_warm_connection(lab, warm_inventory):
    inv = warm_inventory(fresh(lab))
    stopped = threading.Event()
    stopped.set()
    with pytest.raises(HostError, match="interrupted"):
        warm.WarmTransport(inv.hosts["w"], stopped).connect()
    assert not warm.socket_path(inv.hosts["w"]).exists()


def test_an_early_master_is_asked_again_only_when_its_idle_bound_could_have_ended_it(lab, warm_inventory,
                                                                                      monkeypatch):
    """connect_soon() starts the master; the first command asks it again only when its idle bound
    is near (then a master that ended meanwhile is replaced, and the command runs); a ready
    transport asks nothing more for its later commands."""
    host = fresh(lab)
    asked: list[str] = []
    masters_made: list[str] = []
    control, ensure = warm._control, warm.ensure_master
    monkeypatch.setattr(warm, "_control", lambda sock, op: asked.append(op) or control(sock, op))
    monkeypatch.setattr(warm, "ensure_master", lambda h, sock, stopped: masters_made.append(h.name) or
                        ensure(h, sock, stopped))
    far = open_transport(warm_inventory(host, persist=600).hosts["w"])
    far.connect_soon()
    assert far.run("true", timeout=20).ok and far.run("true", timeout=20).ok
    assert (masters_made, asked) == (["w"], [])     # a new master: nothing to ask, before or after
    far.close()
    near = open_transport(warm_inventory(host, persist=warm.IDLE_MARGIN).hosts["w"])
    near.connect_soon()
    near._early.join()
    warm.stop_master(near.socket)             # its idle bound ended it while the run started
    result = near.run("echo again", timeout=20)
    assert result.ok and "again" in result.tail, result
    assert masters_made == ["w", "w", "w"]
    near.close()
    warm.stop_master(near.socket)


def test_a_master_that_does_not_answer_is_not_alive_within_the_check_bound(tmp_path, monkeypatch):
    """A control socket whose master hangs (it takes the connection and says nothing): `ssh -O
    check` is given up after CHECK_TIMEOUT and the master counts as gone, to be replaced."""
    monkeypatch.setattr(warm, "CHECK_TIMEOUT", 1)
    hung = socket.socket(socket.AF_UNIX)
    hung.bind(str(tmp_path / "m.sock"))
    hung.listen()
    start = time.monotonic()
    try:
        assert warm._control(tmp_path / "m.sock", "check") == (False, "")
        assert not warm.master_alive(tmp_path / "m.sock")
    finally:
        hung.close()
    assert time.monotonic() - start < 10


def test_rsync_goes_over_the_master_and_a_dry_run_only_says_so(lab, warm_inventory):
    host = warm_inventory(fresh(lab)).hosts["w"]
    sock = warm.socket_path(host)
    t = warm.WarmTransport(host)
    dry = t.own_rsync_shell(connect=False)
    assert dry == remote.quote(warm.client_argv(host, sock)[:-1]) and dry.endswith(" -T"), dry
    assert f"ControlPath={sock}" in dry and "ProxyCommand=/bin/false" in dry and not sock.exists()
    assert t.own_rsync_shell() == dry
    assert warm.master_alive(sock) and sock.with_suffix(".used").exists()
    t.close()
    warm.stop_master(sock)


def test_a_command_over_a_master_that_dies_is_a_lost_connection_and_its_own_exit_255_is_not(lab,
                                                                                           warm_inventory):
    """ssh exits 255 both for a command that exits 255 and for a master gone mid-command: only
    the second is a lost connection; a command's deadline holds over the master too."""
    host = warm_inventory(fresh(lab)).hosts["w"]
    t = open_transport(host)
    assert t.run("exit 255", timeout=20).exit_code == 255
    start = time.monotonic()
    late = t.run("sleep 30", timeout=1)
    assert late.timed_out and time.monotonic() - start < 10, late
    pid = int(re.search(r"pid=(\d+)", warm._control(t.socket, "check")[1]).group(1))
    threading.Timer(1.0, os.kill, (pid, 9)).start()
    with pytest.raises(ConnectError, match="connection lost while running a command") as e:
        t.run("sleep 20", timeout=30)
    assert (e.value.message, e.value.host, e.value.command, e.value.retry) == \
        ("connection lost while running a command (the warm connection ended)", "w", "sleep 20", False)
    t.close()


def test_a_fresh_connection_that_fails_outside_the_host_errors_is_still_this_hosts_failure(lab, warm_inventory,
                                                                                              monkeypatch):
    from orchestrator.connectors.paramiko import SshConnection
    host = warm_inventory(fresh(lab)).hosts["w"]

    def broken(*args, **kwargs):
        raise OSError("too many open files")
    monkeypatch.setattr(SshConnection, "open", broken)
    with pytest.raises(ConnectError) as e:
        warm._fresh_error(host, threading.Event(), "the host key probe failed")
    assert (e.value.message, e.value.host, e.value.retry) == \
        ("the host key probe failed: too many open files", "w", False)


def test_a_master_start_that_gets_no_key_exchange_gives_up_within_its_bound(hostile, tmp_path):
    host, _ = hostile(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"), persist=30)
    said: list[str | None] = []
    thread = threading.Thread(target=lambda: said.append(warm._start_master(host, tmp_path / "m.sock")), daemon=True)
    thread.start()
    thread.join(1 + warm.START_MARGIN + 5)
    assert not thread.is_alive(), "the master's start still waits"
    assert said == ["no connection within 1 s"]


def test_a_control_path_ssh_cannot_bind_fails_with_what_ssh_said(lab, warm_inventory, monkeypatch, tmp_path):
    """A socket path beyond the Unix limit (a deep KDTREE_CONTROL_DIR): the master cannot start
    though the host answers; the error carries ssh's words and the way out, and is not retried."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("KDTREE_CONTROL_DIR", str(deep))
    host = warm_inventory(fresh(lab)).hosts["w"]
    with pytest.raises(ConnectError) as e:
        warm.WarmTransport(host).connect()
    assert re.match(r"ssh could not start a warm connection: unix_listener: path \S+ too long", e.value.message), \
        e.value.message
    assert "(persist: false or --no-persist uses the run's own connection)" in e.value.message
    assert (e.value.host, e.value.retry) == ("w", False)


def test_a_master_that_fails_to_start_once_is_started_again_after_a_fresh_connection(lab, warm_inventory,
                                                                                      monkeypatch):
    """A host restarting while the master starts: the fresh connection settles it, the second
    start holds, and `invoke connections` lists it. No key probe without a socket to vouch for."""
    host = warm_inventory(fresh(lab)).hosts["w"]
    start, starts, probes = warm._start_master, [], []
    monkeypatch.setattr(warm, "_start_master", lambda h, sock: starts.append(h.name) or
                        ("Connection reset by peer" if len(starts) == 1 else start(h, sock)))
    monkeypatch.setattr(warm, "_Probe", lambda h, probe=warm._Probe: probes.append(h.name) or probe(h))
    t = warm.WarmTransport(host)
    assert t.run("echo up", timeout=20).ok and starts == ["w", "w"] and probes == []
    assert [row["host"] for row in warm.listing() if row["socket"] == str(t.socket)] == ["w"]
    t.close()
    warm.stop_master(t.socket)


@pytest.mark.parametrize("failing", ["probe", "start"])
def test_a_fresh_connection_failing_oddly_after_the_warm_path_failed_says_which(lab, warm_inventory, monkeypatch,
                                                                                failing):
    """The warm path failed (the key probe under a live master, or the master's start), and the
    fresh connection that should say why fails outside the host errors: the error names both."""
    from orchestrator.connectors.paramiko import SshConnection
    host = warm_inventory(fresh(lab)).hosts["w"]
    t = warm.WarmTransport(host)
    if failing == "probe":
        assert t.run("true", timeout=20).ok
        t.close()
        monkeypatch.setattr(warm._Probe, "accepted", lambda self: self.cancel() or False)
    else:
        monkeypatch.setattr(warm, "_start_master", lambda h, sock: "Connection reset by peer")

    def broken(*args, **kwargs):
        raise OSError("too many open files")
    monkeypatch.setattr(SshConnection, "open", broken)
    with pytest.raises(ConnectError) as e:
        warm.WarmTransport(host).connect()
    why = {"probe": "the host key probe failed", "start": "Connection reset by peer"}[failing]
    assert e.value.message == f"{why}: too many open files"
    warm.stop_master(warm.socket_path(host))


def test_the_socket_name_binds_everything_the_master_was_verified_against(lab, warm_inventory, tmp_path, monkeypatch):
    """The same host, user, port, identity, pin, ssh config and known_hosts contents: the same
    socket; any one of them changed: another socket (a freshly verified master)."""
    host = fresh(lab)
    config = tmp_path / "ssh_config"
    config.write_text("")
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(config))
    known = tmp_path / "known_hosts"
    known.write_text(lab.known_hosts.read_text())
    base = {"known_hosts": str(known)}

    def sock(**entry):
        ssh_common._read_ssh_config.cache_clear()
        return warm.socket_path(warm_inventory(host, **{**base, **entry}).hosts["w"])
    first = sock()
    assert first == sock() and first.parent == lab.control_dir and re.fullmatch(r"[0-9a-f]{24}\.sock", first.name)
    names = {first}
    for entry in ({"user": "someone"}, {"port": host.port + 1}, {"identity": str(tmp_path / "other_key")},
                  {"host_key": host.fingerprint()}, {"address": "localhost"}):
        names.add(sock(**entry))
    known.write_text(known.read_text() + "# a trusted key changed\n")
    names.add(sock())
    config.write_text("Host *\n  ServerAliveCountMax 3\n")
    names.add(sock())
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(tmp_path / "nothing"))
    (tmp_path / "nothing").write_text("")
    names.add(sock())
    assert len(names) == 9, names


def test_the_ssh_options_are_the_key_checks_and_nothing_weaker_as_ssh_reads_them(tmp_path, monkeypatch):
    """OpenSSH's own reading (`ssh -G`) of every warm ssh process's options: strict key checks
    against our known_hosts only (or the pin), no forwarding, no local command, no tty, bounded."""
    from orchestrator.inventory import Host
    monkeypatch.setenv("KDTREE_SSH_CONFIG", "/dev/null")
    known = tmp_path / "known_hosts"
    (tmp_path / "key").write_text("")           # ssh -G leaves out an identity file that is not there
    pin = "SHA256:" + "A" * 43
    host = Host(name="w", transport="ssh", remote_dir="/x", address="127.0.0.1", port=2222, user="kd",
                identity=str(tmp_path / "key"), known_hosts=str(known), host_key=pin,
                timeouts={"connect": 7, "keepalive": 4})
    argv = warm._base_argv(host)
    out = subprocess.run(argv[:1] + ["-G"] + argv[1:] + ["127.0.0.1"], capture_output=True, text=True, check=True).stdout
    read: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        read.setdefault(key, value)
    assert str(tmp_path / "key") in [line[len("identityfile "):] for line in out.splitlines()
                                     if line.startswith("identityfile ")]
    assert {k: read.get(k) for k in (
        "batchmode", "stricthostkeychecking", "userknownhostsfile", "globalknownhostsfile", "updatehostkeys",
        "verifyhostkeydns", "checkhostip", "clearallforwardings", "forwardagent", "forwardx11",
        "permitlocalcommand", "requesttty", "loglevel", "connecttimeout", "serveraliveinterval",
        "serveralivecountmax", "port", "user")} == {
        "batchmode": "yes", "stricthostkeychecking": "true",
        "userknownhostsfile": " ".join(map(str, hostkeys.known_hosts_files(str(known)))),
        "globalknownhostsfile": "none", "updatehostkeys": "false", "verifyhostkeydns": "false",
        "checkhostip": "no", "clearallforwardings": "yes", "forwardagent": "no", "forwardx11": "no",
        "permitlocalcommand": "no", "requesttty": "false", "loglevel": "ERROR", "connecttimeout": "7",
        "serveraliveinterval": "4", "serveralivecountmax": "3", "port": "2222", "user": "kd"}
    assert read["knownhostscommand"] == hostkeys.pin_command(pin) and pin in read["knownhostscommand"]
    small = warm._base_argv(dataclasses.replace(host, timeouts={"connect": 0.5, "keepalive": 0.5}))
    assert {"ConnectTimeout=1", "ServerAliveInterval=1"} <= set(small)        # whole seconds, at least one
    monkeypatch.delenv("KDTREE_SSH_CONFIG")
    assert "-F" not in warm._base_argv(host)                                   # the user's own ssh config
    assert "knownhostscommand" not in subprocess.run(
        ["ssh", "-G"] + warm._base_argv(dataclasses.replace(host, host_key=None))[1:] + ["127.0.0.1"],
        capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("where", ["KDTREE_CONTROL_DIR", "XDG_RUNTIME_DIR", "neither"])
def test_the_control_directory_is_chosen_created_private_and_checked(tmp_path, monkeypatch, where):
    monkeypatch.delenv("KDTREE_CONTROL_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    expected = {"KDTREE_CONTROL_DIR": tmp_path / "ctl", "XDG_RUNTIME_DIR": tmp_path / "kdtree-ssh",
                "neither": Path("/tmp") / f"kdtree-ssh-{os.geteuid()}"}[where]
    if where != "neither":
        monkeypatch.setenv(where, str(tmp_path / "ctl" if where == "KDTREE_CONTROL_DIR" else tmp_path))
    assert warm.control_dir(create=False) == expected if expected.exists() else True
    assert warm.control_dir() == expected and os.stat(expected).st_mode & 0o777 == 0o700
    if where != "neither":
        expected.rmdir()
        expected.write_text("")
        with pytest.raises(UsageError, match=f"control socket directory {expected} is not a directory: refusing"):
            warm.control_dir()


def test_a_default_control_directory_another_user_made_first_is_left_for_one_of_the_users_own(lab, warm_inventory,
                                                                                               tmp_path, monkeypatch):
    """Issue 37, finding 4: with neither KDTREE_CONTROL_DIR nor XDG_RUNTIME_DIR (a CI service), a
    second uid's `mkdir -m700 /tmp/kdtree-ssh-UID` (here in a sticky folder of the test's, as /tmp)
    does not stop warm runs: the sockets go to the user's cache folder ($XDG_CACHE_HOME/kdtree-ssh,
    0700), where a deploy keeps its master. Only when that one is not private either is it an
    error (exit 2), naming both."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as a second user")
    base = Path(tempfile.mkdtemp(prefix="kdtree-warm-", dir="/tmp"))    # short: a socket path is at most 107 bytes
    base.chmod(0o755)
    tmp, cache = base / "tmp", base / "cache"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    squatted = tmp / f"kdtree-ssh-{os.geteuid()}"
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "mkdir", "-m700", str(squatted)],
                   check=True)
    monkeypatch.setattr(warm, "TMP", tmp)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("KDTREE_CONTROL_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    try:
        inv = warm_inventory(fresh(lab))
        code, out = deploy(inv, "w")
        assert code == 0, out
        sock = warm.socket_path(inv.hosts["w"])
        assert sock.parent == cache / "kdtree-ssh" and warm.master_alive(sock)
        assert os.stat(sock.parent).st_mode & 0o777 == 0o700 and os.stat(squatted).st_uid == 65534
        warm.stop_master(sock)
        os.chmod(cache / "kdtree-ssh", 0o755)
        with pytest.raises(UsageError) as e:
            cli.deploy(inv, list(inv.hosts.values()), Console(io.StringIO()))
        assert str(e.value) == (
            f"no private directory for the control sockets: {squatted} is owned by uid 65534, not by you (uid 0), "
            f"and {cache}/kdtree-ssh is open to group or others (mode 0755, not 0700): refusing to keep connections "
            f"there. {warm.REMEDY}")
    finally:
        shutil.rmtree(base)


def test_a_host_behind_a_jump_or_a_proxy_command_keeps_its_own_connection(lab, warm_inventory, tmp_path,
                                                                           monkeypatch):
    host = fresh(lab)
    config = tmp_path / "ssh_config"
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(config))
    for line in ("", "ProxyJump nobody@127.0.0.1:1", "ProxyCommand /bin/false"):
        config.write_text(f"Host *\n  {line}\n" if line else "")
        ssh_common._read_ssh_config.cache_clear()
        assert warm.uses_warm(warm_inventory(host).hosts["w"]) is (not line), line
    config.write_text("Host *\n  NoSuchOption yes\n")
    ssh_common._read_ssh_config.cache_clear()
    entry = warm_inventory(host).hosts["w"]
    with pytest.raises(ConnectError) as e:
        warm.uses_warm(entry)
    assert e.value.message.startswith(f"ssh -G cannot read the ssh config for {entry.address}: ") and \
        "bad configuration option" in e.value.message and (e.value.host, e.value.retry) == ("w", False)
    ssh_common._read_ssh_config.cache_clear()


def test_a_host_whose_ssh_config_cannot_be_read_fails_in_the_run_record(lab, warm_inventory, tmp_path, monkeypatch):
    """The hosts that run first read their ssh config in the background (Run.prepare): ssh -G's
    error is that host's failure, recorded and shown, not an error that ends the run unrecorded."""
    inv = warm_inventory(fresh(lab))
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  NoSuchOption yes\n")
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(config))
    ssh_common._read_ssh_config.cache_clear()
    try:
        code, out = deploy(inv, "w")
    finally:
        ssh_common._read_ssh_config.cache_clear()
    assert code == 1 and re.search(r"w\s+FAILED.*sync: ssh -G cannot read the ssh config for ", out), out


def test_a_tight_connect_timeout_still_leaves_the_probe_and_the_master_their_time(lab, warm_inventory, tmp_path):
    """connect: 1 on a live host: the key probe accepts and the master starts (their bound is the
    connect timeout plus START_MARGIN, never less than the timeout itself)."""
    host = warm_inventory(fresh(lab), timeouts={"connect": 1, "keepalive": 5}).hosts["w"]
    assert warm._Probe(host).accepted()
    sock = tmp_path / "m.sock"
    assert warm._start_master(host, sock) is None and warm.master_alive(sock)
    warm.stop_master(sock)


def test_a_pin_that_agrees_with_known_hosts_keeps_the_warm_connection(lab, warm_inventory):
    host = fresh(lab)
    assert warm.uses_warm(warm_inventory(host, host_key=host.fingerprint()).hosts["w"])


def test_two_aliases_of_one_host_get_two_masters(lab, warm_inventory, tmp_path, monkeypatch):
    """Aliases of the same hostname and port may differ in what ssh checks (HostKeyAlias): each
    has its own socket, verified on its own."""
    host = fresh(lab)
    config = tmp_path / "ssh_config"
    config.write_text("".join(f"Host {alias}\n  HostName 127.0.0.1\n  Port {host.port}\n" for alias in ("a1", "a2")))
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(config))
    ssh_common._read_ssh_config.cache_clear()
    first, second = (warm.socket_path(warm_inventory(host, address=alias).hosts["w"])
                     for alias in ("a1", "a2"))
    ssh_common._read_ssh_config.cache_clear()
    assert first != second


def test_a_pin_contradicted_by_the_users_known_hosts_keeps_its_own_connection(lab, warm_inventory, tmp_path,
                                                                               monkeypatch):
    """The project's known_hosts file missing, the user's holding another key than the pin: the
    contradiction is still found (every file is read), and the host keeps Paramiko's connection."""
    host = fresh(lab)
    users = tmp_path / "user_known_hosts"
    users.write_text(lab.known_hosts.read_text())
    monkeypatch.setenv("KDTREE_USER_KNOWN_HOSTS", str(users))
    ssh_common._read_ssh_config.cache_clear()
    entry = warm_inventory(host, known_hosts=str(tmp_path / "missing"), host_key="SHA256:" + "A" * 43).hosts["w"]
    assert not warm.uses_warm(entry)
    assert warm.uses_warm(dataclasses.replace(entry, host_key=host.fingerprint()))
