"""The tree lock's modes on a loopback sshd host: runs of one deployed tree share it; a run that
changes the tree holds it alone, waiting up to `wait` seconds for the others and naming them when
they stay; nobody overtakes a run on its way back from exclusive to shared; dead holders are
recovered while live ones are not."""
from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest

from orchestrator import state
from orchestrator.host import client
from orchestrator.errors import HostError, LockError
from orchestrator.state import EXCLUSIVE, SHARED, Owner
from orchestrator.connectors.factory import open_transport

WAIT = 2
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def host(lab, make_inventory, remote_dir):
    inv = make_inventory({"h": lab.inventory_entry(lab.hosts["h1"], remote_dir=remote_dir)})
    return inv.hosts["h"]


def owner(name: str, pid: int) -> Owner:
    return Owner("laptop", pid, "2026-01-01T00:00:00Z", name)


def take(host, name, pid, mode=SHARED, wait=WAIT):
    transport = open_transport(host)
    return state.acquire(transport, owner(name, pid), mode, wait), transport


def test_runs_share_the_tree_and_one_that_changes_it_waits_for_the_others(host):
    a, ta = take(host, "validate", 1)
    b, tb = take(host, "nightly", 2)
    with ta, tb:
        assert a.mode == b.mode == SHARED and a.stale is None
        start = time.monotonic()
        with pytest.raises(LockError) as e:
            with a.exclusive():
                pass
        assert time.monotonic() - start >= WAIT
        assert e.value.message == (f"{host.remote_dir} is in use by other runs (the tree cannot change under them): "
                                   f"nightly by pid 2 on laptop, started 2026-01-01T00:00:00Z (waited {WAIT} s: "
                                   "timeouts.lock)")
        assert a.mode == SHARED
        c, tc = take(host, "baseline", 3)          # a's failed change left it shared, as the others
        with tc:
            c.release()
        b.release()
        with a.exclusive():
            assert a.mode == EXCLUSIVE
            with pytest.raises(LockError, match=r"is locked by another run: validate by pid 1 on laptop"):
                take(host, "nightly", 4)
        assert a.mode == SHARED
        d, td = take(host, "nightly", 5)
        with td:
            d.release()
        a.release()


def test_a_change_proceeds_when_the_others_leave_during_the_wait(host):
    a, ta = take(host, "validate", 1, wait=30)
    b, tb = take(host, "nightly", 2, wait=30)
    with ta, tb:
        threading.Timer(1, b.release).start()
        with a.exclusive():
            assert a.mode == EXCLUSIVE
        a.release()


def test_nobody_overtakes_a_run_going_back_to_shared(host):
    """A changer that arrives while a run holds the tree alone waits, holding the gate; the run's
    way back to shared waits for it to give up: the changer fails naming the run, and the tree
    never changed hands."""
    a, ta = take(host, "validate", 1)
    with ta:
        results = []
        with a.exclusive():
            def changer():
                try:
                    results.append(take(host, "nightly", 2, EXCLUSIVE))
                except LockError as e:
                    results.append(e)
            thread = threading.Thread(target=changer)
            thread.start()
            time.sleep(0.5)
        assert a.mode == SHARED                    # back to shared only once the changer gave up
        thread.join(30)
        assert isinstance(results[0], LockError), results
        assert "is locked by another run: validate by pid 1 on laptop" in results[0].message
        a.release()


def test_a_dead_holder_is_recovered_and_a_live_one_is_not(host, lab):
    live, tl = take(host, "validate", 1)
    with tl:
        dead = owner("nightly", 999)
        argv = lab.ssh_argv(lab.hosts["h1"], client.lock(host, dead, mode=SHARED).line)
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "LOCKED shared"
        proc.kill()
        proc.wait()
        time.sleep(0.3)
        third, t3 = take(host, "baseline", 3)
        with t3:
            assert third.stale == dead
            third.release()
        with pytest.raises(LockError) as e:
            take(host, "deploy", 4, EXCLUSIVE, wait=0)
        assert e.value.message == f"{host.remote_dir} is locked by another run: validate by pid 1 on laptop, " \
                                  "started 2026-01-01T00:00:00Z"
        live.release()


