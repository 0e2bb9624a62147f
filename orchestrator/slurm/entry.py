"""The `scheduler: slurm` host entry (docs/slurm.md): a partition of a Slurm cluster reached through its
login node, whose ssh alias is the entry's `address`. Its keys, the request record they make
(SlurmRequest, a Host's `slurm`) and their validation with inventory.py's validator (request()):
every error names the host and the key, as for every other key.

    partition: gpu-h100        # required
    gpus: 2                    # the GRES request: gpu:2; `h100:2`: gpu:h100:2; 0 or absent: none
    account, qos, constraint   # optional: sbatch's --account, --qos, --constraint
    cpus_per_task: 16          # optional: sbatch's --cpus-per-task (the build's parallel compiles)
    mem: 64G                   # optional: sbatch's --mem, MiB or a count with K, M, G or T
    time_limit: 7200           # seconds or [D-]HH:MM:SS (default: the partition's)
    queue_limit: 600           # seconds the job may wait in the queue before the host fails
    slurm_conf: /etc/slurm/x.conf   # SLURM_CONF on the login node (default: its own)
"""
from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Any, NoReturn, Protocol

from . import SLURM_KEYS

# The gpu_claims keys are refused on a Slurm entry: Slurm's allocation is the claim, `gpus` the GRES request.
SCHEDULERS = ("slurm",)
CLAIM_KEYS = ("gpu_policy", "gpu_count", "gpu_max_used_mib", "gpu_wait")
DEFAULT_QUEUE_LIMIT = 600       # seconds a Slurm job may wait in the queue before the host fails
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")         # partition, account, qos, GRES type
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.&|()\[\]*-]+\Z")           # features and Slurm's operators
_MEM = re.compile(r"[1-9]\d{0,8}[KMGT]?\Z")                         # sbatch --mem: MiB, or with a unit
_SLURM_TIME = re.compile(r"(?:(\d{1,3})-)?(\d{1,2}):(\d{2}):(\d{2})\Z")   # [D-]HH:MM:SS


@dataclasses.dataclass(frozen=True)
class SlurmRequest:
    """What a `scheduler: slurm` entry asks Slurm for: one node of `partition` with the GRES `gres`
    (`gpu:N`, `gpu:TYPE:N`; None: no GPU), under its account, QOS, constraint and time limit
    (seconds; None: the partition's default), with `cpus_per_task` CPUs and `mem` of memory
    (sbatch's --mem; None: the partition's defaults), waiting at most `queue_limit` seconds in the queue.
    `conf`: SLURM_CONF for the Slurm commands on the login node (None: the login node's own)."""

    partition: str
    gres: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time_limit: int | None = None
    queue_limit: float = DEFAULT_QUEUE_LIMIT
    conf: str | None = None


class Checks(Protocol):
    """What request() uses of inventory's validator: each raises InventoryError naming host and key."""

    def fail(self, host, key, problem) -> NoReturn: ...
    def string(self, value, host, key, pattern=None, what="") -> str: ...
    def integer(self, value, host, key, low, high) -> int: ...
    def path(self, value, host, key, base=None) -> str: ...
    def choice(self, value, host, key, choices) -> str: ...


