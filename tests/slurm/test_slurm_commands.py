"""Slurm entries (issue 41, first half) against a real local Slurm cluster (tests/slurm/slurm_cluster.py),
its login node a loopback sshd host: the client's allocation, queue limit and cancel, and doctor
on a healthy and a drained partition. Each test checks from slurmctld's side (`scontrol show job`)
that the job it expected ran, waited or was cancelled. `pytest -k slurm` selects them, with the
Slurm inventory tests of test_inventory.py."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli, doctor, inventory
from orchestrator.slurm import commands as slurm, facts
from orchestrator.connectors.factory import open_transport
from orchestrator.runner.console import Console
from orchestrator.errors import HostError, UsageError
from orchestrator.inventory import Host
from orchestrator.slurm.entry import SlurmRequest

import slurm_cluster
from task_runs import doctor_task


@pytest.fixture
def entry(slurm_lab, lab, make_inventory):
    """entry(**keys) -> Host: a `scheduler: slurm` entry for the local cluster's partition, reached
    through the login node (gpus: 2, queue_limit 60 unless given)."""
    cluster, login = slurm_lab

    def make(**keys) -> Host:
        fields = {"scheduler": "slurm", "partition": slurm_cluster.PARTITION, "gpus": 2, "queue_limit": 60,
                  "slurm_conf": str(cluster.conf), **keys}
        inv = make_inventory({"c": lab.inventory_entry(login, **fields)})
        return inv.hosts["c"]
    return make


@pytest.fixture
def drained(slurm_lab):
    """The cluster's node drained for the test (jobs wait: PD), resumed after it."""
    cluster, _ = slurm_lab
    cluster.drain("kdtree test: drained")
    yield cluster
    cluster.resume()


def test_slurm_allocation_runs_on_the_node_with_the_gpus_slurm_gave_and_is_cancelled_after(slurm_lab, entry):
    cluster, _ = slurm_lab
    with open_transport(entry()) as t:
        with slurm.allocation(t, poll=0.5) as job:
            seen = cluster.job(job.job_id)
            detail = cluster.scontrol("-o", "-d", "show", "job", job.job_id).stdout
            devices = slurm.visible_devices(t, job.job_id)
    assert (job.state, job.node, job.gpus, job.partition) == ("RUNNING", slurm_cluster.NODE, (0, 1), "gpu")
    assert devices == "0,1"                             # what a job step of the allocation sees
    assert job.queue_wait is not None and 0 <= job.queue_wait < 60 and job.started and job.submitted
    # slurmctld's side: it ran on the node with both GPUs, under the entry's name and time limit
    assert (seen["JobState"], seen["NodeList"], seen["JobName"]) == ("RUNNING", slurm_cluster.NODE, "kdtree-c")
    assert seen["TimeLimit"] == "01:21:00"              # the sum of the step timeouts, 4860 s
    assert "GRES=gpu:2(IDX:0-1)" in detail
    assert _state_soon(cluster, job.job_id, "CANCELLED")


def test_slurm_queue_limit_fails_with_the_pending_reason_of_a_drained_node_and_cancels(slurm_lab, entry, drained):
    cluster, _ = slurm_lab
    host = entry(queue_limit=3)
    with open_transport(host) as t:
        job_id = slurm.submit(t)
        began = time.monotonic()
        with pytest.raises(facts.QueueLimitError) as e:
            slurm.wait_running(t, job_id, poll=0.5)
    assert 3 <= time.monotonic() - began < 30
    assert e.value.job_id == job_id and e.value.state == "PENDING"
    assert "DRAINED" in e.value.reason and e.value.reason in str(e.value)
    assert f"job {job_id} waited" in str(e.value) and "past queue_limit 3 s" in str(e.value)
    seen = cluster.ended_job(job_id)                          # slurmctld: it waited, never ran, and was cancelled
    assert seen["JobState"] == "CANCELLED" and seen["NodeList"] in ("", "(null)")


