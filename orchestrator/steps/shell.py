"""The engine shell: how a step's engine commands (the project's commands of hosts.yaml) run on
its host (StepContext.shell): in remote_dir, under the current step's deadline (the host's
timeout for it), pinned to the claimed GPUs by uuid (CUDA_VISIBLE_DEVICES: the step's record
says which) and with the selected bundles' environment; short ones that several steps ask for
fused into one host command.

Every engine command line of a step is built by `EngineShell.build`.
"""
from __future__ import annotations

import dataclasses
import secrets
import shlex
import typing
from typing import Callable

from .. import remote
from ..connectors.base import Result, capture_failure
from ..errors import CommandError, cause_of
from ..inventory import Project
from .session import HostSession

if typing.TYPE_CHECKING:      # bundle_plan imports what imports this module at run time
    from ..resources.bundle_plan import BundlePlan
    from ..resources.gpus import Gpu


@dataclasses.dataclass
class EngineShell:
    """The engine commands of one host's steps: built, pinned and run under the current step's
    deadline; `generation` counts those that may have changed the host's tree."""

    session: HostSession
    project: Project
    bundles: BundlePlan | None = None   # the bundles the host runs (None: deploy, exec)
    out: Callable[[str], None] = print  # each line of an engine command's output (StepContext.output)
    step: str = ""                      # the current step: its timeout is every command's deadline
    devices_used: list[str] = dataclasses.field(default_factory=list)   # CUDA_VISIBLE_DEVICES uuids of this step
    generation: int = 0                 # engine commands run so far (each may change what a host read gave)

    def begin(self, step: str) -> None:
        """The commands from now on are `step`'s: its deadline, its record of the GPUs used."""
        self.step, self.devices_used = step, []

    def build(self, script: str, *, step: str | None = None, env: dict[str, str] | None = None,
              what: str = "command", with_secrets: bool = False) -> remote.Command:
        """`script` (trusted: the project's commands) as the host runs it in remote_dir under
        `step`'s deadline (the current step's), `env` added to the steps' environment;
        `with_secrets`: it reads the host's secret_env on stdin."""
        host = self.session.host
        command = remote.step(host, script, host.timeout(step or self.step), with_secrets=with_secrets, env=env,
                              what=what)
        return self.session.on_node(command)

    def command(self, name: str, env: dict[str, str] | None = None, step: str | None = None) -> remote.Command:
        """The project's command `name` as the host runs it for `step` (the current one), `env`
        (else the claimed GPUs') added to its environment."""
        return self.build(self.project.commands[name], step=step, env=self.pinned(None) if env is None else env,
                          what=name)

    def run(self, name: str, env: dict[str, str] | None = None) -> Result:
        """Run the project's command `name` on the host under the current step's deadline, `env`
        added to its environment; its output goes to `out` line by line. Raises CommandError
        (with the tail) unless it exits 0."""
        snippet = self.project.commands[name]
        timeout = self.session.host.timeout(self.step)
        env = self.pinned(env)
        self.generation += 1        # the command may change what results depend on
        command = self.build(snippet, env=env, what=name, with_secrets=True)
        self.out(f"$ {' '.join(f'{k}={v}' for k, v in env.items())}{' ' if env else ''}{snippet}")
        result = self.session.transport.run(command, on_output=self.out)
        if not result.ok:
            why = f"timed out after {timeout:g} s" if result.timed_out else f"exited with {result.exit_code}"
            cause = None if result.timed_out else cause_of(result.tail)
            why += f": {cause}" if cause else ""
            raise CommandError(f"{name} {why}", host=self.session.host.name, command=snippet,
                               exit_status=result.exit_code, tail=result.tail, timed_out=result.timed_out)
        return result

    def output(self, name: str, env: dict[str, str], step: str | None = None, max_bytes: int = 1 << 20) -> str:
        """The standard output of the short project command `name` (e.g. build_key, version) run
        for `step` (the current one) with `env`."""
        return self.session.transport.capture(self.command(name, env, step),
                                              max_bytes=max_bytes).decode(errors="replace")

    def outputs(self, steps: dict[str, str], env: dict[str, str],
                max_bytes: int = 1 << 20) -> dict[str, str | CommandError]:
        """The output of each short project command named in `steps` (name -> the step it is
        for), run side by side in one host command under the longest of their steps' deadlines:
        each as output() gives it, or the CommandError output() would raise."""
        host = self.session.host
        mark = secrets.token_hex(16)
        # each command's output (stderr with it, as a command of its own gives it) and exit status
        # through a file descriptor of its own, printed one after the other
        fds = range(5, 5 + len(steps))
        script = "".join(f"exec {fd}< <(bash -c {shlex.quote(self.project.commands[name])} 2>&1; "
                         f"printf '\\n{mark} %d\\n' \"$?\")\n" for fd, name in zip(fds, steps))
        script += " ".join(f"cat <&{fd};" for fd in fds)
        longest = max(steps.values(), key=host.timeout)
        command = self.build(script, step=longest, env=env, what=" and ".join(steps))
        rest = self.session.transport.capture(command, max_bytes=len(steps) * (max_bytes + len(mark) + 16))
        found: dict[str, str | CommandError] = {}
        for name in steps:
            output, sep, rest = rest.partition(f"\n{mark} ".encode())
            status, newline, rest = rest.partition(b"\n")
            if not sep or not newline or not status.isdigit():
                raise CommandError(f"{command.what}: an answer that does not frame as asked", host=host.name,
                                   command=command.line, tail=output[-2000:].decode(errors="replace"))
            text = output.decode(errors="replace")
            why = capture_failure(int(status), len(output), max_bytes)
            found[name] = text if why is None else CommandError(
                f"{name} {why}", host=host.name, command=self.project.commands[name], exit_status=int(status),
                tail=text[-2000:])
        return found

    def gpu_env(self, gpu: Gpu | None = None) -> dict[str, str]:
        """The environment that pins an engine command to the claimed GPUs (or to `gpu` alone,
        with its own results folder and without building: one of the runs made once per GPU)."""
        if gpu is not None:
            return {"CUDA_VISIBLE_DEVICES": gpu.uuid, "KD_RESULTS_DIR": results_dir(gpu), "KD_NO_BUILD": "1"}
        if self.session.job is not None:        # the GPUs Slurm gave (no claim of ours)
            return self.session.job.gpu_env()
        gpus = self.session.gpus
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpus)} if gpus else {}

    def bundle_env(self) -> dict[str, str]:
        """The selected bundles' environment of every engine command (bundle_plan: KD_MAX_MEMORY,
        KD_CONFIGS)."""
        return self.bundles.env() if self.bundles is not None else {}

    def pinned(self, env: dict[str, str] | None) -> dict[str, str]:
        """`env` over the bundles' and the claimed GPUs' environment (and a Slurm job's CPU count);
        the uuids are noted for the step's record."""
        cpus = self.session.job.cpu_env() if self.session.job is not None else {}
        env = {**self.bundle_env(), **self.gpu_env(), **cpus, **(env or {})}
        for uuid in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
            if uuid and uuid not in self.devices_used:
                self.devices_used.append(uuid)
        return env


def results_dir(gpu: Gpu) -> str:
    """Where the engine's commands run for one GPU write their result files (KD_RESULTS_DIR)."""
    return f"build/gpu-{gpu.index}"
