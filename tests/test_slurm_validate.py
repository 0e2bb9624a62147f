"""One whole `invoke validate` on a `scheduler: slurm` entry with the real engine (CPU backend),
against the local Slurm cluster (tests/slurm_cluster.py) through its login node: sync to the
shared filesystem, then build, bundles, golden, test and bench as job steps of one allocation.
slurmctld's record says the job ran on the node and was cancelled at the end; slurmd's log that
every engine command was a job step of it. The local bundle cache starts with the session's
reference bundles (as tests/test_validate.py's does); the host runs the `tiny` bundles only, the
engine's tests on them and a light bench: the steps' plumbing inside the allocation, not the
engine's coverage (tests/test_validate.py's)."""
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

REPO = Path(__file__).resolve().parent.parent
# one tree budget, one repeat, the smallest MoE layer: the bench step's plumbing, not its figures
LIGHT_BENCH = 'KD_BENCH_ARGS="--budgets 4 --repeats 1 --moe-experts 8 --moe-tokens 1" bash scripts/bench.sh'
LIGHT_TEST = "KD_TEST_BUNDLES=tiny_fp32,tiny_int4 bash scripts/run_tests.sh"


def test_slurm_invoke_validate_runs_the_whole_pipeline_inside_one_allocation(slurm_lab, lab, reference_bundles,
                                                                             tmp_path):
    cluster, login = slurm_lab
    shutil.copytree(REPO / "engine_src", tmp_path / "engine_src",
                    ignore=shutil.ignore_patterns("build", "__pycache__", "*.kdtr", "manifest.json"))
    if reference_bundles.key_of(tmp_path / "engine_src") == reference_bundles.key:
        reference_bundles.copy_to(tmp_path / "build" / "local-bundles" / reference_bundles.key)
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = str(tmp_path / "engine_src")
    data["project"]["commands"].update(bench=LIGHT_BENCH, test=LIGHT_TEST)
    data["project"]["bundle_tiers"]["default"] = ["tiny"]
    data["hosts"] = {"cluster": lab.inventory_entry(
        login, remote_dir=str(login.root / f"{tmp_path.name}-engine"), scheduler="slurm",
        partition=slurm_cluster.PARTITION, gpus=2, slurm_conf=str(cluster.conf))}
    data.pop("groups", None)
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "invoke", "validate", "--inventory", str(inventory), "--host",
                           "cluster", "--report-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=1500, env={**os.environ, **lab.env()})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    run = json.loads((run_dir / "run.json").read_text())
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
