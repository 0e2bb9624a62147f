"""Whether a host can hold the bundles a run selected (bundle_plan.BundlePlan): its disk at
remote_dir and its RAM, judged by preflight before anything is written (GPU memory is judged by
the GPU selection: gpus.Request.min_free_mib).

    room = probe(transport, plan, bundle_folder)       # free space, MemAvailable, bundles already there
    problem = disk_problem(room, plan, host)           # None or the numbers that do not fit
    problem = ram_problem(room, plan, engines)

The host's answer is bounded and parsed line by line: only `key=integer` lines count.
"""
from __future__ import annotations

import dataclasses
import posixpath
import re

from .bundle_plan import BundlePlan, gb
from .gpus import visible
from ..host import client
from ..inventory import Host
from ..connectors.base import Transport

MAX_OUTPUT = 64 * 1024
_LINE = re.compile(r"(disk_free_kb|mem_available_kb|have_bytes)=(\d{1,20})(?: (.*))?\Z")


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


def probe(transport: Transport, plan: BundlePlan, bundle_folder: str) -> Room:
    """Ask the host for its room: one short command (remote_dir, then the selected bundles' files
    relative to it)."""
    host = transport.host
    files = [posixpath.join(bundle_folder, b.file) for b in plan.bundles]
    return parse(client.output(transport, client.room(host, files=files), max_bytes=MAX_OUTPUT), files)


def parse(text: str, files: list[str]) -> Room:
    """The room script's output; a line of another shape is ignored, a file not asked about too."""
    path, free, mem, present = "?", None, None, {}
    for line in text.splitlines():
        if line.startswith("disk_path="):
            path = visible(line[len("disk_path="):], 300)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        value = int(m.group(2))
        if m.group(1) == "disk_free_kb":
            free = value * 1024
        elif m.group(1) == "mem_available_kb":
            mem = value * 1024
        elif m.group(3) in files:
            present[m.group(3)] = value
    return Room(path, free, mem, present)


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

