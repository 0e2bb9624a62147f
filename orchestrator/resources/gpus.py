"""A host's GPUs: what nvidia-smi reports (the inventory), and which of them a run takes.

    command = query_command(host)                # finds nvidia-smi, runs both CSV queries
    found = parse_query(output, host=host.name)  # GpuInventory(nvidia_smi, gpus), or GpuQueryError
    found = query(transport)                     # the two above over a transport
    request = Request.for_host(host, parse_flag("2"))      # the inventory's policy, --gpus over it
    choice = choose(found.gpus, request)         # usable GPUs in preference order, the others and why

nvidia-smi's output is the host's word and treated as hostile: the host side bounds it, every line
is checked against the exact shape of its query (a line that fits none is an error that shows the
line), numbers are bounded, text fields are shortened and their control characters escaped.
`[N/A]`-style values become None. Selection (`gpu_policy`): `idle` takes GPUs without compute
processes and with at most `gpu_max_used_mib` in use; `any` takes any GPU, idle ones first; a list
of indices takes those GPUs whatever their load. Under every policy a GPU whose free memory
(total less used) is below the selected bundles' need (Request.min_free_mib) is not taken, and
says so. `gpu_count` says how many (a list: all of it),
`--gpus` overrides either. The host-side claims that keep two runs off one GPU: gpu_claims.py.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Collection, Mapping, Sequence, cast

from .. import remote
from ..errors import HostError, UsageError
from ..host import client

# Where nvidia-smi lives when the host's PATH for non-interactive ssh sessions lacks it: the
# driver packages' own bin, the NVIDIA container runtime, WSL, the GPU operator's driver root.
DRIVER_PATHS = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/lib/wsl/lib",
                "/run/nvidia/driver/usr/bin")
GPU_FIELDS = ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu", "compute_cap", "pci.bus_id")
APP_FIELDS = ("gpu_uuid", "pid", "process_name", "used_memory")
QUERY_GPUS = f"--query-gpu={','.join(GPU_FIELDS)}"
QUERY_APPS = f"--query-compute-apps={','.join(APP_FIELDS)}"
CSV_FORMAT = "--format=csv,noheader,nounits"
NO_DEVICES_EXIT = 6          # nvidia-smi's exit status for "No devices were found"

OUTPUT_MAX_BYTES = 256 * 1024    # per query, cut on the host; the client refuses a longer answer
MAX_GPUS = 1024
MAX_PROCESSES = 4096
MAX_MIB = 1 << 30                # 1 PiB: more is not a memory figure
NAME_CHARS = 96
PROCESS_NAME_CHARS = 96
SHOWN_PROCESSES = 6              # processes named per GPU in a message; the rest are counted

DEFAULT_MAX_USED_MIB = 1024

_NA = re.compile(r"\[?(?:N/A|Not Supported|Unknown Error|Insufficient Permissions|Not Found|GPU is lost)\]?\Z", re.I)
_UUID = re.compile(r"GPU-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}\Z")
_CAP = re.compile(r"\d{1,2}\.\d{1,2}\Z")
_BUS = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]\Z")
_INT = re.compile(r"\d{1,12}\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


class GpuQueryError(HostError):
    """nvidia-smi failed on the host, or answered something that is not its CSV."""


class GpuSelectionError(HostError):
    """The host has not enough GPUs the policy allows (each other GPU is named with why)."""


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, as nvidia-smi lists it (pid or MiB None when not reported)."""

    pid: int | None
    name: str
    used_mib: int | None

    def __str__(self) -> str:
        mib = "? MiB" if self.used_mib is None else f"{self.used_mib} MiB"
        return f"pid {'?' if self.pid is None else self.pid} {self.name} {mib}"


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU: identity, memory (MiB), utilization (%), compute processes; None: not reported."""

    index: int
    uuid: str
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None
    compute_cap: str | None
    pci_bus_id: str | None
    processes: tuple[GpuProcess, ...] = ()

    def why_busy(self, max_used_mib: int) -> str | None:
        """Why the `idle` policy may not take this GPU (processes, memory in use), or None."""
        if self.processes:
            shown = ", ".join(str(p) for p in self.processes[:SHOWN_PROCESSES])
            more = len(self.processes) - SHOWN_PROCESSES
            return (f"{len(self.processes)} compute process{'es' if len(self.processes) > 1 else ''}: {shown}"
                    + (f" and {more} more" if more > 0 else ""))
        if self.memory_used_mib is None:
            return "memory in use is not reported"
        if self.memory_used_mib > max_used_mib:
            return f"{self.memory_used_mib} MiB in use (more than {max_used_mib} MiB)"
        return None

    def why_too_small(self, need_mib: int) -> str | None:
        """Why this GPU cannot hold `need_mib` MiB more (its free memory, total less used), or None."""
        if not need_mib:
            return None
        if self.memory_used_mib is None or self.memory_total_mib is None:
            return f"free memory is not reported (the bundles need {need_mib} MiB)"
        free = self.memory_total_mib - self.memory_used_mib
        if free < need_mib:
            return f"{free} MiB free of {self.memory_total_mib} MiB, the bundles need {need_mib} MiB"
        return None

    def label(self) -> str:
        """`GPU 3 (NVIDIA H200)`."""
        return f"GPU {self.index} ({self.name})"

    def to_record(self, max_used_mib: int) -> dict:
        """The GPU as run.json's host entry lists it (`busy` under the host's threshold)."""
        data = dataclasses.asdict(self)
        data["processes"] = [dataclasses.asdict(p) for p in self.processes]
        data["busy"] = self.why_busy(max_used_mib) is not None
        return data


@dataclasses.dataclass(frozen=True)
class GpuInventory:
    """What the query found: nvidia-smi's path (None: none on the host) and its GPUs by index."""

    nvidia_smi: str | None
    gpus: tuple[Gpu, ...] = ()


