"""What a step works with (StepContext): the host, the project, the run directory, the local
reference (shared by every host of the run) and the host's record, which steps fill; and the
objects that do the context's jobs: the host session (the connection, the tree lock and GPUs the
run holds: session.py), the engine shell (the step's engine commands, pinned to the claimed GPUs
under the step's deadline: shell.py) and the host reads (started ahead, kept until the next
engine command: host_reads.py). The context itself decides what a step's results depend on and
whether those of an earlier run still hold (results_key, cached_result).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
import typing
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from .. import bounded, ownership, remote, state
from ..runner import progress
from . import STEPS, inputs
from .host_reads import RESULT_MAX_BYTES, HostReads
from .session import HostSession
from .shell import EngineShell, results_dir
from .stamps import Stamps
from ..errors import HostError, KdError, StepError
from ..inventory import Host, Project
from ..records.record import GpuRun, HostRecord
from ..records.redaction import redact, redact_tree
from ..records.run_store import RunDir
from ..sync import SourceId

if typing.TYPE_CHECKING:      # each imports this module, or one that does, at run time
    from ..resources.bundle_plan import BundlePlan
    from ..resources.gpus import Gpu
    from ..runner.pipeline import LocalReference, Plan

# A nightly's and a bisect's bench measure for the benchmark history with this project command, when named.
HISTORY_BENCH = "bench_nightly"
T = TypeVar("T")


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


@dataclasses.dataclass
class StepContext:
    """One host's view of the run, handed to each step in turn."""

    host: Host
    session: HostSession                # the connection, and the tree lock and GPUs the run holds over it
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
    inputs_digest: str | None = None    # the digest of what this step's results depend on (results_key)
    progress: progress.Reporter = dataclasses.field(default_factory=progress.Ignored)   # the current step's
    bundles: BundlePlan | None = None   # the bundles the host runs (None: deploy, exec)
    shell: EngineShell = dataclasses.field(init=False, repr=False)    # the step's engine commands
    reads: HostReads = dataclasses.field(init=False, repr=False)      # the host reads, ahead or kept
    stamps: Stamps = dataclasses.field(init=False, repr=False)   # the host's state files as this run knows them

    def __post_init__(self) -> None:
        self.shell = EngineShell(self.session, self.project, self.bundles, out=self.output, step=self.step)
        self.reads = HostReads(self.shell, self.plan)
        self.stamps = Stamps(self.reads.stamps, lambda name, data: state.write_json(self.session.transport, name, data))

    def begin(self, step: str, log: Callable[[str], None]) -> None:
        """From now on the context is `step`'s: its log, its engine commands' deadline, its record
        of the GPUs used and of what its results depend on."""
        self.step, self.log, self.inputs_digest = step, log, None
        self.shell.begin(step)

    def output(self, line: str) -> None:
        """One line of an engine command's output: a progress report goes to the step's
        progress, any other line to the step log."""
        update = progress.parse(line)
        if update is None:
            self.log(line)
        else:
            self.progress.report(update)

    def on_each_gpu(self, work: Callable[["StepContext", Gpu], T]) -> dict[int, T | KdError]:
        """`work(ctx, gpu)` for every claimed GPU at once, each with a context whose log lines
        say the GPU (its host session, host reads and state files this one's); the result or the
        KdError of each, by GPU index."""
        guard = threading.Lock()

        def one(gpu):
            def log(text: str) -> None:
                with guard:
                    self.log("\n".join(f"[gpu {gpu.index}] {line}" for line in str(text).split("\n")))
            try:
                one_gpu = copy.copy(self)
                one_gpu.log, one_gpu.shell = log, copy.copy(self.shell)     # the step's devices_used shared
                one_gpu.shell.out = one_gpu.output
                return work(one_gpu, gpu)
            except KdError as e:
                log(str(e))
                return e
        gpus = self.session.gpus
        with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
            return dict(zip((g.index for g in gpus), pool.map(one, gpus)))

    # -- results cache: test and bench are not re-run when nothing they depend on changed ---------
    def results_key(self) -> dict | None:
        """What the current step's results depend on, as the host has it now: the content hashes
        of the executables and of the tree's other files (steps.inputs), the build key, the step's
        command and environment; its digest becomes the step's `inputs`. None (the step runs)
        without the cache (--no-cache), in a nightly run, on claimed GPUs or a Slurm entry (what
        a GPU or a node gives is never reused: HostSession.measures_anew), or when the host cannot
        hash them or give the build key."""
        if not self.plan.reuses_results or self.session.measures_anew:
            return None
        try:
            found, build = self.reads.inputs(self.tree_hash), self.build_key()
        except KdError as e:            # nothing reused, nothing stamped: the step itself decides
            self.log(f"not reused: {e.message}")
            return None
        key = {"command": self.project.commands.get(self.step_command()), "build": build,
               "env": {**remote.host_env(self.host), **self.shell.bundle_env(), **self.shell.gpu_env()},
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
            text = self.reads.output("build_key")
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

    def pull_json(self, result: str, gpu: Gpu | None = None) -> dict:
        """Read the project's result file `result` (a key of project.results; of `gpu`'s run: from
        its results folder) from the host, parse it within limits (orchestrator.bounded) and keep
        it, redacted, in the run directory (<host>/<file name>, <host>/gpu-<index>.<file name>,
        0600); StepError names the file when it is not JSON or breaks a limit."""
        remote_path = self.project.results[result]
        name = remote_path.rsplit("/", 1)[-1]
        if gpu is not None:
            remote_path, name = f"{results_dir(gpu)}/{name}", f"gpu-{gpu.index}.{name}"
        local = self.run_dir.host_file(self.host.name, name)
        raw = self.reads.get(("file", remote_path) if gpu is None else None,
                             lambda: self.session.transport.read_file(remote_path, max_bytes=RESULT_MAX_BYTES))
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


def gpu_run(ctx: StepContext, gpu: Gpu) -> GpuRun:
    """The host record's entry for `gpu`'s own runs (golden, test), made on first use."""
    for entry in ctx.record.gpu_runs:
        if entry.gpu == gpu.index:
            return entry
    entry = GpuRun(gpu.index, gpu.uuid, results_dir(gpu))
    ctx.record.gpu_runs.append(entry)
    return entry


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
