"""validate and nightly on Slurm entries (issue 41, second half) against the real local Slurm
cluster (tests/slurm/slurm_cluster.py), its login node a loopback sshd host: the engine commands as job
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
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import cli, remote
from orchestrator.connectors.factory import open_transport
from orchestrator.records.record import HostRecord
from orchestrator.runner.console import Console
from orchestrator.slurm.run import Allocation

import slurm_cluster
from bundle_manifests import needs, write_manifest

REPO = Path(__file__).resolve().parents[2]
# The small project's engine commands: the build says where it ran and with which GPUs, then sleeps
# SLEEP seconds; version prints the deployed tree's hash as the engine's does.
BUILD = ('echo "built on node $(hostname) CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES-unset}} '
         'KD_JOBS=${{KD_JOBS-unset}} nproc=$(nproc)"; sleep {sleep}; '
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
        entries = {name: lab.inventory_entry(login, **{
            "remote_dir": str(login.root / f"{tmp_path.name}-{name}"), "scheduler": "slurm",
            "partition": slurm_cluster.PARTITION, "gpus": 2, "queue_limit": 60, "slurm_conf": str(cluster.conf), **keys})
            for name, keys in hosts.items()}
        if ssh:
            entries["h1"] = lab.inventory_entry(lab.hosts["h1"], remote_dir=str(lab.hosts["h1"].root / tmp_path.name))
        base = make_inventory({}).project.commands
        return make_inventory(entries, commands={**base, **COMMANDS, "build": BUILD.format(sleep=sleep)})
    return make


def validate(inv, names: list[str], steps: str = "sync,build", command: str = "validate",
             report_dir: Path | None = None) -> tuple[int, dict, str]:
    """Run `command` (validate, nightly) with `steps` on the named hosts as the task does (into
    `report_dir` when given): the exit code, run.json and the console's output."""
    out = io.StringIO()
    code = cli.validate(inv, [inv.hosts[n] for n in names], Console(out), steps=steps, command=command,
                        report_dir=str(report_dir) if report_dir else None)
    run_dir = report_dir or inv.project.root / "runs" / "latest"
    return code, json.loads((run_dir / "run.json").read_text()), out.getvalue()


def building(run_dir: Path, host: str = "c") -> bool:
    """Whether the host's build command started on the node (its first line is in the build log)."""
    log = run_dir / host / "build.log"
    return log.exists() and "built on node" in log.read_text(errors="replace")


def job_steps(cluster, job_id: str) -> list[str]:
    """The job steps of the job that the node launched (slurmd's log: `launch task StepId=JOB.N`;
    slurmctld logs no step at its verbosity), the batch step aside."""
    log = (cluster.dir / "log" / "slurmd.log").read_text(errors="replace")
    return sorted({line.split("StepId=")[1].split()[0] for line in log.splitlines()
                   if "launch task StepId=" in line and f"StepId={job_id}." in line})