def test_slurm_queue_limit_names_a_reservation_and_cancels(slurm_lab, entry):
    cluster, _ = slurm_lab
    made = cluster.scontrol("create", "reservation", "ReservationName=kdmaint", "StartTime=now", "Duration=10",
                            f"Nodes={slurm_cluster.NODE}", "Users=nobody", "Flags=MAINT,IGNORE_JOBS")
    assert made.returncode == 0, made.stderr
    try:
        with open_transport(entry(queue_limit=3)) as t, pytest.raises(facts.QueueLimitError) as e:
            with slurm.allocation(t, poll=0.5):
                pass
    finally:
        cluster.scontrol("delete", "ReservationName=kdmaint")
    assert "Reserved_for_maintenance" in e.value.reason
    assert cluster.ended_job(e.value.job_id)["JobState"] == "CANCELLED"


def test_slurm_an_interrupted_wait_still_cancels_the_job(slurm_lab, entry, drained):
    cluster, _ = slurm_lab
    stop = threading.Event()
    with open_transport(entry(queue_limit=120), stop) as t:
        job_id = slurm.submit(t)
        threading.Timer(2, stop.set).start()
        with pytest.raises(HostError, match=f"interrupted while job {job_id} waited"):
            slurm.wait_running(t, job_id, poll=0.5)
        slurm.cancel(t, job_id)          # after the stop the run's transport refuses commands: scancel goes on its own
    assert _state_soon(cluster, job_id, "CANCELLED")


def test_slurm_two_allocations_at_once_are_queued_by_slurm_and_the_wait_is_measured(slurm_lab, entry):
    cluster, _ = slurm_lab
    host = entry()
    second: dict = {}

    def later():
        with open_transport(host) as t2, slurm.allocation(t2, poll=0.5) as job:
            second["job"], second["seen"] = job, cluster.job(job.job_id)

    with open_transport(host) as t, slurm.allocation(t, poll=0.5) as first:
        waiter = threading.Thread(target=later)
        waiter.start()
        pending = _pending_job(cluster, exclude=first.job_id)      # slurmctld: the second waits for the GPUs
        assert pending and slurm_cluster.soon(lambda: cluster.job(pending).get("Reason") == "Resources", 20)
        time.sleep(3)
    waiter.join(60)
    job = second["job"]
    assert job.job_id == pending and second["seen"]["JobState"] == "RUNNING" and job.gpus == (0, 1)
    assert job.queue_wait is not None and job.queue_wait >= 3          # Slurm's StartTime - SubmitTime
    assert cluster.ended_job(first.job_id)["JobState"] == "CANCELLED"
    assert _state_soon(cluster, job.job_id, "CANCELLED")


def test_slurm_lab_resumes_a_node_left_drained_and_says_slurms_reason(slurm_lab):
    cluster, _ = slurm_lab
    assert cluster.heal() is None                       # in service: nothing to do
    cluster.drain("Kill task failed")                   # what slurmd sets when it cannot kill a job step
    found = cluster.heal()
    assert found is not None and found.startswith(f"node {slurm_cluster.NODE} was IDLE+DRAIN (Kill task failed ")
    assert found.endswith("): resumed") and cluster.node_state() == "IDLE"


def test_slurm_doctor_on_a_healthy_partition(slurm_lab, entry, tmp_path):
    host = entry(account="infer")
    checked = doctor_task(inventory.load(tmp_path / "hosts.yaml"), host)
    findings = checked.findings
    assert [findings[c].status for c in ("reachable", "slurm", "partition", "nodes", "queue", "account")] == ["ok"] * 6
    cluster, _ = slurm_lab
    version = cluster.command("sinfo", "--version").stdout.strip()        # slurm-wlm 22.05.8 on Debian 12
    assert findings["slurm"].detail == f"{version} (SLURM_CONF {cluster.conf})"
    assert findings["partition"].detail.startswith("gpu: UP, 1 node(s)")
    assert "GRES gpu:2" in findings["nodes"].detail and "features sm_90,cuda12" in findings["nodes"].detail
    assert findings["account"].detail.startswith("account infer: sbatch --test-only accepts the request: sbatch: Job")
    assert not {"gpu", "nvcc", "python", "arch"} & set(findings)      # the compute nodes' business
    assert checked.code == 0, checked.output
    assert "[c] preflight | ok    partition  gpu: UP" in checked.output


