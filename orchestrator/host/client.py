"""The one client of the host-side scripts (orchestrator/host/*.sh): one function per script, its
values as typed, named arguments, never an argument list a caller puts together. No other module
builds a script's command line (but for the wrappers every command line carries: the step guard
and the secrets reader in remote.py, the ownership check of an engine step in ownership.guarded);
a script that works under remote_dir is sent after the ownership check (ownership.guard), decided
here, once per script.

A function returns the script as a remote.Command (data: what a test compares, what --dry-run
shows, what a caller starts or fuses) or, for a script whose answer the client reads itself, runs
it over a transport and returns that answer parsed; what a host prints is bounded on the way in
(`output`, `answers`), and a failure is a KdError with the host, the command line, its exit status
and the tail of its output.

    client.lock(host, owner, mode="exclusive", wait=0, silence=90)     # state.acquire starts it
    client.begun(process, host)     # the lock's answer to `begin`: {"PARTIAL": ..., "RSYNC": ..., "RSYNC_VERSION": ...}
    client.finish_sync(transport, tree_hash=h, record=r, hash_line=line)   # (exit status, output tail)
    client.write_json(transport, name="build.json", data={...})
    client.output(transport, client.room(host, files=[...]), max_bytes=64 * 1024)   # bounded text
"""
from __future__ import annotations

import json
import posixpath
import time
from typing import TYPE_CHECKING, BinaryIO, Iterator, Sequence

from .. import ownership, remote
from ..errors import CommandError, DestinationError, HostError, OutputOverflow, refusal
from ..inventory import Host
from . import script_text

if TYPE_CHECKING:       # the lock's owner (state.Owner) and a host's transport, as types only
    from ..connectors.base import Transport
    from ..state import Owner

FINISH_TAIL = 8192          # the bytes of the tree hash command's output the host sends back (and the client keeps)
ANSWER_BYTES = 1 << 20      # what a conversational script may print before its answer (a few lines normally)
BEGIN_SYNC_FACTS = ("PARTIAL", "RSYNC", "RSYNC_VERSION")
BEGIN_SYNC_BYTES = 4096     # the most characters of a fact of the sync's first step (PARTIAL: 500), and of its error's tail


def _script(names: Sequence[str], *args: str, check: str | None, timeout: float | None,
            stdin: bytes | BinaryIO | None = None, what: str, short: bool = False, **values: object) -> remote.Command:
    """The scripts `names` sent as one (`values` for their placeholders), their values positional
    arguments; `check`: the ownership check runs first on the directory that shell expression names.
    `short`: a script of a few commands of its own in the state directory (the sync's first and
    last steps) runs under its timeout in a process group of its own but without the step guard
    (remote.GUARD: its watcher and its sweep of /proc cost more than such a script), as it did
    inside the lock command."""
    text = "".join(script_text(name, **values) if i == len(names) - 1 else script_text(name)
                   for i, name in enumerate(names))
    if check is not None:
        text = ownership.guard(text, check)
    argv = ["bash", "-c", text, "kdtree", *args]
    if short:
        return remote.Command(tuple(argv), remote.wrap(argv, timeout=timeout, reads_stdin=True), timeout, what=what)
    return remote.command(argv, timeout=timeout, stdin=stdin, what=what)


def output(transport: "Transport", command: remote.Command, *, max_bytes: int) -> str:
    """What `command` printed (at most `max_bytes`, decoded, undecodable bytes replaced);
    CommandError with the evidence when it failed, timed out or printed more."""
    if command.stdin is not None:
        raise TypeError("a captured command gets no stdin: run it with Transport.run or check")
    return transport.capture(command, max_bytes=max_bytes).decode("utf-8", errors="replace")


