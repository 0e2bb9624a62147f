"""Both bundles of a big config (k2wide: 13.5 and 15 GB), written in one pass by worker processes.

    entries = write_pair(source, recipe, golden, out_dir, workers)   # the files and their manifest entries
    entries = write_pair(source, recipe, golden, None, workers)      # the entries alone (hashes, no files)

`golden` maps each bundle label ("fp32", "int4") to its manifest entry as the golden search
made it (prompt, golden tokens, margins); the bundles' headers carry those. Every weight is one
job: its rows made a block at a time from `weights.Weights` (so a worker holds one block of one
weight, never a whole model), converted to what each bundle stores (the routed experts' INT4
codes are made once and go to both files), written at its place in each file (format version 2,
kdtree_ref.stream) and hashed on the way; the biggest weights go first. The parent writes each
file's index once every job is done and prints progress lines (kdtree_ref.progress): weights
and bytes done. The bytes equal gen_model.build_config's for the same golden, in version 2.
"""

import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import kdtr, progress, stream
from .quant import GROUP_SIZE, is_quantized, quantize
from .schema import tensor_specs
from .weights import Weights

ROW_BLOCK = 1024        # rows of a weight made at a time (7.3M values at h = 7168: about 200 MB of temporaries)
DRAFTER = "drafter"     # the job that makes the lowrank_head drafter's three tensors
PROGRESS_EVERY_S = 1.0  # at most one progress line a second (and the last)


@dataclass(frozen=True)
class Target:
    """One bundle being written: its label, header `quant`, layout, and file (None: hashes only)."""

    label: str
    quant: dict
    plan: kdtr.Plan
    path: str | None


def targets_for(source: Weights, quants: dict[str, dict], drafter: dict, golden: dict[str, dict],
                out_dir: Path | None) -> list[Target]:
    """The bundles' layouts: `quants` and `golden` by label, `drafter` the drafter header object."""
    out = []
    for label, quant in quants.items():
        meta = {"config": source.args.to_json(), "quant": quant, "drafter": drafter,
                "prompt": golden[label]["prompt"], "golden": golden[label]["golden"]}
        path = None if out_dir is None else str(out_dir / f"model_{source.args.name}_{label}.kdtr")
        out.append(Target(label, quant, kdtr.plan(meta, tensor_specs(meta)), path))
    return out


def stored_rows(source: Weights, name: str, rows: tuple[int, int], quants: dict[str, dict]) -> dict[str, dict]:
    """{label: {tensor: array}}: what each bundle stores for rows [r0, r1) of weight `name`
    (a direct routed expert: all its rows), each conversion made once."""
    if source.is_direct(name):
        qw, sc = source.expert_int4(name)
        return {label: {name + ".qw": qw, name + ".sc": sc} for label in quants}
    master = source.fp32(name, rows)
    made: dict[tuple, dict[str, np.ndarray]] = {}
    out = {}
    for label, quant in quants.items():
        keep = tuple(quant.get("keep_fp32", ()))
        int4 = quant["type"] == "int4" and is_quantized(name, keep)
        if int4 not in made:
            made[int4] = dict(zip((name + ".qw", name + ".sc"), quantize(master, GROUP_SIZE))) if int4 else {name: master}
        out[label] = made[int4]
    return out


@dataclass(frozen=True)
class Job:
    """One weight (or the drafter) of both bundles."""

    name: str
    rank: int = 0       # the drafter's rank (DRAFTER job only)
    block: int = 0      # the drafter's block size


_worker: dict = {}     # a worker process's Weights and targets (set once per process: _start_worker)


def _start_worker(source: Weights, targets: list[Target]) -> None:
    _worker.update(source=source, targets=targets)


def _run_in_worker(job: "Job") -> tuple[dict[str, dict[str, bytes]], int]:
    return run_job(_worker["source"], _worker["targets"], job)


