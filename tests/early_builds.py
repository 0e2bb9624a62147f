"""The session's longest pieces of work, started in the background when the session begins: the
CUDA builds (tests/engine/test_engine_cuda_compile.py), the sanitized engine suite
(tests/engine/test_engine_sanitize.py), the CPU build that the whole-pipeline modules start from
(CPU_BUILD_MODULES: one compile instead of one per module) and the engine's reference bundles
(the reference_bundles fixture: half a minute of NumPy that the first test of the session used to
wait for). They are mostly compilers, NumPy and engine processes on their own, while most of the
other tests wait on ssh, rsync and sleeps: on CI's 2 cores, starting them at the beginning (at a
lower priority, so the timing bounds of the other tests keep their CPU) and running the first two
modules last (conftest.py) overlaps several minutes of work that used to run alone. Each starts
only when the session selected a test that uses it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from engine_copies import CpuBuild, ReferenceBundles, cuda_home, engine_copy

CUDA_ARCHES = ("sm_120", "sm_90")
CUDA_SANITIZED = "sm_120"   # the arch built with KD_SANITIZE=1 (tests/engine/test_engine_cuda_compile.py says why)
FUZZ_SECONDS = 60           # CI time is shared; the long runs are in docs/engine/scripts.md
NICE = ["nice", "-n", "10"]
# Seconds a background command may run: a hang guard only (it starts with the session, and at its lower
# priority it may wait behind the other tests; a test waiting for it has its own pytest timeout).
HANG_GUARD = 3600
# The modules whose session fixtures start early; conftest.py runs their tests last.
LATE_MODULES = ("test_engine_cuda_compile", "test_engine_sanitize")
# The modules that start from the session's CPU build (the cpu_build fixture).
CPU_BUILD_MODULES = ("test_engine_native", "test_validate", "test_gpu_validate", "test_slurm_validate")
# The order of the whole-pipeline modules, after every other module but the LATE_MODULES: the CPU
# build has had the session so far to finish in the background, and the nightly workflow's module
# starts from test_validate's deployment (their folders, engine/ and scenarios/, no longer place
# them late by name).
PIPELINE_ORDER = ("test_engine_native", "test_gpu_validate", "test_validate", "test_workflow_nightly")


class Background:
    """`work` run in a thread from now on; `result()` waits for what it returns (or raises what it
    raised). The processes it starts through `run` are killed when the session ends first."""

    def __init__(self, work: Callable[["Background"], object]):
        self._procs: list[subprocess.Popen] = []
        self._outcome: tuple[bool, object] | None = None
        self._waited_for = False        # once a test waits, what is left runs at the session's priority
        self._thread = threading.Thread(target=self._main, args=(work,), daemon=True)
        self._thread.start()

    def _main(self, work) -> None:
        try:
            self._outcome = (True, work(self))
        except BaseException as exc:  # handed to the test that waits for it
            self._outcome = (False, exc)

    def run(self, args: list[str], *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """`args` at the lower priority, its output captured, killed at `timeout` (as subprocess.run)."""
        proc = subprocess.Popen(([] if self._waited_for else NICE) + args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def result(self, hurry: bool = True) -> object:
        """What the work returned, once it has; `hurry` (a test waits for it): it runs at full
        priority from now on (another background work waiting for it leaves it at the lower one)."""
        if hurry:
            self._waited_for = True
            for proc in self._procs:
                _renice_tree(proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
        self._thread.join()
        assert self._outcome is not None
        ok, value = self._outcome
        if not ok:
            raise value  # type: ignore[misc]
        return value

    def stop(self) -> None:
        """Kill what is still running (the session ended before a test waited for it)."""
        for proc in self._procs:
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()


def _renice_tree(root: int, niceness: int) -> None:
    """Give `root` and every process under it `niceness` (its children that started their own
    process groups included, as `timeout` does). Lowering a niceness needs root (CI runs as root);
    for another user the work finishes at its lower priority, which only costs time."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:         # the process ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(parents.get(pid, []))
        try:
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
        except (PermissionError, ProcessLookupError):
            pass


def _cuda_builds(tmp_path_factory) -> Callable[[Background], dict]:
    cuda = cuda_home()
    # Folders are made here, in the session's thread: pytest's TempPathFactory is not thread-safe (the
    # first mktemp creates the session's base folder, and two threads doing it at once made two).
    folders = {arch: tmp_path_factory.mktemp(f"engine_{arch}") for arch in CUDA_ARCHES}

    def work(bg: Background) -> dict:
        results = {}
        for arch in CUDA_ARCHES:
            tree = engine_copy(folders[arch])
            env = dict(os.environ, KD_BACKEND="cuda", KD_ARCH=arch, KD_SANITIZE="1" if arch == CUDA_SANITIZED else "0",
                       CUDA_HOME=str(cuda), PATH=f"{cuda / 'bin'}:{os.environ.get('PATH', '')}")
            results[arch] = (bg.run(["bash", "scripts/build.sh"], cwd=tree, env=env, timeout=HANG_GUARD), tree)
        return results
    return work


