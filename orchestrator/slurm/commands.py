"""A Slurm cluster through its login node: the allocation of a `scheduler: slurm` entry submitted,
waited for within the entry's queue limit, read back, and cancelled (docs/slurm.md).

    job_id = submit(transport)                  # sbatch --parsable: a job that holds the allocation
    job = wait_running(transport, job_id)       # past queue_limit: cancelled, QueueLimitError with Slurm's reason
    job.node, job.gpus, job.queue_wait          # slurmctld's facts (scontrol -o -d show job)
    visible_devices(transport, job)             # CUDA_VISIBLE_DEVICES inside it (srun --jobid --overlap)
    cancel(transport, job_id)                   # scancel
    with allocation(transport) as job: ...      # the three together, the job cancelled on the way out

`transport` is the login node's (connectors/): every Slurm command runs there as any command of
the orchestrator does (remote.wrap: a host-side timeout, a controlled environment, the entry's
`slurm_conf` as SLURM_CONF). Nothing is run on a compute node but through Slurm.

Why sbatch and not salloc: sbatch returns the job id at once and the job lives on its own, so the
orchestrator polls it (the queue reason is there to report, the queue limit is ours to enforce)
and a dropped ssh connection loses nothing; salloc blocks in a session until the allocation is
granted and ties the allocation to that session. The job sbatch submits only holds the allocation
(`sleep` in its batch step, bounded by its time limit); the work runs in it as job steps
(`srun --jobid=ID --overlap`), each with its own output, exit code and timeout.

Everything Slurm prints is hostile until checked: the output is bounded (MAX_OUTPUT), each field
the orchestrator uses must match its own pattern (facts.py) and the job id asked for, else
SlurmError with the command, exit code and output tail.
"""
from __future__ import annotations

import contextlib
import re
import time
from typing import Iterator

from .. import remote
from ..connectors.base import Transport
from ..errors import CommandError, HostError
from ..inventory import Host
from .entry import SlurmRequest
from ..steps import ORDER
from . import facts
from .facts import WAITING, Job, QueueLimitError, SlurmError

MAX_OUTPUT = 256 << 10      # bytes one Slurm command may print
COMMAND_TIMEOUT = 60        # seconds one Slurm client command may take
POLL = 2.0                  # seconds between two looks at a waiting job
HOLD = "exec sleep infinity"    # the batch step: it holds the allocation until scancel or the time limit
_ID = re.compile(r"(\d{1,12})(?:;[A-Za-z0-9_.-]{1,64})?\n?\Z")     # sbatch --parsable: JOBID[;CLUSTER]
_DEVICES = re.compile(r"(?:\d{1,4}(?:,\d{1,4}){0,1023})?\Z")


def request(host: Host) -> SlurmRequest:
    """The entry's Slurm request; SlurmError when `host` is not a `scheduler: slurm` entry."""
    if host.slurm is None:
        raise SlurmError("not a `scheduler: slurm` entry", host=host.name)
    return host.slurm


def command(host: Host, argv: list[str], what: str, timeout: float = COMMAND_TIMEOUT) -> remote.Command:
    """A Slurm client command for the entry's login node, with the entry's SLURM_CONF."""
    conf = request(host).conf
    line = remote.wrap(argv, timeout=timeout, env={"SLURM_CONF": conf} if conf else None)
    return remote.Command(tuple(argv), line, timeout, what=what)


def output(transport: Transport, argv: list[str], what: str) -> str:
    """What a Slurm command printed (at most MAX_OUTPUT bytes, invalid UTF-8 replaced); SlurmError
    with its evidence unless it exited 0."""
    cmd = command(transport.host, argv, what)
    try:
        data = transport.capture(cmd, max_bytes=MAX_OUTPUT, what=what)
    except CommandError as e:
        raise SlurmError(e.message, host=transport.host.name, command=e.command, exit_status=e.exit_status,
                         tail=e.tail, timed_out=e.timed_out) from None
    return data.decode("utf-8", errors="replace")


def time_limit(host: Host) -> int:
    """The job's time limit in seconds: the entry's `time_limit`, else the sum of its step
    timeouts (every step may run to its timeout in the one allocation)."""
    limit = request(host).time_limit
    return limit if limit is not None else int(sum(host.timeout(step) for step in ORDER))


