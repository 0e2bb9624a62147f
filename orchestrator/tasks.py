"""The orchestrator's tasks (`invoke --list`, `kdtree-orch --list`, `invoke deploy -h`), as the
collection `namespace` that the checkout's tasks.py and the `kdtree-orch` program both load.

Every task takes --inventory (default: see cli.default_inventory); host tasks take --host/-H NAME
(repeatable), --group NAME or --all; no selection means the host `local`. `-h` is help on every task.
Exit codes: 0 ok, 1 a host failed, 2 usage or inventory error (Invoke's own parse errors: 1).
"""
from __future__ import annotations

import sys

from invoke import Collection, Exit, Task, task as _invoke_task

from . import cli
from .runner.console import Console


class KdTask(Task):
    """A task whose `-h` is always help (Invoke would give it to --host): --host is `-H`."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names | {"h", "H"})
        if name == "host":
            opts["names"] = [opts["names"][0], "H"]
        return opts


def task(*args, **kwargs):
    """Invoke's @task with KdTask (explicit short flags; -h is help)."""
    return _invoke_task(*args, klass=KdTask, **kwargs)

def _inventory(c, inventory: str | None) -> str | None:
    """The task's --inventory, else the program's (`kdtree-orch --inventory PATH TASK`)."""
    return inventory or c.config.get("kdtree", {}).get("inventory")


def _parallel(value) -> int | None:
    from .runner.parallel import parse_parallel        # a UsageError (exit 2) for anything but a count
    return parse_parallel(value)


SELECT_HELP = {"host": "a host of the inventory (repeatable)", "group": "every host of a group",
               "all": "every host", "inventory": "the inventory file (default: the checkout's hosts.yaml, else ./hosts.yaml)",
               "parallel": "hosts in flight at once (default: 4 per core, at most 32)",
               "no_persist": "use a connection of the run's own and keep none warm (as `persist: false`)"}


@task(help={"inventory": SELECT_HELP["inventory"]})
def hosts(c, inventory=None):
    """List the inventory's hosts and groups."""
    with cli.exit_codes():
        inv = cli.load_inventory(_inventory(c, inventory))
        raise Exit(code=cli.hosts_table(inv, Console()))


@task(iterable=["host"], help=SELECT_HELP)
def doctor(c, host=None, group=None, all=False, inventory=None, parallel=None, no_persist=False):
    """Check the selected hosts: reachable, auth, rsync, nvcc, GPU and arch, disk, python+numpy."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, persist=not no_persist)
        raise Exit(code=cli.doctor(inv, selected, Console(), _parallel(parallel)))


@task(iterable=["fingerprint"], help={"host": "the host whose key to pin", "inventory": SELECT_HELP["inventory"],
                                      "fingerprint": "the SHA256:... fingerprint you expect (repeatable)"})
def trust(c, host=None, fingerprint=None, inventory=None):
    """Show a host's SSH key fingerprint and pin it in the project known_hosts file."""
    with cli.exit_codes():
        raise Exit(code=cli.trust(cli.load_host(_inventory(c, inventory), host, "trust"), fingerprint or [], Console()))


@task(iterable=["host"], help={**SELECT_HELP, "dry_run": "print the commands that would run; change nothing"})
def deploy(c, host=None, group=None, all=False, inventory=None, dry_run=False, parallel=None, no_persist=False):
    """Sync the engine source to the selected hosts (rsync --delete, verified by tree hash)."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, persist=not no_persist)
        raise Exit(code=cli.deploy(inv, selected, Console(), dry_run, _parallel(parallel)))


@task(name="exec", iterable=["host"],
      help={**SELECT_HELP, "timeout": f"seconds the command may run on each host (default {cli.EXEC_TIMEOUT}); "
                                      "then it and everything it started there are killed"})
def exec_(c, host=None, group=None, all=False, inventory=None, timeout=None, parallel=None, no_persist=False):
    """Run one command on the selected hosts: invoke exec -H HOST -- COMMAND [ARG...] (each word as typed)."""
    with cli.exit_codes():
        # The words come from the command line itself: Invoke's remainder has lost their quoting.
        words = cli.command_words(sys.argv, getattr(c, "remainder", None))
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, persist=not no_persist)
        raise Exit(code=cli.exec_command(inv, selected, Console(), words, timeout, _parallel(parallel)))


STEP_HELP = {"steps": "comma list of steps to run (default: preflight,sync,build,bundles,golden,test,bench; "
                       "nightly adds stress; validate runs stress when named here)",
             "skip": "comma list of steps to leave out", "report_dir": "write the run here instead of runs/<run-id>",
             "no_cache": "rebuild and regenerate even when nothing changed",
             "history": "the benchmark history file (default: runs/history.sqlite)",
             "gpus": "GPUs per host, over gpu_policy/gpu_count: a count (2), all (every GPU the policy allows), "
                     "or indices (0,3; one index as 3,)",
             "bundles": "bundle tiers per host, over its `bundles`: a comma list of project.bundle_tiers (default,k2wide)"}


@task(iterable=["host"], help={**SELECT_HELP, **STEP_HELP})
def validate(c, host=None, group=None, all=False, inventory=None, steps=None, skip=None, report_dir=None,
             no_cache=False, history=None, gpus=None, parallel=None, no_persist=False, bundles=None):
    """Sync, build, regenerate bundles, check golden tokens, test and benchmark; write the reports."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, persist=not no_persist)
        raise Exit(code=cli.validate(inv, selected, Console(), steps=steps, skip=skip, report_dir=report_dir,
                                     no_cache=no_cache, history=history, gpus=gpus, parallel=_parallel(parallel),
                                     bundles=bundles))


