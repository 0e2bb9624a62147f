"""The guarded mutants: small, realistic bugs that break a promise of the Guarantees
table (docs/guarantees.md), each of which its named tests must catch. Every case applies one bug to a copy of the
checkout and runs the named tests there: they must fail (pytest exit 1), and the bug must still
apply (its text found exactly once), so a refactoring that moves the code fails here until the
list is brought along. benchmarks/mutation.py is the broad, slow measurement (mutmut); this is
the short list CI runs on every change."""
from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# (id, file, text, replacement, tests that must fail with the bug in)
MUTANTS = [
    ("host-key-pin-after-authentication", "orchestrator/connectors/paramiko.py",
     "transport_factory=factory)", "transport_factory=None)",
     ["tests/connectors/test_ssh.py::test_a_pin_in_the_inventory_overrides_a_known_hosts_entry[paramiko]"]),
    ("warm-pin-contradiction-ignored", "orchestrator/connectors/hostkeys.py",
     "    if not host.host_key:\n        return False\n", "    if True:\n        return False\n",
     ["tests/connectors/test_ssh.py::test_a_pin_in_the_inventory_overrides_a_known_hosts_entry[warm]"]),
    ("warm-key-probe-trusted-without-an-answer", "orchestrator/connectors/openssh.py",
     "            self.cancel()\n            return False\n", "            self.cancel()\n            return True\n",
     ["tests/connectors/test_warm.py::test_a_key_probe_that_gets_no_key_exchange_is_refused_within_its_bound"]),
    ("unknown-host-key-accepted", "orchestrator/connectors/hostkeys.py",
     "raise unknown(host, hostname, key, hop)", "return",
     ["tests/connectors/test_ssh.py::test_unknown_host_key_is_refused_before_anything_runs"]),
    ("session-members-left", "orchestrator/host/step_guard.sh",
     ' -e "[0-9]+ \\(.*\\) [A-Za-z] -?[0-9]+ -?[0-9]+ $step [^)]*"', '',
     ["tests/connectors/test_ssh.py::test_a_step_leaves_nothing_in_its_process_group_even_a_child_without_the_tag"]),
    ("step-timeout-ignored", "orchestrator/host/step_guard.sh",
     'setsid -w timeout -k "$1" "$2" "${@:3}"', 'setsid -w timeout -k "$1" "$(($2 * 10))" "${@:3}"',
     ["tests/connectors/test_ssh.py::test_timeout_kills_the_whole_process_group_on_the_host"]),
    ("golden-last-token-ignored", "orchestrator/records/record.py",
     "enumerate(zip(expected, actual))", "enumerate(zip(expected[:-1], actual[:-1]))",
     ["tests/records/test_golden.py::test_a_divergence_at_the_final_token_fails"]),
    ("build-cache-ignores-build-key", "orchestrator/steps/build.py",
     'key: dict[str, Any] = {"tree": tree, "build": ctx.build_key()}',
     'key: dict[str, Any] = {"tree": tree}; ctx.build_key()',
     ["tests/scenarios/test_faults_tree.py::test_the_build_cache_is_keyed_on_the_toolchain_and_arch"]),
    ("build-stamp-checks-the-tree-only", "orchestrator/steps/build.py",
     'stamp.get("key") == key and', 'record.mapping(stamp.get("key")).get("tree") == tree and',
     ["tests/scenarios/test_faults_tree.py::test_the_build_cache_is_keyed_on_the_toolchain_and_arch"]),
    ("tree-hash-check-off", "orchestrator/sync.py",
     "if remote_hash != source.tree_hash:", "if False:",
     ["tests/connectors/test_ssh.py::test_a_deployed_tree_whose_hash_differs_fails_the_sync"]),
    ("deployed-tree-not-rehashed", "orchestrator/sync.py",
     'return current if current == record["tree_hash"] else None', 'return record["tree_hash"]',
     ["tests/scenarios/test_deploy.py::"
      "test_a_deployed_tree_is_the_recorded_one_only_while_the_host_still_hashes_to_it"]),
    ("bundles-cache-ignores-its-key", "orchestrator/steps/bundles.py",
     'if ctx.plan.use_cache and stamp.get("key") == key and stamp.get("run_id"):',
     'if ctx.plan.use_cache and stamp.get("run_id"):',
     ["tests/test_performance.py::test_the_bundles_cache_follows_the_generator_and_no_cache_and_needs_a_manifest"]),
    ("rsync-without-delete", "orchestrator/sync.py",
     '"--no-group", "--delete", ', '"--no-group", ',
     ["tests/scenarios/test_deploy.py::test_deploy_redeploy_delete_and_excludes[rsync]"]),
    ("rsync-keeps-the-owner", "orchestrator/sync.py",
     '"-az", "--no-owner", "--no-group", ', '"-az", ',
     ["tests/scenarios/test_deploy.py::test_a_checkout_of_another_uid_deploys_as_the_host_user[rsync]"]),
    ("tar-without-delete", "orchestrator/sync.py",
     "    if gone:\n", "    if False:\n",
     ["tests/scenarios/test_deploy.py::test_deploy_redeploy_delete_and_excludes[tar]"]),
    ("excludes-dropped", "orchestrator/sync.py",
     'argv += [f"--exclude={pattern}" for pattern in project.excludes]', "argv += []",
     ["tests/scenarios/test_deploy.py::test_deploy_redeploy_delete_and_excludes[rsync]"]),
    ("write-run-without-redaction", "orchestrator/records/run_store.py",
     "data = redact_tree(data, list(secrets))", "data = redact_tree(data, [])",
     ["tests/records/test_record.py::test_write_run_redacts_every_string_and_key"]),
    ("renderers-without-redaction", "orchestrator/records/run_view.py",
     "s = visible(redact(s, secrets))", "s = visible(s)",
     ["tests/records/test_report.py::test_each_renderer_redacts_on_its_own"]),
    ("usage-error-exits-1", "orchestrator/errors.py",
     "    exit_code = 2\n", "    exit_code = 1\n",
     ["tests/test_inventory.py::test_cli_exit_code_2_on_unknown_host"]),
    ("lock-always-shared", "orchestrator/host/lock.sh",
     'take "$([ "$mode" = exclusive ] && echo -x || echo -s)"', "take -s",
     ["tests/scenarios/test_deploy.py::test_lock_contention_and_recovery_of_a_dead_runs_lock"]),
    ("system-dirs-allowed", "orchestrator/inventory.py",
     "if norm in SYSTEM_DIRS or norm.startswith(_UNDER_SYSTEM):", "if False:",
     ["tests/scenarios/test_faults_tree.py::"
      "test_11_dangerous_destinations_in_the_inventory_are_refused_before_anything_runs"]),
    ("bundle-extra-tensors-accepted", "engine_src/python/kdtree_ref/kdtr.py",
     "    _check_tensor_set(path, header, entries)\n", "",
     ["engine_src/python/tests/test_ref_kdtr.py::test_reader_error[extra_layer_tensors-1]"]),
    ("bundle-v2-tensor-hashes-unchecked", "engine_src/python/kdtree_ref/kdtr.py",
     "_check_hash(self._path, self._buf, e, self._unchecked[name])", "None",
     ["engine_src/python/tests/test_ref_kdtr.py::test_v2_lazy_reader_checks_a_tensor_on_first_access"]),
]


