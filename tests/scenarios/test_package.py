"""The package without the checkout: its wheel, installed (not editable) into a new virtual
environment, runs `kdtree-orch` from another directory with nothing of the checkout on its path."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE")      # and orchestrator/


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment with the wheel built from this checkout installed in it. Its
    dependencies come from the running environment (a .pth file naming its site-packages), so the
    test downloads nothing but the build backend."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"           # the package's files only: the build writes build/ and *.egg-info there
    shutil.copytree(REPO / "orchestrator", src / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
    for name in PACKAGE_FILES:
        shutil.copy2(REPO / name, src / name)
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    wheel, = wheels.glob("kdtree_orchestrator-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    purelib = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_kdtree_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    return venv


def kdtree_orch(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(venv / "bin" / "kdtree-orch"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_installed_wheel_runs_hosts_from_another_directory(installed, tmp_path):
    """`kdtree-orch --inventory PATH hosts` from a directory that is neither the checkout nor the
    inventory's folder: the inventory's relative paths resolve against its own folder."""
    site = tmp_path / "site"
    (site / "engine_src").mkdir(parents=True)
    data = yaml.safe_load((REPO / "hosts.yaml").read_text())
    data["hosts"] = {"local": {"transport": "local", "remote_dir": ".deploy/local"},
                     "gpu1": {"address": "gpu1", "remote_dir": "/srv/kdtree", "groups": ["blackwell"]}}
    (site / "hosts.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, check=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    assert Path(where.strip()).is_relative_to(installed), where       # the wheel's copy, not the checkout's
    proc = kdtree_orch(installed, "--inventory", str(site / "hosts.yaml"), "hosts", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["host", "transport", "address", "remote_dir", "arch", "gpus", "groups"]
    assert lines[2].split()[:4] == ["local", "local", "-", str(site / ".deploy" / "local")]
    assert lines[3].split()[:4] == ["gpu1", "ssh", "gpu1", "/srv/kdtree"]
    assert "blackwell" in proc.stdout
    proc = kdtree_orch(installed, "hosts", cwd=elsewhere)      # no checkout: ./hosts.yaml, named when missing
    assert proc.returncode == 2 and "hosts.yaml" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = kdtree_orch(installed, "hosts", cwd=site)
    assert proc.returncode == 0 and "gpu1" in proc.stdout, proc.stderr


def test_the_installed_wheel_carries_the_host_scripts(installed, tmp_path):
    """orchestrator/host/*.sh are package data: the installed package holds each of them and sends
    the same lock script as the checkout."""
    from orchestrator import host
    code = ("from pathlib import Path; from orchestrator import host; "
            "print(sorted(p.name for p in Path(host.__file__).parent.glob('*.sh'))); print(len(host.script_text('lock')))")
    proc = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in Path(host.__file__).parent.glob("*.sh"))
    assert proc.stdout.splitlines() == [str(names), str(len(host.script_text("lock")))] and "lock.sh" in names


def test_the_program_offers_only_options_that_apply_and_its_version_is_the_package_metadata(installed, tmp_path):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = kdtree_orch(installed, "--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"kdtree-orch {version}")
    proc = kdtree_orch(installed, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: kdtree-orch [--core-opts]")
    for gone in ("--pty", "--prompt-for-sudo-password", "--echo", "--hide", "--warn-only", "--dry", "--config",
                 "--command-timeout", "--write-pyc", "--collection", "--search-root"):
        assert gone not in proc.stdout, gone
    for task in ("hosts", "doctor", "trust", "deploy", "validate", "nightly", "baseline", "report", "clean"):
        assert f"\n  {task} " in proc.stdout, task
    for argv in (["--pty", "hosts"], ["--prompt-for-sudo-password", "hosts"], ["--nope"], ["nosuch"],
                 ["hosts", "--nope"], ["deploy", "--group"]):
        proc = kdtree_orch(installed, *argv, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (argv, proc.stderr)