def test_slurm_entry_deploys_to_the_shared_filesystem_through_the_login_node(slurm_lab, entry, tmp_path):
    host = entry()
    out = io.StringIO()
    assert cli.deploy(inventory.load(tmp_path / "hosts.yaml"), [host], Console(out)) == 0, out.getvalue()
    assert (Path(host.remote_dir) / "src" / "main.cpp").read_text() == "int main() { return 0; }\n"


def test_slurm_doctor_fails_on_a_drained_partition_with_slurms_reason(slurm_lab, entry, drained, tmp_path):
    host = entry()
    checked = doctor_task(inventory.load(tmp_path / "hosts.yaml"), host)
    findings = checked.findings
    assert checked.code == 1 and findings["partition"].status == "ok"          # the partition is UP; its one node is not
    assert findings["nodes"] == doctor.Finding(
        "nodes", "fail", "no node takes jobs: 1 drained (GRES gpu:2, features sm_90,cuda12, kdtree test: drained)")
    assert findings["account"].status == "fail"
    assert "Requested node configuration is not available" in findings["account"].detail


def test_slurm_doctor_on_a_missing_or_down_partition_and_a_refused_account(slurm_lab, entry, tmp_path):
    cluster, _ = slurm_lab
    host = entry(partition="nope")
    assert doctor_task(inventory.load(tmp_path / "hosts.yaml"), host).findings["partition"] == doctor.Finding(
        "partition", "fail", "nope: Partition nope not found")
    cluster.scontrol("update", "PartitionName=gpu", "State=DOWN", "AllowAccounts=other")
    try:
        host = entry(account="infer")
        findings = doctor_task(inventory.load(tmp_path / "hosts.yaml"), host).findings
    finally:
        cluster.scontrol("update", "PartitionName=gpu", "State=UP", "AllowAccounts=ALL")
    assert findings["partition"].status == "fail" and findings["partition"].detail.startswith("gpu: DOWN")
    assert findings["account"] == doctor.Finding(
        "account", "fail", "account infer may not submit to gpu (AllowAccounts=other, DenyAccounts=)")


def test_slurm_gpus_beyond_every_node_fail_doctor(slurm_lab, entry, tmp_path):
    host = entry(gpus=3)
    findings = doctor_task(inventory.load(tmp_path / "hosts.yaml"), host).findings
    assert findings["nodes"].status == "fail" and findings["nodes"].detail.startswith("no usable node has gpu:3")


def _state_soon(cluster, job_id: str, state: str) -> bool:
    return slurm_cluster.soon(lambda: cluster.job(job_id).get("JobState") == state, 20)