JOBS = 2     # CI's cores: two bugs' tests at a time, each in its own copy of the checkout

# runs argv as a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so every process the run leaves
# behind (a bug in the step guard leaves a step's children running, on purpose) is reparented to it,
# not to init; once argv has ended those are killed, so no later test meets them; its exit code is argv's
REAPED = """
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
code = subprocess.call(sys.argv[1:])
me = str(os.getpid())
while True:
    left = []
    for stat in os.listdir("/proc"):
        try:
            if stat.isdigit() and open(f"/proc/{stat}/stat").read().rsplit(") ", 1)[1].split()[1] == me:
                left.append(int(stat))
        except (OSError, IndexError):
            pass
    if not left:
        break
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
sys.exit(code)
"""


def copy_checkout(to: Path) -> Path:
    """A copy of the checkout's files (tracked and new ones, as they are now)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, to / rel)
    return to


def run_with_bug(checkout: Path, file: str, text: str, bug: str, tests: list[str]) -> tuple[int, str]:
    """(pytest's exit code, its output) for `tests` with `text` replaced by `bug` in `file`; exit
    code -1 when `text` is not found exactly once."""
    path = checkout / file
    original = path.read_text()
    if original.count(text) != 1:
        return -1, f"{file} no longer has exactly one {text!r}: update MUTANTS"
    path.write_text(original.replace(text, bug))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-c", REAPED, sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=checkout, capture_output=True, text=True, timeout=300, env=env)
    path.write_text(original)
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-1000:]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every bug of MUTANTS run against its tests, JOBS at a time."""
    base = copy_checkout(tmp_path_factory.mktemp("checkout"))
    copies = [base] + [Path(shutil.copytree(base, tmp_path_factory.mktemp("checkout"), dirs_exist_ok=True))
                       for _ in range(JOBS - 1)]
    free: queue.Queue[Path] = queue.Queue()
    for c in copies:
        free.put(c)

    def one(mutant):
        name, *case = mutant
        checkout = free.get()
        try:
            return name, run_with_bug(checkout, *case)
        finally:
            free.put(checkout)
    with ThreadPoolExecutor(JOBS) as pool:
        return dict(pool.map(one, MUTANTS))


@pytest.mark.parametrize("name", [m[0] for m in MUTANTS])
def test_the_named_tests_catch_the_bug(outcomes, name):
    code, output = outcomes[name]
    assert code == 1, f"the bug survived (pytest exit {code}):\n{output}"
