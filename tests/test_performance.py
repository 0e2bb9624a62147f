"""What keeps the orchestrator fast, as unit tests (the figures are benchmarks/bench_orchestrator.py's):
no delayed-ACK wait per round trip, lazy imports, the results cache of the golden, test and bench
steps, and the local tree hash kept by its files' stat."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator import doctor, state, sync
from orchestrator.runner import pipeline
from orchestrator.records import record, run_store
from orchestrator.connectors import base, factory, paramiko as connection
from orchestrator.errors import AuthError, CommandError, FetchError, UsageError
from orchestrator.runner.run import Run
from orchestrator.steps import bench as bench_step, build as build_step, bundles as bundles_step, \
    executables, host_reads, test as test_step
from orchestrator.errors import StepError
from orchestrator.steps.context import StepContext
from orchestrator.steps.session import HostSession
from orchestrator.sync import SourceId

import overlap

REPO = Path(__file__).resolve().parent.parent


def test_paramiko_sockets_get_tcp_nodelay():
    with socket.socket() as s:
        connection._no_delay(s)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    connection._no_delay(object())          # a jump host's channel or a ProxyCommand: left alone


def test_the_task_layer_imports_neither_paramiko_nor_jinja2():
    code = "import sys, tasks; print(sorted(m for m in ('paramiko', 'fabric', 'jinja2') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_pipeline_and_the_inventory_import_what_only_some_commands_use_when_they_use_it():
    """A warm deploy's client is mostly imports: the pipeline (with the hosts.yaml it loads, no
    `scheduler: slurm` entry) loads neither the doctor, the preflight step, the bundle plan and its
    capacity, the GPU claims, Slurm's modules nor bisect; validate and doctor import them where used."""
    lazy = ("orchestrator.doctor", "orchestrator.steps.preflight", "orchestrator.resources.bundle_plan",
            "orchestrator.resources.capacity", "orchestrator.resources.gpu_claims", "orchestrator.slurm.entry",
            "orchestrator.slurm.commands", "orchestrator.slurm.facts", "orchestrator.slurm.run",
            "orchestrator.records.bisect")
    code = ("import sys; from orchestrator import inventory, cli; from orchestrator.runner import pipeline; "
            "from orchestrator.records import history; inventory.load('hosts.yaml'); "
            f"print(sorted(m for m in {lazy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


TESTS = {"version": 1, "backend": "cpu", "passed": 2, "failed": 0, "skipped": 0,
         "tests": [{"name": "a", "status": "passed", "seconds": 0.1, "message": ""},
                   {"name": "b", "status": "passed", "seconds": 0.1, "message": ""}]}


TREE, OTHER_TREE = "a" * 64, "b" * 64


@pytest.fixture
def context(make_inventory, tmp_path):
    """A step context on a local host whose deployment (of tree TREE) already holds executables
    stamped with their tree, a script, a bundle, a compiled source, and test and bench results."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host")}})
    host = inv.hosts["local"]
    root = Path(host.remote_dir)
    for name, text in {"scripts/run_tests.sh": "echo tests\n", "tests/refs/model_tiny.kdtr": "weights",
                       "src/tree.cpp": "int x = 1;\n", "build/test_results.json": json.dumps(TESTS),
                       "build/bench.json": json.dumps({"version": 1, "metrics": {}})}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    deploy(root, TREE)

    def make(command="validate", use_cache=True, build_key=None, owner=None, step="test", project=None, changed=None):
        """`project`, `changed`: the project, the host made other by them (functions of one)."""
        run_dir = run_store.create_run_dir(tmp_path / "runs")
        on = changed(host) if changed else host
        ctx = StepContext(on, HostSession(on, factory.open_transport(on)), project(inv.project) if project else inv.project,
                          run_dir, SourceId(TREE, None, False), state.Owner.now(owner or command), None,
                          record.HostRecord(build_key=build_key or {"cxx": "g++"}),
                          pipeline.Plan.of(command, use_cache=use_cache), step=step, log=lines.append)
        return ctx
    lines: list[str] = []
    make.root, make.lines = root, lines
    return make


def commands(**named: str):
    """A project with these commands (name -> its snippet) over its own."""
    return lambda project: dataclasses.replace(project, commands={**project.commands, **named})


def measured(ctx: StepContext):
    """The inputs of the context's deployed tree, measured on its host (or read ahead)."""
    return ctx.reads.inputs(ctx.tree_hash)


def deploy(root: Path, tree: str, code: bytes = b"\x7fELF code") -> None:
    """The deploy record of `tree` and executables built from it (their tree stamp in them)."""
    (root / ".kdtree").mkdir(exist_ok=True)
    (root / ".kdtree" / "deploy.json").write_text(json.dumps({"tree_hash": tree}))
    for name in ("kdtree", "test_ops"):
        (root / "build" / name).write_bytes(code + b"\0tree=" + tree.encode() + b"\0rest")
        (root / "build" / name).chmod(0o755)


def built(root: Path, tree: str) -> None:
    """The build stamp of a build of `tree`."""
    (root / ".kdtree" / "build.json").write_text(json.dumps({"key": {"tree": tree, "build": {"cxx": "g++"}},
                                                              "run_id": "r0"}))


def test_results_key_is_the_content_of_what_the_results_depend_on(context):
    key = context().results_key()
    assert set(key["executables"]) == {"build/kdtree", "build/test_ops"}
    assert set(key["files"]) == {"scripts/run_tests.sh", "tests/refs/model_tiny.kdtr"}   # src/: compiled
    assert key["build"] == {"cxx": "g++"} and key["command"] == "bash scripts/run_tests.sh"
    assert key["env"]["KD_BACKEND"] and "PYTHON" in key["env"]
    assert context(use_cache=False).results_key() is None
    assert context(command="nightly").results_key() is None


def _host_cache(root: Path) -> dict:
    return json.loads((root / ".kdtree" / "inputs-cache.json").read_text())


def test_the_host_reuses_the_hashes_of_unchanged_files_and_sees_a_rewrite_that_keeps_the_mtime(context):
    """The host keeps each file's hash with its stat (steps/hash_inputs.py): a file is hashed again
    when its ctime moves, which a rewrite cannot avoid even when it puts the mtime back; files
    changed within the racy window are not kept at all."""
    root = context.root
    measured(context())
    assert not (root / ".kdtree" / "inputs-cache.json").exists()     # every file is younger than the racy window
    time.sleep(2.2)
    first = measured(context())
    cache = _host_cache(root)
    assert set(cache["f"]) == {"scripts/run_tests.sh", "tests/refs/model_tiny.kdtr", "src/tree.cpp"}
    assert set(cache["x"]) == {"build/kdtree", "build/test_ops"} and cache["mask"] == TREE
    cache["f"]["scripts/run_tests.sh"][1] = "e" * 64     # what the host kept is what it reports
    (root / ".kdtree" / "inputs-cache.json").write_text(json.dumps(cache))
    assert measured(context()).files["scripts/run_tests.sh"] == "e" * 64
    bundle = root / "tests/refs/model_tiny.kdtr"
    before = bundle.stat()
    bundle.write_text("WEIGHTS")                         # same size, and the old mtime put back
    os.utime(bundle, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = measured(context())
    assert again.files["tests/refs/model_tiny.kdtr"] == hashlib.sha256(b"WEIGHTS").hexdigest() \
        != first.files["tests/refs/model_tiny.kdtr"]
    assert again.executables == first.executables


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"mask": "", "f": {"src/x": 1}, "x": []}',
                                    '{"mask": "' + TREE + '", "f": {"tests/refs/model_tiny.kdtr": [[1], "f00"]}, "x": {}}'])
