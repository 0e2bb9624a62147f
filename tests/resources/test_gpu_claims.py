"""GPU query and claims on a loopback sshd host whose PATH starts with a fake nvidia-smi: the real
ssh connection, bash, flock and the query/claim scripts as they run on a GPU host."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import state
from orchestrator.resources import gpu_claims, gpus
from orchestrator.errors import DestinationError
from orchestrator.resources.gpus import GpuQueryError, GpuSelectionError, Request
from orchestrator.connectors.factory import open_transport

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def g1(gpu_lab, lab, make_inventory, request):
    """g1's inventory host (written to tmp_path/hosts.yaml) with a fresh remote_dir, its .kdtree/
    made by taking the tree lock once; the fake nvidia-smi; that .kdtree/."""
    host, fake = gpu_lab
    remote_dir = host.root / request.node.name.replace("[", "_").replace("]", "")
    shutil.rmtree(remote_dir, ignore_errors=True)
    inv = make_inventory({"g1": lab.inventory_entry(host, remote_dir=str(remote_dir))})
    with open_transport(inv.hosts["g1"]) as t:
        state.acquire(t, state.Owner.now("test")).release()
    return inv.hosts["g1"], fake, remote_dir / ".kdtree"


def claim(host, request, command="validate", **kw):
    transport = open_transport(host)
    return gpu_claims.acquire(transport, request, state.Owner.now(command), **kw), transport


def indices(claim_):
    return [g.index for g in claim_.gpus]


def test_query_over_ssh_reads_the_fake_on_the_hosts_path(g1):
    host, fake, _ = g1
    fake.set(3, busy={1: [(4242, "python3 -m sglang.launch_server", 30000)]})
    with open_transport(host) as t:
        found = gpus.query(t)
    assert found.nvidia_smi == str(fake.bin / "nvidia-smi")
    assert [(g.index, g.uuid, g.memory_used_mib) for g in found.gpus] == \
        [(0, fake.uuid(0), 0), (1, fake.uuid(1), 30000), (2, fake.uuid(2), 0)]
    assert found.gpus[1].processes == (gpus.GpuProcess(4242, "python3 -m sglang.launch_server", 30000),)


def test_query_looks_under_the_driver_paths_when_the_path_has_none(lab, make_inventory, gpu_lab, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi on its PATH")
    _, fake = gpu_lab
    fake.set(2)
    host = make_inventory({"h1": lab.inventory_entry(lab.hosts["h1"])}).hosts["h1"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with open_transport(host) as t:
        assert gpus.query(t, driver_paths=(str(empty),)) == gpus.GpuInventory(None)
        found = gpus.query(t, driver_paths=(str(empty), str(fake.bin)))
    assert found.nvidia_smi == str(fake.bin / "nvidia-smi") and len(found.gpus) == 2


def test_a_failing_nvidia_smi_is_reported_with_its_exit_code_and_output(g1):
    host, fake, _ = g1
    fake.set(2, exit={"gpu": 9}, raw={"gpu": "NVIDIA-SMI has failed because it couldn't communicate with the "
                                              "NVIDIA driver.\n"}, stderr="\x1b[2Jdriver gone")
    with open_transport(host) as t, pytest.raises(GpuQueryError) as e:
        gpus.query(t)
    assert e.value.host == "g1" and e.value.exit_status == 9
    assert e.value.message.endswith("--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,"
                                    "compute_cap,pci.bus_id exited with 9")
    assert "couldn't communicate with the NVIDIA driver" in e.value.tail and "\\x1b[2Jdriver gone" in e.value.tail
    fake.set(1, raw={"gpu": "garbage\n"})
    with open_transport(host) as t, pytest.raises(GpuQueryError, match="GPU line 1 is not its CSV.*: garbage"):
        gpus.query(t)


def test_first_idle_gpus_are_claimed_and_released(g1):
    host, fake, kdtree = g1
    fake.set(4, busy={0: [(4242, "sglang", 30000)]})
    claimed, t = claim(host, Request(count=2))
    with t, claimed:
        assert indices(claimed) == [1, 2] and claimed.stale == ()
        assert claimed.visible_devices() == f"{fake.uuid(1)},{fake.uuid(2)}"
        assert [g.index for g in claimed.inventory.gpus] == [0, 1, 2, 3]
        assert state.Owner.parse((kdtree / f"gpu-{fake.uuid(1)}.owner").read_text()).command == "validate"
    assert not list(kdtree.glob("gpu-*.owner"))


def test_an_explicit_list_and_any_take_busy_gpus(g1):
    host, fake, _ = g1
    fake.set(4, busy={i: [(100 + i, "sglang", 30000)] for i in range(4)})
    for request, expected in ((Request("list", (3, 1), None), [1, 3]), (Request("any", count=2), [0, 1])):
        claimed, t = claim(host, request)
        with t, claimed:
            assert indices(claimed) == expected


def test_not_enough_idle_gpus_fails_at_once_naming_each_busy_gpu(g1):
    host, fake, kdtree = g1
    fake.set(2, busy={0: [(4242, "sglang", 30000)], 1: [(777, "python3", 2048), (778, "ollama", 512)]})
    with pytest.raises(GpuSelectionError) as e:
        claim(host, Request(count=1))
    assert e.value.host == "g1"
    assert e.value.message == (
        "not enough GPUs: needs 1 idle GPU (no compute process, at most 1024 MiB in use), none usable; "
        "GPU 0 (NVIDIA H200): 1 compute process: pid 4242 sglang 30000 MiB; "
        "GPU 1 (NVIDIA H200): 2 compute processes: pid 777 python3 2048 MiB, pid 778 ollama 512 MiB")
    assert not list(kdtree.glob("gpu-*.owner"))


def test_not_enough_idle_gpus_after_waiting(g1):
    host, fake, _ = g1
    fake.set(1, busy={0: [(4242, "sglang", 30000)]})
    start = time.monotonic()
    with pytest.raises(GpuSelectionError) as e:
        claim(host, Request(count=1, wait=3), poll=1)
    assert time.monotonic() - start >= 3
    assert "none usable after waiting 3 s (gpu_wait); GPU 0 (NVIDIA H200): 1 compute process: pid 4242" in e.value.message


def test_a_gpu_that_becomes_free_during_the_wait_is_taken(g1):
    host, fake, _ = g1
    fake.set(2, busy={0: [(4242, "sglang", 30000)], 1: [(4243, "sglang", 30000)]})
    timer = threading.Timer(2, lambda: fake.set(2, busy={0: [(4242, "sglang", 30000)]}))
    timer.start()
    try:
        claimed, t = claim(host, Request(count=1, wait=60), poll=0.5)
    finally:
        timer.cancel()
    with t, claimed:
        assert indices(claimed) == [1]


def test_two_concurrent_runs_get_different_gpus(g1):
    host, fake, _ = g1
    fake.set(3)
    barrier, results, errors = threading.Barrier(2), {}, []

    def run(name):
        barrier.wait()
        try:
            results[name] = claim(host, Request(count=1), command=name)
        except Exception as e:      # shown by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("validate", "nightly")]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    try:
        taken = {name: indices(c) for name, (c, _) in results.items()}
        assert sorted(taken["validate"] + taken["nightly"]) in ([0, 1], [0, 2], [1, 2]), taken
        assert len(taken["validate"]) == len(taken["nightly"]) == 1
        third, t3 = claim(host, Request(count=1), command="baseline")
        with t3, third:                 # the one GPU left
            assert indices(third) == sorted({0, 1, 2} - set(taken["validate"]) - set(taken["nightly"]))
            with pytest.raises(GpuSelectionError) as e:
                claim(host, Request(count=1))
        assert "claimed by another run (nightly by pid" in e.value.message
        assert "claimed by another run (validate by pid" in e.value.message
        assert "claimed by another run (baseline by pid" in e.value.message
    finally:
        for c, t in results.values():
            c.release()
            t.close()


def test_every_gpu_the_policy_allows_skips_those_other_runs_hold(g1):
    host, fake, _ = g1
    fake.set(4, busy={3: [(1, "x", 5000)]})
    first, t1 = claim(host, Request("list", (1,), None))
    with t1, first:
        every, t2 = claim(host, Request(count=None))
        with t2, every:
            assert indices(every) == [0, 2]


CLIENT = """
import sys, time
from orchestrator import inventory, state
from orchestrator.resources import gpu_claims
from orchestrator.resources.gpus import Request
from orchestrator.connectors.factory import open_transport
host = inventory.load(sys.argv[1]).hosts["g1"]
claim = gpu_claims.acquire(open_transport(host), Request(count=1), state.Owner.now("nightly"))
print("CLAIMED", claim.visible_devices(), flush=True)
time.sleep(300)
"""


def test_a_stale_claim_of_a_killed_client_is_recovered(g1, lab, tmp_path):
    host, fake, kdtree = g1
    fake.set(1)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(tmp_path / "hosts.yaml")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **lab.env()})
    try:
        assert proc.stdout.readline().strip() == f"CLAIMED {fake.uuid(0)}"
        proc.kill()
    finally:
        proc.wait()
    claimed, t = claim(host, Request(count=1, wait=30), poll=0.5)
    with t, claimed:
        assert indices(claimed) == [0]
        assert [(u, o.command, o.pid) for u, o in claimed.stale] == [(fake.uuid(0), "nightly", proc.pid)]


def test_claims_need_the_state_directory(gpu_lab, lab, make_inventory, tmp_path):
    host, fake = gpu_lab
    fake.set(1)
    inv = make_inventory({"g1": lab.inventory_entry(host, remote_dir=str(host.root / "never-locked"))})
    with pytest.raises(DestinationError, match="never-locked/.kdtree is not the orchestrator's state directory"):
        claim(inv.hosts["g1"], Request())


def test_claims_refuse_a_state_directory_others_can_write(g1):
    host, fake, kdtree = g1
    fake.set(1)
    kdtree.chmod(0o777)        # another user could now plant a claim file or swap one for a link
    try:
        with pytest.raises(DestinationError, match=r"\.kdtree is writable by group or others \(mode 777\)"):
            claim(host, Request())
        assert not list(kdtree.glob("gpu-*"))
    finally:
        kdtree.chmod(0o755)


def test_a_host_without_gpus_claims_none(g1):
    host, fake, _ = g1
    fake.set(0)
    claimed, t = claim(host, Request())
    with t, claimed:
        assert claimed.gpus == () and claimed.visible_devices() == "" and claimed.inventory.gpus == ()
    with pytest.raises(GpuSelectionError, match="asked for, but nvidia-smi lists no GPU"):
        claim(host, Request(count=2, explicit=True))


def test_a_client_whose_heartbeat_stops_loses_its_claim(gpu_lab, lab, make_inventory, tmp_path):
    """A client that stops (SIGSTOP: its connection stays open, as in a network partition) loses its
    claim after 3 keepalive intervals without a heartbeat; the next run recovers it as stale."""
    host, fake = gpu_lab
    fake.set(1)
    remote_dir = host.root / "heartbeat"
    shutil.rmtree(remote_dir, ignore_errors=True)
    inv = make_inventory({"g1": lab.inventory_entry(host, remote_dir=str(remote_dir),
                                                    timeouts={"connect": 5, "keepalive": 1})})
    with open_transport(inv.hosts["g1"]) as t:
        state.acquire(t, state.Owner.now("test")).release()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(inv.path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **lab.env()})
    try:
        assert proc.stdout.readline().strip() == f"CLAIMED {fake.uuid(0)}"
        proc.send_signal(signal.SIGSTOP)
        with pytest.raises(GpuSelectionError, match=r"claimed by another run \(nightly by pid"):
            claim(inv.hosts["g1"], Request())
        claimed, t = claim(inv.hosts["g1"], Request(wait=30), poll=0.5)
        with t, claimed:
            assert [(u, o.pid) for u, o in claimed.stale] == [(fake.uuid(0), proc.pid)]
    finally:
        proc.kill()
        proc.wait()


def test_preview_counts_other_runs_claims_and_takes_none(g1, gpu_lab, lab, make_inventory):
    host, fake, kdtree = g1
    fake.set(3, busy={2: [(4242, "sglang", 30000)]})
    first, t1 = claim(host, Request(count=1), command="nightly")
    with t1, first:
        with open_transport(host) as t:
            found, choice = gpu_claims.preview(t, Request(count=None))
        assert len(found.gpus) == 3 and [g.index for g in choice.taken()] == [1]
        assert [(g.index, why.split(" by pid")[0]) for g, why in choice.refused] == [
            (0, "claimed by another run (nightly"), (2, "1 compute process: pid 4242 sglang 30000 MiB")]
        assert sorted(p.name for p in kdtree.glob("gpu-*.owner")) == [f"gpu-{fake.uuid(0)}.owner"]
    never = make_inventory({"g1": lab.inventory_entry(gpu_lab[0], remote_dir=str(gpu_lab[0].root / "never"))})
    with open_transport(never.hosts["g1"]) as t:
        assert gpu_claims.held_claims(t, [fake.uuid(0)]) == {}
