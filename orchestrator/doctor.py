"""Doctor: is a host ready? A list of small checks over facts gathered in one round trip.

    findings, facts = examine(transport)   # [Finding(check, status, detail)], the probe's facts
    failed(findings)                       # the findings with status "fail"

Checks: reachable, auth, host_key (from the connection), then, from one probe command: rsync,
nvcc (path and version under cuda_home), gpu (name, compute capability, driver, from
nvidia-smi), arch (does `arch` match the GPU), disk (free space under remote_dir), python (with
numpy). The preflight step (steps/preflight.py: the doctor command, and the first step of validate)
runs them.

A `scheduler: slurm` entry (docs/slurm.md) gets SLURM_CHECKS instead: rsync and disk of its login
node (where the tree goes: the cluster's shared filesystem), then, from a second probe there
(host/slurm_probe.sh): slurm (the commands and their version), partition (exists and is UP),
nodes (their states, GRES and features: at least one usable node with the GPUs asked for),
queue (its jobs by state) and account (the partition's AllowAccounts/DenyAccounts/AllowQos for the
entry's account and QOS, and whether `sbatch --test-only` accepts the whole request). Its GPUs are
the scheduler's: nvcc, gpu, arch and python belong to the compute nodes, checked inside the
allocation (not built yet: docs/slurm.md).
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Sequence

from . import remote
from .bounded import short_text
from .errors import AuthError, ConnectError, HostKeyError
from .host import client
from .inventory import Host
from .connectors.base import Transport
from .safe_text import visible

# Slurm's modules (slurm/commands.py, slurm/facts.py) are imported by the functions of a
# `scheduler: slurm` entry, when one runs: most runs have none, and each run pays for its imports.

MIN_FREE_MB = 1024
LOW_FREE_MB = 5 * 1024


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str          # ok | warn | fail
    detail: str


def examine(transport: Transport, started: Future | None = None, import_numpy: bool = True,
            bundle_files: Sequence[str] = ()) -> tuple[list[Finding], dict[str, list[str]]]:
    """Every check's finding and the probe's facts (none when the host could not be reached:
    a connection, host key or authentication failure is a finding). Other errors (the probe
    failed or timed out, the run was interrupted) are raised. `started`: the probe already
    under way (Run.prepare), else it runs now (`import_numpy`, `bundle_files`: as probe())."""
    host = transport.host
    try:
        facts = started.result() if started is not None else probe(transport, import_numpy, bundle_files)
    except HostKeyError as e:
        return [Finding("reachable", "ok", host.label), Finding("host_key", "fail", e.message)], {}
    except AuthError as e:
        return [Finding("reachable", "ok", host.label), Finding("host_key", "ok", "verified"),
                Finding("auth", "fail", e.message)], {}
    except ConnectError as e:
        if transport.stopped.is_set():
            raise
        return [Finding("reachable", "fail", e.message)], {}
    connection = [Finding("reachable", "ok", host.label)]
    if not host.is_local:
        connection += [Finding("host_key", "ok", "verified"), Finding("auth", "ok", host.user or "as configured")]
    checks = SLURM_CHECKS if host.slurm is not None else CHECKS
    return connection + [check(host, facts) for check in checks], facts


def failed(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "fail"]


def probe_command(host: Host, import_numpy: bool = True, bundle_files: Sequence[str] = ()) -> remote.Command:
    """The one command that gathers every fact the checks need (key=value lines); numpy's version
    from importing it, or (not `import_numpy`) from its installed metadata when it has some; and
    the room for the bundles whose files (relative to remote_dir) are `bundle_files` (capacity.room_of)."""
    return client.doctor_probe(host, import_numpy=import_numpy, bundle_files=bundle_files)


def probe(transport: Transport, import_numpy: bool = True, bundle_files: Sequence[str] = ()) -> dict[str, list[str]]:
    """Run the probe; facts as key -> list of values (a key may repeat, e.g. one gpu per GPU).
    `import_numpy` False (a validate's preflight, whose later steps import it where they use it):
    numpy's version is read from its installed metadata, a tenth of the time of importing it.
    `bundle_files`: the selected bundles' files, whose room it measures too (one command)."""
    host = transport.host
    facts = _facts(transport.check(probe_command(host, import_numpy, bundle_files)).tail)
    if host.slurm is not None:
        facts.update(_facts(transport.check(slurm_probe_command(host)).tail))
    return facts


def slurm_probe_command(host: Host) -> remote.Command:
    """The second probe of a Slurm entry, on its login node (host/slurm_probe.sh)."""
    from .slurm import commands as slurm
    req = slurm.request(host)
    return client.slurm_probe(host, conf=req.conf or "", partition=req.partition,
                              sbatch_options=slurm.sbatch_options(host))


def _facts(output: str) -> dict[str, list[str]]:
    """A probe's key=value lines as key -> values."""
    facts: dict[str, list[str]] = {}
    for line in output.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            facts.setdefault(key, []).append(value.strip())
    return facts


def _one(facts, key) -> str:
    return (facts.get(key) or [""])[0]


def rsync_of(facts) -> tuple[str, str]:
    """Where rsync is on the host and its version line, as the probe's `facts` say ("" where there is none)."""
    return _one(facts, "rsync"), _one(facts, "rsync_version")


def check_rsync(host: Host, facts) -> Finding:
    path, version = rsync_of(facts)
    if path:
        return Finding("rsync", "ok", f"{path} ({version})")
    where = f"no executable rsync at {host.rsync_path}" if host.rsync_path else "no rsync on PATH"
    return Finding("rsync", "warn", f"{where}: deploy falls back to a tar stream")


def check_nvcc(host: Host, facts) -> Finding:
    path, version = _one(facts, "nvcc"), _one(facts, "nvcc_version")
    if path:
        return Finding("nvcc", "ok", f"{path} (release {version or 'unknown'})")
    where = f"under {host.cuda_home}/bin" if host.cuda_home else "on PATH (no cuda_home)"
    status = "fail" if host.backend == "cuda" else "warn"
    return Finding("nvcc", status, f"no nvcc {where}" + ("" if status == "fail" else ": CPU build only"))


def check_gpu(host: Host, facts) -> Finding:
    gpus = facts.get("gpu", [])
    if not gpus:
        status = "fail" if host.backend == "cuda" or host.gpus else "warn"
        why = "nvidia-smi is not on the host's PATH" if facts.get("nvidia_smi") else "no GPU found by nvidia-smi"
        return Finding("gpu", status, f"{why}{'' if status == 'fail' else ': CPU backend'}")
    models = sorted(set(gpus))
    detail = f"{len(gpus)} x " + "; ".join(models) if len(models) == 1 else "; ".join(gpus)
    if host.gpus and len(gpus) != host.gpus:
        return Finding("gpu", "warn", f"{detail} (inventory says {host.gpus})")
    return Finding("gpu", "ok", detail)


def check_arch(host: Host, facts) -> Finding:
    caps = sorted({g.split(",")[1].strip() for g in facts.get("gpu", []) if g.count(",") >= 2})
    found = ", ".join("sm_" + c.replace(".", "") for c in caps)
    if host.arch == "auto":
        return Finding("arch", "ok", f"auto ({found or 'no GPU'})")
    if not caps:
        return Finding("arch", "warn", f"{host.arch} configured but no GPU found")
    if found != host.arch:
        return Finding("arch", "fail", f"inventory arch {host.arch} but the GPU is {found}")
    return Finding("arch", "ok", host.arch)


def check_disk(host: Host, facts) -> Finding:
    free_kb = _one(facts, "disk_free_kb")
    if not free_kb.isdigit():
        return Finding("disk", "fail", f"cannot read free space under {host.remote_dir}")
    mb = int(free_kb) // 1024
    status = "fail" if mb < MIN_FREE_MB else "warn" if mb < LOW_FREE_MB else "ok"
    return Finding("disk", status, f"{mb / 1024:.1f} GiB free at {_one(facts, 'disk_path')}")


def check_python(host: Host, facts) -> Finding:
    version, numpy = _one(facts, "python_version"), _one(facts, "numpy_version")
    if not version:
        return Finding("python", "fail", f"{host.python} does not run")
    if not numpy:
        return Finding("python", "fail", f"{host.python} {version} has no numpy")
    return Finding("python", "ok", f"{host.python} {version}, numpy {numpy}")


CHECKS = (check_rsync, check_nvcc, check_gpu, check_arch, check_disk, check_python)

# -- a `scheduler: slurm` entry ----------------------------------------------------------------
# Slurm's own words (its messages, GRES, features, reasons) shown escaped and cut at this length.
SHOWN = 200
_USABLE = ("idle", "mixed", "allocated", "completing", "planned")       # sinfo's states that take new jobs


def _said(value: str, limit: int = SHOWN) -> str:
    """Text from the login node's Slurm as a finding may show it: control characters escaped, cut."""
    return visible(short_text(value, limit))


def _no_slurm(facts) -> Finding | None:
    return None if "slurm_version" in facts else Finding("slurm", "fail", "not checked: no Slurm on the login node")


def check_slurm(host: Host, facts) -> Finding:
    from .slurm import commands as slurm
    if "slurm_version" not in facts:
        return Finding("slurm", "fail", "no sinfo or sbatch on the login node's PATH")
    conf = slurm.request(host).conf
    return Finding("slurm", "ok", _said(_one(facts, "slurm_version")) + (f" (SLURM_CONF {conf})" if conf else ""))


def _partition(host: Host, facts) -> dict[str, str] | None:
    """The partition's scontrol fields, None when scontrol did not show it."""
    from .slurm import facts as slurm_facts
    if _one(facts, "partition_rc") != "0":
        return None
    return slurm_facts.fields(_one(facts, "partition"))


def check_partition(host: Host, facts) -> Finding:
    from .slurm import commands as slurm
    missing = _no_slurm(facts)
    if missing:
        return dataclasses.replace(missing, check="partition")
    name = slurm.request(host).partition
    found = _partition(host, facts)
    if found is None:
        return Finding("partition", "fail", f"{name}: {_said(_one(facts, 'partition')) or 'scontrol showed nothing'}")
    state = found.get("State", "")
    detail = (f"{name}: {_said(state, 20) or 'no State'}, {_said(found.get('TotalNodes', '?'), 20)} node(s), "
              f"MaxTime {_said(found.get('MaxTime', '?'), 30)}")
    return Finding("partition", "ok" if state == "UP" else "fail", detail)


def check_nodes(host: Host, facts) -> Finding:
    from .slurm import commands as slurm, facts as slurm_facts
    missing = _no_slurm(facts)
    if missing:
        return dataclasses.replace(missing, check="nodes")
    wanted = slurm.request(host).gres
    usable = enough = 0
    groups = []
    for line in facts.get("nodes", []):
        count, state, gres, features, reason = (line.split("|", 4) + [""] * 4)[:5]
        if not count.isdigit():
            return Finding("nodes", "fail", f"sinfo: {_said(line)}")
        kind = state.rstrip("*~#!%$@+^-")
        if kind in _USABLE:
            usable += int(count)
            enough += int(count) if slurm_facts.has_gpus(gres, wanted) else 0
        why = f", {_said(reason, 80)}" if reason and kind not in _USABLE else ""
        groups.append(f"{count} {_said(state, 30)} (GRES {_said(gres, 80)}, features {_said(features, 80)}{why})")
    detail = "; ".join(groups[:20]) or "sinfo lists no node"
    if not usable:
        return Finding("nodes", "fail", f"no node takes jobs: {detail}")
    if not enough:
        return Finding("nodes", "fail", f"no usable node has {wanted}: {detail}")
    return Finding("nodes", "ok" if usable == enough else "warn", detail)


def check_queue(host: Host, facts) -> Finding:
    from .slurm import commands as slurm
    missing = _no_slurm(facts)
    if missing:
        return dataclasses.replace(missing, check="queue")
    if "queue_error" in facts:
        return Finding("queue", "warn", f"squeue: {_said(_one(facts, 'queue_error'))}")
    counts = {}
    for line in facts.get("queue", []):
        state, _, count = line.partition(" ")
        if count.isdigit():
            counts[_said(state, 30)] = int(count)
    depth = ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items())) or "no job"
    return Finding("queue", "ok", f"{slurm.request(host).partition}: {depth}")


