"""What the steps read on their host (StepContext.reads): the build and bundles keys, the state
files, the input hashes, the result files a reuse pulls, the build's executables. On a run that
changes nothing they are started side by side before the first step that needs them
(`read_ahead`), so the run waits about one round trip for all of them; each is kept only until
the next engine command, which may change what it read.
"""
from __future__ import annotations

import typing
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from .. import state
from ..errors import FetchError, KdError
from . import STEPS, executables, inputs
from .shell import EngineShell
from .stamps import Files

if typing.TYPE_CHECKING:      # the pipeline imports this module, through the step context, at run time
    from ..runner.pipeline import Plan

RESULT_MAX_BYTES = 16 << 20      # a result file pulled back from a host is never larger
NOT_READ = object()      # a read ahead that was not made (the step makes it itself)
T = TypeVar("T")


class HostReads:
    """The host reads of one host's steps, started ahead or made when first asked, each kept
    until the next engine command the shell runs."""

    def __init__(self, shell: EngineShell, plan: Plan):
        self.shell, self.plan = shell, plan
        self.ahead: dict[object, Future] = {}        # reads started by read_ahead: key -> Future
        self.measured: inputs.Inputs | None = None    # the inputs on the host since its last engine command
        self._generation = shell.generation

    def read_ahead(self, steps: tuple[str, ...], tree: str | None) -> None:
        """Start, side by side, the host reads that `steps` make one after the other when nothing
        changed (the build and bundles keys, the state files, the input hashes, the result files
        a reuse pulls), `tree` being the deployed tree as the run knows it. Each is the command
        the step would run, taken from here only until the next engine command. The build's
        executables are checked against this machine's records of the key of the host's last
        build step, and the binary's --version runs on the host only when they match one
        (steps.executables); the build step uses that only when that key is the build key. A
        run that will rebuild would throw the input hashes away: the host hashes them only when
        its build stamp names the deployed tree. The result files are read in one command with
        the state files and taken only once these show that."""
        session, project = self.shell.session, self.shell.project
        reusable = [r for step in steps for r in STEPS[step].reuses] \
            if self.plan.reuses_results and not session.measures_anew else []
        # every read has a thread of its own: those that wait for the state files never hold up another
        pool = ThreadPoolExecutor(max_workers=6 + len(reusable), thread_name_prefix=f"read-ahead-{session.host.name}")
        ahead: dict[object, Future] = {}
        keys = {name: step for step, name in (("build", "build_key"), ("bundles", "bundles_key")) if step in steps}
        if keys:                # both in one command
            outputs = pool.submit(self.shell.outputs, keys, self.shell.gpu_env())
            for name in keys:
                ahead[("engine", name)] = pool.submit(_one_of, outputs, name)
        if any(STEPS[step].reads_ahead for step in steps):
            # the state files and the result files in one command, these taken once the stamps show a build
            paths = [project.results[r] for r in reusable]
            files = pool.submit(session.transport.read_files,
                                state.json_paths(state.STAMPS) + [(path, RESULT_MAX_BYTES) for path in paths],
                                timeout=max(session.host.timeout("lock"), 60 if paths else 0))
            stamps = ahead["stamps"] = pool.submit(_stamps_of, files)
            if "build" in steps and self.plan.use_cache and tree:
                ahead["built"] = pool.submit(self._check_built, tree)
            if tree and (reusable or "bundles" in steps):     # the host itself checks the build stamp
                ahead["inputs"] = pool.submit(lambda: inputs.measure_if_built(session.transport, project, tree)
                                              or NOT_READ)
            for path in paths:
                ahead[("file", path)] = pool.submit(_once_built, stamps, tree, _one_of, files, path)
        pool.shutdown(wait=False)
        self.ahead, self._generation = ahead, self.shell.generation

    def _check_built(self, tree: str) -> Any:
        """(the key, executables.Checked) for the build key of the host's last build step when it
        was of `tree` and this machine recorded it; NOT_READ otherwise."""
        project, host = self.shell.project, self.shell.session.host
        key = executables.last_key(project, host)
        records = executables.load(project, key) if key and key.get("tree") == tree else []
        if not records:
            return NOT_READ
        shell = self.shell
        return key, executables.check(shell.session.transport, records,
                                      shell.command("version", shell.gpu_env(), "build"))

    def built(self, key: dict) -> Any:
        """The check of the build's executables read ahead for the build `key` (executables.Checked),
        NOT_READ when none was made for that key."""
        future = self._current().get("built")
        found = future.result() if future is not None else NOT_READ
        if not isinstance(found, tuple) or found[0] != key:
            return NOT_READ
        self.shell.pinned(None)          # its --version ran on the claimed GPUs: noted for the record
        return found[1]

    def get(self, key: object, read: Callable[[], T]) -> T:
        """The read started ahead under `key`, once done (unless it was not made: NOT_READ);
        else `read()` now."""
        future = self._current().get(key)
        value = future.result() if future is not None else NOT_READ
        return read() if value is NOT_READ else typing.cast(T, value)

    def stamps(self) -> Files:
        """Every state file of the host (state.STAMPS), as read ahead or read now."""
        return self.get("stamps", lambda: state.read_jsons(self.shell.session.transport, state.STAMPS))

    def output(self, name: str, max_bytes: int = 1 << 20) -> str:
        """The standard output of a short project command (e.g. build_key, version) for the
        current step, as read ahead or run now."""
        env = self.shell.pinned(None)
        return self.get(("engine", name), lambda: self.shell.output(name, env, max_bytes=max_bytes))

    def inputs(self, tree: Callable[[], str]) -> inputs.Inputs:
        """The content hashes of the deployment's executables and other files (steps.inputs) of
        the deployed tree (`tree()`), measured on the host, once until the next engine command."""
        self._current()
        if self.measured is None:
            self.measured = self.get("inputs", lambda: inputs.measure(self.shell.session.transport,
                                                                      self.shell.project, tree()))
        return self.measured

    def _current(self) -> dict[object, Future]:
        """The reads kept, after forgetting them all when an engine command ran since they were made."""
        if self._generation != self.shell.generation:
            self.ahead, self.measured, self._generation = {}, None, self.shell.generation
        return self.ahead


def _once_built(stamps: Future, tree: str | None, read: Callable[..., Any], *args, **kwargs) -> Any:
    """`read(*args, **kwargs)` once the state files (`stamps`) show a build of `tree`; NOT_READ
    when they do not (the build step will rebuild) or could not be read."""
    try:
        build = stamps.result().get("build.json")
    except Exception:       # the stamps.get() that needs them reads them again and reports it
        return NOT_READ
    key = build.get("key") if isinstance(build, dict) else None
    return read(*args, **kwargs) if isinstance(key, dict) and key.get("tree") == tree else NOT_READ


def _stamps_of(files: Future) -> dict[str, dict | None]:
    """The state files among the files read ahead (state.read_jsons' documents)."""
    try:
        found = files.result()
    except FetchError:
        found = None
    return state.parse_jsons(found, state.STAMPS)


def _one_of(reads: Future, key: str) -> Any:
    """What one read among several made in one command (`reads`: key -> value or error) gave
    for `key`: its value, or its error raised."""
    found = reads.result()[key]
    if isinstance(found, KdError):
        raise found
    return found
