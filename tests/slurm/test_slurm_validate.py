"""One whole `invoke validate` on a `scheduler: slurm` entry with the real engine (CPU backend),
against the local Slurm cluster (tests/slurm/slurm_cluster.py) through its login node: sync to the
shared filesystem, then build, bundles, golden, test and bench as job steps of one allocation; then
the same again, which reuses the build (its stamp matches on the shared filesystem) but runs golden,
test and bench anew in its own allocation (a Slurm entry's results are never reused).
slurmctld's record says the job ran on the node and was cancelled at the end; slurmd's log that
every engine command was a job step of it. The local bundle cache starts with the session's
reference bundles (as tests/scenarios/test_validate.py's does); the host runs the `tiny` bundles only, the
engine's tests on them and a light bench: the steps' plumbing inside the allocation, not the
engine's coverage (tests/scenarios/test_validate.py's)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

import slurm_cluster
from test_slurm_run import job_steps

REPO = Path(__file__).resolve().parents[2]
# one tree budget, one repeat, the smallest MoE layer: the bench step's plumbing, not its figures
LIGHT_BENCH = 'KD_BENCH_ARGS="--budgets 4 --repeats 1 --moe-experts 8 --moe-tokens 1" bash scripts/bench.sh'
LIGHT_TEST = "KD_TEST_BUNDLES=tiny_fp32,tiny_int4 bash scripts/run_tests.sh"


def invoke(lab, inventory: Path, run_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`invoke validate` on the entry `cluster` of `inventory` into `run_dir`: the process (exit 0
    asserted) and the entry's record in run.json."""
    proc = subprocess.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory), "--host",
                           "cluster", "--report-dir", str(run_dir), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, **lab.env()})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc, json.loads((run_dir / "run.json").read_text())


def test_slurm_invoke_validate_runs_the_whole_pipeline_inside_one_allocation_and_never_reuses_what_it_measured(
        slurm_lab, lab, reference_bundles, cpu_build, tmp_path):
    cluster, login = slurm_lab
    shutil.copytree(REPO / "engine_src", tmp_path / "engine_src",
                    ignore=shutil.ignore_patterns("build", "__pycache__", "*.kdtr", "manifest.json"))
    if reference_bundles.key_of(tmp_path / "engine_src") == reference_bundles.key:
        reference_bundles.copy_to(tmp_path / "build" / "local-bundles" / reference_bundles.key)
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = str(tmp_path / "engine_src")
    data["project"]["commands"].update(bench=LIGHT_BENCH, test=LIGHT_TEST)
    data["project"]["bundle_tiers"]["default"] = ["tiny"]
    remote_dir = login.root / f"{tmp_path.name}-engine"
    data["hosts"] = {"cluster": lab.inventory_entry(
        login, remote_dir=str(remote_dir), scheduler="slurm", partition=slurm_cluster.PARTITION, gpus=2,
        slurm_conf=str(cluster.conf))}
    data.pop("groups", None)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(data, sort_keys=False))
    # the shared filesystem holds the session's CPU build objects of this tree (tests/early_builds.py): the
    # build step inside the allocation compiles nothing and links
    invoke(lab, inventory, tmp_path / "run-sync", "--steps", "sync")
    cpu_build.seed(remote_dir)
    proc, run = invoke(lab, inventory, tmp_path / "run")
    host = run["hosts"]["cluster"]
    assert {s: v["status"] for s, v in host["steps"].items()} == dict.fromkeys(
        ["preflight", "sync", "build", "bundles", "golden", "test", "bench"], "passed")
    assert host["backend"] == "cpu" and host["deployed_tree_hash"] == host["binary_tree_hash"]
    assert set(host["golden"]) == {"tiny_fp32", "tiny_int4"}
    assert all(g["status"] == "passed" for g in host["golden"].values())
    assert host["tests"]["failed"] == 0 and host["tests"]["passed"] >= 10 and host["bench"]["metrics"]
    job = host["job"]
    assert (job["node"], job["gpus"], job["cuda_visible_devices"]) == (slurm_cluster.NODE, [0, 1], "0,1")
    assert job["ended"] == "cancelled: the host's steps are done" and job["queue_wait"] is not None
    seen = cluster.ended_job(job["job_id"])           # slurmctld: the one job ran on the node, and was cancelled at the end
    assert (seen["JobState"], seen["NodeList"], seen["JobName"]) == ("CANCELLED", slurm_cluster.NODE, "kdtree-cluster")
    # build, bundles, golden, test and bench ran their engine commands as job steps of that job
    assert len(job_steps(cluster, job["job_id"])) >= 6
    assert not host["selected_gpus"] and "gpu_claims" not in proc.stdout
    assert f"slurm cluster: job {job['job_id']} on {slurm_cluster.NODE}" in proc.stdout

    # Nothing changed: the build on the shared filesystem is reused (its stamp matches: the record says
    # so), but golden, test and bench run again in the new allocation: its node and GPUs may differ.
    again, rerun = invoke(lab, inventory, tmp_path / "run-again")
    host = rerun["hosts"]["cluster"]
    steps = host["steps"]
    assert (steps["build"]["status"], steps["build"]["reused_from"]) == ("cached", run["run_id"]), again.stdout
    for step in ("golden", "test", "bench"):
        assert (steps[step]["status"], steps[step]["reused_from"]) == ("passed", None), (step, again.stdout[-4000:])
        assert "reused from run" not in (tmp_path / "run-again" / "cluster" / f"{step}.log").read_text()
    assert host["tests"]["failed"] == 0 and host["tests"]["passed"] >= 10 and host["bench"]["metrics"]
    assert f"reused results (not re-run): cluster build from run {run['run_id']}" in again.stdout
    second = host["job"]
    assert second["job_id"] != job["job_id"] and cluster.ended_job(second["job_id"])["JobState"] == "CANCELLED"
    assert len(job_steps(cluster, second["job_id"])) >= 5        # golden, test and bench among them
