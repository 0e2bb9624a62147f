"""Doctor: is a host ready? A list of small checks over facts gathered in one round trip.

    findings = diagnose(transport)      # [Finding(check, status, detail)], never raises
    failed(findings)                    # the findings with status "fail"

Checks: reachable, auth, host_key (from the connection), then, from one probe command: rsync,
nvcc (path and version under cuda_home), gpu (name, compute capability, driver, from
nvidia-smi), arch (does `arch` match the GPU), disk (free space under remote_dir), python (with
numpy). The validate pipeline's preflight step reuses diagnose().
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future

from . import remote
from .errors import AuthError, ConnectError, HostError, HostKeyError
from .host import script_text
from .inventory import Host
from .connectors.base import Transport

MIN_FREE_MB = 1024
LOW_FREE_MB = 5 * 1024


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str          # ok | warn | fail
    detail: str


def diagnose(transport: Transport) -> list[Finding]:
    """Every check's finding for the host of `transport` (any host error is a finding)."""
    try:
        return examine(transport)[0]
    except HostError as e:
        return [Finding("reachable", "fail", e.message)]


def examine(transport: Transport, started: Future | None = None,
            import_numpy: bool = True) -> tuple[list[Finding], dict[str, list[str]]]:
    """Every check's finding and the probe's facts (none when the host could not be reached:
    a connection, host key or authentication failure is a finding). Other errors (the probe
    failed or timed out, the run was interrupted) are raised. `started`: the probe already
    under way (Run.prepare), else it runs now (`import_numpy`: as probe())."""
    host = transport.host
    try:
        facts = started.result() if started is not None else probe(transport, import_numpy)
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
    return connection + [check(host, facts) for check in CHECKS], facts


def failed(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "fail"]


def probe_command(host: Host, import_numpy: bool = True) -> remote.Command:
    """The one command that gathers every fact the checks need (key=value lines); numpy's version
    from importing it, or (not `import_numpy`) from its installed metadata when it has some."""
    return remote.script(_PROBE_SCRIPT, host.remote_dir, host.rsync_path or "", host.cuda_home or "",
                         host.python, "import" if import_numpy else "find", timeout=host.timeout("preflight"),
                         what="the doctor probe")


def probe(transport: Transport, import_numpy: bool = True) -> dict[str, list[str]]:
    """Run the probe; facts as key -> list of values (a key may repeat, e.g. one gpu per GPU).
    `import_numpy` False (a validate's preflight, whose later steps import it where they use it):
    numpy's version is read from its installed metadata, a tenth of the time of importing it."""
    host = transport.host
    result = transport.check(probe_command(host, import_numpy))
    facts: dict[str, list[str]] = {}
    for line in result.tail.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            facts.setdefault(key, []).append(value.strip())
    return facts


def _one(facts, key) -> str:
    return (facts.get(key) or [""])[0]


def check_rsync(host: Host, facts) -> Finding:
    path = _one(facts, "rsync")
    if path:
        return Finding("rsync", "ok", f"{path} ({_one(facts, 'rsync_version')})")
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

_PROBE_SCRIPT = script_text("doctor_probe")
