"""What a Slurm cluster says, read strictly (docs/slurm.md): the errors of the Slurm commands, a
job's facts (`scontrol -o -d show job`: each field the orchestrator uses checked against its own
pattern), the Key=value words of scontrol's lines, and a node's or a job's GPU GRES.

Everything Slurm prints is hostile until checked: a field that breaks its pattern or is missing is
a SlurmError with the command and the output's tail, never a value passed on.
"""
from __future__ import annotations

import dataclasses
import datetime
import re

from ..errors import HostError

WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_:/]*)=(\S*)")
_TIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}|Unknown|None|N/A"
_FIELDS = {         # the fields of `scontrol -o -d show job` read, and what each may hold
    "JobId": r"\d{1,12}", "JobState": r"[A-Z_]{1,32}", "Reason": r"[A-Za-z0-9_(),.:;/\[\]+=*-]{1,300}",
    "Partition": r"[A-Za-z0-9_][A-Za-z0-9_.,-]{0,200}", "NodeList": r"(?:[A-Za-z0-9_.,\[\]-]{1,1000})?|\(null\)",
    "SubmitTime": _TIME, "StartTime": _TIME, "TimeLimit": r"[0-9:-]{1,20}|UNLIMITED|Partition_Limit|NONE",
    "NumCPUs": r"\d{1,6}", "GRES": r"[A-Za-z0-9_:(),.-]{0,1000}"}
_GPU_IDX = re.compile(r"(?:^|,)gpu(?::[A-Za-z0-9_.-]+)?:\d+\(IDX:([0-9,-]+)\)")
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::([A-Za-z0-9_.-]{1,64}))?:(\d{1,5})")


class SlurmError(HostError):
    """A Slurm command failed, or printed what the orchestrator refuses to read."""


class QueueLimitError(SlurmError):
    """The job waited in the queue past the entry's queue_limit and was cancelled; `reason` is
    Slurm's pending reason."""

    def __init__(self, message: str, *, host: str, job_id: str, state: str, reason: str):
        super().__init__(message, host=host)
        self.job_id, self.state, self.reason = job_id, state, reason


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as slurmctld tells it: id, state, pending reason ("None" once running), partition,
    node (None before it runs), the indices of its GPUs on that node (GRES IDX), the submit and
    start times (Slurm's local time, ISO), the seconds it waited in the queue (None before it
    starts), its time limit as Slurm prints it and the CPUs it holds on its node."""

    job_id: str
    state: str
    reason: str
    partition: str
    node: str | None
    gpus: tuple[int, ...]
    submitted: str | None
    started: str | None
    queue_wait: float | None
    time_limit: str
    cpus: int

    @classmethod
    def of(cls, fields: dict[str, str]) -> "Job":
        """The job that the checked fields of `scontrol -o -d show job` (parse_fields) describe."""
        submitted, started = _when(fields["SubmitTime"]), _when(fields["StartTime"])
        node = fields["NodeList"] if fields["NodeList"] not in ("", "(null)") else None
        running = node is not None and fields["JobState"] not in WAITING      # it ran (or runs) on a node
        wait = (started - submitted).total_seconds() if running and submitted and started else None
        return cls(fields["JobId"], fields["JobState"], fields["Reason"], fields["Partition"], node,
                   gpu_indices(fields["GRES"]), submitted.isoformat() if submitted else None,
                   started.isoformat() if started and running else None, wait, fields["TimeLimit"],
                   int(fields["NumCPUs"]))


def parse_fields(text: str, host: str, argv: str) -> dict[str, str]:
    """The fields of one `scontrol -o show job` line that _FIELDS names (the first of each; GRES,
    from -d's node details, may be absent), each checked against its pattern."""
    lines = text.strip().splitlines()
    if len(lines) != 1:
        raise SlurmError(f"scontrol printed {len(lines)} lines, not one job", host=host, command=argv,
                         tail=text[-2000:])
    found = fields(lines[0])
    found.setdefault("GRES", "")
    for key, pattern in _FIELDS.items():
        if key not in found or not re.fullmatch(pattern, found[key]):
            shown = "missing" if key not in found else f"{found[key][:80]!r}"
            raise SlurmError(f"scontrol's job field {key} is {shown}", host=host, command=argv, tail=text[-2000:])
    return {key: found[key] for key in _FIELDS}


def fields(line: str) -> dict[str, str]:
    """The Key=value words of a line of `scontrol -o show ...` (the first of each key; a value ends
    at a blank: the callers check the ones they use)."""
    found: dict[str, str] = {}
    for key, value in _FIELD.findall(line):
        found.setdefault(key, value)
    return found


def gpu_counts(gres: str) -> dict[str | None, int]:
    """GPUs per GRES type (None: untyped) in a node's GRES as sinfo prints it (`gpu:2`,
    `gpu:h100:4(S:0-1)`, `gpu:a100:2,gpu:h100:2`, `(null)`)."""
    counts: dict[str | None, int] = {}
    for kind, count in _GPU_GRES.findall(gres):
        counts[kind or None] = counts.get(kind or None, 0) + int(count)
    return counts


def has_gpus(gres: str, wanted: str | None) -> bool:
    """Whether a node's GRES (gpu_counts) holds the request `wanted` (gpu:N, gpu:TYPE:N; None: no GPU)."""
    if wanted is None:
        return True
    parts = wanted.split(":")
    counts = gpu_counts(gres)
    have = counts.get(parts[1], 0) if len(parts) == 3 else sum(counts.values())
    return have >= int(parts[-1])


def gpu_indices(gres: str) -> tuple[int, ...]:
    """The GPU indices of a node's GRES detail (`gpu:2(IDX:0-1)`, `gpu:h100:3(IDX:0,2-3)`)."""
    indices: list[int] = []
    for spec in _GPU_IDX.findall(gres):
        for part in spec.split(","):
            low, _, high = part.partition("-")
            if low.isdigit() and (not high or high.isdigit()) and int(high or low) - int(low) < 1024:
                indices.extend(range(int(low), int(high or low) + 1))
    return tuple(sorted(set(indices)))


def _when(value: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:          # Unknown, None, N/A
        return None