def sbatch_options(host: Host) -> list[str]:
    """sbatch's options for the entry: one node, one task, its partition, GRES, account, QOS,
    constraint, CPUs per task, memory, no requeue and time limit (Slurm counts whole minutes:
    rounded up), a job name naming the entry."""
    req = request(host)
    minutes = -(-time_limit(host) // 60)
    # --no-requeue: a job Slurm requeued (its node failed) would hold a new allocation nobody uses
    options = [f"--partition={req.partition}", "--nodes=1", "--ntasks=1", f"--time={minutes}",
               f"--job-name=kdtree-{host.name}", "--no-requeue"]
    options += [f"--{key}={value}" for key, value in (
        ("gres", req.gres), ("account", req.account), ("qos", req.qos), ("constraint", req.constraint),
        ("cpus-per-task", req.cpus_per_task), ("mem", req.mem)) if value]
    return options


def submit(transport: Transport) -> str:
    """Submit the entry's allocation (a job holding it: HOLD); its job id."""
    argv = ["sbatch", "--parsable", *sbatch_options(transport.host), "--chdir=/tmp", "--output=/dev/null",
            f"--wrap={HOLD}"]
    text = output(transport, argv, "sbatch")
    m = _ID.match(text)
    if not m:
        raise SlurmError("sbatch printed no job id", host=transport.host.name, command=remote.quote(argv),
                         tail=text[-2000:])
    return m.group(1)


def job(transport: Transport, job_id: str) -> Job:
    """slurmctld's facts of the job (scontrol -o -d show job); SlurmError when a field it needs is
    missing or holds what it may not."""
    argv = ["scontrol", "-o", "-d", "show", "job", job_id]
    text = output(transport, argv, "scontrol show job")
    fields = facts.parse_fields(text, transport.host.name, remote.quote(argv))
    if fields["JobId"] != job_id:
        raise SlurmError(f"scontrol showed job {fields['JobId']}, not {job_id}", host=transport.host.name,
                         command=remote.quote(argv), tail=text[-2000:])
    return Job.of(fields)


def wait_running(transport: Transport, job_id: str, poll: float = POLL) -> Job:
    """The job once it runs. Past the entry's queue_limit it is cancelled and QueueLimitError
    says Slurm's pending reason; a job that ends without running is a SlurmError with its state."""
    host = transport.host
    limit = request(host).queue_limit
    start = time.monotonic()
    while True:
        facts = job(transport, job_id)
        if facts.state == "RUNNING":
            return facts
        if facts.state not in WAITING:
            raise SlurmError(f"job {job_id} ended without running: {facts.state} ({facts.reason})", host=host.name)
        waited = time.monotonic() - start
        if waited >= limit:
            cancel(transport, job_id)
            raise QueueLimitError(f"job {job_id} waited {waited:.0f} s in the queue of partition {facts.partition}, "
                                  f"past queue_limit {limit:g} s: {facts.state}, reason {facts.reason}; cancelled",
                                  host=host.name, job_id=job_id, state=facts.state, reason=facts.reason)
        if transport.stopped.wait(min(poll, limit - waited)):
            raise HostError(f"the run was interrupted while job {job_id} waited in the queue", host=host.name)


def cancel(transport: Transport, job_id: str) -> None:
    """Cancel the job (scancel; a job already ended is no error), also once the run stopped: the
    run's transport then refuses every new command, so scancel goes over a transport of its own."""
    if not transport.stopped.is_set():
        output(transport, ["scancel", job_id], "scancel")
        return
    from ..connectors.factory import open_transport
    with open_transport(transport.host) as own:
        output(own, ["scancel", job_id], "scancel")


def visible_devices(transport: Transport, job_id: str) -> str:
    """CUDA_VISIBLE_DEVICES as a job step of the job sees it (`srun --jobid --overlap`): the GPUs
    Slurm gave, as the engine will see them ("" when it sets none)."""
    argv = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", "printenv"]
    text = output(transport, argv, "srun printenv")
    value = next((line.partition("=")[2] for line in text.splitlines() if line.startswith("CUDA_VISIBLE_DEVICES=")), "")
    if not _DEVICES.match(value):
        raise SlurmError(f"the job step's CUDA_VISIBLE_DEVICES is {value[:80]!r}", host=transport.host.name,
                         command=remote.quote(argv))
    return value


@contextlib.contextmanager
def allocation(transport: Transport, poll: float = POLL) -> Iterator[Job]:
    """The entry's allocation, running, for the block; cancelled when the block ends, however it ends."""
    job_id = submit(transport)
    try:
        yield wait_running(transport, job_id, poll)
    finally:
        cancel(transport, job_id)
