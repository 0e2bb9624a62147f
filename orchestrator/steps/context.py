"""What a step works with: the host and its open transport, the project, the run directory,
the local reference (shared by every host of the run) and the host's record, which steps fill;
the tree lock the run holds and the GPUs it claimed on the host.

Every engine command of a step runs with CUDA_VISIBLE_DEVICES set to the claimed GPUs by uuid
(one GPU's only, for the runs made once per GPU: on_each_gpu), and the step's record says which.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import secrets
import shlex
import threading
import typing
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from .. import bounded, ownership, progress, remote, state
from . import STEPS, executables, inputs
from .stamps import Files, Stamps
from ..errors import CommandError, FetchError, HostError, KdError, cause_of
from ..gpus import Request
from ..inventory import Host, Project
from ..record import GpuRun, HostRecord
from ..redaction import redact, redact_tree
from ..run_store import RunDir
from ..sync import SourceId
from ..connectors.base import Result, Transport, capture_failure

if typing.TYPE_CHECKING:      # each imports this module, or one that does, at run time
    from ..bundle_plan import BundlePlan
    from ..gpu_claims import GpuClaim
    from ..gpus import Gpu
    from ..pipeline import LocalReference, Plan

RESULT_MAX_BYTES = 16 << 20      # a result file pulled back from a host is never larger
# A nightly's and a bisect's bench measure for the benchmark history with this project command, when named.
HISTORY_BENCH = "bench_nightly"
T = TypeVar("T")
NOT_READ = object()      # a read ahead that was not made (the step makes it itself)


class StepError(HostError):
    """A step found something wrong (not a failed command: a wrong result)."""


@dataclasses.dataclass(frozen=True)
class UserCommand:
    """The command of `invoke exec`: its words as the user typed them, and the seconds it may run."""

    argv: tuple[str, ...]
    timeout: float


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a step ended when it did not raise: passed, or cached (the result of run `reused_from`
    still holds)."""

    status: str = "passed"
    message: str = ""
    reused_from: str | None = None


@dataclasses.dataclass(frozen=True)
class Reused:
    """A result file of an earlier run whose inputs are this run's: its data, that run, why it
    still holds, in words, and the tree that run had deployed."""

    data: dict
    run_id: str
    why: str
    tree: str


def _no_tree_lock(mode: str, wait: float, begin_sync: bool) -> state.HostLock:
    """The take_lock of a context outside a run that holds the tree lock: there is none to take."""
    raise ValueError(f"this step context takes no tree lock (asked for it in {mode} mode)")