def _reference_bundles(tmp_path_factory) -> Callable[[Background], ReferenceBundles]:
    folder = tmp_path_factory.mktemp("reference-bundles")    # in the session's thread, as _cuda_builds says
    return lambda bg: ReferenceBundles.generate(folder, bg.run)


def _sanitized_suite(tmp_path_factory, bundles: Background) -> Callable[[Background], tuple]:
    folder = tmp_path_factory.mktemp("engine_sanitize")    # in the session's thread, as _cuda_builds says

    def work(bg: Background) -> tuple:
        copy = engine_copy(folder)
        reference = bundles.result(hurry=False)
        assert isinstance(reference, ReferenceBundles)
        reference.copy_to(copy / "tests" / "refs")
        seed = str(int(time.time()))  # a new stretch of cases each run; the summary names the seed
        env = dict(os.environ, KD_BACKEND="cpu", KD_SANITIZE="1", KD_FUZZ_SECONDS=str(FUZZ_SECONDS),
                   KD_FUZZ_SEED=seed, PYTHON=sys.executable)
        for name in ("KD_ARCH", "ASAN_OPTIONS", "UBSAN_OPTIONS"):
            env.pop(name, None)
        return copy, bg.run(["bash", "scripts/run_tests.sh"], cwd=copy, env=env, timeout=HANG_GUARD), seed
    return work


def _cpu_build(tmp_path_factory) -> Callable[[Background], CpuBuild]:
    folder = tmp_path_factory.mktemp("engine_cpu")     # in the session's thread, as _cuda_builds says

    def work(bg: Background) -> CpuBuild:
        copy = engine_copy(folder)
        proc = bg.run(["bash", "scripts/build.sh"], cwd=copy, env=CpuBuild.env(), timeout=HANG_GUARD)
        assert proc.returncode == 0, f"build.sh in {copy}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return CpuBuild(copy)
    return work


@pytest.fixture(scope="session", autouse=True)
def early_builds(request, tmp_path_factory):
    """name -> Background: the LATE_MODULES this session selected, "cpu_build" when it selected
    one of CPU_BUILD_MODULES, and "reference_bundles" when a selected test or the sanitized suite
    uses them."""
    items = request.session.items
    selected = {item.module.__name__ for item in items if item.module is not None}
    started = {}
    if any("reference_bundles" in item.fixturenames for item in items) or "test_engine_sanitize" in selected:
        started["reference_bundles"] = Background(_reference_bundles(tmp_path_factory))
    if selected & set(CPU_BUILD_MODULES) and shutil.which("g++") is not None:
        started["cpu_build"] = Background(_cpu_build(tmp_path_factory))
    if "test_engine_cuda_compile" in selected and cuda_home() is not None:
        started["test_engine_cuda_compile"] = Background(_cuda_builds(tmp_path_factory))
    if "test_engine_sanitize" in selected and shutil.which("g++") is not None:
        started["test_engine_sanitize"] = Background(_sanitized_suite(tmp_path_factory, started["reference_bundles"]))
    yield started
    for work in started.values():
        work.stop()


@pytest.fixture(scope="session")
def cuda_builds(early_builds) -> dict:
    """arch -> (completed build.sh process, engine copy), CUDA_SANITIZED built with KD_SANITIZE=1."""
    return early_builds["test_engine_cuda_compile"].result()


@pytest.fixture(scope="session")
def sanitized_run(early_builds) -> tuple:
    """(engine copy, completed run_tests.sh, fuzz seed) of the sanitized suite with a bounded fuzz run."""
    return early_builds["test_engine_sanitize"].result()


@pytest.fixture(scope="session")
def reference_bundles(early_builds) -> ReferenceBundles:
    """engine_src's bundles, generated once per session (scripts/bundles.sh with this interpreter),
    for the tests that would each regenerate them: the long-context bundles cost seconds of NumPy."""
    return early_builds["reference_bundles"].result()


@pytest.fixture(scope="session")
def cpu_build(early_builds) -> CpuBuild:
    """engine_src built once for the CPU backend, for the modules that would each compile it."""
    if "cpu_build" not in early_builds:
        pytest.skip("needs g++")
    return early_builds["cpu_build"].result()


def run_late(items: list) -> None:
    """Reorder `items` in place: the PIPELINE_ORDER modules' tests after every other, in that order,
    then the LATE_MODULES'; each module's tests in their order."""
    def rank(item) -> tuple[int, int]:
        name = getattr(item.module, "__name__", "")
        if name in LATE_MODULES:
            return 2, 0
        return (1, PIPELINE_ORDER.index(name)) if name in PIPELINE_ORDER else (0, 0)
    items.sort(key=rank)