def query_command(host, driver_paths: Sequence[str] = DRIVER_PATHS) -> remote.Command:
    """The command that finds nvidia-smi (the host's PATH, then `driver_paths`) and runs the GPU
    and compute-process queries; its output is tagged lines for parse_query."""
    return client.gpu_query(host, max_bytes=OUTPUT_MAX_BYTES, gpu_fields=QUERY_GPUS, app_fields=QUERY_APPS,
                            csv_format=CSV_FORMAT, driver_paths=driver_paths)


def query(transport, driver_paths: Sequence[str] = DRIVER_PATHS) -> GpuInventory:
    """The host's GPUs now, as nvidia-smi reports them (GpuQueryError when it cannot tell)."""
    command = query_command(transport.host, driver_paths)
    out = transport.capture(command, max_bytes=3 * OUTPUT_MAX_BYTES)
    return parse_query(out.decode("utf-8", errors="replace"), host=transport.host.name, command=command.line)


def parse_query(text: str, *, host: str | None = None, command: str | None = None) -> GpuInventory:
    """The query command's tagged output as a GpuInventory; GpuQueryError names the bad line."""
    lines: dict[str, list[str]] = {"gpu": [], "app": [], "err-gpu": [], "err-app": []}
    status: dict[str, int] = {}
    smi: str | None = None
    for number, line in enumerate(text.split("\n"), 1):
        tag, _, rest = line.partition(" ")
        which, _, code = rest.partition(" ")
        if tag == "smi":
            smi = None if rest == "-" else visible(rest, 256)
        elif tag == "rc" and which in ("gpu", "app") and _INT.match(code):
            status[which] = int(code)
        elif tag in lines:
            lines[tag].append(rest)
        elif line:
            raise GpuQueryError(f"the GPU query printed an unexpected line {number}: {visible(line, 200)}",
                                host=host, command=command)
    if smi is None:
        return GpuInventory(None)
    if status.keys() != {"gpu", "app"}:
        raise GpuQueryError("the GPU query ended before nvidia-smi answered both queries", host=host,
                            command=command)
    if status["gpu"] == NO_DEVICES_EXIT:
        return GpuInventory(smi)
    for which, flag in (("gpu", QUERY_GPUS), ("app", QUERY_APPS)):
        if status[which]:
            tail = "\n".join(visible(l, 300) for l in (lines[which] + lines[f"err-{which}"])[-20:])
            raise GpuQueryError(f"{smi} {flag} exited with {status[which]}", host=host, command=command,
                                exit_status=status[which], tail=tail)
    gpus = parse_gpus(lines["gpu"], host=host)
    return GpuInventory(smi, attach_processes(gpus, parse_processes(lines["app"], host=host), host=host))


