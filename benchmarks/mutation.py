#!/usr/bin/env python3
"""Mutation testing of the critical modules with mutmut, one module at a time, in bounded time.

    python3 benchmarks/mutation.py [MODULE ...] [--budget 900] [--jobs 2] [--work DIR] [--report OUT.md]

A script, not a test (CI runs the small hand-picked list of tests/test_guarded_mutants.py instead).
For each module of MODULES (all of them without arguments; a name matches by substring) it copies
the checkout's tracked files, as they are in the working tree, into --work/<module>, writes the
[tool.mutmut] section for that module alone (the module to mutate, the subset of tests that guard
it), and runs `nice -n 10 mutmut run` for at most --budget seconds. mutmut first runs the subset once
to learn which tests reach which function, then runs each mutant against those tests only, in a
forked process (fast: no interpreter start per mutant).

Then it writes a report (--report, Markdown, and the same figures as JSON beside it): per module
the mutants killed, survived, not reached by the subset ("no tests"), timed out, not run in the
budget, and the score = killed / (every mutant run - the equivalent ones); and each survivor with
its diff and its reason: equivalent (EQUIVALENT below says why), left alive on purpose (ACCEPTED
says why; still counted against the score) or a missing test. --resume continues a module's last
run after new tests: it copies the checkout over, writes the module's test subset as MODULES says
now, and runs that run's survivors again, the mutants it had no time for and every mutant of a
function changed since.

mutmut: 3.x (pinned in the dev extra). Chosen over cosmic-ray because it runs each mutant only
against the tests that reach the mutated function and forks instead of starting pytest anew; with
the sshd fixtures' start-up that is the difference between minutes and hours per module on two cores.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
W = "orchestrator.connectors.openssh."

# module -> (pytest arguments selecting the tests that guard it, function name globs to mutate: empty = all)
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "orchestrator/connectors/hostkeys.py": (["tests/connectors/test_hostkeys.py", "tests/connectors/test_ssh.py",
                                             "tests/connectors/test_warm.py", "-k",
                                             "hostkeys or host_key or trust or pin or unknown or changed or options"],
                                            []),
    "orchestrator/connectors/ssh_common.py": (["tests/connectors/test_warm.py", "tests/test_commands.py", "-k",
                                               "config or jump or warm"], ["openssh_config", "_read_ssh_config"]),
    "orchestrator/connectors/paramiko.py": (["tests/connectors/test_ssh.py", "tests/test_performance.py", "-k",
                                    "host_key or trust or pin or unknown or changed or jump or proxy or target or nodelay"],
                                   ["_open_once", "_connect", "_Target.*"]),
    "orchestrator/remote.py": (["tests/connectors/test_ssh.py", "tests/test_commands.py", "-k",
                                "group or timeout or secret or env or quote or wrap or step"], []),
    "orchestrator/records/golden.py": (["tests/records/test_golden.py"], []),
    "orchestrator/records/record.py": (["tests/records/test_golden.py", "tests/records/test_record.py"], ["Mismatch.*"]),
    "orchestrator/records/redaction.py": (["tests/records/test_record.py"], []),
    "orchestrator/safe_text.py": (["tests/scenarios/test_hostile.py", "tests/records/test_report.py", "-k",
                                   "escaped or terminal or markdown or safe_text"], []),
    "orchestrator/inventory.py": (["tests/test_inventory.py"],
                                  ["is_dangerous_dir", "Inventory.select", "_Validator.string", "_Validator.path",
                                   "_Validator.integer", "_Validator.timeouts", "_Validator.known_keys",
                                   "_Validator.choice", "_Validator.groups"]),
    "orchestrator/sync.py": (["tests/scenarios/test_deploy.py", "tests/connectors/test_ssh.py", "-k",
                              "deploy or sync or hash or exclude"],
                             ["sync_tree", "_begin", "deployed_tree", "is_excluded", "_under_excluded", "_remote_hash",
                              "rsync_argv", "_tar_sync", "_local_listing"]),
    "orchestrator/state.py": (["tests/host/test_lock_modes.py", "tests/scenarios/test_deploy.py",
                               "tests/test_performance.py", "-k",
                               "lock or bundle or build_step or state_files or sync_records or dangerous_destinations"],
                              []),
    "orchestrator/steps/build.py": (["tests/scenarios/test_faults_tree.py", "tests/test_performance.py", "-k",
                                     "build_cache or build_step"], []),
    "orchestrator/steps/bundles.py": (["tests/test_performance.py", "-k", "bundle"], []),
    "orchestrator/connectors/openssh.py": (["tests/connectors/test_warm.py", "tests/connectors/test_ssh.py", "-k",
                                            "warm"],
                             ["control_dir", "_default_dir", "check_private", "_not_private", "uses_warm",
                              "WarmTransport.*", "socket_path", "ensure_master", "master_alive", "stop_master", "_base_argv", "client_argv", "_control",
                              "_start_master", "_Probe.*", "_fresh_error", "_content", "_remove_stale", "_locked", "_note_use",
                              "_idle_bound_far"]),
}

# mutant name -> why it cannot change behaviour (checked by reading its diff in the report)
EQUIVALENT: dict[str, str] = {
    "orchestrator.connectors.hostkeys.x_fingerprint__mutmut_9":
        'rstrip("XX=XX"): the base64 of a 32-byte digest ends in one of AEIMQUYcgkosw048 before its "=", never X',
    "orchestrator.connectors.hostkeys.x_pin__mutmut_18": "385 is 0o600",
    "orchestrator.connectors.hostkeys.x_blob_fingerprint__mutmut_9":
        'rstrip("XX=XX"): the base64 of a 32-byte digest ends in one of AEIMQUYcgkosw048 before its "=", never X',
    "orchestrator.connectors.hostkeys.x_pinned_transport__mutmut_1":
        "the event given to start_client: SSHClient.connect passes none (it waits for the key exchange itself)",
    "orchestrator.records.golden.x__twin_check__mutmut_12":
        "the why of a skipped check is never shown (matrix_row keeps the failed checks' only)",
    "orchestrator.records.golden.x__twin_check__mutmut_62": "the why of a passed check is never shown (as above)",
    "orchestrator.records.redaction.x_redact__mutmut_2": "str() of a str is that str",
    "orchestrator.records.redaction.x__redact_edges__mutmut_7":
        "n = len + 1 or len: secret[-n:] is the whole secret, which redact replaced just before",
    "orchestrator.records.redaction.x__redact_edges__mutmut_24": "the same at the end: secret[:n] is the whole secret",
    "orchestrator.remote.x_secret_input__mutmut_4": "secret values come from os.environ, which cannot hold a NUL byte",
    "orchestrator.remote.x_secret_input__mutmut_6": "the same: the NUL check's message cannot be reached",
    "orchestrator.safe_text.x__escape__mutmut_9": "code <= 0x100: U+0100 is not among the escaped characters",
    "orchestrator.safe_text.x__escape__mutmut_10": "code < 257: the same",
    "orchestrator.connectors.paramiko.x__open_once__mutmut_36": 'the default "NONE" is compared after .lower() with "none"',
    **{f"orchestrator.connectors.paramiko.x__connect__mutmut_{n}":
       "banner_timeout left to Paramiko's 15 s: SSHClient.connect hands the same connect timeout to start_client, "
       "which gives up on a host silent before its banner as soon (tests/connectors/test_ssh.py: a target that never "
       "sends a banner fails within the connect timeout either way)" for n in (36, 45)},
    "orchestrator.connectors.paramiko.x__open_once__mutmut_6": "jump_hops looks the same ssh config entry up again when not "
                                                      "given it",
    "orchestrator.connectors.paramiko.x__open_once__mutmut_8": "the same (found left out)",
    "orchestrator.safe_text.x_markdown_fence__mutmut_11": "max(3, longest + 1): a default longest of 1 instead of 0 "
                                                          "gives 3 all the same",
    "orchestrator.state.x_read_json__mutmut_3": "the name only labels bounded.loads's ValueError, which read_json turns "
                                                "into None",
    "orchestrator.state.xǁHostLockǁ__init____mutmut_1":
        "wait is read only when the mode changes, and the one caller relying on the default (gpu_claims, exclusive) "
        "never changes it",
    "orchestrator.state.xǁHostLockǁ_beat__mutmut_7":
        "the holder on the host takes any line as a heartbeat; only release, exclusive and shared are requests",
    "orchestrator.steps.build.x__records_path__mutmut_8":
        "33 hex digits of the key's sha256 instead of 32 name the record file: only this function ever names it",
    "orchestrator.steps.build.x__hashes__mutmut_8":
        "hashing every executable under build/ instead of those of them at the recorded paths: the same hashes "
        "for every recorded path (the script picks the recorded ones out of that same list), and only those are "
        "compared; more work, the same verdict",
    "orchestrator.steps.build.x__checked_version__mutmut_11":
        'no version line: parse_version("XXXX") is {} as parse_version("") is, and the error says (nothing) either way',
    **{f"orchestrator.steps.build.x__record__mutmut_{n}": "the indentation of this machine's build records: only "
       "json.loads reads them" for n in (32, 34, 39)},
    **{f"orchestrator.state.x_write_json__mutmut_{n}": "the indentation of a stamp on the host: every reader parses it"
       for n in (18, 20, 21)},
    **{f"orchestrator.state.x_answers__mutmut_{n}":
       "`result if result else ...`: readline gives None only once Process._run has returned, its result set (an "
       "error is raised by readline instead), so close() finds that result at once; a helper that closes its output "
       "and lives on is still running, and readline times out instead (the no-answer error, tested)"
       for n in (25, 27, 29, 30)},
    **{f"orchestrator.state.x__answer__mutmut_{n}": "the message of a line never reached: answers() loops until "
       "it raises, so _answer returns or raises inside its loop (the line is there for the type checker)"
       for n in (55, 56, 57)},
    "orchestrator.state.x_read_jsons__mutmut_21":
        "a bound of RECORD_MAX_BYTES + 301 instead of + 300 a name: the script's answer holds at most a name "
        "(state.STAMPS: 12 characters at most), a sign, two NULs and RECORD_MAX_BYTES + 1 bytes a name, never near",
    **{f"orchestrator.state.x_read_jsons__mutmut_{n}":
       "the framing check: a capture that returns has exited 0, so the script printed its last NUL (parts[-1] is "
       "empty), and its 2n frame NULs plus one per NUL inside a file give 2n+1 parts only when no file holds one; "
       "then the names at the even places are those sent, and any other count gives a list of another length: "
       "the length check alone decides" for n in (26, 27)},
    **{f"orchestrator.state.x_read_jsons__mutmut_{n}":
       "the error handler of the names' decoding: it is consulted only on bytes that are not UTF-8, and with 2n+1 "
       "parts the names decoded are the ASCII names sent" for n in (36, 37)},
    "orchestrator.state.x_read_jsons__mutmut_39": "parts[:-2:2] and parts[:-1:2] are the same n names when there "
                                                  "are 2n+1 parts, the only case where the names are compared",
    "orchestrator.state.x_read_jsons__mutmut_60": "the name only labels bounded.loads's ValueError, which read_jsons "
                                                  "turns into None",
    **{f"orchestrator.state.xǁOwnerǁto_json__mutmut_{n}": "the order of the owner's keys: its JSON (a "
       "holder file, a GPU claim) is only parsed back (Owner.parse), never compared as text" for n in (2, 4, 6)},
    "orchestrator.state.x_answers__mutmut_35":
        "now >= deadline instead of >: two monotonic clock readings equal to the nanosecond, then one line later",
    "orchestrator.inventory.xǁ_Validatorǁstring__mutmut_1":
        "what is read only with a pattern, and every call with a pattern passes its what",
    "orchestrator.sync.x__begin__mutmut_10":
        'split(None, 1) instead of split(" ", 1): every line the begin prints is a word, a space and the rest (a '
        "mark's text made one printable line on the host); the two differ only in whitespace after that space, "
        "which sync_tree strips",
    **{f"orchestrator.sync.x_sync_tree__mutmut_{n}": "the indentation of the deploy record on the host: only JSON "
       "parsers read it (state.read_json, read_jsons)" for n in (95, 97, 98)},
    **{f"orchestrator.sync.x_sync_tree__mutmut_{n}": "Owner.now(command).started: only the time is used, the "
       "command given is never read" for n in (75, 76)},
    "orchestrator.sync.x__under_excluded__mutmut_21": "i = len(parts) + 1 repeats the call of i = len(parts) (the same "
                                                      "slice, the same is_dir)",
    "orchestrator.sync.x__tar_sync__mutmut_31": "the delete script removes a directory with rm -rf and anything else "
                                                "with rm -f: the order of the paths changes nothing",
    "orchestrator.sync.x__tar_sync__mutmut_44": "the same (reverse=False)",
    **{f"orchestrator.sync.x__tar_sync__mutmut_{n}": "tarfile's default format is PAX_FORMAT" for n in (64, 67)},
    "orchestrator.sync.x__tar_sync__mutmut_76": "recursive=None is as falsy as False: tar adds the directory alone",
    **{f"orchestrator.sync.x__tar_sync__mutmut_{n}": "the second loop adds changed files and symlinks only (never a "
       "directory), which tar adds alone whatever recursive says" for n in (84, 87, 89)},
    **{f"orchestrator.sync.x__local_listing__mutmut_{n}": "the size and mtime of a directory or symlink entry are "
       "never compared (symlinks are always sent, directories always listed)" for n in (5, 6, 12, 13)},
    "orchestrator.sync.x_deployed_tree__mutmut_12": "any mark, readable or too large, means a broken sync: the read's "
                                                    "bound changes nothing",
    # connectors/openssh.py
    f"{W}x__content__mutmut_2": "the marker of a missing file: a constant in the socket name's hash either way",
    **{f"{W}x__control__mutmut_{n}": "`ssh -O` reads nothing from stdin" for n in (15, 20)},
    **{f"{W}x__control__mutmut_{n}": "the host word of `ssh -O` with an explicit ControlPath (no % tokens) only "
       "names the request: the master on the socket answers it whatever it is" for n in (8, 9)},
    **{f"{W}x__idle_bound_far__mutmut_{n}": "`.used` lives in the user's own 0700 directory (check_private): "
       "nobody else can put a symlink there, and ours are files" for n in (6, 10)},
    **{f"{W}x__idle_bound_far__mutmut_{n}": "a bound of float seconds between two clock readings: equality has "
       "no width" for n in (13, 14)},
    **{f"{W}{name}": "OpenSSH reads option names, and yes/no values, without regard to case" for name in (
        "x__start_master__mutmut_15", "x__start_master__mutmut_16", "x_client_argv__mutmut_6",
        "x_client_argv__mutmut_7", "xǁ_Probeǁ__init____mutmut_7")},
    **{f"{prefix}__mutmut_{n}": "the case of an option's name or of its yes/no/none/ERROR value: OpenSSH "
       "reads both without regard to case (tests/connectors/test_warm.py reads the options back with ssh -G, which "
       "catches every other change)" for prefix, numbers in (
           (f"{W}x__base_argv", (12, 13, 15, 19, 21, 23, 24, 26, 28, 29, 31, 33, 34, 36, 38, 39, 41, 43, 44, 46,
                                 48, 49, 61, 62, 74)),
           ("orchestrator.connectors.hostkeys.x_openssh_options", (6, 7, 9, 11, 12, 14, 15, 17, 19, 20, 22, 24, 25,
                                                                   27, 29, 30, 32, 34, 35, 40)))
       for n in numbers},
    f"{W}x_check_private__mutmut_4": "'' is as falsy as None for `why`",
    f"{W}xǁ_Probeǁ__init____mutmut_8": "ControlPath NONE is a relative path to OpenSSH, where no master "
                                        "listens: with ControlMaster off the probe connects itself, as with none",
    **{f"{W}{name}": "ssh -f -N (the master) and the key probe (BatchMode, stopped before authentication) read "
       "nothing from stdin" for name in ("x__start_master__mutmut_25", "x__start_master__mutmut_30",
                                         "xǁ_Probeǁ__init____mutmut_23", "xǁ_Probeǁ__init____mutmut_28")},
    **{f"{W}xǁ_Probeǁ__init____mutmut_{n}": "the probe's command never runs (no authentication method is "
       "offered), so it prints nothing" for n in (24, 29)},
    f"{W}x_client_argv__mutmut_17": "a client of the master with an explicit ControlPath and ProxyCommand "
                                     "/bin/false: the host word resolves nothing, the master's connection is used",
    **{f"{W}x_socket_path__mutmut_{n}": "a constant for an absent part (no ssh config, no identity, no pin): "
       "the name still changes whenever the part does" for n in (8, 19, 28, 30, 35)},
    f"{W}x_socket_path__mutmut_10": "the directory is the user's own (check_private): the uid in the name "
                                     "never separates two sockets that the directory does not",
    f"{W}x_socket_path__mutmut_32": "_content of the empty path is a constant (a directory): the same as the "
                                     "constant for no ssh config",
    f"{W}x_socket_path__mutmut_42": "the parts' separator: no part holds a NUL, so either separator keeps "
                                     "them apart",
    **{f"{W}{name}": "None is as falsy as False for _ready" for name in (
        "xǁWarmTransportǁ__init____mutmut_5", "xǁWarmTransportǁconnect__mutmut_14")},
    f"{W}xǁWarmTransportǁ__init____mutmut_8": "socket is read only after connect() set it (argv, _exec, "
                                               "own_rsync_shell's connect), or through `or` where '' is as None",
}

# mutant name -> why it is left alive on purpose (it still counts as a survivor in the score)
ACCEPTED: dict[str, str] = {
    **{f"orchestrator.connectors.openssh.xǁ_Probeǁ{m}": "only a host that asks no authentication runs the probe's command: "
       "then the probe is not accepted, the master is ended and the fresh connection checks the key, the same "
       "verdict one connection later" for m in ("__init____mutmut_14", "__init____mutmut_15", "accepted__mutmut_6")},
    "orchestrator.connectors.openssh.x__start_master__mutmut_47": "one character more of ssh's own error in the message: "
                                                    "still bounded",
    **{f"orchestrator.connectors.openssh.x_socket_path__mutmut_{n}": "the identity files ssh -G reads from the user's own "
       "~/.ssh/config (no KDTREE_SSH_CONFIG) are in the name; a test would have to edit that file. They choose "
       "how we authenticate, not which host key is checked" for n in (21, 22, 23, 25, 26, 27)},
}

SEP = "\u01c1"     # mutmut's separator of class and method in a mutant's name

STATUS = {"killed": "killed", "survived": "survived", "no tests": "no_tests", "timeout": "timeout",
          "not checked": "not_run", "suspicious": "suspicious", "skipped": "skipped", "segfault": "killed"}


def main() -> int:
    """Run every selected module, then write the report; exit 1 when a module's score is below --target."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help="substrings of MODULES' keys (default: all)")
    ap.add_argument("--budget", type=float, default=900, help="seconds of mutmut per module")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kdtree-mutation"))
    ap.add_argument("--report", type=Path, default=REPO / "benchmarks" / "results" / "mutation.md")
    ap.add_argument("--reuse", action="store_true", help="report on the last run in --work, run nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue the last run in --work: bring the checkout's module and tests over, then run its "
                         "survivors again, the mutants it had no time for and those of the changed functions")
    ap.add_argument("--target", type=float, default=0.9)
    args = ap.parse_args()
    mutmut = shutil.which("mutmut", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if not mutmut:
        ap.error("mutmut is not installed: pip install -e '.[dev]'")
    chosen = [m for m in MODULES if not args.modules or any(s in m for s in args.modules)]
    if not chosen:
        ap.error(f"no module matches {args.modules}; known: {', '.join(MODULES)}")
    results = {}
    for module in chosen:
        work = args.work / module.replace("/", "_").removesuffix(".py")
        if args.resume:
            run_mutmut(mutmut, work, module, args.budget, args.jobs, resume_names(mutmut, work, module))
        elif not args.reuse:
            prepare(work, module)
            run_mutmut(mutmut, work, module, args.budget, args.jobs)
        results[module] = collect(mutmut, work, module)
        print(summary_line(module, results[module]["counts"]), flush=True)
    write_report(args.report, results)
    return 0 if all(r["counts"]["score"] >= args.target for r in results.values()) else 1


def prepare(work: Path, module: str) -> None:
    """A fresh copy of the tracked files (working tree state) with mutmut's section for `module`."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, work / rel, follow_symlinks=False)
    write_section(work, module, files)


def write_section(work: Path, module: str, files: list[str]) -> None:
    """mutmut's [tool.mutmut] section for `module` at the end of the copy's pyproject.toml, in
    place of the one a last run wrote (a resumed run picks up a changed test subset)."""
    tests, _ = MODULES[module]
    top = sorted({p.split("/")[0] for p in files if p and "/" in p} - {"orchestrator", "tests"})
    extra = sorted(p for p in files if p and "/" not in p and p != "pyproject.toml")
    section = {
        "source_paths": ["orchestrator/"],
        "only_mutate": [module],
        "also_copy": top + extra,
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-p", "no:timeout"],
        "use_git_change_detection": False,
        "process_isolation": "forkserver",   # the sshd fixtures start hosts in the stats run: a fork of that process reaps them as workers
    }
    project = (work / "pyproject.toml").read_text().split("\n[tool.mutmut]\n")[0]
    (work / "pyproject.toml").write_text(project + "\n[tool.mutmut]\n" +
                                         "".join(f"{k} = {json.dumps(v)}\n" for k, v in section.items()))


def resume_names(mutmut: str, work: Path, module: str) -> list[str]:
    """The last run's mutants of `module` to run (again): survivors, not reached, not run, and every
    mutant of a function whose source changed since (mutmut forgets those functions' results); the
    checkout's files copied over first (a killed mutant of an unchanged function stays killed:
    tests are only added)."""
    changed = _chosen(module, changed_functions(work / module, REPO / module))
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):          # the checkout as it is now, but mutmut's own section and mutants
        if rel == "pyproject.toml" or not (REPO / rel).is_file():
            continue
        for base in (work,) if rel == module else (work, work / "mutants"):
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, base / rel, follow_symlinks=False)
    write_section(work, module, files)
    os.utime(work / module)                  # a new mtime: mutmut mutates the module again
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)     # which tests reach what: measured anew
    statuses = _statuses(mutmut, work, module)
    dotted = module.removesuffix(".py").replace("/", ".")
    again = [n for n, s in statuses.items() if s in ("survived", "no_tests", "not_run")
             and _function_of(n, dotted) not in changed]
    return sorted(again) + [_glob(dotted, f) for f in sorted(changed)]


def changed_functions(old: Path, new: Path) -> set[str]:
    """Functions and methods (`f`, `Class.method`) of `new` whose source differs from `old`'s, or that are new."""
    before, after = _function_sources(old), _function_sources(new)
    return {name for name, text in after.items() if before.get(name) != text}


def _chosen(module: str, functions: set[str]) -> set[str]:
    """Those of `functions` that MODULES mutates in `module`."""
    globs = MODULES[module][1]
    return {f for f in functions if not globs or any(fnmatch.fnmatch(f, g) for g in globs)}


def _function_sources(path: Path) -> dict[str, str]:
    text = path.read_text()
    found = {}
    for node in ast.parse(text).body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        prefix = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
        for f in members:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[prefix + f.name] = ast.get_source_segment(text, f) or ""
    return found


def _function_of(mutant: str, dotted: str) -> str:
    """`f` or `Class.method` of a mutant's name."""
    return mutant.removeprefix(f"{dotted}.x").rsplit("__mutmut_", 1)[0][1:].replace(SEP, ".")    # x_f, xǁCǁm


def run_mutmut(mutmut: str, work: Path, module: str, budget: float, jobs: int, names: list[str] | None = None) -> None:
    """`mutmut run` for `module` (its MODULES globs, or the mutants `names` of a resumed run: the
    seconds add up), stopped after `budget` seconds."""
    before = float((work / "seconds").read_text()) if names is not None and (work / "seconds").exists() else 0.0
    if names == []:
        return
    names = names or mutant_globs(module)
    log = open(work / "mutmut.log", "a")
    start = time.monotonic()
    proc = subprocess.Popen(["nice", "-n", "10", mutmut, "run", "--max-children", str(jobs), *names], cwd=work,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)     # mutmut keeps what it finished on an interrupt
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (work / "seconds").write_text(f"{before + time.monotonic() - start:.0f}\n")


def mutant_globs(module: str) -> list[str]:
    """mutmut's names of the mutants of MODULES' functions of `module` (`f*`, `Class.method`, `Class.*`)."""
    dotted = module.removesuffix(".py").replace("/", ".")
    return [_glob(dotted, f) for f in MODULES[module][1]]


def _glob(dotted: str, function: str) -> str:
    """mutmut's names of the mutants of `function` (`f`, `Class.method`, globs allowed) of module `dotted`."""
    return f"{dotted}.x{SEP}{function.replace('.', SEP)}__mutmut_*" if "." in function \
        else f"{dotted}.x_{function}__mutmut_*"


def collect(mutmut: str, work: Path, module: str) -> dict:
    """Counts, score and survivors (with their diffs and reasons) of the last run in `work`."""
    statuses = _statuses(mutmut, work, module)
    counts = {k: 0 for k in ("killed", "survived", "equivalent", "no_tests", "timeout", "not_run", "suspicious",
                             "skipped")}
    survivors = []
    for name, status in sorted(statuses.items()):
        if status == "survived" and name in EQUIVALENT:
            status = "equivalent"
        counts[status] = counts.get(status, 0) + 1
        if status in ("survived", "equivalent", "no_tests"):
            survivors.append({"name": name, "status": status,
                              "reason": EQUIVALENT.get(name) or ACCEPTED.get(name) or (
                                  "missing test" if status == "survived" else "not reached by the module's test subset")})
    show = lambda s: _diff_body(subprocess.run([mutmut, "show", s["name"]], cwd=work, capture_output=True,
                                               text=True).stdout)
    with ThreadPoolExecutor(4) as pool:     # one `mutmut show` takes a second or two
        for survivor, diff in zip(survivors, pool.map(show, survivors)):
            survivor["diff"] = diff
    ran = counts["killed"] + counts["timeout"] + counts["survived"] + counts["no_tests"] + counts["suspicious"]
    counts["score"] = round((counts["killed"] + counts["timeout"]) / ran, 4) if ran else 0.0
    counts["seconds"] = int((work / "seconds").read_text()) if (work / "seconds").exists() else None
    return {"counts": counts, "survivors": survivors}


def _statuses(mutmut: str, work: Path, module: str) -> dict[str, str]:
    """Each mutant of `module`'s MODULES functions in the last run in `work`: its status."""
    dotted = module.removesuffix(".py").replace("/", ".") + "."
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, capture_output=True, text=True).stdout
    statuses = {m.group(1): STATUS.get(m.group(2), m.group(2))
                for m in re.finditer(r"^\s*(\S+): (.+)$", out, re.M) if m.group(1).startswith(dotted)}
    if MODULES[module][1]:    # only these functions ran; the others are left out, not counted as not run
        statuses = {n: s for n, s in statuses.items() if any(fnmatch.fnmatch(n, g) for g in mutant_globs(module))}
    return statuses


