"""The bundle commands, each one step on a host: `check-bundle` runs the deployed engine's bundle
reader and golden check on a bundle already on the host (a user's own weights), reading it only;
`clean-bundles` lists the bundles in the deployed tree's bundle folder with their sizes and, when
told to, removes those the host's selected tiers do not use (never anything else, never outside
that folder of remote_dir).
"""
from __future__ import annotations

import dataclasses
import posixpath
import re

from .. import remote
from ..resources.bundle_plan import gb
from ..errors import CommandError, StepError, cause_of
from ..host import client
from ..resources.gpus import visible
from .context import Outcome, StepContext

ENGINE = "build/kdtree"       # the deployed engine, relative to remote_dir (what the build step leaves)
LISTED_MAX = 4096             # bundle files listed at most (more: refused, nothing removed)
_LISTED = re.compile(r"(\d{1,20}) ([A-Za-z0-9_.+-][A-Za-z0-9_./+-]*\.kdtr)\Z")


@dataclasses.dataclass(frozen=True)
class BundleTask:
    """What a bundle command was asked: check-bundle's `path` (absolute, or relative to
    remote_dir) and its --max-memory (None: the engine's default); clean-bundles' `remove`
    (False: list only)."""

    path: str | None = None
    max_memory: int | None = None
    remove: bool = False


def check_bundle(ctx: StepContext) -> Outcome:
    """`kdtree check --bundle PATH --expect golden` in remote_dir on the claimed GPUs: passed when the
    engine reads the bundle and its AR tokens equal the bundle's golden tokens; else a CommandError
    with what the engine said."""
    task = ctx.plan.task
    assert task is not None and task.path is not None      # the check-bundle plan always carries one
    argv = [ENGINE, "check", "--bundle", task.path, "--expect", "golden"]
    if task.max_memory:
        argv += ["--max-memory", str(task.max_memory)]
    snippet = (f'[ -x {ENGINE} ] || {{ echo "{ENGINE} is not built here: run invoke validate --steps sync,build '
               f'on this host first" >&2; exit 3; }}; exec {remote.quote(argv)}')
    timeout = ctx.host.timeout("golden")
    ctx.log(f"$ {remote.quote(argv)}")
    command = ctx.shell.build(snippet, step="golden", env=ctx.shell.gpu_env(), what="the bundle check")
    result = ctx.session.transport.run(command, on_output=ctx.log)
    said = _last_line(result.tail)
    if result.ok:
        return Outcome("passed", f"{visible(task.path, 300)}: {said}")
    why = f"timed out after {timeout:g} s" if result.timed_out else f"exited with {result.exit_code}"
    raise CommandError(f"the bundle check of {visible(task.path, 300)} {why}: {cause_of(result.tail) or said}",
                       host=ctx.host.name, command=remote.quote(argv), exit_status=result.exit_code, tail=result.tail,
                       timed_out=result.timed_out)


def clean_bundles(ctx: StepContext) -> Outcome:
    """List the bundle files of the deployed bundle folder (sizes; used by the selected tiers or
    stale) and, with BundleTask.remove, remove the stale ones; say what was (or would be) freed."""
    task, plan = ctx.plan.task, ctx.bundles
    assert task is not None and plan is not None
    folder = posixpath.dirname(ctx.project.results["manifest"])
    listed = _list(ctx, folder)
    used = {b.file for b in plan.bundles}
    stale = {path: size for path, size in listed.items() if path not in used}
    for path, size in sorted(listed.items()):
        ctx.log(f"{'stale' if path in stale else 'used ':5}  {gb(size):>10}  {folder}/{path}")
    freed = gb(sum(stale.values()))
    if not stale:
        return Outcome("passed", f"{len(listed)} bundles in {folder}, all used by tiers {', '.join(plan.tiers)}")
    if not task.remove:
        return Outcome("passed", f"{len(stale)} stale bundles ({freed}) of {len(listed)} in {folder} would be removed "
                                 "(a dry run: --remove removes them)")
    _remove(ctx, folder, sorted(stale))
    return Outcome("passed", f"removed {len(stale)} stale bundles ({freed}) of {len(listed)} in {folder}; "
                             f"kept the {len(listed) - len(stale)} of tiers {', '.join(plan.tiers)}")


def _list(ctx: StepContext, folder: str) -> dict[str, int]:
    """The bundle files (*.kdtr, regular files, not through a link) under `folder` of remote_dir:
    relative path -> bytes. A name of another shape is refused, never removed."""
    out = client.output(ctx.session.transport, client.bundle_list(ctx.host, folder=folder), max_bytes=256 * 1024)
    found: dict[str, int] = {}
    for line in out.splitlines():
        m = _LISTED.match(line)
        if line and (m is None or ".." in m.group(2).split("/")):
            raise StepError(f"{folder} holds a bundle whose name cannot be handled safely: {visible(line, 200)} "
                            "(nothing removed)", host=ctx.host.name)
        if m:
            found[m.group(2)] = int(m.group(1))
    if len(found) > LISTED_MAX:
        raise StepError(f"{folder} holds more than {LISTED_MAX} bundles (nothing removed)", host=ctx.host.name)
    return found


def _remove(ctx: StepContext, folder: str, paths: list[str]) -> None:
    """Remove these files of `folder` (each checked again on the host: a regular file, not a link,
    inside the folder); CommandError with the host's words when one cannot be removed."""
    command = client.bundle_remove(ctx.host, folder=folder, paths=paths)
    result = ctx.session.transport.run(command, on_output=ctx.log)
    if not result.ok:
        raise CommandError(f"removing stale bundles exited with {result.exit_code}", host=ctx.host.name,
                           command=command.line, exit_status=result.exit_code, tail=result.tail)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return visible(lines[-1].strip(), 300) if lines else "(no output)"