def answers(process, host: Host, what: str, limit: float) -> Iterator[tuple[str, str]]:
    """The (word, rest of the line) answers a conversational script (the lock, the GPU claim)
    prints, for as long as the caller reads; one that ends first, is still answering `limit`
    seconds from now (a host that trickles lines is no answer), or prints more than ANSWER_BYTES
    (a host that floods lines is no answer either), is a HostError naming `what`."""
    deadline = time.monotonic() + limit
    size = 0
    try:
        while True:
            line = process.readline(timeout=max(0.0, deadline - time.monotonic()))
            size += len(line) + 1 if line is not None else 0
            if size > ANSWER_BYTES:
                process.close(timeout=1)
                raise HostError(f"the {what} printed more than {ANSWER_BYTES} bytes without an answer",
                                host=host.name, tail=(line or "")[:200])
            if line is None:
                result = process.close()
                raise HostError(f"the {what} ended without an answer", host=host.name,
                                command=result.command if result else None,
                                exit_status=result.exit_code if result else None, tail=result.tail if result else "")
            word, _, rest = line.partition(" ")
            yield word, rest
            if time.monotonic() > deadline:
                raise TimeoutError
    except TimeoutError:
        process.close(timeout=1)
        raise HostError(f"no answer from the {what} within {limit:g} s", host=host.name) from None
    except OutputOverflow as e:
        process.close(timeout=1)
        raise HostError(f"the {what} flooded its output: {e}", host=host.name) from None


# -- the tree lock and the sync ------------------------------------------------------------------------
def lock(host: Host, owner: "Owner", *, mode: str, wait: float = 0, silence: float | None = None) -> remote.Command:
    """host/lock.sh: claim remote_dir (checks, marker) and hold its lock in `mode` (shared or
    exclusive, waiting up to `wait` seconds for it) until told; `silence`: it also lets go when the
    client's heartbeat stops for that many seconds. Told `begin` while held alone, it runs the
    sync's first step for `owner` (host/begin_sync.sh, its 7th argument: begun reads the answer).
    No timeout: it lasts as long as the run."""
    return _script(("ownership", "lock"), host.remote_dir, owner.to_json(), _marker_text(owner), mode,
                   remote._seconds(wait), remote._seconds(silence) if silence else "", script_text("begin_sync"),
                   str(owner), host.rsync_path or "", check=None, timeout=None, what="the lock command")


def begun(process, host: Host) -> dict[str, str]:
    """The lock command's answer to `begin` (`process`: the lock command, just told it): the sync
    marked as in progress; its facts (BEGIN_SYNC_FACTS: what a broken sync's mark said, where rsync
    is and its version), each at most BEGIN_SYNC_BYTES characters; within the host's lock timeout
    (the bound of its other state-directory commands). CommandError with the exit status and the
    other lines it printed when the step failed or the lock is not held alone."""
    facts: dict[str, str] = {}
    tail = ""
    for word, rest in answers(process, host, "lock command's beginning of the sync", host.timeout("lock")):
        if word == "BEGUN":
            if rest.strip() == "0":
                return facts
            status = rest.strip()
            raise CommandError("beginning the sync failed" + (": the lock is not held alone" if status == "shared" else ""),
                               host=host.name, command="begin (told to the lock command)",
                               exit_status=int(status) if status.isdigit() else None, tail=tail)
        if word in BEGIN_SYNC_FACTS:
            facts[word] = rest.strip()[:BEGIN_SYNC_BYTES]
        else:
            tail = (tail + f"{word} {rest}"[:BEGIN_SYNC_BYTES] + "\n")[-BEGIN_SYNC_BYTES:]
    raise AssertionError("answers() ends only by raising")


def finish_sync_command(host: Host, *, tree_hash: str, record: dict, hash_line: str) -> remote.Command:
    """host/finish_sync.sh: hash the deployed tree with `hash_line` (run in remote_dir) and, when
    the hash is `tree_hash`, store `record` as the deploy record and clear the sync's mark; under
    the sync step's timeout, its host-side parts included."""
    return _script(("finish_sync",), host.remote_dir, tree_hash, hash_line, json.dumps(record), check='"$1"',
                   timeout=remote.client_timeout(host.timeout("sync")), what="ending the sync", short=True,
                   FINISH_TAIL=FINISH_TAIL)


def finish_sync(transport: "Transport", *, tree_hash: str, record: dict, hash_line: str) -> tuple[int | None, str]:
    """finish_sync_command run: (the hash command's exit status, None when the host did not say;
    the tail of its output). DestinationError when remote_dir fails the ownership check."""
    command = finish_sync_command(transport.host, tree_hash=tree_hash, record=record, hash_line=hash_line)
    try:
        text = output(transport, command, max_bytes=2 * FINISH_TAIL + 1024)
    except CommandError as e:
        if e.exit_status == ownership.UNSAFE_EXIT:
            raise DestinationError(f"refusing to use remote_dir: {refusal(e.tail or '')}", host=transport.host.name,
                                   command=e.command, exit_status=e.exit_status, tail=e.tail) from None
        raise
    tail, code = "", None
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "OUT":
            tail = (tail + rest + "\n")[-FINISH_TAIL:]      # a host may send more than it should
        elif word == "HASHED":
            code = int(rest) if rest.strip().isdigit() else None
    return code, tail


