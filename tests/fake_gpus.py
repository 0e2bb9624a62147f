"""Fake GPUs for tests: a folder with an `nvidia-smi` (tests/fake_nvidia_smi) whose answers the
test chooses, and may change while a run waits.

    fake = FakeGpus(tmp / "bin")          # put fake.bin first on a host's PATH
    fake.set(4, busy={1: [(4242, "python3", 30000)]}, used={2: 5000})
    fake.uuid(1)                          # GPU 1's uuid
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "fake_nvidia_smi"


class FakeGpus:
    """The fake nvidia-smi in `bin_dir` and the state it answers from."""

    def __init__(self, bin_dir: Path):
        self.bin = Path(bin_dir)
        self.bin.mkdir(parents=True, exist_ok=True)
        link = self.bin / "nvidia-smi"
        if not link.exists():
            link.symlink_to(SCRIPT)
        self.state_file = self.bin / "nvidia-smi.json"

    @staticmethod
    def uuid(index: int) -> str:
        return f"GPU-{index:08x}-1111-2222-3333-444455556666"

    def set(self, count: int, busy: dict | None = None, used: dict | None = None, name: str = "NVIDIA H200",
            **extra) -> None:
        """`count` GPUs; `busy`: index -> [(pid, process name, MiB)]; `used`: index -> MiB in use
        besides those processes; `extra`: raw state keys (exit, raw, stderr)."""
        busy, used = busy or {}, used or {}
        gpus = [{"index": i, "uuid": self.uuid(i), "name": name,
                 "memory.used": used.get(i, 0) + sum(p[2] for p in busy.get(i, [])), "memory.total": 143771,
                 "utilization.gpu": 90 if busy.get(i) else 0, "compute_cap": "9.0",
                 "pci.bus_id": f"00000000:{0x18 + i:02X}:00.0", "driver_version": "580.95.05"}
                for i in range(count)]
        apps = [{"gpu_uuid": self.uuid(i), "pid": pid, "process_name": pname, "used_memory": mib}
                for i, procs in sorted(busy.items()) for pid, pname, mib in procs]
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"gpus": gpus, "apps": apps, **extra}))
        os.replace(tmp, self.state_file)