def request(v: Checks, name, entry, transport, max_seconds: float) -> tuple[SlurmRequest, int] | None:
    """A `scheduler: slurm` entry's request and GPU count (None for any other entry, which may
    not use SLURM_KEYS). On such an entry `gpus` is the GRES request: a count (`2`: gpu:2) or
    `TYPE:COUNT` (`h100:2`: gpu:h100:2)."""
    if "scheduler" not in entry:
        for key in SLURM_KEYS:
            if key in entry:
                v.fail(name, key, "is only for a `scheduler: slurm` entry")
        return None
    v.choice(entry["scheduler"], name, "scheduler", SCHEDULERS)
    if transport != "ssh":
        v.fail(name, "transport", "a `scheduler: slurm` entry is reached over ssh (its login node)")
    for key in CLAIM_KEYS:
        if key in entry:
            v.fail(name, key, "is not for a `scheduler: slurm` entry: Slurm's allocation is the claim "
                                 "(`gpus:` is the GRES request)")
    if "partition" not in entry:
        v.fail(name, "partition", "is missing (the Slurm partition to run in)")
    gres, count = _gres(v, name, entry.get("gpus", 0))
    fields: dict[str, Any] = {"partition": v.string(entry["partition"], name, "partition", _SLURM_NAME,
                                                       "a partition name"), "gres": gres}
    for key in ("account", "qos"):
        if key in entry:
            fields[key] = v.string(entry[key], name, key, _SLURM_NAME, f"a Slurm {key} name")
    if "constraint" in entry:
        fields["constraint"] = v.string(entry["constraint"], name, "constraint", _CONSTRAINT,
                                           "a Slurm constraint (features and & | [ ] ( ) *)")
    if "cpus_per_task" in entry:
        fields["cpus_per_task"] = v.integer(entry["cpus_per_task"], name, "cpus_per_task", 1, 4096)
    if "mem" in entry:
        mem = entry["mem"]
        if isinstance(mem, bool) or not isinstance(mem, (int, str)) or not _MEM.match(str(mem)):
            v.fail(name, "mem", f"{mem!r} is not memory for sbatch --mem: MiB, or a count with K, M, G or T "
                                 "(e.g. 64G)")
        fields["mem"] = str(mem)
    if "time_limit" in entry:
        fields["time_limit"] = _time_limit(v, entry["time_limit"], name, max_seconds)
    if "queue_limit" in entry:
        limit = entry["queue_limit"]
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= max_seconds:
            v.fail(name, "queue_limit", f"must be a number of seconds above 0 and at most {max_seconds}, "
                                           f"not {limit!r}")
        fields["queue_limit"] = float(limit)
    if "slurm_conf" in entry:
        fields["conf"] = v.path(entry["slurm_conf"], name, "slurm_conf")
        if not posixpath.isabs(fields["conf"]):
            v.fail(name, "slurm_conf", f"{fields['conf']!r} must be an absolute path on the login node")
    return SlurmRequest(**fields), count


def _gres(v: Checks, name, value) -> tuple[str | None, int]:
    """A Slurm entry's `gpus`: the GRES request (None for 0) and the GPU count."""
    if isinstance(value, str) and value.count(":") == 1:
        kind, _, digits = value.partition(":")
        v.string(kind, name, "gpus", _SLURM_NAME, "TYPE:COUNT with a GRES type name (e.g. h100:2)")
        if not digits.isdigit() or not 1 <= int(digits) <= 1024:
            v.fail(name, "gpus", f"{value!r} is not TYPE:COUNT with a count from 1 to 1024 (e.g. h100:2)")
        return f"gpu:{kind}:{int(digits)}", int(digits)
    if isinstance(value, str):
        v.fail(name, "gpus", f"{value!r} is not a GPU count or TYPE:COUNT (e.g. 2 or h100:2)")
    count = v.integer(value, name, "gpus", 0, 1024)
    return (f"gpu:{count}" if count else None), count


def _time_limit(v: Checks, value, name, max_seconds: float) -> int:
    """`time_limit`: whole seconds (at least 60: Slurm counts minutes) or Slurm's [D-]HH:MM:SS."""
    if isinstance(value, str):
        m = _SLURM_TIME.match(value)
        if not m or int(m.group(3)) > 59 or int(m.group(4)) > 59:
            v.fail(name, "time_limit", f"{value!r} is not seconds or [D-]HH:MM:SS")
        value = ((int(m.group(1) or 0) * 24 + int(m.group(2))) * 60 + int(m.group(3))) * 60 + int(m.group(4))
    return v.integer(value, name, "time_limit", 60, max_seconds)
