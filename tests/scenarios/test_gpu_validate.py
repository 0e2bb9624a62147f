"""`invoke validate`, `doctor` and the GPUs of a shared host: the loopback sshd host g1, whose PATH
starts with a fake nvidia-smi (tests/fake_gpus.py) listing GPUs with chosen loads, and the real
engine forced onto its CPU backend (`backend: cpu`): GPUs are selected, claimed and pinned whatever
the backend. One full run builds the engine on g1 (linking the session's CPU build's objects, put
there after a first sync); the later runs reuse that build (cached)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine_src"
BUSY = (4242, "python3 -m sglang.launch_server", 30000)      # a co-tenant's model server
# The engine's tests once per GPU, the model tests on the tiny bundles only (the whole suite is
# tests/engine/test_engine_native.py's and tests/scenarios/test_validate.py's): what is tested here is where they run.
SELECTED = ("tiny_fp32", "tiny_int4")
LIGHT_TEST = f"KD_TEST_BUNDLES={','.join(SELECTED)} bash scripts/run_tests.sh"

# The engine's generate command, saying which GPUs it was given (CUDA_VISIBLE_DEVICES reaching
# the engine's commands) and, on GPU 1 only when FLIP_ON is that GPU, changing one output token.
GENERATE = r'''echo "generate sees CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES KD_RESULTS_DIR=$KD_RESULTS_DIR"
bash scripts/generate.sh
if [ -n "${FLIP_ON:-}" ] && [ "$CUDA_VISIBLE_DEVICES" = "$FLIP_ON" ]; then
  "$PYTHON" - "$KD_RESULTS_DIR/outputs.json" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
data["bundles"]["tiny_fp32"]["ar"][5] += 1
json.dump(data, open(sys.argv[1], "w"))
EOF
fi'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, reference_bundles) -> Path:
    """The folder of this module's inventories and runs: a snapshot of engine_src, and the session's
    reference bundles in its local bundle cache (what is tested here is where g1's engine commands
    run, not this machine's regeneration)."""
    path = tmp_path_factory.mktemp("gpu-validate")
    shutil.copytree(ENGINE, path / "engine_src", ignore=shutil.ignore_patterns("build", "__pycache__", "*.kdtr",
                                                                             "manifest.json"))
    reference_bundles.seed_local_cache(path, path / "engine_src")
    return path


@pytest.fixture(scope="module")
def g1(gpu_lab):
    return gpu_lab


def write_inventory(workdir: Path, lab, host, name: str, flip_on: str = "", **keys) -> Path:
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["project"]["source"] = str(workdir / "engine_src")
    data["project"]["commands"]["generate"] = (f"FLIP_ON={flip_on} " if flip_on else "") + "bash -c " + \
        "'" + GENERATE.replace("'", "'\"'\"'") + "'"
    data["project"]["commands"]["bench"] = 'KD_BENCH_ARGS="--budgets 4 --repeats 1 --moe-tokens 1" bash scripts/bench.sh'
    data["project"]["commands"]["test"] = LIGHT_TEST

    data["hosts"] = {"g1": lab.inventory_entry(host, remote_dir=str(host.root / "engine"), backend="cpu",
                                               **keys)}
    data.pop("groups", None)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def invoke(lab, task: str, inventory: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", task, "--inventory", str(inventory), "--host", "g1", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **lab.env()})


def start(lab, task: str, inventory: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "invoke", task, "--inventory", str(inventory), "--host", "g1",
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **lab.env()})


def load(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())["hosts"]["g1"]


@pytest.fixture(scope="module")
def full_run(lab, workdir, g1, cpu_build):
    """Every step on GPUs 0 and 1 of four (`--gpus 0,1`), GPU 0 busy with a co-tenant's server."""
    host, fake = g1
    # GPU 0 also lists the run's own engine processes, by the relative name they were started as
    fake.set(4, busy={0: [BUSY]}, own_under={"dir": str(host.root / "engine"), "gpu_uuid": fake.uuid(0),
                                             "log": str(workdir / "own-processes.log")})
    inventory = write_inventory(workdir, lab, host, "full")
    synced = invoke(lab, "validate", inventory, "--steps", "preflight,sync", "--report-dir", str(workdir / "run-sync"))
    assert synced.returncode == 0, synced.stdout[-4000:] + synced.stderr[-2000:]
    cpu_build.seed(host.root / "engine")
    run_dir = workdir / "run-full"
    proc = invoke(lab, "validate", inventory, "--gpus", "0,1", "--report-dir", str(run_dir))
    return proc, run_dir, fake, host


def test_a_run_on_two_gpus_records_them_and_pins_every_engine_command(full_run):
    proc, run_dir, fake, host = full_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rec = load(run_dir)
    assert rec["selected_gpus"] == [0, 1]
    assert [g["index"] for g in rec["gpus"]] == [0, 1, 2, 3]
    assert rec["gpus"][0]["busy"] is True and rec["gpus"][1]["busy"] is False
    assert rec["gpus"][0]["processes"] == [{"pid": 4242, "name": "python3 -m sglang.launch_server", "used_mib": 30000}]
    assert rec["gpus"][0]["uuid"] == fake.uuid(0) and rec["gpus"][0]["memory_total_mib"] == 143771
    both = [fake.uuid(0), fake.uuid(1)]
    for step in ("build", "bundles"):
        assert rec["steps"][step]["cuda_visible_devices"] == both, step
    assert sorted(rec["steps"]["golden"]["cuda_visible_devices"]) == sorted(both)
    assert rec["steps"]["preflight"]["cuda_visible_devices"] is None
    log = (run_dir / "g1" / "golden.log").read_text()
    for i in (0, 1):
        assert f"[gpu {i}] generate sees CUDA_VISIBLE_DEVICES={fake.uuid(i)} KD_RESULTS_DIR=build/gpu-{i}" in log
        assert (host.root / "engine" / "build" / f"gpu-{i}" / "outputs.json").is_file()
        assert (host.root / "engine" / "build" / f"gpu-{i}" / "test_results.json").is_file()
    assert not (host.root / "engine" / "build" / "outputs.json").exists()


def test_golden_and_test_ran_once_per_gpu(full_run, workdir):
    proc, run_dir, fake, _ = full_run
    rec = load(run_dir)
    expected = json.loads((workdir / "engine_src" / "tests" / "refs" / "expected_manifest.json").read_text())
    bundles = {b["name"] for b in expected["bundles"] if not b.get("streamed")}    # the default tier's
    runs = {r["gpu"]: r for r in rec["gpu_runs"]}
    assert sorted(runs) == [0, 1]
    for i, r in runs.items():
        assert (r["uuid"], r["results_dir"], r["golden_status"], r["tests_status"]) == \
            (fake.uuid(i), f"build/gpu-{i}", "passed", "passed")
        assert set(r["golden"]) == bundles and "tiny_fp32" in bundles
        assert r["tests"]["failed"] == 0 and r["tests"]["passed"] >= 10
        skipped = {c["name"] for c in rec["tests"]["cases"]
                   if c["status"] == "skipped" and c["name"].startswith(f"gpu{i}.")}
        assert skipped == {f"gpu{i}.model.cpu.{b}" for b in bundles - set(SELECTED)}       # said, not hidden
    names = [c["name"] for c in rec["tests"]["cases"]]
    assert len(names) == runs[0]["tests"]["passed"] + runs[1]["tests"]["passed"] + \
        runs[0]["tests"]["skipped"] + runs[1]["tests"]["skipped"]
    assert {n.split(".")[0] for n in names} == {"gpu0", "gpu1"}
    assert (run_dir / "g1" / "gpu-0.outputs.json").is_file() and (run_dir / "g1" / "gpu-1.test_results.json").is_file()


def test_bench_runs_on_one_gpu_and_names_its_co_tenants(full_run, workdir):
    proc, run_dir, fake, _ = full_run
    rec = load(run_dir)
    assert rec["steps"]["bench"]["cuda_visible_devices"] == [fake.uuid(0)]
    gpu = rec["bench"]["gpu"]
    assert (gpu["index"], gpu["uuid"]) == (0, fake.uuid(0)) and gpu["samples"] >= 1
    assert gpu["co_tenants"] == [{"pid": 4242, "name": "python3 -m sglang.launch_server", "max_used_mib": 30000,
                                  "samples": gpu["samples"]}]
    # nvidia-smi listed the bench's own processes beside it (named as started, e.g. build/kdtree), the
    # engine under remote_dir and the shell that ran the bench command from /usr/bin: none is a co-tenant
    listed = [line.split(" ", 1) for line in (workdir / "own-processes.log").read_text().splitlines()]
    prefix = str(full_run[3].root / "engine") + "/"
    assert {exe.startswith(prefix) for _, exe in listed} == {True, False}, listed
    assert not {int(pid) for pid, _ in listed} & {p["pid"] for p in gpu["co_tenants"]}
    assert "NOISY: 1 other process(es) on the GPU meanwhile (pid 4242 python3 -m sglang.launch_server)" in \
        rec["steps"]["bench"]["message"]
    assert rec["bench"]["metrics"]


def test_the_reports_show_the_gpus(full_run):
    proc, run_dir, fake, _ = full_run
    md = (run_dir / "report.md").read_text()
    assert "| 0 | NVIDIA H200 | 30000 / 143771 | 90 % | busy | 4242 python3 -m sglang.launch_server 30000 MiB | yes |" in md
    assert "| 2 | NVIDIA H200 | 0 / 143771 | 0 % | idle | - |  |" in md
    html = (run_dir / "report.html").read_text()
    assert fake.uuid(1) in html and "co-tenant" in html


def test_one_gpu_failing_fails_its_cell_and_the_host(full_run, lab, workdir, g1):
    proc, _, fake, host = full_run
    assert proc.returncode == 0
    inventory = write_inventory(workdir, lab, host, "flip", flip_on=fake.uuid(1))
    run_dir = workdir / "run-flip"
    flipped = invoke(lab, "validate", inventory, "--gpus", "0,1", "--steps", "preflight,sync,build,bundles,golden",
                     "--report-dir", str(run_dir))
    assert flipped.returncode == 1, flipped.stdout[-4000:]
    rec = load(run_dir)
    assert rec["status"] == "failed" and rec["steps"]["golden"]["status"] == "failed"
    assert [rec["steps"][s]["status"] for s in ("sync", "build", "bundles")] == ["cached"] * 3
    runs = {r["gpu"]: r for r in rec["gpu_runs"]}
    assert (runs[0]["golden_status"], runs[1]["golden_status"]) == ("passed", "failed")
    assert runs[1]["golden"]["tiny_fp32"]["mismatch"]["position"] == 5
    assert runs[0]["golden"]["tiny_fp32"]["status"] == "passed"
    assert rec["steps"]["golden"]["message"].startswith("GPU 1: golden tokens differ: tiny_fp32: host_ar_vs_golden")
    assert rec["golden"]["tiny_fp32"]["detail"].startswith("GPU 1: ")
    md = (run_dir / "report.md").read_text()
    assert "g1 GPU 1" in md and "g1 GPU 0" in md


def test_not_enough_idle_gpus_fails_preflight_naming_them(lab, workdir, g1):
    host, fake = g1
    fake.set(2, busy={0: [BUSY], 1: [(777, "ollama", 2048), (778, "python3", 512)]})
    inventory = write_inventory(workdir, lab, host, "busy")
    run_dir = workdir / "run-busy"
    proc = invoke(lab, "validate", inventory, "--steps", "preflight", "--report-dir", str(run_dir))
    assert proc.returncode == 1
    message = load(run_dir)["steps"]["preflight"]["message"]
    # 546 MiB: the largest GPU need of the default tier's bundles (the expected manifest's k2mini_fp32)
    assert message == ("not enough GPUs: needs 1 idle GPU (no compute process, at most 1024 MiB in use) with 546 MiB "
                       "free for the bundles, none usable; "
                       "GPU 0 (NVIDIA H200): 1 compute process: pid 4242 python3 -m sglang.launch_server 30000 MiB; "
                       "GPU 1 (NVIDIA H200): 2 compute processes: pid 777 ollama 2048 MiB, pid 778 python3 512 MiB")
    anyway = invoke(lab, "validate", write_inventory(workdir, lab, host, "any", gpu_policy="any"), "--steps",
                    "preflight", "--report-dir", str(workdir / "run-any"))
    assert anyway.returncode == 0, anyway.stdout[-3000:]
    assert load(workdir / "run-any")["selected_gpus"] == [0]


def test_a_gpu_freed_during_gpu_wait_is_taken(lab, workdir, g1):
    host, fake = g1
    fake.set(2, busy={0: [BUSY], 1: [BUSY]})
    inventory = write_inventory(workdir, lab, host, "wait", gpu_wait=60)
    timer = threading.Timer(3, lambda: fake.set(2, busy={0: [BUSY]}))
    timer.start()
    try:
        proc = invoke(lab, "validate", inventory, "--steps", "preflight", "--report-dir", str(workdir / "run-wait"))
    finally:
        timer.cancel()
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert load(workdir / "run-wait")["selected_gpus"] == [1]


def test_two_concurrent_runs_of_one_tree_use_different_gpus(full_run, lab, workdir, g1):
    _, _, fake, host = full_run
    fake.set(4, busy={0: [BUSY]})
    inventory = write_inventory(workdir, lab, host, "pair")
    dirs = [workdir / "run-pair-a", workdir / "run-pair-b"]
    procs = [start(lab, "validate", inventory, "--steps", "preflight,sync,build,bundles,golden", "--report-dir",
                   str(d)) for d in dirs]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    assert all(p.returncode == 0 for p, _, _ in results), [(p.returncode, o[-3000:]) for p, o, _ in results]
    selected = [load(d)["selected_gpus"] for d in dirs]
    assert sorted(selected) == [[1], [2]]
    for d, gpus in zip(dirs, selected):
        rec = load(d)
        assert rec["gpu_runs"][0]["gpu"] == gpus[0] and rec["gpu_runs"][0]["golden_status"] == "passed"
        assert rec["steps"]["golden"]["cuda_visible_devices"] == [fake.uuid(gpus[0])]
    assert not list((host.root / "engine" / ".kdtree").glob("gpu-*.owner"))      # claims released


def test_doctor_shows_the_gpu_table_and_what_a_run_would_take(lab, workdir, g1):
    host, fake = g1
    fake.set(3, busy={0: [BUSY]})
    proc = invoke(lab, "doctor", write_inventory(workdir, lab, host, "doctor", gpu_count=2))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "gpu  name         memory MiB      util  state  processes" in proc.stdout
    assert "0    NVIDIA H200  30000 / 143771  90 %  busy   4242 python3 -m sglang.launch_server 30000 MiB" in proc.stdout
    assert "a run would take GPU 1, 2" in proc.stdout


def test_gpus_flag_errors_exit_2(lab, workdir, g1):
    host, _ = g1
    proc = invoke(lab, "validate", write_inventory(workdir, lab, host, "flag"), "--gpus", "0,,1")
    assert proc.returncode == 2
    assert "--gpus '0,,1': not a list of GPU indices from 0 to 1023" in proc.stderr


def test_a_run_that_needs_another_tree_waits_then_names_the_runs_using_it(full_run, lab, workdir, g1):
    """Another run of the deployed tree holds it (shared, as a validate on its GPU does); a run of
    a changed source must sync: it waits timeouts.lock for the tree alone, then fails naming it."""
    from orchestrator import inventory as inventory_mod, state
    from orchestrator.connectors.factory import open_transport
    _, _, fake, host = full_run
    fake.set(2)
    changed = workdir / "changed"
    if not changed.exists():
        shutil.copytree(workdir / "engine_src", changed)
        (changed / "CHANGED.md").write_text("another tree\n")
    inventory = write_inventory(workdir, lab, host, "changed", timeouts={"connect": 5, "keepalive": 5, "lock": 2})
    data = yaml.safe_load(inventory.read_text())
    data["project"]["source"] = str(changed)
    inventory.write_text(yaml.safe_dump(data, sort_keys=False))
    other = state.Owner("laptop", 4711, "2026-01-01T00:00:00Z", "nightly")
    hosts = inventory_mod.load(write_inventory(workdir, lab, host, "holder")).hosts
    with open_transport(hosts["g1"]) as t, state.acquire(t, other, state.SHARED, 5):
        run_dir = workdir / "run-changed"
        proc = invoke(lab, "validate", inventory, "--steps", "preflight,sync", "--report-dir", str(run_dir))
    assert proc.returncode == 1, proc.stdout[-3000:]
    rec = load(run_dir)
    assert rec["steps"]["preflight"]["status"] == "passed"
    assert rec["steps"]["sync"]["message"] == (
        f"{host.root / 'engine'} is in use by other runs (the tree cannot change under them): nightly by pid 4711 "
        "on laptop, started 2026-01-01T00:00:00Z (waited 2 s: timeouts.lock)")
    assert not (host.root / "engine" / "CHANGED.md").exists()
