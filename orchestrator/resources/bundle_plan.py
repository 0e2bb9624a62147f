"""Which bundles a host runs, and what they need of it.

    plan = for_host(host, project, expected_manifest)    # the host's tiers (hosts.yaml `bundles:`,
                                                         # --bundles over it) as bundles and needs
    plan.disk_bytes, plan.ram_bytes, plan.gpu_bytes      # what the host must hold (rules below)
    plan.env()                                           # KD_MAX_MEMORY (and KD_CONFIGS) of the engine commands
    plan.timeouts(host)                                  # the host's step timeouts scaled by the bundles' bytes

A tier (project.bundle_tiers) names configs; a config's bundles are the expected manifest's
entries of that config, each declaring its `needs` (disk_bytes, ram_bytes, gpu_bytes: written
by the generator from the config's tensor sizes). The rules, for the selected bundles together:

- disk: the sum of their files (the remote_dir filesystem's free space plus what those files
  already occupy there must hold it);
- RAM of one engine process: the sum of their ram_bytes (the bench loads every bundle at once);
  the host's MemAvailable must hold that times the engine processes run at once (one per GPU
  claimed, else one);
- GPU memory: the largest gpu_bytes of one bundle, free on every GPU the run takes
  (gpus.Request.min_free_mib; the engine makes one bundle's model at a time, each run its own);
- the engine's --max-memory (KD_MAX_MEMORY): the largest ram_bytes of one bundle (the engine
  judges each bundle on its own against it) instead of its fixed 4 GiB;
- the timeouts of the bundles, golden, test and bench steps: the configured timeout plus
  SECONDS_PER_GB for every GB (10^9 bytes) of the selected bundles, rounded up to a second: a
  conservative 50 MB/s to write, hash or read them once.
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Mapping

from ..errors import UsageError
from ..inventory import DEFAULT_TIER, Host, Project
from ..steps import STEPS

SECONDS_PER_GB = 20.0
SCALED_STEPS = tuple(s.name for s in STEPS.values() if s.scaled)
NEEDS_KEYS = ("disk_bytes", "ram_bytes", "gpu_bytes")
MAX_NEED = 1 << 50          # 1 PiB: more is not a figure a manifest may declare


class PlanError(UsageError):
    """The selected tiers cannot be resolved against the project (a config without bundles, a
    bundle without needs): exit 2, naming the key."""


@dataclasses.dataclass(frozen=True)
class Bundle:
    """One selected bundle: its manifest name, file (relative to the bundle folder), config and needs."""

    name: str
    file: str
    config: str
    disk_bytes: int = 0
    ram_bytes: int = 0
    gpu_bytes: int = 0
    declared: bool = True       # False: the manifest declares no needs (one written before they existed)


@dataclasses.dataclass(frozen=True)
class BundlePlan:
    """The bundles a host runs: its tiers, their configs, the expected manifest's bundles of them."""

    tiers: tuple[str, ...]
    configs: tuple[str, ...]
    bundles: tuple[Bundle, ...]

    @property
    def is_default(self) -> bool:
        """Only the default tier: the engine commands run as they do without a selection."""
        return self.tiers == (DEFAULT_TIER,)

    @property
    def disk_bytes(self) -> int:
        return sum(b.disk_bytes for b in self.bundles)

    @property
    def ram_bytes(self) -> int:
        """RAM of one engine process: every selected bundle at once (the bench holds them all)."""
        return sum(b.ram_bytes for b in self.bundles)

    @property
    def gpu_bytes(self) -> int:
        """GPU memory of one engine process: the largest one bundle's (one model at a time)."""
        return max((b.gpu_bytes for b in self.bundles), default=0)

    @property
    def max_memory(self) -> int:
        """The engine's --max-memory: the largest one bundle's RAM need; 0 (the engine's default)
        when a selected bundle declares none (an older manifest: a bisect's earlier commits)."""
        if self.undeclared():
            return 0
        return max((b.ram_bytes for b in self.bundles), default=0)

    def undeclared(self) -> list[str]:
        """The selected bundles whose needs are not declared: not judged, never guessed."""
        return [b.name for b in self.bundles if not b.declared]

    def expected(self, manifest: dict) -> dict:
        """The expected manifest with only the selected configs' bundles (what golden checks)."""
        entries = manifest.get("bundles") if isinstance(manifest, dict) else None
        if not isinstance(entries, list):
            return manifest
        return {**manifest, "bundles": [e for e in entries if isinstance(e, dict) and e.get("config") in self.configs]}

    def env(self) -> dict[str, str]:
        """The engine commands' environment for these bundles: KD_MAX_MEMORY (bytes) when a need is
        declared, KD_CONFIGS (the configs, space-separated) unless only the default tier runs."""
        env = {"KD_MAX_MEMORY": str(self.max_memory)} if self.max_memory else {}
        if not self.is_default:
            env["KD_CONFIGS"] = " ".join(self.configs)
        return env

    def timeouts(self, host: Host) -> Mapping[str, float]:
        """The host's timeouts with SCALED_STEPS' raised by the bundles' bytes (module doc)."""
        extra = math.ceil(self.disk_bytes / 1e9 * SECONDS_PER_GB)
        return MappingProxyType({k: v + extra if k in SCALED_STEPS else v for k, v in host.timeouts.items()})

    def to_record(self, host: Host) -> dict:
        """The plan as run.json's host entry `bundles` holds it (with the scaled timeouts)."""
        return {"tiers": list(self.tiers), "configs": list(self.configs),
                "bundles": [dataclasses.asdict(b) for b in self.bundles],
                "disk_bytes": self.disk_bytes, "ram_bytes_per_engine": self.ram_bytes, "gpu_bytes": self.gpu_bytes,
                "max_memory": self.max_memory or None, "undeclared": self.undeclared(),
                "timeouts": {k: v for k, v in self.timeouts(host).items() if k in SCALED_STEPS},
                "seconds_per_gb": SECONDS_PER_GB}