def test_a_damaged_hash_cache_on_the_host_is_ignored(context, damage):
    fresh = measured(context())
    (context.root / ".kdtree" / "inputs-cache.json").write_text(damage)
    assert measured(context()) == fresh


def test_file_names_with_a_newline_or_a_backslash_are_hashed_too(context):
    """Such a name is written escaped, so the file is part of the key (a change to it shows)."""
    odd = context.root / "scripts" / "a\nb\\c"
    odd.write_text("one")
    name = "scripts/a\\nb\\\\c"
    assert measured(context()).files[name] == hashlib.sha256(b"one").hexdigest()
    odd.write_text("two")
    assert measured(context()).files[name] == hashlib.sha256(b"two").hexdigest()


def test_retargeting_a_symlink_changes_what_the_results_depend_on(context, tmp_path):
    """A symlink is an input by its target (never followed): pointing it elsewhere changes the
    results key, as the source tree hash (scripts/tree_hash.sh) changes with it."""
    link = context.root / "scripts" / "config"
    link.symlink_to("a.json")
    before = measured(context()).files["scripts/config"]
    tree_before = _engine_tree_hash(context.root)
    link.unlink()
    link.symlink_to("b.json")
    assert measured(context()).files["scripts/config"] != before
    assert _engine_tree_hash(context.root) != tree_before
    (context.root / "scripts" / "dir").symlink_to("/")        # a link to a directory: listed, not followed
    assert "scripts/dir" in measured(context()).files


def _engine_tree_hash(tree: Path) -> str:
    script = Path(__file__).resolve().parent.parent / "engine_src" / "scripts" / "tree_hash.sh"
    return subprocess.run(["bash", str(script), str(tree)], capture_output=True, text=True, check=True).stdout.strip()


def test_read_ahead_runs_the_no_change_reads_at_once_and_each_step_takes_its_own(context):
    """The reads of a no-change build, bundles, golden and test start together (each a command of
    its own on the host, so they overlap), and each step takes its read from there: the same
    values as reading one after the other."""
    # each of the two reads waits (10 s at most) until the other one has started too: they say
    # "alone" unless they run side by side (no wall-clock bound: the machine may be loaded)
    marks = context.root.parent / "slow-marks"
    marks.mkdir()
    (context.root / "scripts" / "slow.sh").write_text(
        f"if {overlap.meet(marks, most=10)}; then echo '{{\"cxx\": \"g++\"}}'; else echo alone; fi\n")
    built(context.root, TREE)
    ctx = context(project=commands(build_key="bash scripts/slow.sh", bundles_key="bash scripts/slow.sh"))
    ctx.deployed_tree_hash = TREE
    expected = measured(context()), state.read_jsons(ctx.session.transport, state.STAMPS)
    ctx.reads.read_ahead(("build", "bundles", "golden", "test"), ctx.deployed_tree_hash)
    assert set(ctx.reads.ahead) == {("engine", "build_key"), ("engine", "bundles_key"), "stamps", "inputs", "built",
                              *(("file", ctx.project.results[r]) for r in ("outputs", "manifest", "tests"))}
    assert ctx.reads.ahead["built"].result() is host_reads.NOT_READ      # no build of it recorded here
    assert ctx.reads.output("build_key").strip() == ctx.reads.output("bundles_key").strip() == '{"cxx": "g++"}'
    assert ctx.reads.ahead["inputs"].result() is not host_reads.NOT_READ       # the build stamp names TREE
    assert (measured(ctx), ctx.stamps.get("deploy.json")) == (expected[0], expected[1]["deploy.json"])
    assert ctx.pull_json("tests") == TESTS


def test_the_build_and_bundles_keys_read_in_one_command_each_give_what_their_own_command_gives(context):
    """build_key and bundles_key run side by side in one host command: each step takes its own
    output (stderr with it, as before), or the error its command alone gives (the name, the
    exit status, the output), the other's output untouched; an answer that breaks the framing
    (the shell that frames a command's output killed) fails both, naming the command."""
    root = context.root
    (root / "scripts" / "key.sh").write_text("echo 'warning: old gcc' >&2; echo '{\"cxx\": \"g++\"}'\n")
    (root / "scripts" / "bad.sh").write_text("echo 'no python' >&2; exit 3\n")
    ctx = context(project=commands(build_key="bash scripts/key.sh", bundles_key="bash scripts/bad.sh"))
    ctx.reads.read_ahead(("build", "bundles"), ctx.deployed_tree_hash)
    assert ctx.reads.output("build_key") == ctx.shell.output("build_key", {}, "build") == \
        'warning: old gcc\n{"cxx": "g++"}\n'
    with pytest.raises(CommandError) as failed:
        ctx.reads.output("bundles_key")
    with pytest.raises(CommandError) as alone:
        ctx.shell.output("bundles_key", {}, "bundles")
    assert (failed.value.message, failed.value.exit_status, failed.value.tail) == \
        (alone.value.message, alone.value.exit_status, alone.value.tail) == ("bundles_key failed", 3, "no python\n")
    (root / "scripts" / "bad.sh").write_text("kill -9 $PPID\n")     # the shell that frames its output
    ctx.reads.read_ahead(("build", "bundles"), ctx.deployed_tree_hash)
    for name in ("build_key", "bundles_key"):
        with pytest.raises(CommandError, match="build_key and bundles_key: an answer that does not frame as asked"):
            ctx.reads.output(name)


