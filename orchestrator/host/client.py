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
    process.write(client.begin_sync_request(owner, rsync_path)); client.begun(process, host)   # {"PARTIAL": ..., "RSYNC": ...}
    process.write(client.finish_sync_request(tree_hash=h, record=r, hash_line=line)); client.finished(process, host)
    client.write_json(transport, name="build.json", data={...})
    client.output(transport, client.bundle_list(host, folder="bundles"), max_bytes=64 * 1024)   # bounded text
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
BEGIN_SYNC_BYTES = 4096     # the most characters of a fact of the sync's first step (PARTIAL: 500)


def _script(names: Sequence[str], *args: str, check: str | None, timeout: float | None,
            stdin: bytes | BinaryIO | None = None, what: str, **values: object) -> remote.Command:
    """The scripts `names` sent as one (`values` for their placeholders), their values positional
    arguments; `check`: the ownership check runs first on the directory that shell expression names."""
    text = "".join(script_text(name, **values) if i == len(names) - 1 else script_text(name)
                   for i, name in enumerate(names))
    if check is not None:
        text = ownership.guard(text, check)
    argv = ["bash", "-c", text, "kdtree", *args]
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
# The scripts the lock command runs when told (`run I ARGS`), under the lock held alone: the sync's
# first and last steps, in the lock's own session (no session, no ssh client of their own each).
HELD_SCRIPTS = ("begin_sync", "finish_sync")


def lock(host: Host, owner: "Owner", *, mode: str, wait: float = 0, silence: float | None = None) -> remote.Command:
    """host/lock.sh: claim remote_dir (checks, marker) and hold its lock in `mode` (shared or
    exclusive, waiting up to `wait` seconds for it) until told; `silence`: it also lets go when the
    client's heartbeat stops for that many seconds. It carries HELD_SCRIPTS, which it runs when
    told (begin_sync_request, finish_sync_request). No timeout: it lasts as long as the run."""
    return _script(("ownership", "lock"), host.remote_dir, owner.to_json(), _marker_text(owner), mode,
                   remote._seconds(wait), remote._seconds(silence) if silence else "", *_held_texts(),
                   check=None, timeout=None, what="the lock command")


def _held_texts() -> tuple[str, ...]:
    """HELD_SCRIPTS as the lock command carries them: the sync's first step (in the state directory
    the lock checked as it claimed remote_dir), its last after the ownership check again (rsync
    wrote the tree meanwhile)."""
    return script_text("begin_sync"), ownership.guard(script_text("finish_sync", FINISH_TAIL=FINISH_TAIL), '"$1"')


def _request(script: str, *args: str) -> bytes:
    """The line that tells the lock command to run `script` (one of HELD_SCRIPTS) with `args`: each
    an `x` and the value with backslashes, spaces and every byte but printable ASCII escaped as
    `printf %b` reads them, so that a value (a JSON record, a command line) never breaks the line
    and reaches the script only as an argument."""
    def escaped(value: str) -> str:
        return "x" + "".join(c if c.isascii() and c.isprintable() and c not in " \\" else
                             "".join(f"\\x{b:02x}" for b in c.encode()) for c in value)
    return " ".join(["run", str(HELD_SCRIPTS.index(script) + 1), *map(escaped, args)]).encode() + b"\n"


def begin_sync_request(owner: "Owner", rsync_path: str | None, ask_rsync: bool = True) -> bytes:
    """What tells the lock command to begin `owner`'s sync (host/begin_sync.sh): mark it as in
    progress, say what a broken sync's mark said and, if `ask_rsync`, where rsync is (the host's
    `rsync_path`, else on PATH) and its version; begun reads the answer."""
    return _request("begin_sync", str(owner), rsync_path or "", *(() if ask_rsync else ("known",)))


def finish_sync_request(*, tree_hash: str, record: dict, hash_line: str) -> bytes:
    """What tells the lock command to end the sync (host/finish_sync.sh): check remote_dir's
    ownership again, hash the deployed tree with `hash_line` (run in remote_dir) and, when the hash
    is `tree_hash`, store `record` as the deploy record and clear the sync's mark; finished reads
    the answer."""
    return _request("finish_sync", tree_hash, hash_line, json.dumps(record))


def _ran(process, host: Host, what: str, limit: float) -> Iterator[tuple[str, str]]:
    """The lines a script the lock command runs prints, as (word, rest), up to its RAN line
    (within `limit` seconds, bounded: answers); CommandError naming `what`, with the exit status
    and the last lines, when it failed or the lock is not held alone (DestinationError when
    remote_dir failed the ownership check)."""
    tail = ""
    for word, rest in answers(process, host, f"lock command ({what})", limit):
        if word == "RAN":
            status = rest.strip()
            if status == "0":
                return
            command = f"{what} (run by the lock command)"
            if status == str(ownership.UNSAFE_EXIT):
                raise DestinationError(f"refusing to use remote_dir: {refusal(tail)}", host=host.name,
                                       command=command, exit_status=ownership.UNSAFE_EXIT, tail=tail)
            raise CommandError(f"{what} failed" + (": the lock is not held alone" if status == "shared" else ""),
                               host=host.name, command=command, exit_status=int(status) if status.isdigit() else None,
                               tail=tail)
        tail = (tail + f"{word} {rest}"[:FINISH_TAIL] + "\n")[-FINISH_TAIL:]      # a host may send more than it should
        yield word, rest
    raise AssertionError("answers() ends only by raising")


def begun(process, host: Host) -> dict[str, str]:
    """The lock command's answer to begin_sync_request (`process`: the lock command, just told
    it), within the host's lock timeout (the bound of its other state-directory commands): the
    sync's facts (BEGIN_SYNC_FACTS: what a broken sync's mark said, where rsync is and its
    version), each at most BEGIN_SYNC_BYTES characters. CommandError as _ran."""
    return {word: rest.strip()[:BEGIN_SYNC_BYTES] for word, rest in _ran(process, host, "beginning the sync",
                                                                         host.timeout("lock"))
            if word in BEGIN_SYNC_FACTS}


def finished(process, host: Host) -> tuple[int | None, str]:
    """The lock command's answer to finish_sync_request, within the sync step's timeout: (the hash
    command's exit status, None when the host did not say; the last FINISH_TAIL bytes of its
    output). DestinationError when remote_dir failed the ownership check; CommandError as _ran."""
    tail, code = "", None
    for word, rest in _ran(process, host, "ending the sync", remote.client_timeout(host.timeout("sync"))):
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
def doctor_probe(host: Host, *, import_numpy: bool, bundle_files: Sequence[str] = ()) -> remote.Command:
    """host/doctor_probe.sh: every fact the doctor's checks need, as key=value lines; numpy's
    version by importing it, or (not `import_numpy`) from its installed metadata; with the room
    for the selected bundles (capacity.room): MemAvailable and the bytes of each of `bundle_files`
    (relative to remote_dir) that is there."""
    return _script(("doctor_probe",), host.remote_dir, host.rsync_path or "", host.cuda_home or "", host.python,
                   "import" if import_numpy else "find", *bundle_files, check=None,
                   timeout=host.timeout("preflight"), what="the doctor probe")


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
