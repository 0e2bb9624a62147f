"""Exec: the user's own command (`invoke exec -- ARGV`) on the host, as one step: its words quoted
once (remote.adhoc), its output streamed to the step log, under the step timeout and guard. On a
`scheduler: slurm` entry it is a job step of an allocation held for it (the step is `on_node`),
cancelled when the step ends, however it ends."""
from __future__ import annotations

from .. import remote
from ..errors import CommandError, cause_of
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Run the user's command; passed when it exits 0, else a CommandError with its exit code and
    output tail (timed out only when it ran past its timeout: an exit status of 124 or 137 that
    came sooner is the command's own)."""
    command = ctx.plan.user_command
    assert command is not None         # an exec plan always carries one
    argv, timeout = command.argv, command.timeout
    shown = remote.quote(argv)
    ctx.log(f"$ {shown}")
    # on a Slurm entry a job step of an allocation held for it, with the GPUs and CPUs Slurm gave
    line = ctx.session.on_node(remote.adhoc(ctx.host, argv, timeout, env=ctx.shell.pinned(None)))
    result = ctx.session.transport.run(line, on_output=ctx.log)
    if result.ok:
        return Outcome("passed", "exited with 0")
    timed_out = result.exit_code is None or (result.timed_out and result.seconds >= timeout)
    why = f"timed out after {timeout:g} s" if timed_out else f"exited with {result.exit_code}"
    cause = None if timed_out else cause_of(result.tail)
    raise CommandError(why + (f": {cause}" if cause else ""), host=ctx.host.name, command=shown,
                       exit_status=result.exit_code, tail=result.tail, timed_out=timed_out)