def test_the_input_hashes_and_result_files_wait_for_a_build_of_the_deployed_tree(context):
    """A run that will rebuild (the build stamp names another tree) does not hash the inputs or
    pull result files ahead, only to throw them away: the steps read them when they need them."""
    built(context.root, OTHER_TREE)
    ctx = context()
    ctx.deployed_tree_hash = TREE
    ctx.reads.read_ahead(("golden", "test"), ctx.deployed_tree_hash)
    skipped = {"inputs", *(("file", ctx.project.results[r]) for r in ("outputs", "manifest", "tests"))}
    assert {key for key, future in ctx.reads.ahead.items() if future.result() is host_reads.NOT_READ} == skipped
    assert ctx.pull_json("tests") == TESTS and measured(ctx) == measured(context())


def test_the_doctor_probe_runs_as_the_host_connects_beside_this_machines_work(make_inventory, tmp_path):
    """Run.prepare starts the probe (read-only) as soon as the host is open, so preflight waits
    for what is left of it, not all of it; an error it met is the finding it always was."""
    started = tmp_path / "probe-started"
    slow_python = tmp_path / "python"
    slow_python.write_text(f"#!/bin/sh\ntouch {started}\nsleep 1\nexec {sys.executable} \"$@\"\n")
    slow_python.chmod(0o755)
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    "python": str(slow_python)}})
    host = inv.hosts["local"]
    with Run("validate") as run:
        run.prepare([host], doctor.probe)
        # this machine's own work (the source hash) goes on while the probe runs: the probe has
        # started before preflight asks for it (no wall-clock bound: the machine may be loaded)
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "Run.prepare did not start the probe"
        findings, _ = doctor.examine(run.transport(host), run.first_result(host))
        assert {f.check: f.status for f in findings}["python"] == "ok" and run.first_result(host) is None

    def refused(transport):
        raise AuthError("permission denied (publickey)", host="local")
    with Run("validate") as run:
        run.prepare([host], refused)
        findings, facts = doctor.examine(run.transport(host), run.first_result(host))
    assert [(f.check, f.status) for f in findings][-1] == ("auth", "fail") and facts == {}


def test_a_validate_preflight_reads_numpys_version_from_its_metadata_and_doctor_imports_it(make_inventory, tmp_path):
    """The import costs most of the probe: a validate's preflight reads the installed version
    (the steps that use numpy import it), while `invoke doctor` imports it, so a numpy that is
    installed but cannot be imported is a failed check there."""
    site = tmp_path / "site"
    (site / "numpy").mkdir(parents=True)
    (site / "numpy" / "__init__.py").write_text("raise ImportError('numpy is broken')\n")
    (site / "numpy-9.9.dist-info").mkdir()
    (site / "numpy-9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 9.9\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"), "python": str(python)}})
    with factory.open_transport(inv.hosts["local"]) as t:
        checks = {deep: {f.check: f for f in doctor.examine(t, import_numpy=deep)[0]} for deep in (False, True)}
    assert (checks[False]["python"].status, checks[False]["python"].detail.endswith("numpy 9.9")) == ("ok", True)
    assert checks[True]["python"].status == "fail" and "has no numpy" in checks[True]["python"].detail


def test_an_engine_command_drops_what_was_read_ahead(context):
    """An engine command may change what was read ahead (a rebuild, regenerated results): what
    comes after it is read again."""
    built(context.root, TREE)
    changed = dict(TESTS, passed=1)
    ctx = context(project=commands(test=f"echo '{json.dumps(changed)}' > build/test_results.json"))
    ctx.deployed_tree_hash = TREE
    ctx.reads.read_ahead(("test",), ctx.deployed_tree_hash)
    assert ctx.reads.ahead[("file", ctx.project.results["tests"])].result() is not host_reads.NOT_READ
    assert ctx.pull_json("tests") == TESTS
    ctx.shell.run("test")
    assert ctx.pull_json("tests") == changed
    assert measured(ctx) == measured(context())


def test_nothing_is_read_ahead_for_results_that_cannot_be_reused(context):
    for ctx in (context(use_cache=False), context(command="nightly")):
        ctx.deployed_tree_hash = TREE
        ctx.reads.read_ahead(("golden", "test"), ctx.deployed_tree_hash)
        assert set(ctx.reads.ahead) == {"stamps"}


def test_a_nightly_or_a_bisect_measures_with_the_history_bench_command_and_keys_its_results_by_it(context):
    """The shipped project names `bench_nightly`: a nightly's and a bisect's bench run it, and a
    bisect's results key holds it, so a validate's cached bench (measured otherwise) is never a
    bisect probe's figure; validate, the other steps and a project without it keep their own."""
    commands = {}
    for command in ("validate", "nightly", "bisect"):
        ctx = context(command=command)
        ctx.begin("bench", ctx.log)
        commands[command] = ctx.step_command()
        if command != "nightly":
            assert ctx.results_key()["command"] == ctx.project.commands[commands[command]]
    assert commands == {"validate": "bench", "nightly": "bench_nightly", "bisect": "bench_nightly"}
    assert "--min-time-ms" in context().project.commands["bench_nightly"]
    ctx = context(command="nightly")
    assert ctx.step_command() == "test"
    ctx.begin("golden", ctx.log)
    assert ctx.step_command() == "generate"
    ctx = context(command="nightly", step="bench", project=lambda project: dataclasses.replace(project, commands={
        k: v for k, v in project.commands.items() if k != "bench_nightly"}))
    assert ctx.step_command() == "bench"


