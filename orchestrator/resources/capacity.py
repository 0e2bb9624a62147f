"""Whether a host can hold the bundles a run selected (bundle_plan.BundlePlan): its disk at
remote_dir and its RAM, judged by preflight before anything is written (GPU memory is judged by
the GPU selection: gpus.Request.min_free_mib).

    files = bundle_files(plan, project)               # what the doctor probe is asked about
    room = room_of(facts, files)                       # from its facts: free space, MemAvailable, bundles there
    problem = disk_problem(room, plan, host)           # None or the numbers that do not fit
    problem = ram_problem(room, plan, engines)

The room comes with the doctor's probe (host/doctor_probe.sh, one command: doctor.probe), whose
answer is bounded; only `key=integer` values count.
"""
from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Mapping, Sequence

from .bundle_plan import BundlePlan, gb
from .gpus import visible
from ..inventory import Host, Project

_VALUE = re.compile(r"(\d{1,20})(?: (.*))?\Z")


@dataclasses.dataclass(frozen=True)
class Room:
    """What the host has: free bytes of remote_dir's filesystem (at `disk_path`, the nearest
    existing folder), MemAvailable bytes (None: not readable), the selected bundles' files
    already there and the bytes they occupy."""

    disk_path: str
    free_bytes: int | None
    mem_available_bytes: int | None
    present: dict[str, int]

    @property
    def present_bytes(self) -> int:
        return sum(self.present.values())


def bundle_files(plan: BundlePlan | None, project: Project) -> list[str]:
    """The files of the bundles `plan` selects, relative to remote_dir (in the folder of the
    project's bundle manifest), whose bytes already there the doctor probe reports; none without a plan."""
    folder = posixpath.dirname(project.results["manifest"])
    return [posixpath.join(folder, b.file) for b in plan.bundles] if plan is not None else []


def room_of(facts: Mapping[str, Sequence[str]], files: Sequence[str]) -> Room:
    """The room in the doctor probe's facts (doctor.probe, asked about `files`); a value of
    another shape is ignored, a file not asked about too."""
    free, mem = _number(facts, "disk_free_kb"), _number(facts, "mem_available_kb")
    present = {}
    for value in facts.get("have_bytes", ()):
        m = _VALUE.match(value)
        if m and m.group(2) in files:
            present[m.group(2)] = int(m.group(1))
    path = facts.get("disk_path") or ["?"]
    return Room(visible(path[0], 300), free * 1024 if free is not None else None,
                mem * 1024 if mem is not None else None, present)


def _number(facts: Mapping[str, Sequence[str]], key: str) -> int | None:
    m = _VALUE.match((facts.get(key) or [""])[0])
    return int(m.group(1)) if m and m.group(2) is None else None


def disk_problem(room: Room, plan: BundlePlan, host: Host) -> str | None:
    """Why the selected bundles do not fit at remote_dir, with the numbers, or None."""
    need = plan.disk_bytes
    if need == 0:
        return None
    if room.free_bytes is None:
        return f"cannot read the free space of {room.disk_path} (df) to place {gb(need)} of bundles"
    if room.free_bytes + room.present_bytes >= need:
        return None
    return (f"the bundles of {_tiers(plan)} need {gb(need)} of disk under {host.remote_dir}, but the filesystem at "
            f"{room.disk_path} has {gb(room.free_bytes)} free plus {gb(room.present_bytes)} of those bundles already "
            f"there ({gb(room.free_bytes + room.present_bytes)}): free {gb(need - room.free_bytes - room.present_bytes)} "
            "more, or choose fewer tiers (hosts.yaml `bundles:`, --bundles)")


def ram_problem(room: Room, plan: BundlePlan, engines: int) -> str | None:
    """Why the host's MemAvailable cannot hold `engines` engine processes at once, or None."""
    per = plan.ram_bytes
    if per == 0:
        return None
    if room.mem_available_bytes is None:
        return "cannot read MemAvailable from /proc/meminfo to judge the bundles' RAM need"
    need = per * engines
    if room.mem_available_bytes >= need:
        return None
    return (f"the bundles of {_tiers(plan)} need {gb(per)} of RAM per engine process, x {engines} "
            f"engine{'s' if engines != 1 else ''} at once (one per GPU) = {gb(need)}, but the host has "
            f"{gb(room.mem_available_bytes)} available (MemAvailable)")


def summary(room: Room, plan: BundlePlan, engines: int) -> str:
    """What was judged, in words, for the preflight's message."""
    return (f"room for {_tiers(plan)}: disk {gb(plan.disk_bytes)} of {gb((room.free_bytes or 0) + room.present_bytes)}, "
            f"RAM {gb(plan.ram_bytes * engines)} of {gb(room.mem_available_bytes or 0)}")


def _tiers(plan: BundlePlan) -> str:
    return f"tier{'s' if len(plan.tiers) > 1 else ''} {', '.join(plan.tiers)} ({len(plan.bundles)} bundles)"

