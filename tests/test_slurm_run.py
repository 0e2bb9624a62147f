"""validate and nightly on Slurm entries (issue 41, second half) against the real local Slurm
cluster (tests/slurm_cluster.py), its login node a loopback sshd host: the engine commands as job
steps of one allocation per entry, a step timeout, an interrupt, two runs queued by Slurm, a node
that goes down mid-job, the record's job facts and a nightly across an ssh host and a Slurm entry.
These use a small project whose build is a shell command (sleep, print what the node gave); the
whole `invoke validate` with the real CPU engine is test_slurm_validate.py. Each test checks from
slurmctld's side (`scontrol show job`, its log) that the job ran, waited or was cancelled."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli, pipeline
from orchestrator.console import Console

import slurm_cluster

REPO = Path(__file__).resolve().parent.parent
# The small project's engine commands: the build says where it ran and with which GPUs, then sleeps
# SLEEP seconds; version prints the deployed tree's hash as the engine's does.
BUILD = ('echo "built on node $(hostname) CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES-unset}}"; sleep {sleep}; '
         'mkdir -p build && printf "#!/bin/sh\\n" > build/kdtree && chmod +x build/kdtree')
COMMANDS = {
    "build_key": 'echo \'{"backend": "cpu"}\'',
    "version": 'echo "kdtree 0.1.0 tree=$(bash scripts/tree_hash.sh) backend=cpu arch=none"',
}


@pytest.fixture
def slurm_inventory(slurm_lab, lab, make_inventory, tmp_path):
    """slurm_inventory(hosts, sleep) -> the Inventory of the small project (its build sleeping
    `sleep` seconds) with a Slurm entry per name of `hosts` (name -> extra keys), each its own
    remote_dir on the login node, and the ssh host h1 when `ssh` is given."""
    cluster, login = slurm_lab

    def make(hosts: dict[str, dict], sleep: float = 0, ssh: bool = False):
        entries = {name: lab.inventory_entry(
            login, remote_dir=str(login.root / f"{tmp_path.name}-{name}"), scheduler="slurm",
            partition=slurm_cluster.PARTITION, gpus=2, queue_limit=60, slurm_conf=str(cluster.conf), **keys)
            for name, keys in hosts.items()}
        if ssh:
            entries["h1"] = lab.inventory_entry(lab.hosts["h1"], remote_dir=str(lab.hosts["h1"].root / tmp_path.name))
        base = make_inventory({}).project.commands
        return make_inventory(entries, commands={**base, **COMMANDS, "build": BUILD.format(sleep=sleep)})
    return make


def validate(inv, names: list[str], steps: str = "sync,build", command: str = "validate") -> tuple[int, dict, str]:
    """Run `command` (validate, nightly) with `steps` on the named hosts as the task does: the
    exit code, run.json and the console's output."""
    out = io.StringIO()
    plan = pipeline.Plan.choose(steps=steps, command=command)
    code = cli.run_plan(inv, [inv.hosts[n] for n in names], plan, Console(out))
    run = json.loads((inv.project.root / "runs" / "latest" / "run.json").read_text())
    return code, run, out.getvalue()


def job_steps(cluster, job_id: str) -> list[str]:
    """The job steps of the job that the node launched (slurmd's log: `launch task StepId=JOB.N`;
    slurmctld logs no step at its verbosity), the batch step aside."""
    log = (cluster.dir / "log" / "slurmd.log").read_text(errors="replace")
    return sorted({line.split("StepId=")[1].split()[0] for line in log.splitlines()
                   if "launch task StepId=" in line and f"StepId={job_id}." in line})


def test_slurm_validate_runs_the_build_as_job_steps_of_one_allocation_and_records_the_job(slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}})
    code, run, output = validate(inv, ["c"])
    assert code == 0, output
    host = run["hosts"]["c"]
    assert {s: v["status"] for s, v in host["steps"].items() if s in ("sync", "build")} == \
        {"sync": "passed", "build": "passed"}
    job = host["job"]
    seen = cluster.job(job["job_id"])           # slurmctld: the job ran on the node, and was cancelled at the end
    assert (seen["JobState"], seen["NodeList"], seen["JobName"]) == ("CANCELLED", slurm_cluster.NODE, "kdtree-c")
    assert (job["node"], job["gpus"], job["cuda_visible_devices"], job["partition"]) == \
        (slurm_cluster.NODE, [0, 1], "0,1", "gpu")
    assert job["ended"] == "cancelled: the host's steps are done" and job["time_limit"] == seen["TimeLimit"]
    assert 0 <= job["queue_wait"] < 30 and job["submitted"] and job["started"]
    # every engine command of the build (build_key, build, version) was a job step of that job
    assert len(job_steps(cluster, job["job_id"])) == 4      # + the look at CUDA_VISIBLE_DEVICES
    log = (inv.project.root / "runs" / "latest" / "c" / "build.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1" in log                    # the GPUs Slurm gave, as the engine saw them
    assert host["steps"]["build"]["cuda_visible_devices"] == ["0", "1"] and not host["selected_gpus"]
    assert f"slurm c: job {job['job_id']} on {slurm_cluster.NODE} (partition gpu), GPUs 0,1, queue wait" in output


def test_slurm_a_step_timeout_scancels_the_job_and_the_record_says_timeout(slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {"timeouts": {"connect": 5, "keepalive": 5, "build": 4}}}, sleep=120)
    began = time.monotonic()
    code, run, output = validate(inv, ["c"])
    assert code == 1 and time.monotonic() - began < 60, output
    host = run["hosts"]["c"]
    assert host["status"] == "failed" and host["steps"]["build"]["status"] == "timeout"
    assert host["steps"]["build"]["message"].startswith("build timed out after 4 s")
    job = host["job"]
    assert job["ended"] == "cancelled: the build step timed out"
    seen = cluster.job(job["job_id"])               # slurmctld: it ran on the node, and scancel ended it
    assert seen["JobState"] == "CANCELLED" and seen["NodeList"] == slurm_cluster.NODE
    assert f"_slurm_rpc_kill_job: REQUEST_KILL_JOB JobId={job['job_id']} " in cluster.ctld_log()
