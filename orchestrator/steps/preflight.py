"""Preflight: the doctor's checks on the host, the host's fingerprint for the record, whether
the host can hold the selected bundles (disk and RAM: capacity.py; GPU memory: the GPU
selection), and its GPUs: the table of what nvidia-smi reports, the ones this run claims
(validate, nightly) or would take (doctor, which is this step alone)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from .. import doctor, state
from ..resources import capacity, gpu_claims, gpus
from ..resources.bundle_plan import BundlePlan
from ..records.record import Fingerprint
from ..errors import StepError
from .context import Outcome, StepContext


def run(ctx: StepContext) -> Outcome:
    """Probe the host once, log every finding (reachable, host key and auth included), record its
    fingerprint; fail on a failed check. The probe measures the room for the selected bundles too
    (judged once the checks pass). A run that claims GPUs asks for them and takes the tree lock
    meanwhile (the lock begins no sync before the checks pass)."""
    plan = ctx.bundles
    query = lock = None
    if ctx.session.claims_gpus:     # the host reads of this step at once: each its own thread
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"preflight-{ctx.host.name}")
        query = pool.submit(gpus.query, ctx.session.transport)
        lock = pool.submit(_lock_for, ctx, query)
        pool.shutdown(wait=False)
    files = capacity.bundle_files(plan, ctx.project)
    findings, facts = doctor.examine(ctx.session.transport, ctx.session.probe, ctx.plan.imports_numpy, files)
    for f in findings:
        ctx.log(f"{f.status:4}  {f.check:9}  {f.detail}")
    ctx.record.fingerprint = fingerprint(facts)
    failed = doctor.failed(findings)
    if failed:
        raise StepError("; ".join(f"{f.check}: {f.detail}" for f in failed), host=ctx.host.name)
    warnings = [f"{f.check}: {f.detail}" for f in findings if f.status == "warn"]
    room = _room(ctx, plan, capacity.room_of(facts, files)) if plan is not None and plan.bundles else None
    taken = take_gpus(ctx, query, lock)
    return Outcome("passed", "; ".join(warnings + [taken] + ([_ram(ctx, plan, room)] if plan and room else [])))


def _room(ctx: StepContext, plan: BundlePlan, room: capacity.Room) -> capacity.Room:
    """The host's `room` for the selected bundles `plan` (capacity.room_of, from the doctor's probe), logged; StepError
    with the numbers when its disk cannot hold them."""
    ctx.log(f"bundles    {', '.join(plan.tiers)}: {len(plan.bundles)} bundles, disk {capacity.gb(plan.disk_bytes)}, "
            f"RAM {capacity.gb(plan.ram_bytes)} per engine, GPU {capacity.gb(plan.gpu_bytes)}, --max-memory "
            f"{plan.max_memory} bytes")
    if plan.undeclared():
        ctx.log(f"bundles    {', '.join(plan.undeclared())}: the manifest declares no needs: not judged, and the "
                "engine keeps its own --max-memory")
    problem = capacity.disk_problem(room, plan, ctx.host)
    if problem:
        raise StepError(f"disk: {problem}", host=ctx.host.name)
    return room


def _ram(ctx: StepContext, plan: BundlePlan, room: capacity.Room) -> str:
    """The RAM verdict for the engine processes the run will have at once: one per GPU claimed
    (doctor: per GPU a run would ask for), one on a host without GPUs. StepError with the
    numbers when they do not fit."""
    if ctx.session.claims_gpus or not ctx.record.gpus:
        engines = len(ctx.session.gpus)
    else:
        request = ctx.session.gpu_request
        engines = len(request.indices) if request.policy == "list" else request.count or len(ctx.record.gpus)
    problem = capacity.ram_problem(room, plan, max(1, engines))
    if problem:
        raise StepError(f"RAM: {problem}", host=ctx.host.name)
    return capacity.summary(room, plan, max(1, engines))


def take_gpus(ctx: StepContext, query: Future | None = None, lock: Future | None = None) -> str:
    """Doctor: what a run would take. Validate and nightly: hold the tree and claim the GPUs
    (hold_tree_and_gpus; `query`: the GPU query under way, `lock`: its lock). What happened, in words."""
    if ctx.session.claims_gpus:
        return hold_tree_and_gpus(ctx, query, lock)
    found, choice = gpu_claims.preview(ctx.session.transport, ctx.session.gpu_request)
    _record(ctx, found, ())
    if not found.gpus:
        return "no GPU"
    taken = ", ".join(str(g.index) for g in choice.taken())
    return f"a run would take GPU {taken}" if choice.enough else f"a run would not start: {choice.shortage()}"


def hold_tree_and_gpus(ctx: StepContext, query: Future | None = None, lock: Future | None = None) -> str:
    """Take the tree lock and the run's GPUs for the rest of the run: on a host with GPUs the lock
    shared (waiting up to timeouts.lock for a run changing the tree) and the GPUs claimed (waiting
    up to gpu_wait for enough: GpuSelectionError naming each GPU not taken and why); on a host
    without, the lock alone, as one run at a time. Records every GPU and the selection. `lock`:
    that lock, being taken already (_lock_for)."""
    found = query.result() if query is not None else gpus.query(ctx.session.transport)
    if not found.gpus:
        gpus.choose((), ctx.session.gpu_request, host=ctx.host.name)       # GPUs asked for explicitly: an error
        ctx.session.hold_tree(state.EXCLUSIVE, taken=lock, log=ctx.log)
        _record(ctx, found, ())
        return "no GPU: the run holds the deployed tree alone"
    held = ctx.session.hold_tree(state.SHARED, ctx.host.timeout("lock"), taken=lock, log=ctx.log)
    claim = ctx.session.hold_gpus()
    for uuid, owner in claim.stale:
        ctx.log(f"recovered the claim on {uuid} left by a run that died: {gpus.visible(str(owner), 300)}")
    _record(ctx, claim.inventory, claim.gpus)
    if not claim.gpus:                  # they went away since the first look
        held.to_exclusive()
        return "no GPU: the run holds the deployed tree alone"
    return (f"GPU {', '.join(str(g.index) for g in claim.gpus)} claimed for the run "
            f"(CUDA_VISIBLE_DEVICES by uuid; {ctx.session.gpu_request.describe()})")


def _lock_for(ctx: StepContext, query: Future):
    """The tree lock in hold_tree_and_gpus' mode for the GPUs `query` finds, taken without
    beginning a sync (the sync step begins it over the lock's channel)."""
    if query.result().gpus:
        return ctx.session.take_lock(state.SHARED, ctx.host.timeout("lock"))
    return ctx.session.take_lock(state.EXCLUSIVE)


def _record(ctx: StepContext, found: gpus.GpuInventory, taken) -> None:
    """Every GPU and the selection into the host's record, and the GPU table into the log."""
    ctx.record.gpus = [g.to_record(ctx.session.gpu_request.max_used_mib) for g in found.gpus]
    ctx.record.selected_gpus = sorted(g.index for g in taken)
    if not found.gpus:
        ctx.log(f"gpus       {'no nvidia-smi on the host' if found.nvidia_smi is None else 'nvidia-smi lists no GPU'}")
        return
    rows = [list(gpus.TABLE_HEADER)] + gpus.table_rows(ctx.record.gpus, ctx.record.selected_gpus)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        ctx.log("gpus       " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


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