def test_the_settings_come_from_the_plan_not_from_the_lock_owner_record(context):
    """Whether results may be reused and which command measures follow the run's Plan; the lock
    owner record (what the host shows other runs of the one holding its tree) decides nothing."""
    nightly, validate = (context(command="nightly", owner="validate", step="bench"),
                         context(command="validate", owner="nightly", step="bench"))
    assert nightly.results_key() is None and nightly.step_command() == "bench_nightly"
    assert validate.results_key() is not None and validate.step_command() == "bench"
    nightly.deployed_tree_hash = TREE
    nightly.reads.read_ahead(("test", "bench"), nightly.deployed_tree_hash)
    assert set(nightly.reads.ahead) == {"stamps"}          # nothing read ahead for a reuse that cannot come


def test_a_stamped_result_is_reused_until_inputs_or_the_file_change(context):
    ctx = context()
    assert ctx.cached_result("tests") is None                     # no stamp yet: the step runs
    ctx.stamp_result(TESTS)
    stamp = json.loads((context.root / ".kdtree" / "test.json").read_text())
    assert stamp["key"] == ctx.results_key() and len(stamp["digest"]) == 64 and stamp["tree"] == TREE
    assert stamp["run_id"] == ctx.run_dir.run_id
    reused = context().cached_result("tests")
    assert (reused.data, reused.run_id) == (TESTS, ctx.run_dir.run_id)      # and the run it came from
    assert context(build_key={"cxx": "another compiler"}).cached_result("tests") is None
    changed = dict(TESTS, passed=1)
    (context.root / "build" / "test_results.json").write_text(json.dumps(changed))
    assert context().cached_result("tests") is None               # not the file the stamp recorded
    assert "is not the file it left" in context.lines[-1]


def test_an_edit_that_leaves_the_executables_identical_reuses_results(context):
    """Another tree (a comment edited in a compiled source): the executables differ only in their
    tree stamp, so the results of the earlier tree are reused, and the reason names both trees."""
    context().stamp_result(TESTS)
    (context.root / "src" / "tree.cpp").write_text("int x = 1;  // a comment\n")
    deploy(context.root, OTHER_TREE)
    reused = context().cached_result("tests")
    assert reused is not None and f"it ran on tree {TREE[:12]}, not this {OTHER_TREE[:12]}" in reused.why


def test_an_edit_to_the_documentation_reuses_results_and_the_same_file_elsewhere_does_not(context):
    """A file under project.documentation (notes no command reads) is not an input: a new or
    edited one there leaves the results' key as it was; the same file outside it is an input."""
    ctx = context(project=lambda project: dataclasses.replace(project, documentation=("NOTES.md", "bench/experiments/")))
    key = ctx.results_key()
    (context.root / "NOTES.md").write_text("what was tried\n")
    (context.root / "bench" / "experiments").mkdir(parents=True)
    (context.root / "bench" / "experiments" / "try.patch").write_text("--- a\n")
    ctx.reads.measured = None
    assert ctx.results_key() == key
    ctx = context(project=lambda project: dataclasses.replace(project, documentation=("bench/experiments/",)))
    assert ctx.results_key()["files"] == {**key["files"], "NOTES.md": hashlib.sha256(b"what was tried\n").hexdigest()}


@pytest.mark.parametrize("change, named", [
    (lambda root: deploy(root, OTHER_TREE, b"\x7fELF other code"), "build/kdtree, build/test_ops changed"),
    (lambda root: (root / "build" / "kdtree").write_bytes(b"tampered"), "build/kdtree changed"),
    (lambda root: (root / "tests/refs/model_tiny.kdtr").write_text("tampered"), "tests/refs/model_tiny.kdtr changed"),
    (lambda root: (root / "scripts/run_tests.sh").write_text("echo other\n"), "scripts/run_tests.sh changed"),
    (lambda root: (root / "build" / "fuzz").write_bytes(b"new") and (root / "build" / "fuzz").chmod(0o755),
     "build/fuzz changed"),
])
def test_a_changed_executable_bundle_or_script_is_rerun(context, change, named):
    """A real code change (other executables), a binary or bundle changed on the host since, a
    changed script, a new executable: the step runs, and its log says what changed."""
    context().stamp_result(TESTS)
    change(context.root)
    assert context().cached_result("tests") is None
    assert context.lines[-1].endswith(named)


def test_cached_test_and_bench_steps(context):
    ctx = context()
    ctx.stamp_result(TESTS)
    test_ctx = context()
    outcome = test_step.run(test_ctx)
    assert outcome.status == "cached" and "2 passed" in outcome.message and outcome.reused_from == ctx.run_dir.run_id
    assert test_ctx.inputs_digest == ctx.inputs_digest and len(ctx.inputs_digest) == 64          # run.json's step `inputs`
    ctx.begin("bench", ctx.log)
    ctx.stamp_result({"version": 1, "metrics": {}})
    bench_ctx = context()
    bench_ctx.begin("bench", bench_ctx.log)
    outcome = bench_step.run(bench_ctx)
    assert outcome.status == "cached" and outcome.reused_from == ctx.run_dir.run_id
    assert "not a new measurement" in outcome.message


def test_bundles_changed_on_the_host_are_regenerated(context):
    """The bundles stamp alone is not trusted: a bundle changed on the host since the last
    regeneration (or gone) is regenerated, its stamp keeping the outputs' hashes."""
    root = context.root
    (root / "scripts" / "tree_hash.sh").write_text("echo " + "c" * 64 + "\n")     # the generator's input hash
    (root / "scripts" / "bundles.sh").write_text("mkdir -p tests/refs && echo weights > tests/refs/model_tiny.kdtr "
                                                "&& echo '{}' > tests/refs/manifest.json && echo regenerated\n")
    first = context()
    first.begin("bundles", first.log)
    assert bundles_step.run(first).status == "passed"
    again = context()
    again.begin("bundles", again.log)
    outcome = bundles_step.run(again)
    assert (outcome.status, outcome.message, outcome.reused_from) == \
        ("cached", f"bundles of generator {'c' * 12} are up to date", first.run_dir.run_id)
    for n, (tamper, named) in enumerate(((lambda: (root / "tests/refs/model_tiny.kdtr").write_text("tampered"),
                                          "(tests/refs/model_tiny.kdtr changed): regenerating"),
                                         (lambda: (root / "tests/refs/manifest.json").unlink(),
                                          "(tests/refs/manifest.json, tests/refs/model_tiny.kdtr changed): regenerating")), 1):
        tamper()
        ctx = context()
        ctx.begin("bundles", ctx.log)
        assert bundles_step.run(ctx).status == "passed"
        said = [line for line in context.lines if "are not those run" in line and "regenerating" in line]
        assert len(said) == n and named in said[-1]
    assert (root / "tests/refs/model_tiny.kdtr").read_text() == "weights\n"