@task(positional=["path"], help={"host": "the host the bundle is on", "path": "the bundle on the host (absolute, or relative to remote_dir)",
            "max_memory": "the engine's --max-memory in bytes (default: the engine's 4 GiB)",
            "inventory": SELECT_HELP["inventory"]})
def check_bundle(c, path=None, host=None, max_memory=None, inventory=None):
    """Check a bundle already on a host (your own weights) with the deployed engine: read it, AR == its golden tokens."""
    with cli.exit_codes():
        raise Exit(code=cli.check_bundle(cli.load_inventory(_inventory(c, inventory)),
                                         cli.load_host(_inventory(c, inventory), host, "check-bundle"), Console(),
                                         path, max_memory))


@task(iterable=["host"], help={**SELECT_HELP, "bundles": STEP_HELP["bundles"],
                               "remove": "remove the stale bundles (default: only list them, a dry run)"})
def clean_bundles(c, host=None, group=None, all=False, inventory=None, bundles=None, remove=False, parallel=None,
                  no_persist=False):
    """List the bundles on the hosts with their sizes; --remove deletes those their bundle tiers do not use."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, persist=not no_persist)
        raise Exit(code=cli.clean_bundles(inv, selected, Console(), bundles, remove, _parallel(parallel)))


@task(iterable=["host"], help={**SELECT_HELP, **STEP_HELP,
                               "baseline": "compare with this baseline file by a fixed ratio instead of the history"})
def nightly(c, host=None, group=None, all=False, inventory=None, baseline=None, report_dir=None, steps=None,
            skip=None, no_cache=False, history=None, gpus=None, parallel=None, no_persist=False, bundles=None):
    """Validate every host but `local` (or the selection) and flag benchmark regressions from history (exit 3)."""
    with cli.exit_codes():
        inv, selected = cli.load_selection(_inventory(c, inventory), host, group, all, nightly=True,
                                           persist=not no_persist)
        raise Exit(code=cli.validate(inv, selected, Console(), steps=steps, skip=skip, report_dir=report_dir,
                                     no_cache=no_cache, command="nightly", baseline=baseline, history=history, gpus=gpus,
                                     parallel=_parallel(parallel), bundles=bundles))


@task(help={"close": "end every warm connection (and remove stale entries)"})
def connections(c, close=False):
    """List your warm SSH connections (kept between runs, closed when idle); --close ends them."""
    with cli.exit_codes():
        raise Exit(code=cli.connections(Console(), close))


@task(help={"rebuild": "reindex the history from the run directories under runs/", "html": "write runs/history.html",
            "history": STEP_HELP["history"], "inventory": SELECT_HELP["inventory"]})
def history(c, rebuild=False, html=False, history=None, inventory=None):
    """The benchmark history: every series' latest verdict; --rebuild reindexes, --html writes the dashboard."""
    with cli.exit_codes():
        raise Exit(code=cli.history(cli.load_inventory(_inventory(c, inventory)), Console(), history, rebuild, html))


@task(help={"host": "the host that builds and measures each commit", "good": "a revision known good",
            "bad": "a revision known bad", "metric": "the benchmark metric that regressed",
            "golden": "find the first commit whose golden check fails", "inventory": SELECT_HELP["inventory"]})
def bisect(c, host=None, good=None, bad=None, metric=None, golden=False, inventory=None):
    """Find the first bad commit between --good and --bad (a git worktree; your checkout is never touched)."""
    with cli.exit_codes():
        inv = cli.load_inventory(_inventory(c, inventory))
        raise Exit(code=cli.bisect(inv, cli.load_host(_inventory(c, inventory), host, "bisect"), Console(), good, bad,
                                   metric, golden))


@task(help={"run": "a run id, a run directory or latest (default: the newest validate or nightly run)", "out": "the baseline file to write",
            "inventory": SELECT_HELP["inventory"]})
def baseline(c, out=None, run=None, inventory=None):
    """Write a benchmark baseline file (for nightly --baseline) from a run's passing hosts."""
    with cli.exit_codes():
        inv = cli.load_inventory(_inventory(c, inventory))
        raise Exit(code=cli.baseline(inv, Console(), out, run))


@task(help={"run": "a run id, a run directory or latest (default)", "compare": "a second run to compare with",
            "inventory": SELECT_HELP["inventory"]})
def report(c, run=None, compare=None, inventory=None):
    """Re-render a run's report.md, report.html and junit.xml; --compare puts two runs' benchmarks side by side."""
    with cli.exit_codes():
        inv = cli.load_inventory(_inventory(c, inventory))
        raise Exit(code=cli.rerender(inv, Console(), run, compare))


@task(help={"keep": "how many of the newest runs to keep (default 10)", "inventory": SELECT_HELP["inventory"]})
def clean(c, keep=None, inventory=None):
    """Delete old runs under runs/, keeping the newest --keep (and always the newest passing nightly)."""
    with cli.exit_codes():
        inv = cli.load_inventory(_inventory(c, inventory))
        raise Exit(code=cli.clean(inv, Console(), keep))


@task(help={"out": "the folder to build into (default: site/ of the checkout)"})
def docs(c, out=None):
    """Build the documentation site (docs/, MkDocs) in strict mode and print its folder's absolute path."""
    with cli.exit_codes():
        from . import docs_site
        print(docs_site.build(out))


namespace = Collection.from_module(sys.modules[__name__])
