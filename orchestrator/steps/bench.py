"""Bench: run the engine's benchmarks on the host and pull its JSON report. With GPUs claimed, the
benchmarks run on the first of them alone, and the processes of others seen on that GPU while they
ran (nvidia-smi, sampled) are recorded as its co-tenants: a figure measured beside them is noisy.
The step's own processes are the connecting user's (the kernel's word: another user cannot copy
it) whose executable lies under remote_dir (private to the user) or whose environment holds a marker
the step puts there (what the bench command starts from elsewhere, such as PyTorch's interpreter
for the side-by-side timings), never known by the name nvidia-smi shows, which is whatever the
process was started as (`build/kdtree`), nor by the marker alone, which travels on a command line
every user of the host can read."""
from __future__ import annotations

import secrets
import threading

from ..resources import gpus
from ..errors import KdError, StepError
from ..records.result_files import bench_from_engine
from .context import Outcome, StepContext

SAMPLE_SECONDS = 5.0         # between two looks at the GPU while the benchmarks run
OWNER_VARIABLE = "KDTREE_OWNER"   # in the bench command's environment: its processes are the step's own


def run(ctx: StepContext) -> Outcome:
    """Run the bench command and record its metrics; a validate run whose executables, build key,
    bundles and scripts are those of the last successful bench on the host reuses its report
    (cached; nightly and GPU runs never)."""
    reused = ctx.cached_result("bench")
    if reused is not None:
        ctx.record.bench = _bench(ctx, reused.data)
        return Outcome("cached", f"{len(ctx.record.bench['metrics'])} metrics reused from run {reused.run_id} "
                                 f"({reused.why}; not a new measurement)", reused.run_id)
    command = ctx.step_command()
    if not ctx.session.gpus:
        ctx.shell.run(command)
        data = ctx.pull_json("bench")
        ctx.record.bench = _bench(ctx, data)
        _annotate(ctx, busy=bool(ctx.record.fingerprint.gpus_busy))
        ctx.stamp_result(data)
        return Outcome("passed", f"{len(ctx.record.bench['metrics'])} metrics")
    gpu = ctx.session.gpus[0]
    with _Sampler(ctx, gpu.uuid) as sampler:
        ctx.shell.run(command, {**ctx.shell.gpu_env(gpu), OWNER_VARIABLE: sampler.owner})
    ctx.record.bench = _bench(ctx, ctx.pull_json("bench", gpu))
    others = gpus.co_tenants(sampler.samples, gpu.uuid, sampler.own)
    ctx.record.bench["gpu"] = {"index": gpu.index, "uuid": gpu.uuid, "co_tenants": others,
                               "samples": len(sampler.samples)}
    _annotate(ctx, busy=bool(others) or bool(ctx.record.fingerprint.gpus_busy))
    metrics = f"{len(ctx.record.bench['metrics'])} metrics on GPU {gpu.index}"
    if not others:
        return Outcome("passed", f"{metrics}, alone on it ({len(sampler.samples)} looks)")
    names = ", ".join(f"pid {p['pid'] if p['pid'] is not None else '?'} {p['name']}" for p in others[:5])
    ctx.log(f"co-tenants on GPU {gpu.index} while the benchmarks ran: {names}")
    return Outcome("passed", f"{metrics}, NOISY: {len(others)} other process(es) on the GPU meanwhile ({names})")


def _annotate(ctx: StepContext, busy: bool) -> None:
    """Mark every metric noisy when another process used the GPUs meanwhile, and record the build
    key when the build step did not run (the history files points by it)."""
    if busy and ctx.record.bench is not None:
        for metric in ctx.record.bench["metrics"].values():
            metric["noisy"] = True
    ctx.build_key()


class _Sampler:
    """Looks at the host's GPUs (nvidia-smi) now and every SAMPLE_SECONDS until the with-block ends,
    and tells the step's own processes on GPU `uuid` (own: their pids) from the others."""

    def __init__(self, ctx: StepContext, uuid: str):
        self.ctx, self.uuid, self._done = ctx, uuid, threading.Event()
        self.samples: list = []
        self.own: set[int] = set()
        self.owner = secrets.token_hex(8)      # a value no earlier or concurrent run's processes carry
        self._resolved: set[int] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            try:
                sample = gpus.query(self.ctx.session.transport)
                new = gpus.pids_on(sample, self.uuid) - self._resolved
                self.own |= gpus.own_pids(self.ctx.session.transport, new, self.ctx.host.remote_dir,
                                          f"{OWNER_VARIABLE}={self.owner}")
                self._resolved |= new
                self.samples.append(sample)
            except KdError as e:            # a look that failed is no evidence either way
                self.ctx.log(f"(a look at the GPUs failed: {e.message})")
            if self._done.wait(SAMPLE_SECONDS):
                return

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(60)


def _bench(ctx: StepContext, data: dict) -> dict:
    """The engine's report as the record keeps it; StepError when it breaks a limit."""
    try:
        return bench_from_engine(data)
    except ValueError as e:
        raise StepError(f"{ctx.project.results['bench']}: {e}", host=ctx.host.name) from None