def test_the_bundles_cache_follows_the_generator_and_no_cache_and_needs_a_manifest(context):
    """Bundles are reused only for the generator inputs they were made from, never with
    --no-cache, and never without the manifest (nothing then says which files are the bundles)."""
    root = context.root
    generator = root / "scripts" / "tree_hash.sh"
    generator.write_text("echo " + "c" * 64 + "\n")
    (root / "scripts" / "bundles.sh").write_text("mkdir -p tests/refs && echo weights > tests/refs/model_tiny.kdtr "
                                                "&& echo '{}' > tests/refs/manifest.json\n")

    def bundles(**how):
        ctx = context(**how)
        ctx.begin("bundles", ctx.log)
        return bundles_step.run(ctx)
    first = bundles()
    assert (first.status, first.message) == ("passed", f"regenerated with {context().host.python}")
    stamp = json.loads((root / ".kdtree" / "bundles.json").read_text())
    assert stamp["key"] == {"generator": "c" * 64, "python": context().host.python}
    assert bundles().status == "cached"
    assert bundles(use_cache=False).status == "passed"
    generator.write_text("echo " + "d" * 64 + "\n")
    assert bundles().status == "passed" and bundles().status == "cached"
    (root / "scripts" / "bundles.sh").write_text("echo weights > tests/refs/model_tiny.kdtr\n")   # no manifest made
    (root / "tests/refs/manifest.json").unlink()
    assert bundles().status == "passed" and bundles().status == "passed"


def test_a_bundle_or_build_stamp_that_is_not_a_mapping_reads_as_no_stamp(context):
    """A stamp on the host is hostile data: a list or a broken document is no stamp (the step runs)."""
    ctx = context()
    for text in ("[1, 2]", "{broken", '"a string"'):
        (context.root / ".kdtree" / "bundles.json").write_text(text)
        assert state.read_json(ctx.session.transport, "bundles.json") is None
    state.write_json(ctx.session.transport, "bundles.json", {"key": {"generator": "g"}})
    assert state.read_json(ctx.session.transport, "bundles.json") == {"key": {"generator": "g"}}


def test_files_read_at_once_are_each_what_read_file_gives(context):
    """Transport.read_files reads several files in one command: each path's content, or the
    FetchError (message and exit status) that read_file raises for it: missing, a symlink, not a
    regular file, over its own limit, outside remote_dir; a NUL byte or an empty file read as
    they are."""
    root = context.root
    (root / "nul").write_bytes(b"a\0b\n\n")
    (root / "empty").write_bytes(b"")
    (root / "link").symlink_to(root / "nul")
    (root / "big").write_bytes(b"x" * 11)
    t = context().session.transport
    paths = [("nul", 100), ("empty", 1), ("missing", 10), ("link", 100), ("build", 100), ("big", 10), ("..", 10)]
    found = t.read_files(paths)
    assert list(found) == [p for p, _ in paths]
    for path, most in paths:
        try:
            alone: bytes | tuple = t.read_file(path, most)
        except FetchError as e:
            alone = (e.message, e.exit_status)
        got = found[path]
        assert (got if isinstance(got, bytes) else (got.message, got.exit_status)) == alone, path
    assert found["nul"] == b"a\0b\n\n" and found["empty"] == b"" and found["missing"].exit_status == base.READ_MISSING


def test_the_state_files_are_read_at_once_each_as_read_json_would(context):
    """One round trip for every stamp (state.read_jsons): each as read_json gives it (a missing,
    broken, non-mapping or oversized one is None), a NUL byte or a line like the framing's in
    one file leaving the others as they are (the step context's cache of them: tests/steps/test_stamps.py)."""
    ctx = context()
    kd = context.root / ".kdtree"
    (kd / "build.json").write_text('{"key": 1}')
    (kd / "bundles.json").write_text("[1]")
    (kd / "golden.json").write_text("{broken")
    (kd / "test.json").write_bytes(b'{"a": "' + b"x" * state.RECORD_MAX_BYTES + b'"}')
    (kd / "bench.json").unlink(missing_ok=True)
    found = state.read_jsons(ctx.session.transport, state.STAMPS)
    assert {n: found[n] == state.read_json(ctx.session.transport, n) for n in state.STAMPS} == dict.fromkeys(state.STAMPS, True)
    assert found["build.json"] == {"key": 1} and found["bundles.json"] is found["test.json"] is None
    (kd / "golden.json").write_bytes(b'{"a": 1}\0x')
    (kd / "test.json").write_bytes(b'{"a":\n0 \n}')        # the framing's status line, without the mark
    assert state.read_jsons(ctx.session.transport, state.STAMPS) == {**found, "test.json": {"a": 0}}


# a stand-in for the engine's build: a new executable each time (its build number in it); says whether
# it found build/kdtree, what KD_REBUILD it got, and that the engine's tree cache had the build when asked
BUILD_SH = """mkdir -p build
n=$(( $(cat build/.n 2>/dev/null || echo 0) + 1 )); echo $n > build/.n
echo "had kdtree: $([ -e build/kdtree ] && echo yes || echo no)"
echo "KD_REBUILD=${KD_REBUILD:-unset}"
if [ -f restore-me ]; then echo "(restored from build/trees/x)"; fi
printf '#!/bin/sh\\n# build %s\\necho kdtree 0.0 tree=TREE backend=cuda arch=sm_90\\n' "$n" > build/kdtree
chmod +x build/kdtree
"""


