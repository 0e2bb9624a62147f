"""Big bundles first-class: each bundle's declared needs (the expected manifest's `needs`), the
bundle tiers a host runs (hosts.yaml `bundles:`, --bundles), preflight refusing a host whose disk,
RAM or GPUs cannot hold them (with the numbers), memory-aware GPU selection, the engine's
--max-memory following the needs, and the check-bundle and clean-bundles commands, on loopback
sshd hosts (tests/sshd.py) and the fake nvidia-smi (tests/fake_gpus.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator import inventory
from orchestrator.resources import bundle_plan, capacity, gpus
from orchestrator.errors import InventoryError, UsageError

from bundle_manifests import GB, needs, write_manifest
from fake_gpus import FakeGpus

REPO = Path(__file__).resolve().parents[2]
TIERS = {"default": ["tiny"], "big": ["big"]}
FAST = {"connect": 3, "keepalive": 2, "lock": 10}


def invoke(lab, task: str, inv, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    """`invoke TASK --inventory INV ARGS...` from the repo, as a user types it."""
    return subprocess.run([sys.executable, "-m", "invoke", task, "--inventory", str(inv.path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **lab.env()})


def latest_run(inv) -> dict:
    return json.loads(((inv.path.parent / "runs" / "latest").resolve() / "run.json").read_text())


def host_entry(lab, name: str, **overrides) -> dict:
    return lab.inventory_entry(lab.hosts[name], timeouts=FAST, **overrides)


# ---- the plan: tiers, needs, the rules ---------------------------------------------------------

def plan_for(make_inventory, source, tiers=("default",), **bundles) -> bundle_plan.BundlePlan:
    write_manifest(source, **bundles)
    inv = make_inventory({"h": {"transport": "local", "remote_dir": "d/x", "bundles": list(tiers)}}, bundle_tiers=TIERS)
    expected = json.loads((source / "tests/refs/expected_manifest.json").read_text())
    return bundle_plan.for_host(inv.hosts["h"], inv.project, expected)


def test_the_plan_sums_disk_and_ram_takes_the_largest_gpu_need_and_scales_the_timeouts(make_inventory, source):
    plan = plan_for(make_inventory, source, ("default", "big"), tiny_fp32=needs(GB, 3 * GB, 2 * GB),
                    big_int4=needs(13 * GB, 28 * GB, 14 * GB), other_fp32=needs(99 * GB, 99 * GB, 99 * GB))
    assert [b.name for b in plan.bundles] == ["tiny_fp32", "big_int4"]         # other: in no selected tier
    assert (plan.disk_bytes, plan.ram_bytes, plan.gpu_bytes, plan.max_memory) == (14 * GB, 31 * GB, 14 * GB, 28 * GB)
    assert plan.env() == {"KD_MAX_MEMORY": str(28 * GB), "KD_CONFIGS": "tiny big"}
    host = make_inventory({"h": {"transport": "local", "remote_dir": "d/x", "timeouts": {"golden": 100}}},
                          bundle_tiers=TIERS).hosts["h"]
    scaled = plan.timeouts(host)            # 14 GB at 20 s per GB: 280 s more for the bundle steps only
    assert (scaled["golden"], scaled["bench"], scaled["build"]) == (380, host.timeout("bench") + 280, host.timeout("build"))
    assert plan.to_record(host)["timeouts"]["golden"] == 380
    expected = {"bundles": [{"name": "tiny_fp32", "config": "tiny"}, {"name": "other_fp32", "config": "other"}]}
    assert plan.expected(expected)["bundles"] == [{"name": "tiny_fp32", "config": "tiny"}]


def test_the_default_tier_keeps_the_commands_default_and_a_tier_without_bundles_is_refused(make_inventory, source):
    plan = plan_for(make_inventory, source, tiny_fp32=needs())
    assert plan.is_default and plan.env() == {"KD_MAX_MEMORY": str(GB // 10)}     # no KD_CONFIGS: today's bundles
    with pytest.raises(bundle_plan.PlanError, match=r"project.bundle_tiers.big: config 'big' has no bundle"):
        plan_for(make_inventory, source, ("big",), tiny_fp32=needs())
    older = plan_for(make_inventory, source, tiny_fp32=needs(), tiny_int4=None)     # a bisect's earlier commit
    assert older.undeclared() == ["tiny_int4"] and older.env() == {} and older.disk_bytes == needs()["disk_bytes"]
    with pytest.raises(bundle_plan.PlanError, match=r"bundle 'tiny_fp32': needs.ram_bytes must be bytes"):
        plan_for(make_inventory, source, tiny_fp32={"disk_bytes": 1, "ram_bytes": -1, "gpu_bytes": 1})


def test_bundle_tiers_are_validated_naming_the_key(make_inventory):
    with pytest.raises(InventoryError, match=r"'h'.*bundles.*unknown bundle tier 'bgi' \(did you mean 'big'\?\)"):
        make_inventory({"h": {"transport": "local", "remote_dir": "d/x", "bundles": ["default", "bgi"]}},
                       bundle_tiers=TIERS)
    with pytest.raises(InventoryError, match=r"project.bundle_tiers.*must name the tier 'default'"):
        make_inventory({}, bundle_tiers={"big": ["big"]})
    inv = make_inventory({}, bundle_tiers=TIERS)
    assert bundle_plan.parse_flag("default, big", inv.project) == ("default", "big")
    with pytest.raises(UsageError, match=r"--bundles: unknown bundle tier 'huge'"):
        bundle_plan.parse_flag("default,huge", inv.project)


def test_the_committed_manifest_declares_needs_for_every_bundle_and_the_shipped_inventory_reads_them():
    inv = inventory.load(REPO / "hosts.yaml")
    expected = json.loads((inv.project.source / inv.project.results["expected_manifest"]).read_text())
    plan = bundle_plan.for_host(inv.hosts["local"], inv.project, expected)
    assert {b.config for b in plan.bundles} == {"tiny", "tiny2", "k2mini"} and len(plan.bundles) == 6
    for b in plan.bundles:
        assert 0 < b.disk_bytes < b.ram_bytes and b.gpu_bytes > 0


# ---- judging the room ------------------------------------------------------------------------

def test_disk_counts_the_bundles_already_there_and_ram_counts_one_engine_per_gpu(make_inventory, source):
    plan = plan_for(make_inventory, source, tiny_fp32=needs(disk=10 * GB, ram=4 * GB))
    host = make_inventory({"h": {"transport": "local", "remote_dir": "d/x"}}, bundle_tiers=TIERS).hosts["h"]
    facts = {"disk_path": ["/srv"], "disk_free_kb": ["4000000"], "mem_available_kb": ["10000000"],
             "have_bytes": ["7000000000 tests/refs/model_tiny_fp32.kdtr", "9 tests/refs/not_asked.kdtr", "x y"],
             "noise": ["1"]}              # the doctor probe's facts
    files = capacity.bundle_files(plan, make_inventory({}).project)
    assert files == ["tests/refs/model_tiny_fp32.kdtr"]
    room = capacity.room_of(facts, files)
    assert room.present_bytes == 7 * GB and room.free_bytes == 4096 * 10**6 and room.disk_path == "/srv"
    assert capacity.disk_problem(room, plan, host) is None              # 4.1 GB free + 7 GB there >= 10 GB
    short = capacity.room_of({**facts, "have_bytes": ["5000000000 tests/refs/model_tiny_fp32.kdtr"]}, files)
    assert "need 10.00 GB of disk" in capacity.disk_problem(short, plan, host)
    assert capacity.ram_problem(room, plan, 2) is None                   # 8 GB of 10.24 GB
    assert capacity.ram_problem(room, plan, 3) == (
        "the bundles of tier default (1 bundles) need 4.00 GB of RAM per engine process, x 3 engines at once "
        "(one per GPU) = 12.00 GB, but the host has 10.24 GB available (MemAvailable)")


def test_gpu_selection_takes_gpus_with_enough_free_memory_or_says_why_none_qualifies():
    def gpu(i, used):
        return gpus.Gpu(i, FakeGpus.uuid(i), "NVIDIA H200", used, 143771, 0, "9.0", None)
    found = [gpu(0, 143000), gpu(1, 60000), gpu(2, 0)]
    request = gpus.Request("any", count=2, min_free_mib=20000)
    choice = gpus.choose(found, request)
    assert [g.index for g in choice.taken()] == [2, 1]          # GPU 1 is busy, but has room
    assert choice.refused[0][1] == "771 MiB free of 143771 MiB, the bundles need 20000 MiB"
    idle = gpus.choose(found, gpus.Request("idle", count=1, min_free_mib=200000))
    assert not idle.enough and "GPU 2 (NVIDIA H200): 143771 MiB free of 143771 MiB, the bundles need 200000 MiB" \
        in idle.shortage()


# ---- preflight on loopback hosts ----------------------------------------------------------------

def test_preflight_refuses_a_host_whose_disk_cannot_hold_the_bundles(lab, make_inventory, source, tmpfs, tmp_path):
    # 1200 MB: above doctor's 1 GiB floor (a tmpfs allocates nothing until written)
    tmpfs_dir = tmpfs(lab.hosts["h2"].root / f"big-{tmp_path.name}", "1200m", "755")
    write_manifest(source, tiny_fp32=needs(disk=2 * GB))
    inv = make_inventory({"small": host_entry(lab, "h2", remote_dir=str(tmpfs_dir / "engine"))}, bundle_tiers=TIERS)
    proc = invoke(lab, "validate", inv, "--host", "small", "--steps", "preflight,sync")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    step = latest_run(inv)["hosts"]["small"]["steps"]
    assert step["sync"]["status"] == "skipped"                  # no byte of the tree written
    message = step["preflight"]["message"]         # the filesystem at the tmpfs or remote_dir (the lock may make it)
    assert message.startswith(f"disk: the bundles of tier default (1 bundles) need 2.00 GB of disk under "
                              f"{tmpfs_dir}/engine, but the filesystem at {tmpfs_dir}"), message
    assert message.endswith(" has 1.26 GB free plus 0.0 MB of those bundles already there (1.26 GB): free 0.74 GB "
                            "more, or choose fewer tiers (hosts.yaml `bundles:`, --bundles)"), message


def test_preflight_measures_the_room_in_the_doctors_probe(lab, make_inventory, source, fake_tool, tmp_path):
    """The room for the bundles comes with the doctor's probe, one command: a preflight runs `df`
    once (the probe's), and still finds the bundle already there (its bytes count as room)."""
    calls = tmp_path / "df-calls"
    fake_tool("df", f"echo x >> {calls}\nexec {shutil.which('df')} \"$@\"")
    write_manifest(source, tiny_fp32=needs(disk=1 << 50))
    remote_dir = tmp_path / "host"
    bundle = remote_dir / "tests/refs/model_tiny_fp32.kdtr"
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(os.urandom(3_000_000))      # 3.0 MB there: counted, and still far too little
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(remote_dir)}}, bundle_tiers=TIERS)
    proc = invoke(lab, "validate", inv, "--host", "local", "--steps", "preflight")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert calls.read_text() == "x\n"
    message = latest_run(inv)["hosts"]["local"]["steps"]["preflight"]["message"]
    assert message.startswith("disk: the bundles of tier default (1 bundles) need 1125899.91 GB of disk"), message
    assert " plus 3.0 MB of those bundles already there " in message, message