def write_json_command(host: Host, *, name: str, data: dict) -> remote.Command:
    """host/write_json.sh: store `data` as .kdtree/NAME on the host, atomically, within the host's
    lock timeout (the bound of its other state-directory commands)."""
    return _script(("write_json",), host.remote_dir, name, check='"$1"', timeout=host.timeout("lock"),
                   stdin=json.dumps(data, indent=1).encode(), what=f"writing .kdtree/{name}")


def write_json(transport: "Transport", *, name: str, data: dict) -> None:
    """write_json_command run; CommandError with the evidence when it failed."""
    transport.check(write_json_command(transport.host, name=name, data=data))


def read_file(host: Host, *, path: str, max_bytes: int, timeout: float) -> remote.Command:
    """host/read_file.sh: the first `max_bytes` + 1 bytes of `path` (absolute) when it is a regular
    file inside remote_dir and no symlink; else an exit status of connectors/base.py's _READ_ERRORS."""
    return _script(("read_function", "read_file"), path, str(max_bytes), host.remote_dir, check='"$3"',
                   timeout=timeout, what=f"reading {path}")


def read_files(host: Host, *, mark: str, paths: Sequence[tuple[str, int]], timeout: float) -> remote.Command:
    """host/read_files.sh: read_file's answer for each (path relative to remote_dir, most bytes),
    each followed by a newline, `mark`, a space, its exit status and a newline."""
    root = host.remote_dir
    return _script(("read_function", "read_files"), root, mark,
                   *(w for path, most in paths for w in (posixpath.join(root, path), str(most))),
                   check='"$1"', timeout=timeout, what="reading files")


def sync_space(host: Host) -> remote.Command:
    """host/sync_space.sh: remote_dir's filesystem's free kB, then the kB remote_dir holds."""
    return _script(("sync_space",), host.remote_dir, check=None, timeout=30, what="checking free space")


def sync_list(host: Host, *, timeout: float) -> remote.Command:
    """host/sync_list.sh: every entry under remote_dir but .kdtree/, as NUL-terminated
    `KIND SIZE MTIME PATH` (the tar sync's listing)."""
    return _script(("sync_list",), host.remote_dir, check='"$1"', timeout=timeout, what="listing remote_dir")


def sync_delete(host: Host, *, paths: Sequence[bytes], timeout: float) -> remote.Command:
    """host/sync_delete.sh: delete these paths (relative, never out of remote_dir nor into .kdtree/)."""
    return _script(("sync_delete",), host.remote_dir, check='"$1"', timeout=timeout,
                   stdin=b"".join(p + b"\0" for p in paths), what="deleting removed files")


def sync_extract(host: Host, *, stream: BinaryIO, timeout: float) -> remote.Command:
    """host/sync_extract.sh: extract the gzipped tar `stream` into remote_dir."""
    return _script(("sync_extract",), host.remote_dir, check='"$1"', timeout=timeout, stdin=stream,
                   what="extracting the tar stream")


# -- preflight, doctor, GPUs ---------------------------------------------------------------------------
def room(host: Host, *, files: Sequence[str]) -> remote.Command:
    """host/room.sh: the nearest folder of remote_dir, its free kB, MemAvailable and the bytes of
    each of `files` (relative to remote_dir) that is there, as key=value lines."""
    return _script(("room",), host.remote_dir, *files, check=None, timeout=host.timeout("preflight"),
                   what="measuring free disk and memory")


def doctor_probe(host: Host, *, import_numpy: bool) -> remote.Command:
    """host/doctor_probe.sh: every fact the doctor's checks need, as key=value lines; numpy's
    version by importing it, or (not `import_numpy`) from its installed metadata."""
    return _script(("doctor_probe",), host.remote_dir, host.rsync_path or "", host.cuda_home or "", host.python,
                   "import" if import_numpy else "find", check=None, timeout=host.timeout("preflight"),
                   what="the doctor probe")


def slurm_probe(host: Host, *, conf: str, partition: str, sbatch_options: Sequence[str]) -> remote.Command:
    """host/slurm_probe.sh: a Slurm entry's second probe, on its login node (`conf`: its
    SLURM_CONF, empty: the node's own), as key=value lines."""
    return _script(("slurm_probe",), conf, partition, *sbatch_options, check=None,
                   timeout=host.timeout("preflight"), what="the Slurm doctor probe")