def test_the_build_step_reuses_only_its_own_recorded_executables(context):
    """The build cache on its own (a local host, a stand-in engine): the stamp's format; the same
    key reused with the run it came from; --no-cache rebuilds with KD_REBUILD=1; the stamp of
    another build key matched by executables this machine recorded for the first key only is
    not trusted (they are removed before the build); a build the engine's own cache restored
    is `cached` and says so; a build key is the same whatever the order of its fields; a recorded
    executable that lost its execute bit is not reused."""
    root = context.root
    (root / "scripts" / "build.sh").write_text(BUILD_SH.replace("TREE", TREE))

    def build(**how):
        ctx = context(**how)
        ctx.begin("build", ctx.log)
        return build_step.run(ctx), ctx.run_dir.run_id

    def said(text: str) -> str:
        return [line for line in context.lines if text in line][-1]
    first, first_run = build()
    assert (first.status, first.message, said("had kdtree"), said("KD_REBUILD=")) == \
        ("passed", "cuda build for sm_90", "had kdtree: yes", "KD_REBUILD=unset")
    stamp = json.loads((root / ".kdtree" / "build.json").read_text())
    assert stamp == {"key": {"tree": TREE, "build": {"cxx": "g++"}}, "run_id": first_run}
    again, _ = build()
    assert (again.status, again.message, again.reused_from) == \
        ("cached", f"cuda build for sm_90 of tree {TREE[:12]} is up to date", first_run)
    assert build(use_cache=False)[0].status == "passed" and said("KD_REBUILD=") == "KD_REBUILD=1"
    first_key_binary = (root / "build" / "kdtree").read_bytes()
    assert build(build_key={"cxx": "clang"})[0].status == "passed"
    (root / "build" / "kdtree").write_bytes(first_key_binary)       # recorded, but for the other key
    assert build(build_key={"cxx": "clang"})[0].status == "passed"
    assert said("the build stamp") == ("the build stamp matches, but the executables under build/ are not those "
                                       "this machine recorded for it: removing them and building again")
    assert said("had kdtree") == "had kdtree: no"
    (root / "restore-me").write_text("")
    restored, _ = build(build_key={"cxx": "icc"})
    assert (restored.status, restored.message, restored.reused_from) == \
        ("cached", f"cuda build for sm_90 of tree {TREE[:12]} restored from the host's build cache", None)
    (root / "restore-me").unlink()
    assert build(build_key={"cxx": "g++", "arch": "sm_90"})[0].status == "passed"
    assert build(build_key={"arch": "sm_90", "cxx": "g++"})[0].status == "cached"    # the same key, told in another order
    (root / "build" / "kdtree").chmod(0o644)            # recorded, its content unchanged, but no longer executable
    assert build(build_key={"arch": "sm_90", "cxx": "g++"})[0].status == "passed"
    assert said("the build stamp").startswith("the build stamp matches, but the executables under build/ are not")
    assert build(build_key={"arch": "sm_90", "cxx": "g++"})[0].status == "cached"


def test_the_binary_runs_only_once_the_host_found_its_executables_recorded_and_that_check_is_read_ahead(context):
    """A no-change build's check of build/'s executables and the binary's --version are one host
    command, read ahead for the key of the host's last build step: the binary runs only when
    every executable of one of this machine's records hashes as recorded (a changed binary is
    never run: the build removes it and builds again), and the build step takes that check only
    for its own build key."""
    root = context.root
    (root / "scripts" / "build.sh").write_text(BUILD_SH.replace("TREE", TREE).replace("echo kdtree", "echo >> ran; echo kdtree"))

    def runs() -> int:
        return len((root / "ran").read_text()) if (root / "ran").exists() else 0

    def ahead():
        ctx = context(step="build", project=commands(build_key="""echo '{"cxx": "g++"}'"""))
        ctx.deployed_tree_hash = TREE
        ctx.reads.read_ahead(("build",), ctx.deployed_tree_hash)
        return ctx
    first = context()
    first.begin("build", first.log)
    assert build_step.run(first).status == "passed" and runs() == 1
    ctx = ahead()
    key, checked = ctx.reads.ahead["built"].result()
    assert key == {"tree": TREE, "build": {"cxx": "g++"}} and runs() == 2
    assert checked.version.strip() == f"kdtree 0.0 tree={TREE} backend=cuda arch=sm_90"
    assert set(checked.hashes) == {"build/kdtree", "build/test_ops"}
    assert ctx.reads.built({"tree": TREE, "build": {"cxx": "clang"}}) is host_reads.NOT_READ
    assert build_step.run(ctx).status == "cached" and runs() == 2          # the check read ahead, not run again
    with (root / "build" / "kdtree").open("a") as binary:
        binary.write("# changed on the host\n")
    ctx = ahead()
    assert ctx.reads.ahead["built"].result()[1].version is None and runs() == 2   # not run
    assert build_step.run(ctx).status == "passed" and runs() == 3
    assert [line for line in context.lines if "the build stamp" in line][-1].endswith("removing them and building again")
    ctx = context()                 # nothing read ahead: the step checks, the same way
    ctx.begin("build", ctx.log)
    assert build_step.run(ctx).status == "cached" and runs() == 4


@pytest.mark.parametrize("printed, version, what", [
    (f"noise\nkdtree 0.1.0 tree={TREE} backend=cpu arch=none\n",
     {"version": "0.1.0", "tree": TREE, "backend": "cpu", "arch": "none"}, "cpu build"),
    (f"kdtree 0.1.0 tree={TREE} backend=cuda arch=sm_90 extra", {"version": "0.1.0", "tree": TREE, "backend": "cuda",
                                                                 "arch": "sm_90"}, "cuda build for sm_90"),
    (f"kdtree 2 tree={TREE} junk", {"version": "2", "tree": TREE, "backend": "?", "arch": "?"}, "? build"),
])
def test_the_build_step_reads_and_records_the_binary_version(context, printed, version, what):
    """The build's binary is known by its last --version line: version, tree, backend and arch
    (recorded in the host's record; `?` where the line says nothing), and described by them."""
    (context.root / "build" / "kdtree").write_text(f"#!/bin/sh\nprintf '%s' '{printed}'\n")
    ctx = context()
    ctx.begin("build", ctx.log)
    assert build_step._checked_version(ctx, TREE) == version
    assert build_step._what(version) == what
    assert (ctx.record.binary_tree_hash, ctx.record.backend, ctx.record.fingerprint.arch) == \
        (TREE, None if version["backend"] == "?" else version["backend"], "sm_90" if "sm_90" in what else None)
    assert context.lines[-1] == "binary: " + printed.strip().splitlines()[-1]


