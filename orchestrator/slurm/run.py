"""A `scheduler: slurm` entry in a run (docs/slurm.md): one allocation per host, held from the
first step that runs on a compute node (Step.on_node: build, bundles, golden, test, bench,
stress) to the end of the host's run, and every engine command of those steps a job step in it.

    job = Allocation.of(transport, record)        # None for any other host
    job.hold()                                    # sbatch, the queue (queue_limit), the GPUs Slurm gave
    transport.run(job.step(command))              # the command on the node: srun --jobid --overlap --time
    job.release(steps, stopped)                   # scancel, and why, into the host's record

Each job step keeps the command's own host-side timeout (remote.wrap's guard, now on the node:
exit 124 when it fires) and gets it again as srun's `--time` (whole minutes, rounded up past the
guard's KILL_AFTER), so Slurm ends a step the guard could not; the job's own time limit
(commands.time_limit: the sum of the step timeouts) covers the run. On the login node srun runs
under that timeout plus SRUN_GRACE, with the command's stdin passed through to the node (the
secret values, then the open stdin whose end stops the step there).

The job ends with the host's run, however it ends: `release` cancels it and records why (the run
passed, a step failed or timed out, the run was interrupted); after a failed step it first asks
slurmctld for the job's state, so a job that Slurm ended (a node down: NODE_FAIL, its time limit:
TIMEOUT) fails the host with Slurm's state and reason.
"""
from __future__ import annotations

import dataclasses

from .. import remote
from ..connectors.base import Transport
from ..errors import KdError
from ..records.record import FAILED_STEP_STATUSES, HostRecord, SlurmJob, StepRecord
from . import commands as slurm
from .facts import QueueLimitError

SRUN_GRACE = 30         # seconds srun gets on the login node past the step's timeout and its KILL_AFTER


class Allocation:
    """One host's Slurm job for the run, and its engine commands as job steps in it."""

    def __init__(self, transport: Transport, record: HostRecord):
        self.transport, self.record = transport, record
        self.devices = ""       # CUDA_VISIBLE_DEVICES of a job step (the GPUs Slurm gave)

    @classmethod
    def of(cls, transport: Transport, record: HostRecord) -> "Allocation | None":
        """The allocation a `scheduler: slurm` entry's run will hold (not submitted yet); None for any other host."""
        return cls(transport, record) if transport.host.slurm is not None else None

    @property
    def held(self) -> bool:
        """Whether the job was submitted (and so must be released)."""
        return self.record.job is not None

    def hold(self) -> str:
        """Submit the job and wait until it runs (commands.wait_running: past queue_limit it is
        cancelled, the QueueLimitError saying Slurm's reason); its facts into the host's record.
        What Slurm gave, in words."""
        job_id = slurm.submit(self.transport)
        rec = self.record.job = SlurmJob(job_id, slurm.request(self.transport.host).partition)
        try:
            job = slurm.wait_running(self.transport, job_id)
        except QueueLimitError as e:
            rec.state, rec.reason, rec.ended = e.state, e.reason, "cancelled: it waited past queue_limit"
            raise
        self.devices = slurm.visible_devices(self.transport, job_id)
        rec.node, rec.gpus, rec.cuda_visible_devices = job.node, list(job.gpus), self.devices
        rec.submitted, rec.started, rec.queue_wait = job.submitted, job.started, job.queue_wait
        rec.time_limit, rec.cpus, rec.state, rec.reason = job.time_limit, job.cpus, job.state, job.reason
        gpus = f"GPU {','.join(map(str, job.gpus))}" if job.gpus else "no GPU"
        wait = f"{job.queue_wait:.0f} s" if job.queue_wait is not None else "an unknown time"
        return (f"job {job_id} runs on {job.node} with {gpus} (CUDA_VISIBLE_DEVICES={self.devices or 'unset'}) "
                f"and {job.cpus} CPU(s) after {wait} in the queue of partition {job.partition}, "
                f"time limit {job.time_limit}")

    def gpu_env(self) -> dict[str, str]:
        """The environment that gives an engine command the GPUs Slurm gave the job (remote.wrap
        starts every command with a clean environment, srun's included)."""
        return {"CUDA_VISIBLE_DEVICES": self.devices} if self.devices else {}

    def cpu_env(self) -> dict[str, str]:
        """The environment that tells an engine command how many CPUs the job holds (KD_JOBS: the
        build's parallel compiles): srun's SLURM_CPUS_PER_TASK does not pass remote.wrap's clean
        environment, and nproc counts the node's CPUs where the cluster does not bind tasks to theirs."""
        job = self.record.job
        return {"KD_JOBS": str(job.cpus)} if job is not None and job.cpus else {}

    def step(self, command: remote.Command) -> remote.Command:
        """`command` (an engine command of remote.step) as a job step of the held job on its node."""
        job = self.record.job
        if job is None or command.timeout is None:
            raise ValueError("a job step needs a held allocation and a command with a timeout")
        minutes = -(-int(command.timeout + remote.KILL_AFTER) // 60)
        argv = ["srun", f"--jobid={job.job_id}", "--overlap", "--nodes=1", "--ntasks=1", f"--time={minutes}",
                "--quiet", "--chdir=/", "bash", "-c", command.line]
        conf = slurm.request(self.transport.host).conf
        outer = command.timeout + remote.KILL_AFTER + SRUN_GRACE
        line = remote.wrap(argv, timeout=outer, env={"SLURM_CONF": conf} if conf else None, reads_stdin=True)
        return dataclasses.replace(command, argv=tuple(argv), line=line, timeout=outer)

    def release(self, steps: dict[str, StepRecord], stopped: bool) -> None:
        """Cancel the job (scancel) and record why; after a failed step whose job Slurm ended
        (NODE_FAIL, TIMEOUT...), that step's message says the job's state and reason."""
        job = self.record.job
        if job is None or job.ended:        # never submitted, or cancelled already (queue_limit)
            return
        failed = next((name for name, s in steps.items() if s.status in FAILED_STEP_STATUSES), None)
        if failed is not None and not stopped:
            self._ended_by_slurm(job, steps[failed])
        if job.ended:
            return
        outcome = "timed out" if failed and steps[failed].status == "timeout" else "failed"
        why = ("the run was interrupted" if stopped else f"the {failed} step {outcome}" if failed
               else "the host's steps are done")
        try:
            slurm.cancel(self.transport, job.job_id)
            job.ended = f"cancelled: {why}"
        except KdError as e:
            job.ended = f"not cancelled ({why}): {e.message}"

    def _ended_by_slurm(self, job: SlurmJob, failed: StepRecord) -> None:
        try:
            facts = slurm.job(self.transport, job.job_id)
        except KdError:         # the step's own evidence stands
            return
        job.state, job.reason = facts.state, facts.reason
        if facts.state not in ("RUNNING", "COMPLETING"):
            job.ended = f"ended by Slurm: {facts.state} ({facts.reason})"
            failed.message += f"; Slurm ended job {job.job_id}: {facts.state}, reason {facts.reason}"


def describe(job: SlurmJob) -> str:
    """A job of the record in one line: id, node, GPUs, queue wait, how it ended."""
    gpus = ",".join(map(str, job.gpus)) or "none"
    wait = f"{job.queue_wait:.1f} s" if job.queue_wait is not None else "-"
    cpus = f", {job.cpus} CPU(s)" if job.cpus else ""
    return (f"job {job.job_id} on {job.node or '-'} (partition {job.partition}), GPUs {gpus}{cpus}, "
            f"queue wait {wait}; {job.ended or job.state or 'submitted'}")