def parse_flag(text: str | None, project: Project) -> tuple[str, ...] | None:
    """`--bundles`: a comma list of tiers of project.bundle_tiers (None: the flag not given)."""
    if text is None:
        return None
    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    known = ", ".join(project.bundle_tiers)
    if not tiers:
        raise UsageError(f"--bundles {text!r}: names no tier (tiers: {known})")
    for tier in tiers:
        if tier not in project.bundle_tiers:
            raise UsageError(f"--bundles: unknown bundle tier {tier!r} (tiers of project.bundle_tiers: {known})")
    if len(set(tiers)) != len(tiers):
        raise UsageError(f"--bundles {text!r}: names a tier twice")
    return tiers


def for_host(host: Host, project: Project, expected: dict) -> BundlePlan:
    """The bundles of the host's tiers in the expected manifest `expected`. PlanError when a tier
    other than the default names a config without bundles there (the default tier's configs may
    have none: a project without reference bundles), or a selected bundle declares needs that are not byte counts (a bundle declaring none is
    `declared` False: see BundlePlan.undeclared)."""
    entries = expected.get("bundles") if isinstance(expected, dict) else None
    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    configs: list[str] = []
    for tier in host.bundles:
        listed = project.bundle_tiers.get(tier)
        if tier not in project.bundle_tiers:
            raise PlanError(f"host {host.name}: bundles: unknown bundle tier {tier!r} (tiers of project.bundle_tiers: "
                            f"{', '.join(project.bundle_tiers)})")
        if listed is None:
            listed = tuple(dict.fromkeys(str(e.get("config")) for e in entries))
        for config in listed:
            if tier != DEFAULT_TIER and not any(e.get("config") == config for e in entries):
                raise PlanError(f"project.bundle_tiers.{tier}: config {config!r} has no bundle in the expected manifest "
                                f"{project.results.get('expected_manifest')}")
            if config not in configs:
                configs.append(config)
    return BundlePlan(tuple(host.bundles), tuple(configs),
                      tuple(_bundle(e) for e in entries if e.get("config") in configs))


def _bundle(entry: dict) -> Bundle:
    name = str(entry.get("name"))[:200]
    needs = entry.get("needs")
    if needs is None:
        return Bundle(name, str(entry.get("file")), str(entry.get("config")), declared=False)
    if not isinstance(needs, dict):
        raise PlanError(f"expected manifest: bundle {name!r}: needs must be a mapping of disk_bytes, ram_bytes, gpu_bytes")
    for key in NEEDS_KEYS:
        value = needs.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NEED:
            raise PlanError(f"expected manifest: bundle {name!r}: needs.{key} must be bytes from 0 to {MAX_NEED}, "
                            f"not {str(value)[:40]!r}")
    return Bundle(name, str(entry.get("file")), str(entry.get("config")), needs["disk_bytes"], needs["ram_bytes"],
                  needs["gpu_bytes"])


def gb(n: int) -> str:
    """Bytes as decimal GB for messages (`13.56 GB`; small figures in MB)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