@dataclasses.dataclass
class StepContext:
    """One host's view of the run, handed to each step in turn."""

    host: Host
    transport: Transport
    project: Project
    run_dir: RunDir
    source: SourceId
    owner: state.Owner
    reference: LocalReference           # the expected and local manifests
    record: HostRecord
    plan: Plan                          # the command's steps and settings (--no-cache, a nightly's, exec's command)
    step: str = ""
    log: Callable[[str], None] = print
    deployed_tree_hash: str | None = None
    secrets: tuple[str, ...] = ()       # the host's secret_env values: redacted from logs and the record
    lock: state.HostLock | None = None  # the run's tree lock on the host (None: not taken yet)
    take_lock: Callable[[str, float, bool], state.HostLock] = _no_tree_lock   # (mode, wait, begin_sync) -> the lock held
    gpu_request: Request = dataclasses.field(default_factory=Request)   # the inventory's GPU policy, --gpus over it
    claim_gpus: Callable[[Request], GpuClaim] | None = None   # request -> the claim held by the run; None: only look (doctor)
    claim: GpuClaim | None = None       # the run's GPU claim on the host (None: none taken)
    probe: Future[dict[str, list[str]]] | None = None   # the doctor probe started as the host connected (Run.prepare)
    gpus: tuple[Gpu, ...] = ()          # the GPUs claimed for the run, ascending index
    devices_used: list[str] = dataclasses.field(default_factory=list)   # CUDA_VISIBLE_DEVICES uuids of this step
    inputs_digest: str | None = None    # the digest of what this step's results depend on (results_key)
    measured: inputs.Inputs | None = None   # the inputs on the host since its last engine command
    ahead: dict[object, Future] = dataclasses.field(default_factory=dict)   # reads started by read_ahead: key -> Future
    progress: progress.Reporter = dataclasses.field(default_factory=progress.Ignored)   # the current step's
    bundles: BundlePlan | None = None   # the bundles the host runs (None: deploy, exec)
    stamps: Stamps = dataclasses.field(init=False, repr=False)   # the host's state files as this run knows them

    def __post_init__(self) -> None:
        self.stamps = Stamps(self._read_stamps, functools.partial(state.write_json, self.transport))

    def hold_tree(self, mode: str, wait: float = 0, taken: Future[state.HostLock] | None = None) -> state.HostLock:
        """Take the tree lock in `mode` for the rest of the run (waiting up to `wait` seconds), or
        hold the one `taken` already (started as take_lock(mode, wait, False)); held alone
        before a planned sync, the lock command begins the sync too (one round trip). The lock held."""
        lock = self.lock = taken.result() if taken is not None else \
            self.take_lock(mode, wait, "sync" in self.plan.steps and mode == state.EXCLUSIVE)
        if lock.stale:
            self.log(f"recovered the lock left by a run that died: {lock.stale}")
        return lock

    def held_lock(self) -> state.HostLock:
        """The tree lock the run holds; StepError when it holds none (a context outside such a run)."""
        if self.lock is None:
            raise StepError(f"the {self.step} step needs the tree lock, and this run holds none", host=self.host.name)
        return self.lock

    def read_ahead(self, steps: tuple[str, ...]) -> None:
        """Start, side by side, the host reads that `steps` make one after the other when nothing
        changed (the build and bundles keys, the state files, the input hashes, the result files
        a reuse pulls), so a no-change run waits about one round trip for all of them. Each is
        the command the step would run, taken from here only until the next engine command (which
        may change what it read). The build's executables are checked against this machine's
        records of the key of the host's last build step, and the binary's --version runs on the
        host only when they match one (steps.executables); the build step uses that only when that
        key is the build key. A run that will rebuild would throw the input hashes away: the host
        hashes them only when its build stamp names the deployed tree. The result files are read
        in one command with the state files and taken only once these show that."""
        reusable = [r for step in steps for r in STEPS[step].reuses] \
            if self.plan.reuses_results and not self.gpus else []
        tree = self.deployed_tree_hash
        # every read has a thread of its own: those that wait for the state files never hold up another
        pool = ThreadPoolExecutor(max_workers=6 + len(reusable), thread_name_prefix=f"read-ahead-{self.host.name}")
        ahead: dict[Any, Future] = {}
        keys = {name: step for step, name in (("build", "build_key"), ("bundles", "bundles_key")) if step in steps}
        if keys:                # both in one command
            outputs = pool.submit(self._outputs_of, keys, self.gpu_env())
            for name in keys:
                ahead[("engine", name)] = pool.submit(_one_of, outputs, name)
        if any(STEPS[step].reads_ahead for step in steps):
            # the state files and the result files in one command, these taken once the stamps show a build
            paths = [self.project.results[r] for r in reusable]
            files = pool.submit(self.transport.read_files,
                                state.json_paths(state.STAMPS) + [(path, RESULT_MAX_BYTES) for path in paths],
                                timeout=max(self.host.timeout("lock"), 60 if paths else 0))
            stamps = ahead["stamps"] = pool.submit(_stamps_of, files)
            if "build" in steps and self.plan.use_cache and tree:
                ahead["built"] = pool.submit(self._check_built, tree)
            if tree and (reusable or "bundles" in steps):     # the host itself checks the build stamp
                ahead["inputs"] = pool.submit(lambda: inputs.measure_if_built(self.transport, self.project, tree)
                                              or NOT_READ)
            for path in paths:
                ahead[("file", path)] = pool.submit(_once_built, stamps, tree, _one_of, files, path)
        pool.shutdown(wait=False)
        self.ahead = ahead

    def _check_built(self, tree: str) -> Any:
        """(the key, executables.Checked) for the build key of the host's last build step when it
        was of `tree` and this machine recorded it; NOT_READ otherwise."""
        key = executables.last_key(self.project, self.host)
        records = executables.load(self.project, key) if key and key.get("tree") == tree else []
        if not records:
            return NOT_READ
        return key, executables.check(self.transport, records, self.command("version", self.gpu_env(), "build"))

    def built_ahead(self, key: dict) -> Any:
        """The check of the build's executables read ahead for the build `key` (executables.Checked),
        NOT_READ when none was made for that key."""
        future = self.ahead.get("built")
        found = future.result() if future is not None else NOT_READ
        if not isinstance(found, tuple) or found[0] != key:
            return NOT_READ
        self._pinned(None)          # its --version ran on the claimed GPUs: noted for the record
        return found[1]

    def _ahead(self, key, read: Callable[[], T]) -> T:
        """The read started ahead under `key`, once done (unless it was not made: NOT_READ);
        else `read()` now."""
        future = self.ahead.get(key)
        value = future.result() if future is not None else NOT_READ
        return read() if value is NOT_READ else typing.cast(T, value)

    def _read_stamps(self) -> Files:
        """Every state file of the host (state.STAMPS), as read ahead or read now."""
        return self._ahead("stamps", lambda: state.read_jsons(self.transport, state.STAMPS))

    def changing(self):
        """The with-block in which the current step, one that changes the deployed tree (sync,
        build, bundles: Step.changes_tree), changes it: the run holds the tree lock alone for it
        (LockError naming the runs using it)."""
        if not STEPS[self.step].changes_tree:       # a step that does is declared so: the lock modes rest on it
            raise ValueError(f"the {self.step} step is not declared to change the deployed tree")
        return self.lock.exclusive() if self.lock is not None else contextlib.nullcontext()

    def gpu_env(self, gpu=None) -> dict[str, str]:
        """The environment that pins an engine command to the claimed GPUs (or to `gpu` alone,
        with its own results folder and without building: one of the runs made once per GPU)."""
        if gpu is not None:
            return {"CUDA_VISIBLE_DEVICES": gpu.uuid, "KD_RESULTS_DIR": results_dir(gpu), "KD_NO_BUILD": "1"}
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in self.gpus)} if self.gpus else {}

    def on_each_gpu(self, work: Callable[["StepContext", Any], T]) -> dict[int, T | KdError]:
        """`work(ctx, gpu)` for every claimed GPU at once, each with a context whose log lines
        say the GPU; the result or the KdError of each, by GPU index."""
        guard = threading.Lock()

        def one(gpu):
            def log(text: str) -> None:
                with guard:
                    self.log("\n".join(f"[gpu {gpu.index}] {line}" for line in str(text).split("\n")))
            try:
                one_gpu = dataclasses.replace(self, log=log, devices_used=self.devices_used)
                one_gpu.stamps = self.stamps        # one view of the host's state files
                return work(one_gpu, gpu)
            except KdError as e:
                log(str(e))
                return e
        with ThreadPoolExecutor(max_workers=len(self.gpus)) as pool:
            return dict(zip((g.index for g in self.gpus), pool.map(one, self.gpus)))

    # -- results cache: test and bench are not re-run when nothing they depend on changed ---------
    def results_key(self) -> dict | None:
        """What the current step's results depend on, as the host has it now: the content hashes
        of the executables and of the tree's other files (steps.inputs), the build key, the step's
        command and environment; its digest becomes the step's `inputs`. None (the step runs)
        without the cache (--no-cache), in a nightly run, on GPUs (what a GPU gives is never
        reused: a faulty or busy GPU must show), or when the host cannot hash them or give the
        build key."""
        if not self.plan.reuses_results or self.gpus:
            return None
        try:
            found, build = self.current_inputs(), self.build_key()
        except KdError as e:            # nothing reused, nothing stamped: the step itself decides
            self.log(f"not reused: {e.message}")
            return None
        key = {"command": self.project.commands.get(self.step_command()), "build": build,
               "env": {**remote.host_env(self.host), **self.bundle_env(), **self.gpu_env()},
               "secret_env": sorted(self.host.secret_env),      # names only: a hash of a value could be guessed
               "executables": found.executables, "files": found.files}
        self.inputs_digest = inputs.digest(key)
        return key

    def step_command(self) -> str:
        """The project command the current step runs: its Step's command (`generate` for golden), and
        for a nightly's or a bisect's bench `bench_nightly` when the project names it (docs/nightly.md,
        "Benchmark history")."""
        if self.step == "bench" and self.plan.history_bench and HISTORY_BENCH in self.project.commands:
            return HISTORY_BENCH
        return STEPS[self.step].command

    def current_inputs(self) -> inputs.Inputs:
        """The content hashes of the deployment's executables and other files (steps.inputs),
        measured on the host, once until the next engine command."""
        if self.measured is None:
            self.measured = self._ahead("inputs", lambda: inputs.measure(self.transport, self.project, self.tree_hash()))
        return self.measured

    def cached_result(self, result: str) -> Reused | None:
        """The result file `result` (a key of project.results) left by the last successful run of
        the current step with the same inputs (executables, files, build key, command,
        environment: whatever the tree hash says), pulled into the run directory; None when the
        step must run: inputs changed, no stamp, or the file is not the one the stamp recorded."""
        key = self.results_key()
        if key is None:
            return None
        stamp = self.stamps.get(STEPS[self.step].stamp)
        if not stamp or not stamp.get("run_id"):
            return None
        run_id = str(stamp["run_id"])
        if stamp.get("key") != key:
            old = stamp.get("key")
            self.log(f"not reused from run {run_id}: "
                     f"{inputs.changes(old, key) if isinstance(old, dict) else 'its stamp names no inputs'}")
            return None
        try:
            data = self.pull_json(result)
        except HostError:
            return None
        if _digest(data) != stamp.get("digest"):
            self.log(f"not reused from run {run_id}: {self.project.results[result]} is not the file it left")
            return None
        made_with = str(stamp.get("tree") or "?")
        why = "the same executables, build key, bundles and scripts" + (
            "" if made_with == self.tree_hash() else f"; it ran on tree {made_with[:12]}, not this {self.tree_hash()[:12]}")
        self.log(f"{self.project.results[result]}: reused from run {run_id}, the last successful {self.step} "
                 f"with {why} (not re-run; --no-cache re-runs it)")
        return Reused(data, run_id, why, made_with)

    def stamp_result(self, data: dict) -> None:
        """Record that the current step passed with these inputs (measured again now: the step's
        command may have rebuilt) and this result file."""
        key = self.results_key()
        if key is not None:
            self.stamps.write(STEPS[self.step].stamp, {"key": key, "digest": _digest(data),
                                                      "run_id": self.run_dir.run_id, "tree": self.tree_hash()})

    def build_key(self) -> dict:
        """The engine's build key on the host (compilers, flags, arch: what build.sh --key
        prints), asked once per run and kept in the host's record."""
        if self.record.build_key is None:
            text = self.engine_output("build_key")
            try:        # bounded as every JSON from a host is: its depth, size and numbers
                key = bounded.loads(text, f"the build key (the {self.project.commands['build_key']!r} command's output)")
            except ValueError as e:
                raise StepError(str(e), host=self.host.name, tail=text[-2000:]) from None
            if not isinstance(key, dict):
                raise StepError("the build key is not a JSON object", host=self.host.name, tail=text)
            self.record.build_key = key
        return self.record.build_key

    def tree_hash(self) -> str:
        """The tree hash deployed on the host: this run's sync, or the host's deploy record."""
        if self.deployed_tree_hash is None:
            deployed = self.stamps.get("deploy.json") or {}
            if not deployed.get("tree_hash"):
                raise StepError("nothing has been deployed to the host yet: run the sync step", host=self.host.name)
            self.deployed_tree_hash = self.record.deployed_tree_hash = str(deployed["tree_hash"])
        return self.deployed_tree_hash

    def engine(self, name: str, env: dict[str, str] | None = None) -> Result:
        """Run the project's command `name` on the host under the current step's timeout, `env`
        added to its environment; its output goes to the step log, but for its progress reports
        (progress.parse), which go to the step's progress. Raises CommandError (with the tail)
        unless it exits 0."""
        snippet = self.project.commands[name]
        timeout = self.host.timeout(self.step)
        env = self._pinned(env)
        self.measured, self.ahead = None, {}       # the command may change what results depend on
        command = remote.step(self.host, snippet, timeout, with_secrets=True, env=env, what=name)
        self.log(f"$ {' '.join(f'{k}={v}' for k, v in (env or {}).items())}{' ' if env else ''}{snippet}")
        result = self.transport.run(command, on_output=self.output)
        if not result.ok:
            why = f"timed out after {timeout:g} s" if result.timed_out else f"exited with {result.exit_code}"
            cause = None if result.timed_out else cause_of(result.tail)
            why += f": {cause}" if cause else ""
            raise CommandError(f"{name} {why}", host=self.host.name, command=snippet,
                               exit_status=result.exit_code, tail=result.tail, timed_out=result.timed_out)
        return result

    def output(self, line: str) -> None:
        """One line of an engine command's output: a progress report goes to the step's
        progress, any other line to the step log."""
        update = progress.parse(line)
        if update is None:
            self.log(line)
        else:
            self.progress.report(update)

    def bundle_env(self) -> dict[str, str]:
        """The selected bundles' environment of every engine command (bundle_plan: KD_MAX_MEMORY,
        KD_CONFIGS)."""
        return self.bundles.env() if self.bundles is not None else {}

    def _pinned(self, env: dict[str, str] | None) -> dict[str, str]:
        """`env` over the bundles' and the claimed GPUs' environment; the uuids are noted for the record."""
        env = {**self.bundle_env(), **self.gpu_env(), **(env or {})}
        for uuid in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
            if uuid and uuid not in self.devices_used:
                self.devices_used.append(uuid)
        return env

    def engine_output(self, name: str, max_bytes: int = 1 << 20) -> str:
        """The standard output of a short project command (e.g. build_key, tree_hash)."""
        env = self._pinned(None)
        return self._ahead(("engine", name), lambda: self._output_of(name, env, self.step, max_bytes))

    def command(self, name: str, env: dict[str, str] | None = None, step: str | None = None) -> remote.Command:
        """The project's command `name` as the host runs it for `step` (the current one), `env`
        (else the claimed GPUs') added to its environment."""
        env = self._pinned(None) if env is None else env
        return remote.step(self.host, self.project.commands[name], self.host.timeout(step or self.step), what=name,
                           env=env)

    def _output_of(self, name: str, env: dict[str, str], step: str, max_bytes: int = 1 << 20) -> str:
        return self.transport.capture(self.command(name, env, step), max_bytes=max_bytes).decode(errors="replace")

    def _outputs_of(self, steps: dict[str, str], env: dict[str, str],
                    max_bytes: int = 1 << 20) -> dict[str, str | CommandError]:
        """The output of each short project command named in `steps` (name -> the step it is
        for), run side by side in one host command under the longest of their steps' timeouts:
        each as _output_of gives it, or the CommandError _output_of would raise."""
        mark = secrets.token_hex(16)
        # each command's output (stderr with it, as a command of its own gives it) and exit status
        # through a file descriptor of its own, printed one after the other
        fds = range(5, 5 + len(steps))
        script = "".join(f"exec {fd}< <(bash -c {shlex.quote(self.project.commands[name])} 2>&1; "
                         f"printf '\\n{mark} %d\\n' \"$?\")\n" for fd, name in zip(fds, steps))
        script += " ".join(f"cat <&{fd};" for fd in fds)
        timeout = max(self.host.timeout(step) for step in steps.values())
        command = remote.step(self.host, script, timeout, env=env, what=" and ".join(steps))
        rest = self.transport.capture(command, max_bytes=len(steps) * (max_bytes + len(mark) + 16))
        found: dict[str, str | CommandError] = {}
        for name in steps:
            output, sep, rest = rest.partition(f"\n{mark} ".encode())
            status, newline, rest = rest.partition(b"\n")
            if not sep or not newline or not status.isdigit():
                raise CommandError(f"{command.what}: an answer that does not frame as asked", host=self.host.name,
                                   command=command.line, tail=output[-2000:].decode(errors="replace"))
            text = output.decode(errors="replace")
            why = capture_failure(int(status), len(output), max_bytes)
            found[name] = text if why is None else CommandError(
                f"{name} {why}", host=self.host.name, command=self.project.commands[name], exit_status=int(status),
                tail=text[-2000:])
        return found

    def pull_json(self, result: str, gpu=None) -> dict:
        """Read the project's result file `result` (a key of project.results; of `gpu`'s run: from
        its results folder) from the host, parse it within limits (orchestrator.bounded) and keep
        it, redacted, in the run directory (<host>/<file name>, <host>/gpu-<index>.<file name>,
        0600); StepError names the file when it is not JSON or breaks a limit."""
        remote_path = self.project.results[result]
        name = remote_path.rsplit("/", 1)[-1]
        if gpu is not None:
            remote_path, name = f"{results_dir(gpu)}/{name}", f"gpu-{gpu.index}.{name}"
        local = self.run_dir.host_file(self.host.name, name)
        raw = self._ahead(("file", remote_path) if gpu is None else None,
                          lambda: self.transport.read_file(remote_path, max_bytes=RESULT_MAX_BYTES))
        text = redact(raw.decode("utf-8", errors="replace"), self.secrets)
        try:
            data = redact_tree(bounded.loads(text, remote_path, max_bytes=RESULT_MAX_BYTES), self.secrets)
        except ValueError as e:
            ownership.write_private(local, text)
            raise StepError(str(e), host=self.host.name) from None
        # a secret may also hide in a JSON escape (\u0041...): what is kept is the redacted parse
        ownership.write_private(local, json.dumps(data, indent=1) if self.secrets else text)
        if not isinstance(data, dict):
            raise StepError(f"{remote_path} does not hold a JSON object", host=self.host.name)
        return data


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


def gpu_run(ctx: StepContext, gpu) -> GpuRun:
    """The host record's entry for `gpu`'s own runs (golden, test), made on first use."""
    for entry in ctx.record.gpu_runs:
        if entry.gpu == gpu.index:
            return entry
    entry = GpuRun(gpu.index, gpu.uuid, results_dir(gpu))
    ctx.record.gpu_runs.append(entry)
    return entry


def results_dir(gpu) -> str:
    """Where the engine's commands run for one GPU write their result files (KD_RESULTS_DIR)."""
    return f"build/gpu-{gpu.index}"


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