def parse_gpus(lines: Sequence[str], *, host: str | None = None) -> tuple[Gpu, ...]:
    """The lines of the --query-gpu CSV (fields GPU_FIELDS, no header, no units), by index."""
    lines = [l for l in lines if l.strip()]
    if len(lines) > MAX_GPUS:
        raise GpuQueryError(f"nvidia-smi listed {len(lines)} GPUs (more than {MAX_GPUS})", host=host)
    gpus: dict[int, Gpu] = {}
    for number, line in enumerate(lines, 1):
        row = _Row("GPU", number, line, len(GPU_FIELDS), host)
        # a name may hold commas (nvidia-smi does not quote): the fields after it count from the end
        index, uuid, *_, used, total, util, cap, bus = row.fields
        # optional=False raises on a missing value, so these are never None
        gpu = Gpu(index=cast(int, row.number(index, "index", MAX_GPUS - 1, optional=False)),
                  uuid=cast(str, row.match(uuid, _UUID, "uuid", optional=False)),
                  name=visible(row.text(2, len(row.fields) - 5), NAME_CHARS) or "?",
                  memory_used_mib=row.number(used, "memory.used", MAX_MIB),
                  memory_total_mib=row.number(total, "memory.total", MAX_MIB),
                  utilization_pct=row.number(util, "utilization.gpu", 100),
                  compute_cap=row.match(cap, _CAP, "compute_cap"),
                  pci_bus_id=row.match(bus, _BUS, "pci.bus_id"))
        if gpu.index in gpus or any(g.uuid == gpu.uuid for g in gpus.values()):
            row.fail("a GPU index or uuid listed twice")
        gpus[gpu.index] = gpu
    return tuple(gpus[i] for i in sorted(gpus))


def parse_processes(lines: Sequence[str], *, host: str | None = None) -> list[tuple[str, GpuProcess]]:
    """The lines of the --query-compute-apps CSV (fields APP_FIELDS) as (gpu uuid, process)."""
    lines = [l for l in lines if l.strip()]
    if len(lines) > MAX_PROCESSES:
        raise GpuQueryError(f"nvidia-smi listed {len(lines)} compute processes (more than {MAX_PROCESSES})",
                            host=host)
    found = []
    for number, line in enumerate(lines, 1):
        row = _Row("compute process", number, line, len(APP_FIELDS), host)
        uuid, pid, *_, used = row.fields      # a process name may hold commas
        found.append((cast(str, row.match(uuid, _UUID, "gpu_uuid", optional=False)),
                      GpuProcess(row.number(pid, "pid", 1 << 31),
                                 visible(row.text(2, len(row.fields) - 1), PROCESS_NAME_CHARS) or "?",
                                 row.number(used, "used_memory", MAX_MIB))))
    return found


def attach_processes(gpus: Sequence[Gpu], processes: Sequence[tuple[str, GpuProcess]], *,
                     host: str | None = None) -> tuple[Gpu, ...]:
    """The GPUs with their compute processes; a process on a GPU not listed is an error."""
    by_uuid: dict[str, list[GpuProcess]] = {g.uuid: [] for g in gpus}
    for uuid, process in processes:
        if uuid not in by_uuid:
            raise GpuQueryError(f"nvidia-smi lists a compute process (pid {process.pid}) on GPU {uuid}, "
                                "which its GPU query did not list", host=host)
        by_uuid[uuid].append(process)
    return tuple(dataclasses.replace(g, processes=tuple(by_uuid[g.uuid])) for g in gpus)


