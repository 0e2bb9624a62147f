"""Sync: put the engine source tree on a host, exactly, safely, and prove it.

    sync_tree(transport, project, source_id, owner, log, lock) -> DeployResult   # the host's lock held alone
    deploy_commands(transport, project, source_id, owner) -> [(what, command)]   # --dry-run

The sync step (steps/sync.py) syncs under the run's tree lock held alone (state.acquire: also
refuses a dangerous or foreign remote_dir). Its first step marks the sync as in progress and finds
rsync (HostLock.begin_sync: the lock holder on the host runs it, told over the lock's own channel); it transfers the tree with `rsync -az --delete` and the project's
excludes (or, when either side has no rsync, a tar stream that sends only changed files and
deletes removed ones); its last step runs the project's `tree_hash` command on the host and, when
it gives the local hash, writes the deploy record and clears the in-progress mark, in one exchange
with the lock holder (HostLock.finish_sync). A sync broken half-way leaves the mark behind: the next deploy repairs the
tree and says so.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from . import ownership, remote, state
from .errors import CommandError, FetchError, KdError, SyncError, cause_of
from .host import client
from .inventory import Host, Project
from .connectors import relay
from .connectors.base import READ_MISSING, Transport

STATE_EXCLUDE = "/" + state.STATE_DIR + "/"    # always excluded: --delete spares the state dir
TREE_HASH_CACHE = "build/tree-hashes"     # under the project root, private: the local tree hash by its files' stat
RACY_SECONDS = 2        # a file changed this recently is not known by its stat (_tree_hash)
PARTIAL = f"{state.STATE_DIR}/sync.partial"
LISTING_MAX_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class SourceId:
    """What is deployed: the local tree hash (the project's tree_hash command) and git revision."""

    tree_hash: str
    git_revision: str | None
    git_dirty: bool


@dataclasses.dataclass(frozen=True)
class DeployResult:
    """What a deploy did on one host."""

    host: str
    method: str                 # rsync | tar
    files: int                  # regular files transferred
    bytes: int                  # bytes sent over the wire
    deleted: int
    tree_hash: str
    repaired: str | None        # what the broken sync left behind said, when it was repaired
    seconds: float


def source_id(project: Project) -> SourceId:
    """Hash the local source tree (the project's tree_hash command, or its answer for the same
    files: _tree_hash) and read its git revision."""
    return SourceId(_tree_hash(project), *_git_revision(project.source))


def _tree_hash(project: Project) -> str:
    """The tree_hash command's answer over the local source. Kept, as git's index keeps what it
    knows of a file, by the path, size, modification and change times, inode and mode of every
    file under the source (excluded paths aside: they are never synced, so a hash that read them
    could never match a host's): while none of those changed, the answer is the one the command
    gave. A file changed within the last RACY_SECONDS may change again within its timestamp's
    tick, as may one changed while the command ran: then nothing is kept."""
    snippet = project.commands["tree_hash"]
    key = hashlib.sha256(f"{project.source}\0{snippet}".encode()).hexdigest()[:32]
    cache = ownership.private_dir(project.root / TREE_HASH_CACHE, "tree hash cache") / f"{key}.json"
    files = _files_digest(project)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = None
    if files is not None and isinstance(known, dict) and known.get("files") == files \
            and isinstance(known.get("tree_hash"), str):
        return known["tree_hash"]
    proc = subprocess.run(["bash", "-c", snippet], cwd=project.source, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.split()
    if proc.returncode != 0 or not lines:
        raise SyncError(f"the local tree hash failed in {project.source}", command=snippet,
                        exit_status=proc.returncode, tail=proc.stdout + proc.stderr)
    if files is not None and _files_digest(project) == files:
        ownership.write_private(cache, json.dumps({"files": files, "tree_hash": lines[-1]}))
    return lines[-1]


def _files_digest(project: Project) -> str | None:
    """The digest of every source file's path and stat (_tree_hash); None when one changed too
    recently to be sure of it."""
    recent = time.time_ns() - RACY_SECONDS * 10**9
    digest = hashlib.sha256()
    for rel, st in _entries(project):
        if stat.S_ISDIR(st.st_mode):
            continue
        if max(st.st_mtime_ns, st.st_ctime_ns) >= recent:
            return None
        digest.update(f"{rel}\0{st.st_mode} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino} {st.st_dev}\0"
                      .encode(errors="surrogateescape"))
    return digest.hexdigest()


def sync_tree(transport: Transport, project: Project, source: SourceId, owner: state.Owner,
              log: Callable[[str], None], lock: state.HostLock, rsync: tuple[str, str] | None = None) -> DeployResult:
    """Sync and verify the source on a host whose `lock` the caller holds alone (validate holds
    it for the whole run). `rsync`: where rsync is on the host and its version line, when this
    run knows them already (its doctor probe; "" where there is none); else the host says as the
    sync begins."""
    host = transport.host
    if lock.mode != state.EXCLUSIVE:
        raise ValueError("a sync runs only under the tree lock held alone")
    start = time.monotonic()
    # this machine's rsync version is read while the host begins the sync: both are on its path
    local_version = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-rsync-version")
    local_rsync = local_version.submit(_local_rsync_version)
    local_version.shutdown(wait=False)
    facts = lock.begin_sync(ask_rsync=rsync is None)
    repaired = facts.get("PARTIAL", "").strip() or None
    if repaired:
        log(f"the previous sync did not finish ({repaired}); this sync repairs the tree (comparing contents)")
    remote_rsync, remote_version = rsync or (facts.get("RSYNC", ""), facts.get("RSYNC_VERSION", ""))
    if remote_rsync.strip() and shutil.which("rsync"):
        client_messages = messages_by_protocol(local_rsync.result(), remote_version)
        method, counts = "rsync", _rsync(transport, project, log, checksum=bool(repaired),
                                         client_messages=client_messages)
    else:
        log(f"no rsync on {'the host' if not remote_rsync else 'this machine'}: using a tar stream")
        method, counts = "tar", _tar_sync(transport, project, everything=bool(repaired))
    record = {"version": 1, "tree_hash": source.tree_hash, "git_revision": source.git_revision,
              "git_dirty": source.git_dirty, "deployed_at": state.Owner.now("").started,
              "by": dataclasses.asdict(owner), "method": method, **counts}
    # one exchange: the host hashes the tree and writes the record only when it is the local hash
    code, output = lock.finish_sync(tree_hash=source.tree_hash, record=record, hash_line=hash_line(host, project))
    if code != 0:
        timed_out = remote.timed_out(code)
        cause = None if timed_out else cause_of(output)
        raise CommandError(f"hashing the deployed tree {'timed out' if timed_out else 'failed'}"
                           + (f": {cause}" if cause else ""), host=host.name, command=project.commands["tree_hash"],
                           exit_status=code, tail=output, timed_out=timed_out)
    remote_hash = _last_word(output, host.name, project.commands["tree_hash"])
    if remote_hash != source.tree_hash:
        raise SyncError(f"the deployed tree hash {remote_hash} differs from the local {source.tree_hash}",
                        host=host.name)
    log(f"deployed {source.tree_hash[:12]} with {method}: {counts['files']} files, {counts['bytes']} bytes sent, "
        f"{counts['deleted']} deleted")
    return DeployResult(host.name, method, counts["files"], counts["bytes"], counts["deleted"], source.tree_hash,
                        repaired, round(time.monotonic() - start, 3))


def deployed_tree(transport: Transport, project: Project) -> str | None:
    """The tree hash of a complete deploy on the host, verified by hashing the tree there; None
    when there is none, a sync broke half-way, or the tree is not the one recorded."""
    record = state.read_deploy_record(transport) or {}
    if not record.get("tree_hash"):
        return None
    try:
        transport.read_file(PARTIAL, max_bytes=4096)
        return None                     # a sync broke half-way: the next one repairs the tree
    except FetchError as e:
        if e.exit_status != READ_MISSING:
            return None                 # a mark all the same (too large, not a file): never trusted
    current = _remote_hash(transport, project)
    return current if current == record["tree_hash"] else None


def deploy_commands(transport: Transport, project: Project, owner: state.Owner) -> list[tuple[str, str]]:
    """Exactly what a deploy runs, in order, as (what, command line or what the lock command is
    told) pairs (for --dry-run)."""
    host = transport.host
    where = "host" if not host.is_local else "local"
    return [
        (f"{where}: claim remote_dir, take the lock (held until the deploy ends); it carries the sync's first and "
         "last steps (its last two arguments) and runs each when told",
         client.lock(host, owner, mode=state.EXCLUSIVE, silence=state.lock_silence(host)).line),
        (f"{where}: told over the lock's channel: mark the sync in progress, find rsync",
         client.begin_sync_request(owner, host.rsync_path).decode().strip()),
        ("local: transfer (a tar stream instead when the host has no rsync)",
         remote.quote(rsync_argv(transport, project, rsh=relay.dry_run_shell(transport)))),
        (f"{where}: told over the lock's channel: check remote_dir again, hash the deployed tree; when it is the "
         "local hash, write the deploy record (its last argument), clear the in-progress mark",
         client.finish_sync_request(tree_hash="LOCAL_TREE_HASH", record={"DEPLOY": "RECORD"},
                                    hash_line=hash_line(host, project)).decode().strip()),
    ]


def rsync_argv(transport: Transport, project: Project, checksum: bool = False, rsh: str | None = None,
               client_messages: bool = False) -> list[str]:
    """The rsync command line that mirrors the source onto the host's remote_dir (`checksum`:
    compare contents, not size and time, as when repairing a broken sync; `rsh`: rsync's remote
    shell, relay.rsync_shell's: an ssh host is only ever reached over its verified connection;
    `client_messages`: the host's rsync sends its errors through the transfer's own stream
    (--stderr=client), see messages_by_protocol)."""
    host = transport.host
    # --no-owner --no-group: files take the host user's ownership (-a would keep this machine's
    # owner when the host user is root, whose tree then fails the ownership check); --chmod=go-rwx:
    # -a keeps the source's modes, and nothing deployed may be readable by another user of the host
    argv = ["rsync", "-az", "--no-owner", "--no-group", "--delete", "--stats", "--protect-args", "--chmod=go-rwx"] \
        + (["--checksum"] if checksum else []) + (["--stderr=client"] if client_messages else [])
    argv += [f"--exclude={STATE_EXCLUDE}"]
    argv += [f"--exclude={pattern}" for pattern in project.excludes]
    argv += ["-e", rsh] if rsh else []        # local: no remote shell
    if host.rsync_path and not host.is_local:
        argv.append("--rsync-path=" + remote.quote([host.rsync_path]))
    return argv + [f"{project.source}/", transport.rsync_dest(host.remote_dir + "/")]


def hash_line(host: Host, project: Project) -> str:
    """The command line with which a sync's last step hashes the deployed tree (HostLock.finish_sync,
    run in remote_dir): the project's tree_hash command in the step environment, under the sync
    step's timeout."""
    return remote.wrap(["bash", "-c", project.commands["tree_hash"]], timeout=host.timeout("sync"),
                       env=remote.host_env(host), path_prefix=remote.host_path_prefix(host), reads_stdin=True)


def tree_hash_command(transport: Transport, project: Project) -> remote.Command:
    """The project's tree_hash command over the deployed tree, under the sync step's timeout."""
    host = transport.host
    return remote.step(host, project.commands["tree_hash"], host.timeout("sync"), what="hashing the deployed tree")


def is_excluded(path: str, is_dir: bool, patterns) -> bool:
    """Whether a relative path matches one of rsync's exclude patterns (as rsync reads them:
    a trailing '/' matches directories only, a leading '/' anchors at the top, a pattern with
    a '/' matches the end of the path, one without matches the last component)."""
    parts = path.strip("/").split("/")
    for dirs_only, anchored, tests in _rules(tuple(patterns)):
        if dirs_only and not is_dir:
            continue
        if (len(tests) == len(parts) if anchored else len(tests) <= len(parts)) \
                and all(test(name) for test, name in zip(tests, parts[-len(tests):])):
            return True
    return False


@functools.lru_cache(maxsize=16)
def _rules(patterns: tuple[str, ...]) -> tuple[tuple[bool, bool, tuple[Callable[[str], object], ...]], ...]:
    """Each exclude pattern read once (the source is walked on every run, each path against every
    pattern): for directories only, anchored at the top, and a test per path component."""
    return tuple((pattern.endswith("/"), pattern.startswith("/"),
                  tuple(_matcher(part) for part in pattern.strip("/").split("/"))) for pattern in patterns)


def _matcher(pattern: str) -> Callable[[str], object]:
    """The test of a name against one component of a pattern, true when fnmatch's would be; a
    component without wildcards is the name itself (no regex: most excludes are plain names)."""
    if any(c in pattern for c in "*?["):
        return re.compile(fnmatch.translate(pattern)).match       # fnmatch.fnmatchcase's own test
    return pattern.__eq__


# -- rsync -----------------------------------------------------------------------------------------
def messages_by_protocol(local_version: str, remote_version: str) -> bool:
    """Whether both rsyncs (their `rsync --version` first lines) know --stderr=client (3.2.4 on).
    By default the host's rsync writes its errors (`No space left on device`) to its own stderr,
    which reaches this machine through the remote shell; rsync here ends that shell with SIGUSR1
    as soon as the host's exit code arrives, often before it has passed them on, so the error was
    lost. With --stderr=client they come in the transfer's own stream, which rsync here reads and
    prints before it exits."""
    return all(_version(v) >= (3, 2, 4) for v in (local_version, remote_version))


def _version(line: str) -> tuple[int, ...]:
    m = re.search(r"\bversion v?(\d+)\.(\d+)\.(\d+)", line)
    return tuple(int(g) for g in m.groups()) if m else (0,)


@functools.cache
def _local_rsync_version() -> str:
    try:
        return subprocess.run(["rsync", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _rsync(transport: Transport, project: Project, log, checksum: bool, client_messages: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSYNC_")}
    for attempt in range(3):
        # rsync's remote side runs over the transport's own (verified) connection: no second handshake
        with relay.rsync_shell(transport) as rsh:
            argv = rsync_argv(transport, project, checksum, rsh, client_messages)
            proc = subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=remote.client_timeout(transport.host.timeout("sync")))
        if proc.returncode not in (255, 12) or "Host key verification failed" in proc.stderr \
                or "Permission denied" in proc.stderr or attempt == 2 or transport.stopped.is_set():
            break           # (a stopped run's connection was closed on purpose: no retry)
        log(f"rsync failed with exit code {proc.returncode}, retrying: {proc.stderr.strip()[-200:]}")
        time.sleep(1 + 2 * attempt)
    if proc.returncode != 0:
        cause = cause_of(proc.stderr)
        cause = f"{cause} (in {transport.host.remote_dir})" if cause else _space_cause(transport, project)
        raise SyncError("rsync failed" + (f": {cause}" if cause else ""),
                        host=transport.host.name, command=remote.quote(argv),
                        exit_status=proc.returncode, tail=proc.stdout[-2000:] + proc.stderr[-4000:])
    return {"files": _stat(proc.stdout, "Number of regular files transferred"),
            "bytes": _stat(proc.stdout, "Total bytes sent"),
            "deleted": _stat(proc.stdout, "Number of deleted files")}


def _space_cause(transport: Transport, project: Project) -> str | None:
    """`No space left on device`, with the numbers, when the tree cannot fit in remote_dir's
    filesystem (rsync's receiver does not always get to say so before its connection ends)."""
    try:
        out = client.output(transport, client.sync_space(transport.host), max_bytes=4096)
        free_kb, used_kb = (int(w) for w in out.split()[:2])
    except (KdError, ValueError):
        return None
    needed_kb = sum(size for kind, size, _ in _local_listing(project).values() if kind == "f") // 1024
    if needed_kb <= free_kb + used_kb:
        return None
    return f"No space left on device: the tree needs {needed_kb} kB, {transport.host.remote_dir} holds {used_kb} kB " \
           f"and its filesystem has {free_kb} kB free"


def _stat(stats: str, label: str) -> int:
    m = re.search(rf"^{label}: ([\d,.]+)", stats, re.M)
    return int(m.group(1).replace(",", "").replace(".", "")) if m else 0


# -- tar stream --------------------------------------------------------------------------------------
def _tar_sync(transport: Transport, project: Project, everything: bool) -> dict:
    """Send changed files (`everything`: all files) as a tar stream; delete files gone from the source."""
    host = transport.host
    timeout = host.timeout("sync")
    listing = _remote_listing(transport, timeout)
    local = _local_listing(project)
    changed = [p for p, entry in local.items()
               if entry[0] == "l" or entry[0] == "f" and (everything or listing.get(p) != entry)]
    gone = sorted((p for p, (kind, _, _) in listing.items() if p not in local
                   and not _under_excluded(p, kind == "d", project.excludes)), reverse=True)
    if gone:
        transport.check(client.sync_delete(host, paths=[os.fsencode(p) for p in gone], timeout=timeout))
    with tempfile.TemporaryFile() as stream:
        with tarfile.open(fileobj=stream, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(p for p, (kind, _, _) in local.items() if kind == "d"):
                tar.add(project.source / path, arcname=path, recursive=False)
            for path in changed:
                tar.add(project.source / path, arcname=path, recursive=False)
        size = stream.tell()
        stream.seek(0)
        transport.check(client.sync_extract(host, stream=stream, timeout=timeout))
    return {"files": len(changed), "bytes": size, "deleted": len(gone)}


def _remote_listing(transport: Transport, timeout: float) -> dict:
    data = transport.capture(client.sync_list(transport.host, timeout=timeout), max_bytes=LISTING_MAX_BYTES)
    listing = {}
    for entry in data.split(b"\0"):
        if entry:
            kind, size, mtime, path = entry.decode(errors="surrogateescape").split(" ", 3)
            listing[path] = (kind, int(size) if kind == "f" else 0, int(float(mtime)) if kind == "f" else 0)
    return listing


def _local_listing(project: Project) -> dict:
    """path -> (kind d|f|l, size, mtime) of every source entry not excluded (symlinks not followed)."""
    return {rel: ("d", 0, 0) if stat.S_ISDIR(st.st_mode) else ("l", 0, 0) if stat.S_ISLNK(st.st_mode)
            else ("f", st.st_size, int(st.st_mtime)) for rel, st in _entries(project)}


def _entries(project: Project):
    """(relative path, lstat) of every source entry not excluded, directories first (symlinks not followed)."""
    patterns = (STATE_EXCLUDE, *project.excludes)
    for dirpath, dirnames, filenames in os.walk(project.source):
        base = os.path.relpath(dirpath, project.source)
        subdirs = []
        for name in dirnames:
            rel = name if base == "." else f"{base}/{name}"
            if os.path.islink(os.path.join(dirpath, name)):
                filenames.append(name)
            elif not is_excluded(rel, True, patterns):
                subdirs.append(name)
                yield rel, os.lstat(os.path.join(dirpath, name))
        dirnames[:] = subdirs
        for name in filenames:
            rel = name if base == "." else f"{base}/{name}"
            if not is_excluded(rel, False, patterns):
                yield rel, os.lstat(os.path.join(dirpath, name))


def _under_excluded(path: str, is_dir: bool, patterns) -> bool:
    parts = path.split("/")
    return any(is_excluded("/".join(parts[:i]), i < len(parts) or is_dir, (STATE_EXCLUDE, *patterns))
               for i in range(1, len(parts) + 1))


def _remote_hash(transport: Transport, project: Project) -> str:
    result = transport.check(tree_hash_command(transport, project))
    return _last_word(result.tail, transport.host.name, result.command)


def _last_word(output: str, host: str, command: str) -> str:
    """The hash a tree_hash `command` printed on `host`: the last word of its `output`."""
    words = output.split()
    if not words:
        raise SyncError("the tree hash command printed nothing", host=host, command=command)
    return words[-1]


def _git_revision(source: Path) -> tuple[str | None, bool]:
    """(HEAD's commit, whether the source differs from it), from one `git status`; (None, False)
    outside a repository or before its first commit."""
    try:
        proc = subprocess.run(["git", "-C", str(source), "status", "--porcelain=v2", "--branch", "--", "."],
                              capture_output=True, text=True)
    except OSError:
        return None, False
    lines = proc.stdout.splitlines()
    head = next((line.split()[2] for line in lines if line.startswith("# branch.oid ")), "(initial)")
    if proc.returncode != 0 or head == "(initial)":
        return None, False
    return head, any(not line.startswith("#") for line in lines)