def left_running(folder: str) -> list[str]:
    """The processes working in `folder` (a host's remote_dir, where its engine commands run), each
    as `PID COMMAND`: what a run's job steps left running on the node."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)).is_relative_to(folder):
                words = (cwd.parent / "cmdline").read_bytes().split(b"\0")
                found.append(f"{cwd.parent.name} {b' '.join(words).decode(errors='replace')}")
        except OSError:         # gone meanwhile, or not ours to read
            continue
    return found


def test_slurm_validate_runs_the_build_as_job_steps_of_one_allocation_and_records_the_job(slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}})
    code, run, output = validate(inv, ["c"])
    assert code == 0, output
    host = run["hosts"]["c"]
    assert {s: v["status"] for s, v in host["steps"].items() if s in ("sync", "build")} == \
        {"sync": "passed", "build": "passed"}
    job = host["job"]
    seen = cluster.ended_job(job["job_id"])           # slurmctld: the job ran on the node, and was cancelled at the end
    assert (seen["JobState"], seen["NodeList"], seen["JobName"]) == ("CANCELLED", slurm_cluster.NODE, "kdtree-c")
    assert (job["node"], job["gpus"], job["cuda_visible_devices"], job["partition"]) == \
        (slurm_cluster.NODE, [0, 1], "0,1", "gpu")
    assert job["ended"] == "cancelled: the host's steps are done" and job["time_limit"] == seen["TimeLimit"]
    assert 0 <= job["queue_wait"] < 30 and job["submitted"] and job["started"]
    # every engine command of the build (build_key, build, version) was a job step of that job
    assert len(job_steps(cluster, job["job_id"])) == 4      # + the look at CUDA_VISIBLE_DEVICES
    log = (inv.project.root / "runs" / "latest" / "c" / "build.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1 KD_JOBS=1 " in log         # the GPUs and the one CPU Slurm gave, as the engine saw them
    assert job["cpus"] == int(seen["NumCPUs"]) == 1
    assert host["steps"]["build"]["cuda_visible_devices"] == ["0", "1"] and not host["selected_gpus"]
    assert f"slurm c: job {job['job_id']} on {slurm_cluster.NODE} (partition gpu), GPUs 0,1, 1 CPU(s), queue wait" in output


def test_slurm_cpus_per_task_and_mem_are_asked_of_slurm_and_the_build_compiles_on_the_cpus_given(
        slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {"cpus_per_task": 2, "mem": "100M"}})
    code, run, output = validate(inv, ["c"])
    assert code == 0, output
    job = run["hosts"]["c"]["job"]
    seen = cluster.ended_job(job["job_id"])           # slurmctld: the job held what the entry asked for
    assert (seen["CPUs/Task"], seen["NumCPUs"], seen["MinMemoryNode"], seen["NodeList"]) == \
        ("2", "2", "100M", slurm_cluster.NODE)
    assert job["cpus"] == 2 and "GPUs 0,1, 2 CPU(s)" in output
    log = (inv.project.root / "runs" / "latest" / "c" / "build.log").read_text()
    assert "KD_JOBS=2 " in log          # what build.sh compiles with (engine_src/scripts/build.sh)


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
    seen = cluster.ended_job(job["job_id"])               # slurmctld: it ran on the node, and scancel ended it
    assert seen["JobState"] == "CANCELLED" and seen["NodeList"] == slurm_cluster.NODE
    assert f"_slurm_rpc_kill_job: REQUEST_KILL_JOB JobId={job['job_id']} " in cluster.ctld_log()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, cli.INTERRUPTED), (signal.SIGTERM, cli.TERMINATED)],
                         ids=["sigint", "sigterm"])
def test_slurm_an_interrupt_of_invoke_validate_scancels_the_job(slurm_lab, slurm_inventory, lab, tmp_path, signum,
                                                                 code):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}}, sleep=120)
    run_dir = tmp_path / "run-interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "validate", "--inventory", str(inv.path), "--host", "c",
                             "--steps", "sync,build", "--report-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **lab.env()})
    try:
        assert slurm_cluster.soon(lambda: building(run_dir), 60), "the build never started on the node"
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, output
    run = json.loads((run_dir / "run.json").read_text())
    host = run["hosts"]["c"]
    assert run["status"] == host["status"] == "interrupted" and host["steps"]["build"]["status"] == "interrupted"
    job = host["job"]
    assert job["ended"] == "cancelled: the run was interrupted"
    seen = cluster.ended_job(job["job_id"])           # slurmctld: it ran on the node, and scancel ended it
    assert (seen["JobState"], seen["NodeList"]) == ("CANCELLED", slurm_cluster.NODE)
    assert f"_slurm_rpc_kill_job: REQUEST_KILL_JOB JobId={job['job_id']} " in cluster.ctld_log()
    assert slurm_cluster.soon(lambda: not cluster.command("squeue", "-h", "-s", "-j", job["job_id"]).stdout.strip(), 30)
    # Slurm's kill reached the build's whole step (its `sleep`, in the step guard's own session, too)
    assert slurm_cluster.soon(lambda: not left_running(inv.hosts["c"].remote_dir), 30), \
        left_running(inv.hosts["c"].remote_dir)


def test_slurm_a_job_step_that_slurm_kills_leaves_nothing_running_on_the_node(slurm_lab, slurm_inventory,
                                                                              tmp_path):
    # scancel while an engine command runs as a job step, its srun still connected: Slurm's kill
    # (TERM, KILL after KillWait) reaches the task's process group, the step guard's; the command runs
    # in a session of its own. Left there, it held the step open until slurmd gave up and drained the
    # node ("Kill task failed": the flaky lab node of a clean-clone CI run).
    cluster, _ = slurm_lab
    host = slurm_inventory({"c": {}}).hosts["c"]
    work = tmp_path / "node-work"
    work.mkdir()
    with open_transport(host) as t:
        job = Allocation(t, HostRecord())
        job.hold()
        step = threading.Thread(target=lambda: t.run(job.step(remote.command(
            ["bash", "-c", "sleep 120"], timeout=300, cwd=str(work)))))
        step.start()
        try:
            assert slurm_cluster.soon(lambda: left_running(str(work)), 30), "the job step never started"
            job.release({}, stopped=False)
            assert job.record.job is not None and job.record.job.ended == "cancelled: the host's steps are done"
            assert slurm_cluster.soon(lambda: not left_running(str(work)), 30), left_running(str(work))
            # slurmctld: the job ended (not stuck COMPLETING on a step it cannot kill), the node in service
            seen = cluster.ended_job(job.record.job.job_id)
            assert seen["JobState"] == "CANCELLED", seen
            assert slurm_cluster.soon(lambda: cluster.node().get("State") == "IDLE", 30), cluster.node()
        finally:
            step.join(60)


def test_slurm_exec_runs_the_command_as_a_job_step_of_an_allocation_made_for_it(slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}})
    script = ('echo "on $(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES KD_JOBS=$KD_JOBS"; '
              'printf "\\033[2Jx\\n"; yes "$(printf "%0200d" 0)" | head -c 2200000')   # hostile, then past the log's bounds
    out = io.StringIO()
    code = cli.exec_command(inv, [inv.hosts["c"]], Console(out), ("bash", "-c", script))
    output = out.getvalue()
    assert code == 0, output[-3000:]
    run = json.loads((inv.project.root / "runs" / "latest" / "run.json").read_text())
    host = run["hosts"]["c"]
    job, step = host["job"], host["steps"]["exec"]
    assert run["command"] == "exec" and step["status"] == "passed"
    # what it prints: the job's facts, then the command's output, from the node, with what Slurm gave
    assert f"[c] exec      | job {job['job_id']} runs on {slurm_cluster.NODE} with GPU 0,1" in output
    assert "CUDA_VISIBLE_DEVICES=0,1 KD_JOBS=1" in output and step["cuda_visible_devices"] == ["0", "1"]
    assert "\x1b" not in output and "\\x1b[2Jx" in output
    assert step["output_cut"]["left_out_bytes"] > 0               # 2.2 MB: its first and last MiB kept, the rest left out
    assert f"slurm c: job {job['job_id']} on {slurm_cluster.NODE}" in output
    assert job["ended"] == "cancelled: the host's steps are done"
    seen = cluster.ended_job(job["job_id"])           # slurmctld: it ran on the node, and was cancelled at the end
    assert (seen["JobState"], seen["NodeList"], seen["JobName"]) == ("CANCELLED", slurm_cluster.NODE, "kdtree-c")
    assert len(job_steps(cluster, job["job_id"])) == 2      # the look at CUDA_VISIBLE_DEVICES, the command


def test_slurm_an_interrupted_exec_scancels_its_job(slurm_lab, slurm_inventory, lab):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}})
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "exec", "--inventory", str(inv.path), "--host", "c",
                             "--", "sleep", "4321"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **lab.env()})
    try:
        assert slurm_cluster.soon(lambda: sleeping("4321"), 60), "the command never started on the node"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == cli.INTERRUPTED, output
    run = json.loads((inv.project.root / "runs" / "latest" / "run.json").read_text())
    host = run["hosts"]["c"]
    assert host["steps"]["exec"]["status"] == "interrupted"
    job = host["job"]
    assert job["ended"] == "cancelled: the run was interrupted"
    seen = cluster.ended_job(job["job_id"])           # slurmctld: it ran on the node, and scancel ended it
    assert (seen["JobState"], seen["NodeList"]) == ("CANCELLED", slurm_cluster.NODE)
    assert slurm_cluster.soon(lambda: not sleeping("4321"), 30), sleeping("4321")


def test_slurm_check_bundle_is_a_job_step_and_clean_bundles_holds_no_allocation(slurm_lab, slurm_inventory, source):
    cluster, _ = slurm_lab
    write_manifest(source, tiny_fp32=needs(), big_int4=needs())         # `big` is in no tier of the entry's
    inv = slurm_inventory({"cb": {}})
    host = inv.hosts["cb"]
    code, _, output = validate(inv, ["cb"], steps="sync")
    assert code == 0, output
    refs = Path(host.remote_dir) / "tests" / "refs"
    for name in ("model_tiny_fp32.kdtr", "model_big_int4.kdtr"):
        (refs / name).write_bytes(b"\0" * 1000)
    engine = Path(host.remote_dir) / "build" / "kdtree"          # a stand-in for the engine the build step leaves
    engine.parent.mkdir()
    engine.write_text('#!/bin/sh\necho "OK: $3 on $(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"\n')
    engine.chmod(0o755)
    out = io.StringIO()
    assert cli.check_bundle(inv, host, Console(out), "tests/refs/model_tiny_fp32.kdtr") == 0, out.getvalue()
    checked = json.loads((inv.project.root / "runs" / "latest" / "run.json").read_text())["hosts"]["cb"]
    assert checked["steps"]["check_bundle"]["message"] == \
        f"tests/refs/model_tiny_fp32.kdtr: OK: tests/refs/model_tiny_fp32.kdtr on {socket.gethostname()} " \
        "CUDA_VISIBLE_DEVICES=0,1"
    job = checked["job"]
    seen = cluster.ended_job(job["job_id"])           # slurmctld: the check ran as a job step on the node
    assert (seen["JobState"], seen["NodeList"]) == ("CANCELLED", slurm_cluster.NODE)
    assert len(job_steps(cluster, job["job_id"])) == 2
    out = io.StringIO()
    assert cli.clean_bundles(inv, [host], Console(out), remove=True) == 0, out.getvalue()
    assert "removed 1 stale bundles" in out.getvalue()
    assert (refs / "model_tiny_fp32.kdtr").exists() and not (refs / "model_big_int4.kdtr").exists()
    assert json.loads((inv.project.root / "runs" / "latest" / "run.json").read_text())["hosts"]["cb"]["job"] is None
    # slurmctld: the list and the removal held no job, the sync none either: check-bundle's is the entry's one job
    jobs = [line for line in cluster.command("scontrol", "-o", "show", "jobs").stdout.splitlines()
            if "JobName=kdtree-cb " in line]
    assert len(jobs) == 1 and f"JobId={job['job_id']} " in jobs[0]


def sleeping(seconds: str) -> list[str]:
    """The pids of the `sleep SECONDS` processes on this machine (a test's own command on the node)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes() == f"sleep\0{seconds}\0".encode():
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


def test_slurm_two_runs_at_once_are_queued_by_slurm_and_the_record_shows_the_wait(slurm_lab, slurm_inventory,
                                                                                tmp_path):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c1": {}, "c2": {}}, sleep=8)     # both want the node's 2 GPUs
    first: dict = {}
    runner = threading.Thread(target=lambda: first.update(zip(("code", "run", "output"), validate(
        inv, ["c1"], report_dir=tmp_path / "run-1"))))
    runner.start()
    try:
        assert slurm_cluster.soon(lambda: building(tmp_path / "run-1", "c1"), 60), "the first run's build never started"
        waited: list[str] = []

        def pending() -> bool:          # slurmctld: the second run's job waits for the GPUs
            jobs = cluster.command("squeue", "-h", "-t", "PENDING", "-o", "%i %j %r").stdout.split("\n")
            waited.extend(line for line in jobs if "kdtree-c2" in line and line.endswith("Resources"))
            return bool(waited)
        second: dict = {}
        later = threading.Thread(target=lambda: second.update(zip(("code", "run", "output"), validate(
            inv, ["c2"], report_dir=tmp_path / "run-2"))))
        later.start()
        assert slurm_cluster.soon(pending, 30), cluster.command("squeue").stdout
        later.join(120)
    finally:
        runner.join(120)
    assert first["code"] == second["code"] == 0, first["output"] + second["output"]
    one, two = first["run"]["hosts"]["c1"]["job"], second["run"]["hosts"]["c2"]["job"]
    assert waited[0].split()[0] == two["job_id"] != one["job_id"]
    assert two["queue_wait"] >= 2 and two["queue_wait"] > one["queue_wait"]      # Slurm's StartTime - SubmitTime
    for job in (one, two):
        seen = cluster.ended_job(job["job_id"])
        assert (seen["JobState"], seen["NodeList"]) == ("CANCELLED", slurm_cluster.NODE)
        assert job["gpus"] == [0, 1] and len(job_steps(cluster, job["job_id"])) == 4
    # the queue wait is in no step's seconds: the second run's build took about as long as the first's
    steps = second["run"]["hosts"]["c2"]["steps"]
    assert steps["build"]["seconds"] < two["queue_wait"] + first["run"]["hosts"]["c1"]["steps"]["build"]["seconds"]
    assert f"queue wait {two['queue_wait']:.1f} s" in second["output"]


def test_slurm_a_node_that_goes_down_mid_job_fails_the_host_with_slurms_state(slurm_lab, slurm_inventory,
                                                                              tmp_path):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}}, sleep=120)
    run_dir = tmp_path / "run-down"
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(zip(("code", "run", "output"), validate(
        inv, ["c"], report_dir=run_dir))))
    runner.start()
    try:
        assert slurm_cluster.soon(lambda: building(run_dir), 60), "the build never started on the node"
        down = cluster.scontrol("update", f"NodeName={slurm_cluster.NODE}", "State=DOWN", "Reason=kdtree test: down")
        assert down.returncode == 0, down.stderr
        runner.join(90)
    finally:
        runner.join(60)
        cluster.resume()
    assert not runner.is_alive() and result["code"] == 1, result.get("output")
    host = result["run"]["hosts"]["c"]
    job = host["job"]
    seen = cluster.ended_job(job["job_id"])           # slurmctld: the job ran on the node, and the node's failure ended it
    assert seen["JobState"] == "NODE_FAIL" and seen["NodeList"] == slurm_cluster.NODE
    assert host["status"] == "failed" and host["steps"]["build"]["status"] == "failed"
    assert f"Slurm ended job {job['job_id']}: NODE_FAIL, reason {job['reason']}" in host["steps"]["build"]["message"]
    assert job["ended"].startswith("ended by Slurm: NODE_FAIL") and job["state"] == "NODE_FAIL"
    assert slurm_cluster.soon(lambda: not left_running(inv.hosts["c"].remote_dir), 30), \
        left_running(inv.hosts["c"].remote_dir)