def gpu_query(host: Host, *, max_bytes: int, gpu_fields: str, app_fields: str, csv_format: str,
              driver_paths: Sequence[str]) -> remote.Command:
    """host/gpu_query.sh: find nvidia-smi (PATH, then `driver_paths`) and run the GPU and
    compute-app queries (each output cut at `max_bytes`), as tagged lines (gpus.parse_query)."""
    return _script(("gpu_query",), str(max_bytes), gpu_fields, app_fields, csv_format, *driver_paths, check=None,
                   timeout=host.timeout("preflight"), what="the GPU query")


def gpu_own(host: Host, *, under: str, marker: str, pids: Sequence[int]) -> remote.Command:
    """host/gpu_own.sh: those of `pids` that are this user's processes whose executable lies under
    the folder `under` or whose environment holds the entry `marker`, one a line."""
    return _script(("gpu_own",), under, marker, *map(str, sorted(pids)), check=None,
                   timeout=host.timeout("preflight"), what="reading /proc/PID/exe and environ")


def gpu_claim(host: Host, owner: "Owner", *, uuids: Sequence[str], count: int,
              silence: float | None = None) -> remote.Command:
    """host/gpu_claim.sh: take the first `count` free GPUs of `uuids` (in that order), report who
    holds each other one, and hold the claims until told (or until the client's heartbeat stops
    for `silence` seconds, or its connection ends). No timeout: it lasts as long as the run."""
    return _script(("ownership", "gpu_claim"), host.remote_dir, owner.to_json(), str(count),
                   remote._seconds(silence) if silence else "", *uuids, check=None, timeout=None,
                   what="the GPU claim command")


# -- steps ---------------------------------------------------------------------------------------------
def bundle_list(host: Host, *, folder: str) -> remote.Command:
    """host/bundle_list.sh: `BYTES PATH` of each *.kdtr regular file under `folder` of remote_dir."""
    return _script(("bundle_list",), host.remote_dir, folder, check=None, timeout=host.timeout("preflight"),
                   what="listing the bundles")


def bundle_remove(host: Host, *, folder: str, paths: Sequence[str]) -> remote.Command:
    """host/bundle_remove.sh: remove these files of `folder` (each a regular file inside it, no link)."""
    return _script(("bundle_remove",), host.remote_dir, folder, *paths, check=None,
                   timeout=host.timeout("preflight"), what="removing stale bundles")


def hash_inputs(host: Host, *, program: str, mask: str, if_built: bool, timeout: float) -> remote.Command:
    """host/hash_inputs.sh: run `program` (steps/hash_inputs.py's source) in remote_dir with the
    host's python, the deployed tree's hash `mask` masked; `if_built`: only when the build stamp
    names that tree."""
    return _script(("hash_inputs",), host.remote_dir, host.python, program, mask, *(("if-built",) if if_built else ()),
                   check='"$1"', timeout=timeout, what="hashing what the results depend on")


def build_hash(host: Host, *, timeout: float) -> remote.Command:
    """host/build_hash.sh: the sha256sum line of every executable file under build/."""
    return _script(("build_hash",), host.remote_dir, check='"$1"', timeout=timeout,
                   what="hashing the build's executables")


def build_check(host: Host, *, records: Sequence[dict[str, str]], timeout: float | None,
                matched: str, no_match: int) -> remote.Command:
    """host/build_check.sh: the sha256sum lines of the recorded executables; `matched` (exit 0)
    when every executable of one record (path -> sha256) hashes as recorded, else exit `no_match`."""
    words = [w for r in records for w in (*(f"{h} {p}" for p, h in sorted(r.items())), "--")]
    return _script(("build_check",), host.remote_dir, *words, check='"$1"', timeout=timeout,
                   what="checking the build's executables", MATCHED=matched, NO_MATCH=no_match)


def build_drop(host: Host, *, timeout: float) -> remote.Command:
    """host/build_drop.sh: delete the build's executables."""
    return _script(("build_drop",), host.remote_dir, check='"$1"', timeout=timeout,
                   what="removing build/'s executables")


def _marker_text(owner: "Owner") -> str:
    return f"This directory is a deploy target of kdtree-orchestrator (created {owner.started} by {owner.client}).\n" \
           "Its content is replaced on every deploy (rsync --delete); .kdtree/ holds the orchestrator's state."