def run_job(source: Weights, targets: list[Target], job: "Job") -> tuple[dict[str, dict[str, bytes]], int]:
    """Make, write and hash one job's tensors in every target; returns ({label: {tensor: sha256}}, bytes)."""
    quants = {t.label: t.quant for t in targets}
    parts = {t.label: stream.Part(t.path, t.plan) for t in targets if t.path is not None}
    sinks: dict[tuple[str, str], stream.RowSink] = {}
    written = 0
    try:
        for made in _blocks(source, job, quants):
            for t in targets:
                for tensor, rows in made[t.label].items():
                    key = (t.label, tensor)
                    if key not in sinks:
                        sinks[key] = (parts[t.label].rows(tensor) if t.label in parts
                                      else stream.RowSink(t.plan, t.plan.find(tensor)))
                    sinks[key].write(rows)
                    written += rows.nbytes
        digests: dict[str, dict[str, bytes]] = {t.label: {} for t in targets}
        for (label, tensor), sink in sinks.items():
            digests[label][tensor] = sink.close()
        return digests, written
    finally:
        for part in parts.values():
            part.close()


def _blocks(source: Weights, job: Job, quants: dict[str, dict]):
    """The job's stored tensors, a row block at a time ({label: {tensor: rows}} each)."""
    if job.name == DRAFTER:
        v, u, b = source.lowrank_drafter(job.rank, job.block)
        yield {label: {"drafter.v": v, "drafter.u": u, "drafter.b": b} for label in quants}
        return
    rows = source.specs[job.name].shape[0]
    step = rows if source.is_direct(job.name) or len(source.specs[job.name].shape) == 1 else ROW_BLOCK
    for r0 in range(0, rows, step):
        yield stored_rows(source, job.name, (r0, min(rows, r0 + step)), quants)


def _job_bytes(source: Weights, job: Job) -> int:
    return 1 if job.name == DRAFTER else int(np.prod(source.specs[job.name].shape, dtype=np.int64))


def write_pair(source: Weights, quants: dict[str, dict], drafter: dict, golden: dict[str, dict],
               out_dir: Path | None, workers: int) -> dict[str, tuple[str, kdtr.Plan]]:
    """Write (out_dir None: only hash) the bundles labelled by `quants`; returns {label: (identity
    hex, plan)}. Progress lines on stdout: weights done of all, bytes written."""
    targets = targets_for(source, quants, drafter, golden, out_dir)
    for t in targets:
        if t.path is not None:
            stream.create(t.path, t.plan)
    jobs = [Job(name) for name in source.specs]
    if drafter.get("kind") == "lowrank_head":
        jobs.append(Job(DRAFTER, drafter["rank"], drafter["block_size"]))
    jobs.sort(key=lambda j: -_job_bytes(source, j))         # the longest first: no straggler at the end
    digests: dict[str, dict[str, bytes]] = {t.label: {} for t in targets}
    done = written = 0
    shown = 0.0
    what = f"{source.args.name}: " + " and ".join(Path(t.path).name if t.path else t.label for t in targets)
    with ProcessPoolExecutor(max_workers=max(1, workers), initializer=_start_worker, initargs=(source, targets)) as pool:
        pending = {pool.submit(_run_in_worker, job): job for job in jobs}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                job = pending.pop(future)
                made, nbytes = future.result()
                for label, hashes in made.items():
                    digests[label].update(hashes)
                done, written = done + 1, written + nbytes
                if done == len(jobs) or time.monotonic() - shown >= PROGRESS_EVERY_S:
                    progress.report(done, len(jobs), "weights", f"{what}: {job.name}", written)
                    shown = time.monotonic()
    out = {}
    for t in targets:
        if t.path is not None:
            out[t.label] = (stream.finish(t.path, t.plan, digests[t.label]), t.plan)
        else:
            hashes = [digests[t.label][s.name] for s in t.plan.specs]
            out[t.label] = (t.plan.index(hashes)[-kdtr.HASH_BYTES:].hex(), t.plan)
    return out


def default_workers() -> int:
    """The processes the writer uses by default: every core this process may run on."""
    return len(os.sched_getaffinity(0))