def visible(text: str, limit: int) -> str:
    """Host text made safe to show: at most `limit` characters, control characters (and the
    backslash) written as escapes such as `\\x1b`, so nothing a host sends acts on a terminal."""
    return _CONTROL.sub(_escape, text[:limit])


def _escape(match: re.Match) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


class _Row:
    """One CSV line of a query, split; its checks raise GpuQueryError showing the line."""

    def __init__(self, what: str, number: int, line: str, fields: int, host: str | None):
        self.what, self.line_number, self.line, self.host = what, number, line, host
        self.fields = [f.strip() for f in line.split(",")]
        if len(self.fields) < fields:
            self.fail(f"{len(self.fields)} fields, expected {fields}")

    def text(self, start: int, end: int) -> str:
        """Fields start..end-1 as one text field, its commas kept (nvidia-smi does not quote)."""
        return ",".join(self.line.split(",")[start:end]).strip()

    def fail(self, why: str):
        raise GpuQueryError(f"nvidia-smi's {self.what} line {self.line_number} is not its CSV ({why}): "
                            f"{visible(self.line, 200)}", host=self.host)

    def number(self, value: str, field: str, high: int, optional: bool = True) -> int | None:
        """An integer field from 0 to `high`; None for [N/A] and the like when `optional`."""
        if optional and _NA.match(value):
            return None
        if not _INT.match(value) or int(value) > high:
            self.fail(f"{field} {visible(value, 40)} is not a number from 0 to {high}")
        return int(value)

    def match(self, value: str, pattern: re.Pattern, field: str, optional: bool = True) -> str | None:
        """A field of a known shape; None for [N/A] and the like when `optional`."""
        if optional and _NA.match(value):
            return None
        if not pattern.match(value):
            self.fail(f"{field} {visible(value, 60)} is not what nvidia-smi prints there")
        return value


# ---- selection ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Override:
    """What `--gpus` asked for: a count (None: every GPU the policy allows) or a list of indices."""

    count: int | None = None
    indices: tuple[int, ...] | None = None


def parse_flag(text: str | None) -> Override | None:
    """`--gpus`: an integer is a count (`2`), `all` every GPU the policy allows, a comma list
    indices (`0,3`; one index as `3,`). None when the flag is not given; UsageError if malformed."""
    if text is None:
        return None
    value = text.strip()
    if value == "all":
        return Override()
    hint = "give a count (2), all, or GPU indices (0,3; one index as 3,)"
    if "," in value:
        parts = [p.strip() for p in value.split(",")]
        if parts[-1] == "":
            parts.pop()
        if not parts or not all(_INT.match(p) and int(p) < MAX_GPUS for p in parts):
            raise UsageError(f"--gpus {text!r}: not a list of GPU indices from 0 to {MAX_GPUS - 1}; {hint}")
        indices = tuple(int(p) for p in parts)
        if len(set(indices)) != len(indices):
            raise UsageError(f"--gpus {text!r}: an index is given twice")
        return Override(indices=indices)
    if not _INT.match(value) or not 1 <= int(value) <= MAX_GPUS:
        raise UsageError(f"--gpus {text!r}: not a count from 1 to {MAX_GPUS}; {hint}")
    return Override(count=int(value))