def test_preflight_refuses_a_host_whose_ram_cannot_hold_the_bundles_and_records_the_plan(lab, make_inventory, source):
    write_manifest(source, tiny_fp32=needs(ram=1 << 50))
    inv = make_inventory({"h1": host_entry(lab, "h1")}, bundle_tiers=TIERS)
    proc = invoke(lab, "validate", inv, "--host", "h1", "--steps", "preflight")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    host = latest_run(inv)["hosts"]["h1"]
    assert "RAM: the bundles of tier default (1 bundles) need 1125899.91 GB of RAM per engine process, x 1 engine " \
           "at once (one per GPU) = 1125899.91 GB, but the host has" in host["steps"]["preflight"]["message"]
    assert "available (MemAvailable)" in host["steps"]["preflight"]["message"]
    assert host["bundles"]["tiers"] == ["default"] and host["bundles"]["max_memory"] == 1 << 50
    assert host["bundles"]["timeouts"]["golden"] == 600 + 1       # 10 MB: one second more


def test_gpu_selection_on_a_shared_host_takes_the_gpus_with_room(gpu_lab, lab, make_inventory, source):
    host, fake = gpu_lab
    write_manifest(source, tiny_fp32=needs(gpu=20 * GB))            # 19074 MiB
    fake.set(3, used={0: 143000}, busy={1: [(4242, "python3", 60000)]})
    try:
        inv = make_inventory({"g1": lab.inventory_entry(host, gpu_policy="any", gpu_count=2)}, bundle_tiers=TIERS)
        passed = invoke(lab, "validate", inv, "--host", "g1", "--steps", "preflight")
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert latest_run(inv)["hosts"]["g1"]["selected_gpus"] == [1, 2]
        refused = invoke(lab, "validate", inv, "--host", "g1", "--steps", "preflight", "--gpus", "3")
    finally:
        fake.set(1)         # the session fixture's state, for the other modules' tests
    assert refused.returncode == 1
    message = latest_run(inv)["hosts"]["g1"]["steps"]["preflight"]["message"]
    assert "not enough GPUs: needs 3 GPUs (gpu_policy any) with 19074 MiB free for the bundles, 2 usable" in message
    assert "GPU 0 (NVIDIA H200): 771 MiB free of 143771 MiB, the bundles need 19074 MiB" in message