def test_slurm_a_job_past_the_queue_limit_fails_the_host_with_the_pending_reason(slurm_lab, slurm_inventory):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {"queue_limit": 3}})
    cluster.drain("kdtree test: drained")
    try:
        began = time.monotonic()
        code, run, output = validate(inv, ["c"])
    finally:
        cluster.resume()
    assert code == 1 and time.monotonic() - began < 60, output
    host = run["hosts"]["c"]
    build, job = host["steps"]["build"], host["job"]
    assert build["status"] == "failed" and build["seconds"] == 0.0 and host["steps"]["sync"]["status"] == "passed"
    assert f"job {job['job_id']} waited" in build["message"] and "past queue_limit 3 s" in build["message"]
    assert "DRAINED" in build["message"] and job["reason"] in build["message"] and job["state"] == "PENDING"
    assert job["ended"] == "cancelled: it waited past queue_limit" and job["node"] is None
    seen = cluster.ended_job(job["job_id"])           # slurmctld: it waited, never ran, and was cancelled
    assert seen["JobState"] == "CANCELLED" and seen["NodeList"] in ("", "(null)")


def test_slurm_the_nightly_validates_an_ssh_host_and_a_slurm_entry_in_one_run_and_report(slurm_lab, slurm_inventory,
                                                                                        tmp_path):
    cluster, _ = slurm_lab
    inv = slurm_inventory({"c": {}}, ssh=True)
    _, selected = cli.load_selection(str(inv.path), nightly=True)      # every host but local: the Slurm entry too
    assert sorted(h.name for h in selected) == ["c", "h1"]
    run_dir = tmp_path / "night"
    out = io.StringIO()
    code = cli.validate(inv, selected, Console(out), steps="sync,build", command="nightly", report_dir=str(run_dir))
    assert code == 0, out.getvalue()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["command"] == "nightly" and run["status"] == "passed"
    assert {name: h["status"] for name, h in run["hosts"].items()} == {"c": "passed", "h1": "passed"}
    assert run["hosts"]["h1"]["job"] is None
    job = run["hosts"]["c"]["job"]
    assert cluster.ended_job(job["job_id"])["JobState"] == "CANCELLED" and len(job_steps(cluster, job["job_id"])) == 4
    for report in ("report.md", "report.html"):     # the job beside the ssh host's steps in the one report
        text = (run_dir / report).read_text()
        assert f"job {job['job_id']}" in text and "queue wait" in text and "h1" in text, report