@dataclasses.dataclass(frozen=True)
class Request:
    """Which GPUs a run wants on a host: `policy` idle, any or list (`indices`), `count` (None:
    every GPU the policy allows), the idle threshold in MiB and how long to wait for enough."""

    policy: str = "idle"
    indices: tuple[int, ...] = ()
    count: int | None = 1
    max_used_mib: int = DEFAULT_MAX_USED_MIB
    wait: float = 0.0
    explicit: bool = False          # --gpus or a list in the inventory: a host without GPUs fails
    min_free_mib: int = 0           # the selected bundles' GPU memory need: a GPU with less free is not taken

    @classmethod
    def for_host(cls, host, override: Override | None = None, min_free_mib: int = 0) -> "Request":
        """The host's gpu_policy, gpu_count, gpu_max_used_mib, gpu_wait, with --gpus over them;
        `min_free_mib`: the free memory each GPU taken must have (the bundles' need)."""
        policy = host.gpu_policy
        indices = tuple(policy) if not isinstance(policy, str) else ()
        request = cls("list" if indices else policy, indices, None if indices else host.gpu_count,
                      host.gpu_max_used_mib, float(host.gpu_wait), explicit=bool(indices), min_free_mib=min_free_mib)
        if override is None:
            return request
        if override.indices is not None:
            return dataclasses.replace(request, policy="list", indices=override.indices, count=None, explicit=True)
        return dataclasses.replace(request, count=override.count, explicit=True)

    def describe(self) -> str:
        """What is asked for, e.g. `2 idle GPUs (no compute process, at most 1024 MiB in use)`."""
        many = "every" if self.count is None else str(self.count)
        noun = "GPUs" if self.count not in (None, 1) else "GPU"
        free = f" with {self.min_free_mib} MiB free for the bundles" if self.min_free_mib else ""
        if self.policy == "list":
            return f"{many} {noun} of the list {', '.join(map(str, self.indices))}{free}"
        if self.policy == "any":
            return f"{many} {noun} (gpu_policy any){free}"
        return f"{many} idle {noun} (no compute process, at most {self.max_used_mib} MiB in use){free}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """A Request applied to the GPUs found: `usable` in preference order, `needed` of them to
    take (0: the host has no GPU and none was asked for explicitly), each other candidate with
    why it may not be taken."""

    request: Request
    usable: tuple[Gpu, ...]
    needed: int
    refused: tuple[tuple[Gpu, str], ...]

    @property
    def enough(self) -> bool:
        return len(self.usable) >= self.needed

    def taken(self) -> tuple[Gpu, ...]:
        """The GPUs to take: the first `needed` usable ones."""
        return self.usable[:self.needed]

    def shortage(self, waited: float = 0.0) -> str:
        """Why there are not enough: what was wanted, how many were usable, each other GPU and why."""
        text = f"not enough GPUs: needs {self.request.describe()}, {len(self.usable) or 'none'} usable"
        if waited:
            text += f" after waiting {int(waited)} s (gpu_wait)"
        return "; ".join([text] + [f"{gpu.label()}: {why}" for gpu, why in self.refused])


def choose(gpus: Sequence[Gpu], request: Request, claimed: Mapping[str, str] | None = None,
           host: str | None = None) -> Choice:
    """Apply `request` to the GPUs found; `claimed`: uuid -> who holds it (another run of this
    remote_dir). GpuSelectionError when a listed index does not exist, or when GPUs were asked
    for explicitly and the host has none."""
    claimed = claimed or {}
    by_index = {g.index: g for g in gpus}
    if request.explicit and not gpus:
        raise GpuSelectionError(f"{request.describe()} asked for, but nvidia-smi lists no GPU", host=host)
    if request.policy == "list":
        missing = [i for i in request.indices if i not in by_index]
        if missing:
            there = ", ".join(map(str, by_index))
            raise GpuSelectionError(f"GPU index {missing[0]} does not exist on the host (its GPUs: {there})",
                                    host=host)
        candidates = [by_index[i] for i in request.indices]
    elif request.policy == "any":      # idle GPUs first, then the others, each by index
        candidates = sorted(gpus, key=lambda g: (g.why_busy(request.max_used_mib) is not None, g.index))
    else:
        candidates = list(gpus)
    usable, refused = [], []
    for gpu in candidates:
        why = f"claimed by another run ({claimed[gpu.uuid]})" if gpu.uuid in claimed else \
            gpu.why_busy(request.max_used_mib) if request.policy == "idle" else None
        why = why or gpu.why_too_small(request.min_free_mib)
        if why:
            refused.append((gpu, why))
        else:
            usable.append(gpu)
    if not candidates:
        needed = 0
    elif request.count is not None:
        needed = request.count
    else:
        needed = len(candidates) if request.policy == "list" else max(1, len(usable))
    return Choice(request, tuple(usable), needed, tuple(refused))


# ---- views and co-tenants ----------------------------------------------------------------------

TABLE_HEADER = ("gpu", "name", "memory MiB", "util", "state", "processes", "selected")


def table_rows(records: Sequence[Mapping], selected: Sequence[int] = ()) -> list[list[str]]:
    """The GPU table as rows of text (doctor, report.md), from GPU records as run.json holds them
    (Gpu.to_record): index, name, memory used/total, utilization, busy/idle, processes, selected."""
    rows = []
    for gpu in records:
        processes = gpu.get("processes") or []
        shown = ", ".join(f"{p.get('pid', '?')} {p.get('name', '?')} "
                          f"{'?' if p.get('used_mib') is None else p.get('used_mib')} MiB" for p in processes[:SHOWN_PROCESSES])
        if len(processes) > SHOWN_PROCESSES:
            shown += f" and {len(processes) - SHOWN_PROCESSES} more"
        rows.append([str(gpu.get("index")), str(gpu.get("name")),
                     f"{_or_unknown(gpu.get('memory_used_mib'))} / {_or_unknown(gpu.get('memory_total_mib'))}",
                     f"{_or_unknown(gpu.get('utilization_pct'))} %", "busy" if gpu.get("busy") else "idle",
                     shown or "-", "yes" if gpu.get("index") in selected else ""])
    return rows


def pids_on(sample: GpuInventory, uuid: str) -> set[int]:
    """The pids nvidia-smi listed on GPU `uuid` in one query."""
    return {p.pid for gpu in sample.gpus if gpu.uuid == uuid for p in gpu.processes if p.pid is not None}


def own_pids(transport, pids: Collection[int], under: str, marker: str) -> set[int]:
    """Those of `pids` that are a step's own processes on the host: processes of the connecting
    user (the owner of /proc/PID, which the kernel keeps: another user's process is never one,
    whatever it copied) whose executable lies under the folder `under` (/proc/PID/exe: absolute,
    and not something a process can rename, unlike the name nvidia-smi shows; remote_dir, where no
    other user can run anything) or whose environment holds the entry `marker` (what the step's
    command started from elsewhere: an interpreter, a shell)."""
    if not pids:
        return set()
    out = client.output(transport, client.gpu_own(transport.host, under=under, marker=marker, pids=sorted(pids)),
                        max_bytes=OUTPUT_MAX_BYTES)
    return {int(line) for line in out.splitlines() if _INT.match(line) and int(line) in pids}


def co_tenants(samples: Sequence[GpuInventory], uuid: str, own: Collection[int]) -> list[dict]:
    """The other processes seen on GPU `uuid` across `samples` (queries made while a step ran):
    pid, name, the most MiB seen, in how many samples; the pids in `own` (the step's own processes,
    own_pids) are not counted."""
    seen: dict[tuple, dict] = {}
    for sample in samples:
        for gpu in sample.gpus:
            if gpu.uuid != uuid:
                continue
            for p in gpu.processes:
                if p.pid is not None and p.pid in own:
                    continue
                entry = seen.setdefault((p.pid, p.name), {"pid": p.pid, "name": p.name, "max_used_mib": p.used_mib,
                                                          "samples": 0})
                entry["samples"] += 1
                if p.used_mib is not None and (entry["max_used_mib"] or 0) < p.used_mib:
                    entry["max_used_mib"] = p.used_mib
    return sorted(seen.values(), key=lambda e: (e["pid"] is None, e["pid"] or 0, e["name"]))


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)

