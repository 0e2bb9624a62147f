"""Preflight: the doctor's checks on the host, and the host's fingerprint for the record (the
`doctor` command is this step alone)."""
from __future__ import annotations

from .. import doctor
from ..record import Fingerprint
from .context import Outcome, StepContext, StepError


def run(ctx: StepContext) -> Outcome:
    """Probe the host once, log every finding (reachable, host key and auth included), record its
    fingerprint; fail on a failed check."""
    findings, facts = doctor.examine(ctx.transport)
    for f in findings:
        ctx.log(f"{f.status:4}  {f.check:9}  {f.detail}")
    ctx.record.fingerprint = fingerprint(facts)
    failed = doctor.failed(findings)
    if failed:
        raise StepError("; ".join(f"{f.check}: {f.detail}" for f in failed), host=ctx.host.name)
    warnings = [f"{f.check}: {f.detail}" for f in findings if f.status == "warn"]
    return Outcome("passed", "; ".join(warnings))


def fingerprint(facts: dict[str, list[str]]) -> Fingerprint:
    """GPU model, count, compute capability, driver, nvcc, CPU and GPU load from the probe's facts."""
    gpus = [[part.strip() for part in line.split(",")] for line in facts.get("gpu", [])]
    first: list[str | None] = list(gpus[0]) if gpus else [None, None, None]
    cap = first[1] if len(first) > 1 else None
    busy = facts.get("gpu_busy")
    return Fingerprint(
        gpu=first[0], gpu_count=len(gpus), compute_capability=cap,
        driver=first[2] if len(first) > 2 else None,
        nvcc=next(iter(facts.get("nvcc_version") or []), None),
        arch=f"sm_{cap.replace('.', '')}" if cap else None,
        gpus_busy=(busy[0] == "yes") if busy else None,
        cpu=next(iter(facts.get("cpu") or []), None))