def check_account(host: Host, facts) -> Finding:
    from .slurm import commands as slurm
    missing = _no_slurm(facts)
    if missing:
        return dataclasses.replace(missing, check="account")
    req = slurm.request(host)
    part = _partition(host, facts) or {}
    for key, value, allow, deny in (("account", req.account, "AllowAccounts", "DenyAccounts"),
                                    ("qos", req.qos, "AllowQos", "DenyQos")):
        allowed, denied = part.get(allow, "ALL").split(","), part.get(deny, "").split(",")
        if value and ((allowed != ["ALL"] and value not in allowed) or value in denied):
            return Finding("account", "fail", f"{key} {value} may not submit to {req.partition} "
                                              f"({allow}={_said(part.get(allow, ''), 80)}, "
                                              f"{deny}={_said(part.get(deny, ''), 80)})")
    said = "; ".join(_said(line) for line in facts.get("test_only", [])) or "no answer"
    who = f"account {req.account}" if req.account else "the default account"
    if _one(facts, "test_only_rc") != "0":
        return Finding("account", "fail", f"sbatch --test-only refuses the request ({who}): {said}")
    return Finding("account", "ok", f"{who}: sbatch --test-only accepts the request: {said}")


SLURM_CHECKS = (check_rsync, check_disk, check_slurm, check_partition, check_nodes, check_queue, check_account)