@pytest.mark.parametrize("printed, message", [
    ("garbage line\n", "cannot read the engine's version line: garbage line"),
    ("", "cannot read the engine's version line: (nothing)"),
    ("kdtree 0.1.0 backend=cpu\n", "cannot read the engine's version line: kdtree 0.1.0 backend=cpu"),
    (f"kdtree 0.1.0 tree={OTHER_TREE} backend=cpu arch=none\n",
     f"the binary was built from tree {OTHER_TREE[:12]} but the deployed tree is {TREE[:12]}"),
])
def test_the_build_step_refuses_a_binary_it_cannot_place(context, printed, message):
    """A binary whose version line is unreadable, or built from another tree, fails the build step
    with the line (or `(nothing)`) and the host in the error."""
    (context.root / "build" / "kdtree").write_text(f"#!/bin/sh\nprintf '%s' '{printed}'\n")
    ctx = context()
    ctx.begin("build", ctx.log)
    with pytest.raises(StepError) as caught:
        build_step._checked_version(ctx, TREE)
    assert (caught.value.message, caught.value.host) == (message, "local")


def test_the_build_step_parses_only_kdtree_version_lines():
    assert build_step.parse_version("kdtree 1.2 tree=abc backend=cpu a=b=c junk") == \
        {"version": "1.2", "tree": "abc", "backend": "cpu", "a": "b=c"}
    assert build_step.parse_version("kdtree 2") == {"version": "2"}
    assert build_step.parse_version("kdtree") == build_step.parse_version("kdtrees 1 tree=abc") == \
        build_step.parse_version("") == {}


def test_the_build_step_keeps_its_records_bounded_private_and_trusted_only_when_present(context):
    """This machine's build records: the last 16 builds of a key (older ones dropped, in order),
    written under the key; no record, or a records file that is not one, is no trust (rebuild);
    an unsafe records folder is refused by its name; executables with undecodable names are
    hashed all the same."""
    root = context.root
    (root / "scripts" / "build.sh").write_text(BUILD_SH.replace("TREE", TREE))

    def build(**how):
        ctx = context(**how)
        ctx.begin("build", ctx.log)
        return build_step.run(ctx).status
    assert build() == "passed"
    (records,) = (context().project.root / executables.LOCAL_RECORDS).glob("*.json")
    key = json.loads(records.read_text())["key"]
    old = [{"build/kdtree": f"{i:064x}"} for i in range(20)]
    records.write_text(json.dumps({"key": key, "builds": old}))
    assert build() == "passed"                   # the stamp matches, the executables are none of those recorded
    kept = json.loads(records.read_text())
    assert kept["key"] == key and kept["builds"][:15] == old[5:] and len(kept["builds"]) == 16
    (root / "build" / os.fsdecode(b"odd-\xff")).write_bytes(b"x")
    (root / "build" / os.fsdecode(b"odd-\xff")).chmod(0o755)
    assert build(use_cache=False) == "passed"
    assert "build/odd-\ufffd" in json.loads(records.read_text())["builds"][-1]
    for text in ("{}", "[1]", '{"builds": "x"}'):
        records.write_text(text)
        assert build() == "passed" and build() == "cached", text
    records.unlink()
    assert build() == "passed"                   # a stamp on the host and no record here: not trusted
    records.parent.chmod(0o777)
    with pytest.raises(UsageError, match=r"^build record directory \S+ is writable by group or others"):
        build(use_cache=False)
    records.parent.chmod(0o700)


def test_the_build_step_bounds_removing_untrusted_executables_by_its_timeout(context, fake_tool):
    """The check of build/'s executables and the removal of those this machine did not record run
    under the build step's timeout: a host whose `sha256sum` or `find -delete` hangs fails the
    step within seconds, naming what hung."""
    (context.root / "scripts" / "build.sh").write_text(BUILD_SH.replace("TREE", TREE))
    ctx = context()
    ctx.begin("build", ctx.log)
    assert build_step.run(ctx).status == "passed"
    (context.root / "build" / "kdtree").write_bytes(b"#!/bin/sh\necho not the recorded build\n")
    for tool, script, what in [("sha256sum", "exec sleep 30", "checking the build's executables and its --version"),
                               ("find", 'for a; do [ "$a" = -delete ] && exec sleep 30; done\n'    # the removal only
                                        f'exec {shutil.which("find")} "$@"', "removing build/'s executables")]:
        fake = fake_tool(tool, script)
        ctx = context(step="build", changed=lambda host: dataclasses.replace(host, timeouts={**host.timeouts, "build": 2}))
        start = time.monotonic()
        with pytest.raises(CommandError) as caught:
            build_step.run(ctx)
        assert time.monotonic() - start < 10
        assert f"local: {what} timed out" in str(caught.value), caught.value
        fake.unlink()


