"""SSH transport against real sshd hosts on 127.0.0.1: commands, timeouts, host keys, trust,
a jump host, file reads, doctor."""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fault_lab import MARK
from task_runs import deploy_task, doctor_task
from orchestrator import cli, remote, sync
from orchestrator.runner.console import Console
from orchestrator.errors import ConnectError, FetchError, HostKeyError
from orchestrator.connectors.factory import open_transport

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def h1(lab, make_inventory, remote_dir):
    inv = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)})
    with open_transport(inv.hosts["h1"]) as transport:
        yield transport


def test_run_streams_output_and_reuses_one_connection(h1, lab):
    lines = []
    result = h1.run("echo out; echo err >&2; exit 3", timeout=20, on_output=lines.append)
    assert (result.exit_code, result.timed_out, lines) == (3, False, ["out", "err"])
    assert result.tail == "out\nerr\n"
    connection = h1.connection.paramiko
    assert h1.run("true", timeout=20).ok and h1.connection.paramiko is connection


def test_timeout_kills_the_whole_process_group_on_the_host(h1, lab):
    marker = f"77{MARK}"
    script = f"sleep 3{marker} & (sleep 4{marker} &); bash -c 'sleep 5{marker}'"
    start = time.monotonic()
    result = h1.run(remote.wrap(["bash", "-c", script], timeout=1, kill_after=1), timeout=20)
    assert result.timed_out and result.exit_code == 124 and time.monotonic() - start < 5
    assert left_on_host(f"sleep [345]{marker}") == ""


def running_on_host(pattern: str) -> str:
    """The command lines of the processes matching `pattern` now."""
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout


def left_on_host(pattern: str, settle: float = 5.0) -> str:
    """What still matches `pattern` once the host had `settle` seconds to clean up ('' as soon
    as nothing does: a loaded machine may take longer than a moment to kill a process group)."""
    deadline = time.monotonic() + settle
    while (found := running_on_host(pattern)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if found:       # the evidence a failure needs: whose group and session they are in, their state
        pids = ",".join(line.split()[0] for line in found.splitlines())
        found += subprocess.run(["ps", "-o", "pid,ppid,pgid,sid,stat,etime,args", "-p", pids],
                                capture_output=True, text=True).stdout
    return found


def test_client_timeout_stops_the_command_on_the_host(h1):
    marker = f"78{MARK}"
    result = h1.run(remote.wrap(["bash", "-c", f"sleep 6{marker}; sleep 7{marker}"], timeout=60), timeout=1)
    assert result.timed_out and result.exit_code is None and result.seconds < 3
    for _ in range(5):      # giving up at once, while the command is still starting on the host
        h1.run(remote.wrap(["sleep", f"8{marker}"], timeout=60), timeout=0.01)
    assert left_on_host(f"sleep [678]{marker}") == ""


def test_a_dead_client_leaves_nothing_running_on_the_host(lab):
    marker = f"79{MARK}"
    command = remote.wrap(["bash", "-c", f"echo started; sleep 6{marker}"], timeout=60)
    client = subprocess.Popen(lab.ssh_argv(lab.hosts["h1"], command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert client.stdout.readline() == "started\n"
    deadline = time.monotonic() + 5         # `sleep` starts just after the echo
    while not running_on_host(f"sleep 6{marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_on_host(f"sleep 6{marker}") != ""
    client.kill()
    client.wait()
    assert left_on_host(f"sleep 6{marker}") == ""


def test_what_a_step_leaves_behind_is_killed_when_it_ends(h1):
    marker = f"80{MARK}"
    result = h1.run(remote.wrap(["bash", "-c", f"(sleep 6{marker} &); echo done"], timeout=60), timeout=20)
    assert result.ok and result.tail == "done\n"
    assert left_on_host(f"sleep 6{marker}") == ""


def test_unknown_host_key_is_refused_before_anything_runs(lab, make_inventory, tmp_path):
    stranger = lab.add_host("stranger", trusted=False)
    inv = make_inventory({"stranger": lab.inventory_entry(stranger)})
    with pytest.raises(HostKeyError) as e:
        open_transport(inv.hosts["stranger"]).run("touch /tmp/never", timeout=10)
    fp = stranger.fingerprint()
    assert not e.value.changed and e.value.fingerprint == fp
    assert f"is not known: ssh-ed25519 {fp}" in str(e.value)
    assert f"invoke trust --host stranger --fingerprint {fp}" in str(e.value)
    assert "Accepted publickey" not in stranger.log()


def test_trust_pins_the_key_and_refuses_a_wrong_fingerprint(lab, make_inventory, tmp_path):
    newcomer = lab.add_host("newcomer", trusted=False)
    project_known = tmp_path / "project_known_hosts"
    inv = make_inventory({"newcomer": lab.inventory_entry(newcomer, known_hosts=str(project_known))})
    host = inv.hosts["newcomer"]
    wrong = "SHA256:" + "A" * 43
    with pytest.raises(Exception, match="which is not the fingerprint given"):
        cli.trust(host, [wrong], Console(io.StringIO()))
    assert not project_known.exists()
    out = io.StringIO()
    assert cli.trust(host, [newcomer.fingerprint()], Console(out)) == 0
    assert f"pinned {newcomer.known_name} ssh-ed25519 {newcomer.fingerprint()}" in out.getvalue()
    assert project_known.read_text() == newcomer.known_hosts_line()
    assert open_transport(host).run("true", timeout=10).ok
    out = io.StringIO()
    assert cli.trust(host, [newcomer.fingerprint()], Console(out)) == 0        # known now: verified, not pinned again
    assert f"{newcomer.known_name} ssh-ed25519 {newcomer.fingerprint()}: verified and trusted" in out.getvalue()


def test_trust_through_an_unknown_bastion(lab, make_inventory, tmp_path):
    gate, inner = lab.add_host("gate", trusted=False), lab.add_host("inner", trusted=False)
    project_known = tmp_path / "project_known_hosts"
    inv = make_inventory({"inner": lab.inventory_entry(inner, jump="gate", known_hosts=str(project_known))})
    with pytest.raises(HostKeyError, match=f"the key of jump host {re.escape(gate.known_name)} is not known"):
        open_transport(inv.hosts["inner"]).run("true", timeout=10)
    out = io.StringIO()
    assert cli.trust(inv.hosts["inner"], [gate.fingerprint(), inner.fingerprint()], Console(out)) == 0
    assert project_known.read_text() == gate.known_hosts_line() + inner.known_hosts_line()
    assert open_transport(inv.hosts["inner"]).run("true", timeout=10).ok


def test_changed_host_key_is_refused(lab, make_inventory):
    changer = lab.add_host("changer")
    inv = make_inventory({"changer": lab.inventory_entry(changer)})
    assert open_transport(inv.hosts["changer"]).run("true", timeout=10).ok
    old = changer.fingerprint()
    changer.new_host_key()
    with pytest.raises(HostKeyError) as e:
        open_transport(inv.hosts["changer"]).run("true", timeout=10)
    assert e.value.changed and f"HOST KEY CHANGED for {changer.known_name}" in str(e.value)
    assert changer.fingerprint() in str(e.value) and old in str(e.value)
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        cli.trust(inv.hosts["changer"], [], Console(io.StringIO()))


def test_pinned_host_key_in_the_inventory(lab, make_inventory, tmp_path):
    pinned = lab.add_host("pinned", trusted=False)
    entry = lab.inventory_entry(pinned, known_hosts=str(tmp_path / "empty_known_hosts"))
    inv = make_inventory({"ok": {**entry, "host_key": pinned.fingerprint()},
                          "bad": {**entry, "host_key": "SHA256:" + "B" * 43}})
    with open_transport(inv.hosts["ok"]) as t:
        assert t.run("true", timeout=10).ok
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED"):
        open_transport(inv.hosts["bad"]).run("true", timeout=10)


@pytest.mark.parametrize("persist", [False, 30], ids=["paramiko", "warm"])
def test_a_pin_in_the_inventory_overrides_a_known_hosts_entry(lab, make_inventory, persist):
    """A host whose real key is in known_hosts while host_key: pins another fingerprint is a
    changed key, refused after the key exchange and before authentication: its sshd sees no
    authentication request at all (no credential offered), nothing runs. With a warm connection
    asked for (persist), OpenSSH would accept the known_hosts key: such a host is connected the
    strict way instead."""
    known = lab.add_host(f"knownpin{persist}", log_level="DEBUG")
    inv = make_inventory({"k": {**lab.inventory_entry(known), "host_key": "SHA256:" + "B" * 43, "persist": persist}})
    with pytest.raises(HostKeyError, match="HOST KEY CHANGED") as e:
        open_transport(inv.hosts["k"]).run("touch ran", timeout=10)
    assert e.value.changed and (e.value.host, e.value.known_name) == ("k", known.known_name)
    assert f"offered ssh-ed25519 {known.fingerprint()} but host_key: in the inventory has SHA256:{'B' * 43}" in str(e.value)
    assert not (known.home / "ran").exists()
    ended = re.compile(r"SSH2_MSG_NEWKEYS received[\s\S]*(Connection closed|Connection reset|Disconnected)")
    deadline = time.monotonic() + 10        # sshd logs on its own time: wait for the connection's end
    while not ended.search(log := known.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended.search(log), log[-3000:]       # the key exchange happened, then the connection ended
    assert "userauth-request" not in log and "Accepted publickey" not in log, log[-3000:]


def forwards_to(bastion, port: int) -> int:
    """How many forwarded connections (direct-tcpip channels) to 127.0.0.1:`port` the bastion's log shows."""
    pattern = rf"server_request_direct_tcpip: originator .*, target 127\.0\.0\.1 port {port}$"
    return len(re.findall(pattern, bastion.log(), re.M))


def test_jump_host(lab, make_inventory, remote_dir):
    bastion, h2 = lab.hosts["bastion"], lab.hosts["h2"]
    inv = make_inventory({"far": lab.inventory_entry(h2, jump="bastion", remote_dir=remote_dir)})
    before = forwards_to(bastion, h2.port)
    result = deploy_task(inv, "far")
    assert result.method == "rsync" and result.files > 0 and os.path.isfile(f"{remote_dir}/src/main.cpp")
    time.sleep(0.2)
    # one connection went through the bastion: Paramiko's, reused by every command and by rsync (relay.py)
    assert forwards_to(bastion, h2.port) == before + 1


def test_a_jump_host_given_as_an_address_uses_the_inventory_identity_and_the_target_is_reached_through_it(
        lab, make_inventory):
    """A jump given as user@address:port (no ssh config entry) authenticates with the host's
    `identity:`; the target is reached through the bastion's channel only (the target's sshd sees
    one connection, the one that authenticates)."""
    bastion, h2 = lab.hosts["bastion"], lab.hosts["h2"]
    inv = make_inventory({"far": lab.inventory_entry(h2, jump=f"root@127.0.0.1:{bastion.port}",
                                                     identity=str(lab.client_key))})
    before = h2.log().count("Connection from ")
    with open_transport(inv.hosts["far"]) as t:
        assert t.run("echo far", timeout=10).tail == "far\n"
    time.sleep(0.2)
    assert h2.log().count("Connection from ") == before + 1


def test_a_pin_applies_to_the_target_not_to_its_jump_host(lab, make_inventory):
    h2 = lab.hosts["h2"]
    inv = make_inventory({"far": lab.inventory_entry(h2, jump="bastion", host_key=h2.fingerprint())})
    with open_transport(inv.hosts["far"]) as t:
        assert t.run("echo far", timeout=10).tail == "far\n"


def test_two_jump_hops_in_order(lab, make_inventory):
    """Each hop's channel goes to the next hop, the last one's to the target (here the same
    bastion twice: a channel to the target from the first hop would meet the wrong host key)."""
    bastion, h2 = lab.hosts["bastion"], lab.hosts["h2"]
    inv = make_inventory({"far": lab.inventory_entry(h2, jump="bastion,bastion")})
    before = forwards_to(bastion, bastion.port)
    with open_transport(inv.hosts["far"]) as t:
        assert t.run("echo far", timeout=10).tail == "far\n"
    time.sleep(0.2)
    assert forwards_to(bastion, bastion.port) == before + 1


def test_an_unreachable_target_behind_a_jump_host_names_both(lab, make_inventory):
    bastion = lab.hosts["bastion"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    inv = make_inventory({"far": {"address": "127.0.0.1", "port": closed, "user": "root", "jump": "bastion",
                                  "identity": str(lab.client_key), "remote_dir": "/srv/k",
                                  "known_hosts": str(lab.known_hosts), "timeouts": {"connect": 1}, "persist": False}})
    with pytest.raises(ConnectError, match=rf"cannot reach 127\.0\.0\.1:{closed}: .* \(through jump host "
                                           rf"127\.0\.0\.1:{bastion.port}\)"):
        open_transport(inv.hosts["far"]).run("true", timeout=10)


def test_a_target_takes_the_inventory_port_user_and_identity_over_the_ssh_config(lab, make_inventory):
    h1 = lab.hosts["h1"]
    with open(lab.ssh_config, "a") as f:
        f.write("Host explicit-target\n  HostName 127.0.0.1\n  Port 1\n  User nobody\n"
                "  IdentityFile /nonexistent/key\n\n")
    inv = make_inventory({"x": lab.inventory_entry(h1, address="explicit-target", port=h1.port, user="root",
                                                   identity=str(lab.client_key))})
    with open_transport(inv.hosts["x"]) as t:
        assert t.run("whoami", timeout=10).tail == "root\n"


def test_proxyjump_of_the_ssh_config(lab, make_inventory):
    bastion, h2 = lab.hosts["bastion"], lab.hosts["h2"]
    with open(lab.ssh_config, "a") as f:
        f.write(f"Host h2-behind\n  HostName 127.0.0.1\n  Port {h2.port}\n  User root\n"
                f"  IdentityFile {lab.client_key}\n  ProxyJump bastion\n\n")
    inv = make_inventory({"behind": {**lab.inventory_entry(h2), "address": "h2-behind"}})
    before = forwards_to(bastion, h2.port)
    with open_transport(inv.hosts["behind"]) as t:
        assert t.run("echo behind", timeout=10).tail == "behind\n"
    time.sleep(0.2)
    assert forwards_to(bastion, h2.port) == before + 1


def test_unreachable_host_fails_fast(lab, make_inventory):
    gone = lab.add_host("gone")
    gone.stop()
    inv = make_inventory({"gone": lab.inventory_entry(gone, timeouts={"connect": 1})})
    start = time.monotonic()
    with pytest.raises(ConnectError, match="cannot reach 127.0.0.1:"):
        open_transport(inv.hosts["gone"]).run("true", timeout=10)
    assert time.monotonic() - start < 4      # refused: retried with backoff until the connect timeout


def test_a_target_connection_sets_tcp_nodelay(h1):
    """The connection's own TCP socket sends small packets at once (no delayed-ACK wait per command)."""
    assert h1.run("true", timeout=20).ok
    assert h1.connection.paramiko.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def connect_error(host, within: float = 6.0):
    """The error of connecting to `host` and running `true`; the test fails unless it comes within `within` s."""
    caught: list[BaseException] = []

    def connect():
        try:
            open_transport(host).run("true", timeout=10)
        except BaseException as e:
            caught.append(e)
    start = time.monotonic()
    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"connecting to {host.name} still waits after {within} s"
    assert caught, "the connection succeeded"
    return caught[0], time.monotonic() - start


def test_a_target_that_never_sends_a_banner_fails_within_the_connect_timeout(hostile):
    """A hung sshd (TCP open, no SSH banner): the connect timeout bounds the banner wait."""
    host, _ = hostile(lambda conn: None)
    error, took = connect_error(host)
    assert isinstance(error, ConnectError) and error.host == "x" and not error.retry, error
    assert f"cannot reach 127.0.0.1:{host.port}: no SSH answer within 1 s" in str(error)


def test_a_target_that_stalls_after_its_banner_fails_within_the_connect_timeout(hostile):
    """A banner, then silence in the key exchange: the connect timeout bounds the whole handshake,
    and the failure says the host did not answer (paramiko gives no timeout of its own here)."""
    host, _ = hostile(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"))
    error, took = connect_error(host)
    assert isinstance(error, ConnectError) and error.host == "x" and not error.retry, error
    assert f"cannot reach 127.0.0.1:{host.port}: no SSH answer within 1 s" in str(error)


def test_a_pinned_target_that_stalls_after_its_banner_fails_within_the_connect_timeout(hostile):
    """The same with a `host_key:` pin (its own key exchange, hostkeys.pinned_transport): bounded alike."""
    host, _ = hostile(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n"), host_key="SHA256:" + "A" * 43)
    error, took = connect_error(host)
    assert isinstance(error, ConnectError) and error.host == "x" and not error.retry, error
    assert f"cannot reach 127.0.0.1:{host.port}: no SSH answer within 1 s" in str(error)


def test_a_target_that_hangs_up_at_once_is_not_called_hung(hostile):
    """A host that closes every connection at once (sshd at MaxStartups): a transient failure,
    retried within the connect timeout, and not reported as a host that did not answer."""
    host, listener = hostile(lambda conn: conn.close())
    error, took = connect_error(host)
    assert isinstance(error, ConnectError), error
    # (the banner read fails, or the connection is reset first: either way a transient failure)
    assert re.search(rf"cannot reach 127.0.0.1:{host.port}: .+ \(\d+ attempts in ", str(error)), error
    assert "no SSH answer" not in str(error) and len(listener.open) >= 2


def test_a_target_that_stalls_authentication_fails_within_the_connect_timeout(hostile, tmp_path):
    """A real SSH server (Paramiko's) whose host key is known but which never answers the
    credentials: the connect timeout bounds authentication, and the user offered is the inventory's."""
    import paramiko
    for name in ("server", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    server_key = paramiko.Ed25519Key(filename=str(tmp_path / "server"))
    offered, stop = [], threading.Event()

    class Stalling(paramiko.ServerInterface):
        def get_allowed_auths(self, username):
            return "publickey"

        def check_auth_publickey(self, username, key):
            offered.append(username)
            stop.wait(30)
            return paramiko.AUTH_FAILED

    def serve(conn):
        t = paramiko.Transport(conn)
        t.add_server_key(server_key)
        t.start_server(server=Stalling())

    host, _ = hostile(serve, identity=str(tmp_path / "client"))
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{host.port} ssh-ed25519 {server_key.get_base64()}\n")
    try:
        error, took = connect_error(host)
    finally:
        stop.set()
    assert f"authentication to 127.0.0.1:{host.port} as kd-deployer failed" in str(error), error
    assert offered == ["kd-deployer"]


def test_read_file_and_fetch_refuse_tricks(h1, tmp_path):
    d = h1.host.remote_dir
    h1.check(f"mkdir -p {d} && cd {d} && echo data > f && ln -sf /etc/passwd link && head -c 5000 /dev/zero > big",
             timeout=10)
    assert h1.read_file("f", 100) == b"data\n"
    with pytest.raises(FetchError, match="is a symlink; refusing to read it"):
        h1.read_file("link", 10000)
    with pytest.raises(FetchError, match="is larger than 4096 bytes"):
        h1.read_file("big", 4096)
    with pytest.raises(FetchError, match="does not exist"):
        h1.read_file("nope", 10)
    run_dir = tmp_path / "run"
    assert h1.fetch("f", "h1/f.txt", within=run_dir, max_bytes=100).read_bytes() == b"data\n"
    with pytest.raises(FetchError, match="outside"):
        h1.fetch("f", "../escape", within=run_dir, max_bytes=100)
    (run_dir / "h1" / "evil").symlink_to(tmp_path / "target")
    with pytest.raises(FetchError, match="symlink"):
        h1.fetch("f", "h1/evil", within=run_dir, max_bytes=100)
    assert not (tmp_path / "target").exists()


def test_doctor(lab, make_inventory, tmp_path):
    lost = lab.add_host("lost")
    lost.stop()
    inv = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"], arch="sm_120"),
                          "lost": lab.inventory_entry(lost)})
    findings = doctor_task(inv, inv.hosts["h1"]).findings
    assert [findings[c].status for c in ("reachable", "host_key", "auth", "rsync", "python")] == ["ok"] * 5
    assert findings["python"].detail.endswith(f"numpy {__import__('numpy').__version__}")
    assert findings["disk"].status in ("ok", "warn")
    out = io.StringIO()
    assert cli.doctor(inv, list(inv.hosts.values()), Console(out)) == 1
    text = out.getvalue()
    assert "[h1  ] preflight | ok    rsync" in text and "[lost] preflight | fail  reachable" in text
    assert any(l.startswith("lost  FAILED") for l in text.splitlines())


INTERRUPTED_RUN = """
import sys
from orchestrator import inventory, remote
from orchestrator.runner import parallel
from orchestrator.runner.run import Run
inv = inventory.load(sys.argv[1])
with Run("test") as run:
    def work(host):
        print("started\\n", end="", flush=True)     # one write: threads never interleave it
        return run.transport(host).run(remote.wrap(["sleep", sys.argv[2]], timeout=120), timeout=200)
    try:
        parallel.run_parallel(list(inv.hosts.values()), work, on_interrupt=run.stop)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def test_an_interrupt_stops_the_work_on_every_host(lab, make_inventory, tmp_path):
    seconds = f"81{MARK}"
    inv = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"]), "h2": lab.inventory_entry(lab.hosts["h2"]),
                          "local": {"transport": "local", "remote_dir": str(tmp_path / "local")}})
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_RUN, str(inv.path), seconds], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert [proc.stdout.readline() for _ in range(3)] == ["started\n"] * 3
    deadline = time.monotonic() + 10
    while len(running_on_host(f"^sleep {seconds}").splitlines()) < 3 and time.monotonic() < deadline:
        pass
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.read() == "interrupted\n" and proc.wait(10) == 0
    assert left_on_host(f"^sleep {seconds}") == ""


@pytest.mark.parametrize("jobs", ["", "set -m; "], ids=["its group", "job-control groups of its session"])
def test_a_step_leaves_nothing_in_its_process_group_even_a_child_without_the_tag(h1, jobs):
    """When a guarded command ends, every process left in its group is killed, also a child that
    cleared its environment (so the KDTREE_STEP tag cannot find it) and never left the group; and
    so is one a job-control shell (`set -m`) put in a group of its own within the step's session.
    The command ends only once both children run `sleep` (until then they still carry the tag, and
    a loaded machine's scan for it would kill them whatever the group kill does)."""
    m = f"4{MARK}{len(jobs)}"
    script = (f"{jobs}env -i sleep 31{m} >/dev/null 2>&1 & a=$!; env -i sleep 32{m} >/dev/null 2>&1 & b=$!; "
              "until grep -qa '^sleep' /proc/$a/cmdline && grep -qa '^sleep' /proc/$b/cmdline; do sleep 0.01; done; "
              "echo started")
    result = h1.run(remote.command(["bash", "-c", script], timeout=10))
    assert result.ok and result.tail == "started\n"
    assert left_on_host(f"sleep 3[12]{m}") == ""


def test_a_deployed_tree_whose_hash_differs_fails_the_sync(lab, make_inventory, remote_dir):
    """The tree hash is checked on the host after every sync: a deployed tree that hashes
    differently from the local one (here the command sees build/, which is never synced) fails
    the deploy naming both hashes, and no deploy record says it is deployed."""
    import yaml
    commands = dict(yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"])
    commands["tree_hash"] = "if [ -e build/kdtree ]; then bash scripts/tree_hash.sh; else echo 0000; fi"
    inv = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)}, commands=commands)
    source = sync.source_id(inv.project)
    assert source.tree_hash != "0000"
    result = deploy_task(inv, "h1")
    assert result.status == "failed" and result.message == f"the deployed tree hash 0000 differs from the local " \
        f"{source.tree_hash}"
    with open_transport(inv.hosts["h1"]) as t:
        assert sync.deployed_tree(t, inv.project) is None


def test_a_target_takes_the_inventory_then_the_ssh_config_then_the_defaults():
    import getpass

    import paramiko
    from orchestrator.connectors.paramiko import _Target
    config = paramiko.SSHConfig.from_text("Host full\n  HostName 127.0.0.9\n  Port 2200\n  User cfg\n"
                                          "  IdentityFile /k/cfg\nHost *\n")
    t = _Target.of(config, "full", "inv", 2300, "/k/inv")
    assert (t.alias, t.hostname, t.port, t.user, t.key_files) == ("full", "127.0.0.9", 2300, "inv", ["/k/inv", "/k/cfg"])
    t = _Target.of(config, "full", None, None, None)
    assert (t.hostname, t.port, t.user, t.key_files, t.where) == ("127.0.0.9", 2200, "cfg", ["/k/cfg"], "127.0.0.9:2200")
    t = _Target.of(config, "bare", None, None, "/k/inv")
    assert (t.alias, t.hostname, t.port, t.user, t.key_files) == ("bare", "bare", 22, getpass.getuser(), ["/k/inv"])


def test_a_proxy_command_of_the_ssh_config_carries_the_connection(lab, make_inventory, remote_dir):
    """An alias whose ssh config entry has a ProxyCommand (here system ssh -W through the bastion)
    is reached through it, its host key verified as any other's."""
    bastion, h2 = lab.hosts["bastion"], lab.hosts["h2"]
    proxy = " ".join(lab.ssh_argv(bastion, "true")[:-2] + ["-W", "%h:%p", bastion.name])
    with open(lab.ssh_config, "a") as f:
        f.write(f"Host viaproxy\n  HostName 127.0.0.1\n  Port {h2.port}\n  User root\n  IdentityFile {lab.client_key}\n"
                f"  IdentitiesOnly yes\n  ProxyCommand {proxy}\n\n")
    inv = make_inventory({"p": lab.inventory_entry(h2, address="viaproxy", remote_dir=remote_dir)})
    target = re.compile(rf"target 127\.0\.0\.1 port {h2.port}$", re.M)
    before = len(target.findall(bastion.log()))
    with open_transport(inv.hosts["p"]) as t:
        assert t.run("echo far", timeout=10).tail == "far\n"
    time.sleep(0.2)
    assert len(target.findall(bastion.log())) == before + 1
