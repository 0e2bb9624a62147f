"""Shared fixtures: one loopback sshd lab per session (hosts h1, h2, bastion), a small engine-like
source tree, an inventory factory (the engine builds and reference bundles shared by the session are
tests/early_builds.py's). The lab's machinery lives in tests/sshd.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator import inventory as inventory_mod

from early_builds import cpu_build, cuda_builds, early_builds, reference_bundles, run_late, sanitized_run  # noqa: F401 (fixtures)
from fake_gpus import FakeGpus
from sshd import Hostile, SshLab

# A test session started in the background of a non-interactive shell (nohup, `cmd &`) inherits
# SIGINT ignored, and an ignored signal stays ignored across exec: every orchestrator the tests start
# would then ignore the Ctrl-C the interrupt tests send. A handled signal is reset to the default
# on exec, so handling it here gives each child the default, as a terminal's Ctrl-C would find it.
signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parent.parent

# The engine's own definition of the tree hash (engine_src/README.md, "Source tree hash").
TREE_HASH_SH = (REPO / "engine_src" / "scripts" / "tree_hash.sh").read_text()


def pytest_collection_modifyitems(items):
    """The whole-pipeline modules, then those whose work starts in the background, run last
    (tests/early_builds.py)."""
    run_late(items)


@pytest.fixture
def fake_tool(tmp_path, monkeypatch):
    """put(name, script) -> its path: a shell script of that name first on PATH for the rest of the
    test, and so for the commands it runs on local hosts (a tool that hangs or dies on the host)."""
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")

    def put(name: str, script: str) -> Path:
        (folder / name).write_text(f"#!/bin/sh\n{script}\n")
        (folder / name).chmod(0o755)
        return folder / name
    return put


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """Loopback sshd hosts h1 and h2, and a bastion whose log shows forwarded connections."""
    lab = SshLab(tmp_path_factory.mktemp("sshlab"))
    lab.add_host("h1")
    lab.add_host("h2")
    lab.add_host("bastion", log_level="DEBUG1")
    with lab.environment():
        yield lab
    lab.close()


@pytest.fixture(scope="session")
def gpu_lab(lab, tmp_path_factory):
    """A loopback sshd host `g1` whose sessions find a fake nvidia-smi first on their PATH, and
    that fake (FakeGpus: the test sets its GPUs and their load)."""
    fake = FakeGpus(tmp_path_factory.mktemp("fake-gpus") / "bin")
    fake.set(1)
    host = lab.add_host("g1", setenv={"PATH": f"{fake.bin}:/usr/local/bin:/usr/bin:/bin"})
    return host, fake


@pytest.fixture
def source(tmp_path) -> Path:
    """A small source tree: sources, a script, and files the excludes must keep off hosts."""
    src = tmp_path / "src"
    files = {
        "scripts/tree_hash.sh": TREE_HASH_SH,
        "src/main.cpp": "int main() { return 0; }\n",
        "python/kdtree_ref/model.py": "X = 1\n",
        "README.md": "engine\n",
        "tests/refs/expected_manifest.json": "{}\n",
        # excluded:
        "build/kdtree": "binary\n",
        "python/kdtree_ref/__pycache__/model.cpython-311.pyc": "pyc\n",
        "python/x.pyc": "pyc\n",
        "tests/refs/model_tiny_fp32.kdtr": "bundle\n",
        "tests/refs/manifest.json": "{}\n",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    return src


@pytest.fixture
def make_inventory(tmp_path, source):
    """make_inventory({name: entry, ...}) -> Inventory written to tmp_path/hosts.yaml, with the
    project section of the shipped hosts.yaml pointed at the `source` tree."""
    def make(hosts: dict, **project) -> inventory_mod.Inventory:
        data = yaml.safe_load((REPO / "hosts.yaml").read_text())
        data["project"].update({"source": str(source), **project})
        data["hosts"] = hosts
        data.pop("groups", None)
        path = tmp_path / "hosts.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return inventory_mod.load(path)
    return make


@pytest.fixture
def remote_dir(lab, request) -> str:
    """A fresh remote_dir on h1 named after the test (hosts are shared by the session)."""
    path = lab.hosts["h1"].root / request.node.name.replace("[", "_").replace("]", "")
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


@pytest.fixture
def tmpfs():
    """tmpfs(path, size, mode) -> path: a tmpfs of `size` (e.g. "512k": a disk that fills up) mounted
    at `path` (made when missing), unmounted when the test ends; the test is skipped where mount is
    refused (it needs root)."""
    mounted = []

    def mount(path: Path, size: str, mode: str = "700") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root and mount permission): {proc.stderr.strip()}")
        mounted.append(path)
        return path
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)])


@pytest.fixture
def hostile(make_inventory, tmp_path, monkeypatch):
    """hostile(how, **entry) -> (host, listener): an inventory host at a Hostile listener, as user
    kd-deployer, connect timeout 1 s, its own empty known_hosts and ssh config."""
    listeners = []
    (tmp_path / "known_hosts").touch()
    (tmp_path / "ssh_config").touch()
    monkeypatch.setenv("KDTREE_SSH_CONFIG", str(tmp_path / "ssh_config"))

    def make(how, **entry):
        listeners.append(Hostile(how))
        inv = make_inventory({"x": {"address": "127.0.0.1", "port": listeners[-1].port, "user": "kd-deployer",
                                    "remote_dir": str(tmp_path / "d"), "known_hosts": str(tmp_path / "known_hosts"),
                                    "timeouts": {"connect": 1}, "persist": False, **entry}})
        return inv.hosts["x"], listeners[-1]
    yield make
    for listener in listeners:
        listener.close()