# ---- the engine's --max-memory and the selected configs ------------------------------------------

def test_max_memory_and_the_configs_reach_the_engine_command(lab, make_inventory, source):
    write_manifest(source, tiny_fp32=needs(ram=123456789), tiny_int4=needs(ram=5), big_int4=needs(ram=77))
    shown = 'echo "memory=$KD_MAX_MEMORY configs=${KD_CONFIGS-unset}"; exit 5'
    commands = {**yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"], "test": shown}
    inv = make_inventory({"h1": host_entry(lab, "h1")}, bundle_tiers=TIERS, commands=commands)
    for flags, line in (((), "memory=123456789 configs=unset"), (("--bundles", "default,big"), "memory=123456789 configs=tiny big")):
        proc = invoke(lab, "validate", inv, "--host", "h1", "--steps", "sync,test", "--no-cache", *flags)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"[h1] test      | {line}\n" in proc.stdout


def test_the_engine_scripts_pass_max_memory_and_the_configs_on(tmp_path):
    """generate.sh gives the engine --max-memory from KD_MAX_MEMORY; bundles.sh gives the generator
    --configs from KD_CONFIGS (stand-ins for build/kdtree and python record what they were given)."""
    engine = tmp_path / "engine"
    (engine / "scripts").mkdir(parents=True)
    for name in ("generate.sh", "bundles.sh"):
        shutil.copy(REPO / "engine_src/scripts" / name, engine / "scripts" / name)
    (engine / "build").mkdir()
    (engine / "tests/refs").mkdir(parents=True)
    (engine / "tests/refs/manifest.json").write_text("{}")
    said = tmp_path / "argv"
    for stand_in in (engine / "build/kdtree", tmp_path / "python"):
        stand_in.write_text(f'#!/bin/sh\nprintf "%s|" "$(basename "$0")" "$@" >> {said}\necho >> {said}\n')
        stand_in.chmod(0o755)
    env = {**os.environ, "KD_NO_BUILD": "1", "KD_MAX_MEMORY": "987654321", "KD_CONFIGS": "tiny k2wide",
           "PYTHON": str(tmp_path / "python")}
    for script in ("generate.sh", "bundles.sh"):
        subprocess.run(["bash", f"scripts/{script}"], cwd=engine, env=env, check=True, timeout=30)
    generate, bundles = said.read_text().splitlines()
    assert "|--max-memory|987654321|" in generate
    assert bundles.endswith("|--configs|tiny|k2wide|")


# ---- check-bundle and clean-bundles ---------------------------------------------------------------

def deployed(lab, make_inventory, source, remote_dir: str, **extra):
    """h1 with the source deployed at remote_dir, and its inventory."""
    inv = make_inventory({"h1": host_entry(lab, "h1", remote_dir=remote_dir, **extra)}, bundle_tiers=TIERS)
    proc = invoke(lab, "deploy", inv, "--host", "h1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return inv


def test_check_bundle_runs_the_deployed_engine_on_the_path_and_reports_what_it_says(lab, make_inventory, source,
                                                                                    remote_dir, tmp_path):
    write_manifest(source, tiny_fp32=needs())
    inv = deployed(lab, make_inventory, source, remote_dir)
    missing = invoke(lab, "check-bundle", inv, "--host", "h1", "/data/w.kdtr")
    assert missing.returncode == 1 and "build/kdtree is not built here" in missing.stdout
    engine = Path(remote_dir) / "build/kdtree"          # a stand-in for the engine the build step leaves
    engine.parent.mkdir()
    said = tmp_path / "said"
    engine.write_text(f'#!/bin/sh\nprintf "%s|" "$PWD" "$@" > {said}\n'
                      'case "$3" in *bad*) echo "MISMATCH at token 3: expected 7, got 9 \x1b[31m"; exit 1;; esac\n'
                      'echo "OK: AR equals the golden tokens (64)"\n')
    engine.chmod(0o755)
    ok = invoke(lab, "check-bundle", inv, "--host", "h1", "my weights/k2.kdtr", "--max-memory", "2000000000")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert said.read_text() == f"{remote_dir}|check|--bundle|my weights/k2.kdtr|--expect|golden|--max-memory|2000000000|"
    assert latest_run(inv)["hosts"]["h1"]["steps"]["check_bundle"]["message"] == \
        "my weights/k2.kdtr: OK: AR equals the golden tokens (64)"
    bad = invoke(lab, "check-bundle", inv, "--host", "h1", "/data/bad.kdtr")
    assert bad.returncode == 1
    message = latest_run(inv)["hosts"]["h1"]["steps"]["check_bundle"]["message"]
    assert message == "the bundle check of /data/bad.kdtr exited with 1: MISMATCH at token 3: expected 7, got 9 \\x1b[31m"
    unsafe = invoke(lab, "check-bundle", inv, "--host", "h1", "x;rm -rf ~")
    assert unsafe.returncode == 2 and "is not a safe path" in unsafe.stderr


def test_clean_bundles_lists_and_removes_only_the_stale_bundles_of_the_bundle_folder(lab, make_inventory, source,
                                                                                     remote_dir, tmp_path):
    write_manifest(source, tiny_fp32=needs(), big_int4=needs())
    inv = deployed(lab, make_inventory, source, remote_dir)
    refs = Path(remote_dir) / "tests/refs"
    outside = tmp_path / "outside.kdtr"
    files = {refs / "model_tiny_fp32.kdtr": 3000, refs / "model_big_int4.kdtr": 5000, refs / "old/model_x.kdtr": 7000,
             Path(remote_dir) / "model_elsewhere.kdtr": 11, outside: 13}
    for path, size in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * size)
    (refs / "link.kdtr").symlink_to(outside)
    dry = invoke(lab, "clean-bundles", inv, "--host", "h1")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "[h1] clean_bundles | stale      0.0 MB  tests/refs/model_big_int4.kdtr" in dry.stdout
    assert "2 stale bundles (0.0 MB) of 3 in tests/refs would be removed (a dry run: --remove removes them)" in dry.stdout
    assert all(p.exists() for p in files)
    kept = invoke(lab, "clean-bundles", inv, "--host", "h1", "--remove", "--bundles", "default,big")
    assert kept.returncode == 0 and "1 stale bundles" in kept.stdout and (refs / "model_big_int4.kdtr").exists()
    removed = invoke(lab, "clean-bundles", inv, "--host", "h1", "--remove")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert "removed 1 stale bundles (0.0 MB) of 2 in tests/refs; kept the 1 of tiers default" in removed.stdout
    assert sorted(p.name for p in files if p.exists()) == ["model_elsewhere.kdtr", "model_tiny_fp32.kdtr", "outside.kdtr"]
    assert (refs / "link.kdtr").is_symlink()