def _diff_body(diff: str) -> str:
    """The changed lines of a mutant's diff (what the report shows)."""
    return "\n".join(line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def summary_line(module: str, c: dict) -> str:
    """One module's figures on one line."""
    return (f"{module:32} score {c['score']:.1%}  killed {c['killed']} (+{c['timeout']} timeout)  survived "
            f"{c['survived']}  equivalent {c['equivalent']}  no tests {c['no_tests']}  not run {c['not_run']}  "
            f"{c['seconds']} s")


def write_report(path: Path, results: dict) -> None:
    """The Markdown report and its JSON twin."""
    lines = ["# Mutation testing of the critical modules", "",
             "Written by `benchmarks/mutation.py` (mutmut). Score = killed / (mutants run - equivalent); a "
             "mutant no test of the module's subset reaches counts as not killed.", "",
             "| module | score | killed | timeout | survived | equivalent | no tests | not run | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for module, r in results.items():
        c = r["counts"]
        lines.append(f"| `{module}` | {c['score']:.1%} | {c['killed']} | {c['timeout']} | {c['survived']} | "
                     f"{c['equivalent']} | {c['no_tests']} | {c['not_run']} | {c['seconds']} |")
    for module, r in results.items():
        if r["survivors"]:
            lines += ["", f"## {module}", ""]
            for s in r["survivors"]:
                lines += [f"- `{s['name']}` ({s['status']}): {s['reason']}", "", "  ```diff",
                          *("  " + d for d in s["diff"].splitlines()), "  ```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"report: {path}")


if __name__ == "__main__":
    sys.exit(main())