def _pending_job(cluster, exclude: str, within: float = 20) -> str | None:
    """The id of a PENDING job of the cluster other than `exclude`, once there is one."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        listing = cluster.command("squeue", "-h", "-t", "PENDING", "-o", "%i").stdout.split()
        if [j for j in listing if j != exclude]:
            return next(j for j in listing if j != exclude)
        time.sleep(0.2)
    return None


# -- without a cluster: what Slurm prints is read strictly ---------------------------------------

LINE = ("JobId=7 JobName=kdtree-c JobState=RUNNING Reason=None Partition=gpu NodeList=n1 SubmitTime=2026-12-06T10:00:00 "
        "StartTime=2026-12-06T10:00:03 TimeLimit=01:21:00 Command=(null) Nodes=n1 NumCPUs=1 CPU_IDs=1 GRES=gpu:2(IDX:0-1)")


@pytest.mark.parametrize("line, problem", [
    (LINE.replace("JobState=RUNNING", "JobState=\x1b[2Jrunning"), "JobState is '\\x1b[2Jrunning'"),
    (LINE.replace("NodeList=n1", "NodeList=n1;reboot"), "NodeList is 'n1;reboot'"),
    (LINE.replace("Reason=None", "Reason=" + "x" * 400), "Reason is 'xxxx"),
    (LINE.replace("JobId=7 ", ""), "JobId is missing"),
    (LINE + "\n" + LINE, "scontrol printed 2 lines, not one job"),
])
def test_slurm_output_that_breaks_a_pattern_is_refused_with_the_evidence(line, problem):
    with pytest.raises(facts.SlurmError) as e:
        facts.parse_fields(line, "c", "scontrol -o -d show job 7")
    assert problem in str(e.value) and e.value.command == "scontrol -o -d show job 7" and e.value.tail


def test_slurm_gres_parsing():
    assert facts.parse_fields(LINE, "c", "x")["GRES"] == "gpu:2(IDX:0-1)"
    assert facts.gpu_indices("gpu:2(IDX:0-1)") == (0, 1)
    assert facts.gpu_indices("gpu:h100:3(IDX:0,2-3),mps:100(0/100,0/100)") == (0, 2, 3)
    assert facts.gpu_indices("gpu:1(IDX:0-99999999)") == ()        # a range no node has: ignored
    assert facts.gpu_counts("gpu:a100:2,gpu:h100:4(S:0-1)") == {"a100": 2, "h100": 4}
    assert facts.has_gpus("gpu:a100:2,gpu:h100:4(S:0-1)", "gpu:h100:4")
    assert not facts.has_gpus("gpu:a100:2,gpu:h100:4(S:0-1)", "gpu:a100:4")
    assert facts.has_gpus("gpu:a100:2,gpu:h100:4(S:0-1)", "gpu:6") and not facts.has_gpus("(null)", "gpu:1")


def test_slurm_entries_refuse_bisect_saying_why_and_what_to_do_instead(make_inventory):
    inv = make_inventory({"c": {"scheduler": "slurm", "address": "login", "remote_dir": "/srv/kdtree",
                                "partition": "gpu"}})
    assert inv.hosts["c"].slurm == SlurmRequest(partition="gpu")
    with pytest.raises(UsageError) as e:
        cli.bisect(inv, inv.hosts["c"], Console(io.StringIO()), "HEAD~1", "HEAD", golden=True)
    assert str(e.value).startswith("bisect: c is a `scheduler: slurm` entry: each probe would be a job of its own")
    assert "Bisect on an ssh host with the same GPU, or run `invoke validate --host c`" in str(e.value)


def test_slurm_doctor_shows_slurms_words_escaped_and_refuses_a_garbled_node_line():
    host = Host(name="c", transport="ssh", remote_dir="/srv/kdtree", address="login",
                slurm=SlurmRequest(partition="gpu", gres="gpu:2"))
    facts = {"slurm_version": ["slurm 22.05.8"],
             "nodes": ["1|drained|gpu:2\x1b[2J|sm_90|\u202eevil reason" + "x" * 500]}
    finding = doctor.check_nodes(host, facts)
    assert finding.status == "fail" and "\x1b" not in finding.detail and "\u202e" not in finding.detail
    assert "GRES gpu:2\\x1b[2J" in finding.detail and "\\u202eevil reason" in finding.detail
    assert len(finding.detail) < 300
    assert doctor.check_nodes(host, {**facts, "nodes": ["sinfo: error: \x07boom"]}) == doctor.Finding(
        "nodes", "fail", "sinfo: sinfo: error: \\x07boom")
    assert doctor.check_partition(host, {}) == doctor.Finding(
        "partition", "fail", "not checked: no Slurm on the login node")