def test_an_owner_names_this_machine_process_command_and_utc_start(monkeypatch):
    """What a busy lock shows of its holder: this machine, this process, the command, when it
    started in UTC (ISO 8601, whatever the local time zone)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        before = time.gmtime()
        me = Owner.now("validate")
        after = time.gmtime()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert (me.client, me.pid, me.command) == (socket.gethostname(), os.getpid(), "validate")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", me.started)
    assert time.strftime("%Y-%m-%dT%H:%M:%SZ", before) <= me.started <= time.strftime("%Y-%m-%dT%H:%M:%SZ", after)
    assert Owner.parse(me.to_json()) == me


def test_a_busy_lock_names_every_holder_or_says_it_does_not_know(host):
    one, two = owner("validate", 1), owner("deploy", 2)
    error = state._busy(host, state._Answer("BUSY", [one, two]), 5, "is locked by another run")
    assert str(error).endswith(f"{host.remote_dir} is locked by another run: {one}; {two} (waited 5 s: timeouts.lock)")
    assert error.host == "h" and error.owner == f"{one}; {two}"
    assert "is locked by another run: unknown owner" in str(state._busy(host, state._Answer("BUSY"), 0,
                                                                         "is locked by another run"))
    many = state._busy(host, state._Answer("BUSY", [one] * state.HOLDERS_SHOWN, 3), 0, "is locked by another run")
    assert many.owner == "; ".join([str(one)] * state.HOLDERS_SHOWN) + "; and 3 more"


def test_a_released_lock_cannot_change_mode(host):
    lock, _ = take(host, "validate", 1)
    lock.release()
    with pytest.raises(HostError, match="the lock was released") as e:
        lock.to_exclusive()
    assert e.value.host == "h"


@pytest.fixture
def local(make_inventory, tmp_path):
    """A local host whose client beats every 0.5 s (the holder lets go after 1.5 s of silence),
    lock timeout 2 s (a claim's ownership checks take a second on a busy machine)."""
    inv = make_inventory({"h": {"transport": "local", "remote_dir": str(tmp_path / "d"),
                                "timeouts": {"keepalive": 0.5, "lock": 2}}})
    return inv.hosts["h"]


def test_the_lock_is_kept_by_its_heartbeat_and_let_go_in_bounded_time(local, tmp_path, fake_tool):
    """A held lock outlives many silences (the client's heartbeat keeps it); the claim writes the
    marker; a released lock answers no more requests; a release whose host hangs (its `rm`) returns
    within the lock timeout; a lock command waits 0 s unless told, and takes the lock only (no
    sync begun)."""
    lock, transport = take(local, "validate", 1)
    assert not (tmp_path / "d" / ".kdtree" / "sync.partial").exists()
    marker = (tmp_path / "d" / ".kdtree" / "marker").read_text()
    assert marker.rstrip("\n") == ("This directory is a deploy target of kdtree-orchestrator (created "
                                  "2026-01-01T00:00:00Z by laptop).\nIts content is replaced on every deploy "
                                  "(rsync --delete); .kdtree/ holds the orchestrator's state."), marker
    time.sleep(1.5 * state.lock_silence(local))
    with pytest.raises(LockError, match="is locked by another run: validate by pid 1 on laptop") as busy:
        state.acquire(open_transport(local), owner("nightly", 2))        # waits 0 s unless told
    assert "waited" not in str(busy.value)
    with pytest.raises(LockError, match=r"validate by pid 1 on laptop, started 2026-01-01T00:00:00Z "
                                        r"\(waited 0.5 s: timeouts.lock\)$"):
        take(local, "nightly", 2, EXCLUSIVE, wait=0.5)
    lock.release()
    with pytest.raises(HostError, match="^h: the lock was released$"):
        lock.to_exclusive()
    fake_tool("rm", "exec sleep 10")
    lock, _ = take(local, "nightly", 3)
    start = time.monotonic()
    done = threading.Thread(target=lock.release, daemon=True)
    done.start()
    done.join(6)
    assert not done.is_alive() and time.monotonic() - start < 6
    lock, _ = take(local, "nightly", 4)            # shared: beside the holder still hung in its rm
    start = time.monotonic()
    lock.release(timeout=0.2)                      # a caller's own bound wins over the lock timeout
    assert time.monotonic() - start < 1.5
    srv = dataclasses.replace(local, remote_dir="/srv/kdtree")
    assert shlex.split(client.lock(srv, owner("deploy", 4), mode=EXCLUSIVE).line)[-5:-2] == ["exclusive", "0", ""]


def test_a_client_that_exits_holding_the_lock_does_not_linger(local, tmp_path):
    """The heartbeat never keeps a finished client alive (it beats from a daemon thread): a process
    that exits while it holds the lock ends at once, and the host lets the lock go."""
    code = ("import sys; from orchestrator import inventory, state; from orchestrator.connectors import factory; "
            f"host = inventory.load({str(tmp_path / 'hosts.yaml')!r}).hosts['h']; "
            "state.acquire(factory.open_transport(host), state.Owner.now('validate')); print('held'); sys.exit(0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=10).stdout
    assert out == "held\n"
    lock, _ = take(local, "nightly", 2, EXCLUSIVE, wait=WAIT)
    lock.release()


def test_a_client_cut_off_while_it_holds_the_lock_loses_it(local, tmp_path):
    """A client that stops beating without closing its connection (frozen, or cut off by a network
    partition the host never hears about): the holder on the host lets go after its silence."""
    code = ("import time; from orchestrator import inventory, state; from orchestrator.connectors import factory; "
            f"host = inventory.load({str(tmp_path / 'hosts.yaml')!r}).hosts['h']; "
            "lock = state.acquire(factory.open_transport(host), state.Owner.now('validate')); "
            "print('held', flush=True); time.sleep(60)")
    client = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline() == "held\n"
        client.send_signal(signal.SIGSTOP)
        lock, _ = take(local, "nightly", 2, EXCLUSIVE, wait=3 * state.lock_silence(local))
        lock.release()
    finally:
        client.kill()
        client.wait()


class _Watched:
    """A started lock helper (the real process) whose waits are recorded: the timeout of each
    readline() and of each close()."""

    def __init__(self, process):
        self.process, self.reads, self.closes = process, [], []

    def readline(self, timeout):
        self.reads.append(timeout)
        return self.process.readline(timeout)

    def close(self, timeout=30):
        self.closes.append(timeout)
        return self.process.close(timeout)

    def __getattr__(self, name):
        return getattr(self.process, name)


def test_a_lock_claim_whose_host_hangs_fails_in_bounded_time(local, fake_tool, monkeypatch):
    """A host whose `flock` hangs, printing a line every 0.1 s, never answers the claim: it fails
    after the lock timeout (2 s) and a second to let the holder go, not when the host wakes up
    (no wait for a line runs past the deadline: the waits shrink to it; the helper is given one
    second to go, by the answer's reader and again by the failed claim); one whose holder dies
    says so, with its command, exit status and output."""
    fake_tool("flock", "while :; do echo waiting; sleep 0.1; done")
    transport = open_transport(local)
    started: list[_Watched] = []
    begin = transport.start
    monkeypatch.setattr(transport, "start", lambda command: started.append(_Watched(begin(command))) or started[-1])
    start = time.monotonic()
    with pytest.raises(HostError, match="^h: no answer from the lock command within 2 s$"):
        state.acquire(transport, owner("validate", 1), EXCLUSIVE, 0)
    assert time.monotonic() - start < 8
    (helper,) = started
    assert len(helper.reads) > 3 and max(helper.reads) <= 2 and min(helper.reads) < 0.5, helper.reads
    assert helper.closes == [1, 1]
    transport.close()
    fake_tool("flock", "echo dying; kill -KILL $PPID")     # the holder dies mid-claim
    with pytest.raises(HostError) as died:
        take(local, "validate", 1, EXCLUSIVE, wait=0)
    assert (died.value.message, died.value.host) == ("the lock command ended without an answer", "h")
    assert died.value.exit_status in (-9, 137)     # killed (a local process's status, or the shell's)
    assert "kd_owned" in died.value.command and "dying" in died.value.tail


def test_a_lock_names_garbled_holders_as_unknown(local, tmp_path):
    """Holder files that do not parse (a live one, flocked, and a dead one) are named by their
    first 200 characters, as an unknown owner: as a holder in the busy error, as the stale owner
    the next claim recovered."""
    state_dir = tmp_path / "d" / ".kdtree"
    live, dead = "L" * 250, "D" * 250
    lock, _ = take(local, "validate", 1)
    (state_dir / "holder-1.json").write_text(live)
    with open(state_dir / "holder-1.json") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        with pytest.raises(LockError) as busy:
            take(local, "nightly", 2, EXCLUSIVE, wait=0)
    assert f"another run: {'L' * 200} by pid 0 on unknown, started unknown; validate by pid 1" in str(busy.value)
    lock.release()
    (state_dir / "holder-2.json").write_text(dead)
    lock, _ = take(local, "nightly", 3)
    assert str(lock.stale) == f"{'D' * 200} by pid 0 on unknown, started unknown"
    lock.release()