def test_writing_a_stamp_is_bounded_by_the_lock_timeout(make_inventory, tmp_path, fake_tool):
    """A host whose `mv` hangs while a stamp is written: the write fails within the host's lock
    timeout (1 s here), naming the file, and the stamp is not there."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    "timeouts": {"lock": 1}}})
    (tmp_path / "host" / ".kdtree").mkdir(parents=True)
    fake_tool("mv", "exec sleep 30")
    start = time.monotonic()
    with pytest.raises(CommandError) as caught:
        state.write_json(factory.open_transport(inv.hosts["local"]), "build.json", {"key": 1})
    assert time.monotonic() - start < 10
    assert "local: writing .kdtree/build.json timed out" in str(caught.value), caught.value
    assert not (tmp_path / "host" / ".kdtree" / "build.json").exists()


def test_the_state_files_are_read_up_to_their_size_limit(context):
    """Every stamp at RECORD_MAX_BYTES exactly is read, all six in one answer; one a byte larger
    is no stamp (as read_json)."""
    ctx = context()
    kd = context.root / ".kdtree"

    def document(size: int) -> bytes:
        return b'{"a": "' + b"x" * (size - 9) + b'"}'
    for name in state.STAMPS:
        (kd / name).write_bytes(document(state.RECORD_MAX_BYTES))
    big = {"a": "x" * (state.RECORD_MAX_BYTES - 9)}
    assert state.read_jsons(ctx.session.transport, state.STAMPS) == dict.fromkeys(state.STAMPS, big)
    (kd / "test.json").write_bytes(document(state.RECORD_MAX_BYTES + 1))
    assert state.read_jsons(ctx.session.transport, state.STAMPS) == {**dict.fromkeys(state.STAMPS, big), "test.json": None}
    assert state.read_json(ctx.session.transport, "test.json") is None


def test_reading_the_state_files_is_bounded_by_the_lock_timeout(make_inventory, tmp_path, fake_tool):
    """A host whose `head` hangs while the stamps are read: within the host's lock timeout (1 s
    here) every stamp is None (nothing is reused), as when the read fails."""
    inv = make_inventory({"local": {"transport": "local", "remote_dir": str(tmp_path / "host"),
                                    "timeouts": {"lock": 1}}})
    (tmp_path / "host" / ".kdtree").mkdir(parents=True)
    (tmp_path / "host" / ".kdtree" / "build.json").write_text('{"key": 1}')
    host = factory.open_transport(inv.hosts["local"])
    assert state.read_jsons(host, state.STAMPS)["build.json"] == {"key": 1}
    fake_tool("head", "exec sleep 30")
    start = time.monotonic()
    assert state.read_jsons(host, state.STAMPS) == dict.fromkeys(state.STAMPS)
    assert time.monotonic() - start < 10


def test_rsync_runs_over_the_relay_with_its_helper(make_inventory):
    from orchestrator import sync
    from orchestrator.connectors import relay
    from orchestrator.connectors.paramiko import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree", "rsync_path": "/opt/rsync dir/rsync"}})
    rsh = relay.remote.quote(relay.helper_argv("/tmp/kdtree-rsh-x/s"))
    argv = sync.rsync_argv(SshTransport(inv.hosts["h"]), inv.project, rsh=rsh)
    assert argv[argv.index("-e") + 1] == f"{sys.executable} -I -S {relay.HELPER} /tmp/kdtree-rsh-x/s"
    assert "--rsync-path='/opt/rsync dir/rsync'" in argv and argv[-1] == "h:/srv/kdtree/"
    assert relay.HELPER.is_file()


@pytest.mark.parametrize("command, rsync_path, ok", [
    ("rsync --server -slogDtprze.iLsfxCIvu", None, True),     # what rsync asks for (--protect-args)
    ("rsync --server -logDtprze.iLsfxCIvu --delete . /srv/kdtree/", None, True),
    ("'/opt/rsync dir/rsync' --server -slogDtprcze.iLsfxCIvu", "/opt/rsync dir/rsync", True),
    ("rsync --server -slogDtprcze.iLsfxCIvu", "/opt/rsync dir/rsync", False),
    ("rsync --server . /x; touch /tmp/canary", None, False),
    ("rsync --server . '$(touch /tmp/canary)'", None, False),
    ("rm -rf / --server ", None, False),
    ("rsync --daemon", None, False),
    ("/usr/bin/rsync --server . /x", None, False),
    ("rsync --server . /x\ntouch /tmp/canary", None, False),
])
def test_the_relay_runs_only_rsyncs_server(command, rsync_path, ok):
    from orchestrator.connectors import relay
    assert relay.allowed(command, rsync_path) is ok


def test_dry_run_shows_the_relay(make_inventory):
    from orchestrator import state, sync
    from orchestrator.connectors import relay
    from orchestrator.connectors.local import LocalTransport
    from orchestrator.connectors.paramiko import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"},
                          "local": {"transport": "local", "remote_dir": "/work/.deploy/local"}})
    transfer = dict(sync.deploy_commands(SshTransport(inv.hosts["h"]), inv.project, state.Owner.now("deploy")))
    line = transfer["local: transfer (a tar stream instead when the host has no rsync)"]
    assert f"-e '{sys.executable} -I -S {relay.HELPER} " in line and "kdtree-rsh-XXXXXXXX/s'" in line
    assert relay.dry_run_shell(LocalTransport(inv.hosts["local"])) is None


def test_the_relay_never_reconnects_behind_the_lock(make_inventory):
    from orchestrator.connectors import relay
    from orchestrator.errors import ConnectError
    from orchestrator.connectors.paramiko import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"}})
    with pytest.raises(ConnectError, match="lost before the transfer"):
        with relay.rsync_shell(SshTransport(inv.hosts["h"])):
            pass


def test_the_relay_socket_is_private_and_gone_once_rsync_connected(make_inventory):
    import os
    import stat
    import time
    from orchestrator.connectors import relay
    from orchestrator.connectors.paramiko import SshTransport
    inv = make_inventory({"h": {"address": "h", "remote_dir": "/srv/kdtree"}})
    r = relay._Relay(SshTransport(inv.hosts["h"]))
    try:
        assert stat.S_IMODE(os.stat(r.dir).st_mode) == 0o700 and stat.S_IMODE(os.stat(r.path).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(r.path)
            deadline = time.monotonic() + 5
            while os.path.exists(r.dir) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not os.path.exists(r.dir)
    finally:
        r.close()


def test_the_golden_steps_results_key_names_its_command(context):
    ctx = context()
    ctx.begin("golden", ctx.log)
    assert ctx.results_key()["command"] == "bash scripts/generate.sh"


def test_the_local_tree_hash_is_kept_by_the_files_stat(make_inventory, source, monkeypatch):
    """The local tree hash command runs again when a file changed, even with its size and
    modification time put back (its change time moved), never for an excluded file, and always
    while a file is too recent to be sure of (RACY_SECONDS)."""
    calls = source.parent / "calls"
    commands = {**yaml.safe_load((REPO / "hosts.yaml").read_text())["project"]["commands"],
                "tree_hash": f"echo run >> {calls}; cat version.txt"}
    project = make_inventory({}, commands=commands).project
    monkeypatch.setattr(sync, "RACY_SECONDS", 0)
    version = source / "version.txt"
    version.write_text("1" * 64)
    assert sync.source_id(project).tree_hash == sync.source_id(project).tree_hash == "1" * 64
    assert calls.read_text().count("run") == 1
    st = version.stat()
    version.write_text("2" * 64)
    os.utime(version, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sync.source_id(project).tree_hash == "2" * 64 and calls.read_text().count("run") == 2
    (source / "build" / "new-binary").write_text("excluded: never synced, never hashed\n")
    assert sync.source_id(project).tree_hash == "2" * 64 and calls.read_text().count("run") == 2
    cache = next((project.root / sync.TREE_HASH_CACHE).iterdir())
    assert cache.stat().st_mode & 0o777 == 0o600 and cache.parent.stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(sync, "RACY_SECONDS", 3600)
    sync.source_id(project)
    sync.source_id(project)
    assert calls.read_text().count("run") == 4
