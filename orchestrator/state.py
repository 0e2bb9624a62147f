"""The orchestrator's state on a host, in `<remote_dir>/.kdtree/` (excluded from every sync, so
rsync --delete spares it): the ownership marker, the lock, the deploy record.

    with state.acquire(transport, state.Owner.now("deploy")) as lock:   # one run at a time
        lock.stale        # the owner of a lock left by a dead run, now recovered (or None)
        ...
    lock = state.acquire(transport, owner, begin_sync=True, hash_line=line)   # the lock and a sync's first step at once
    lock.begin_sync(); ...; lock.finish_sync(tree_hash, record)    # a sync's first and last steps, over its channel
    state.read_deploy_record(transport)                  # what the last deploy recorded
    state.read_json(transport, name) / state.write_json(transport, name, data)   # build/bundle stamps
    state.read_jsons(transport, state.STAMPS)            # several at once: {name: document or None}

acquire() also guards the destination: remote_dir must not be a symlink or resolve elsewhere,
nor be the home directory, and a non-empty remote_dir must carry the marker (so rsync --delete
never empties a directory the orchestrator did not create), and it makes remote_dir the user's alone
(0700; an earlier version's 0755 deploy once, whole), so that no other user of the host can open the
lock (a read-only handle is all flock needs to keep every run out). The lock is a flock held by a
process on the host for as long as the run lasts: if the run dies, the kernel releases it and
the next run recovers it and says whose it was. A run about to sync asks the lock command to
begin the sync too (BEGIN_SYNC, once the lock is held alone), and the lock holder ends it (hashes
the tree, writes the deploy record): no host command of their own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import threading
import time
from typing import Iterator

from . import bounded, ownership, remote
from .errors import DestinationError, FetchError, HostError, KdError, LockError
from .host import script_text
from .steps import STEPS
from .connectors.base import OutputOverflow, Transport

STATE_DIR = ".kdtree"
MARKER = f"{STATE_DIR}/marker"
DEPLOY_RECORD = f"{STATE_DIR}/deploy.json"
RECORD_MAX_BYTES = 1 << 20
FINISH_TAIL = 8192          # the bytes of the tree hash command's output the client keeps (and the host sends)
# The state files a validate reads: the deploy record (the sync's) and the stamps of the steps that reuse results
STAMPS = tuple(s.stamp for s in STEPS.values() if s.stamp)
HEARTBEAT_MISSES = 3        # the host lets go of the lock after this many keepalive intervals without a heartbeat
SHARED, EXCLUSIVE = "shared", "exclusive"   # runs that use the deployed tree share it; one that changes it holds it alone
ANSWER_BYTES = 1 << 20      # what a host-side helper may print before its answer (a few lines normally)
HOLDERS_SHOWN = 8           # the owners a busy lock's error names (the others counted)


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who holds a lock: the client machine, its process, when it started, what it runs."""

    client: str
    pid: int
    started: str
    command: str

    @classmethod
    def now(cls, command: str) -> "Owner":
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(socket.gethostname(), os.getpid(), started, command)

    @classmethod
    def parse(cls, text: str) -> "Owner | None":
        try:
            data = json.loads(text)
            return cls(str(data["client"]), int(data["pid"]), str(data["started"]), str(data["command"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def __str__(self) -> str:
        return f"{self.command} by pid {self.pid} on {self.client}, started {self.started}"


class HostLock:
    """A held lock; release() (or leaving the with-block) frees it and removes its owner file.
    A shared lock becomes exclusive for the time of `with lock.exclusive():`."""

    def __init__(self, transport: Transport, process, stale: Owner | None, heartbeat: float | None = None,
                 mode: str = EXCLUSIVE, wait: float = 0, begun: dict[str, str] | None = None):
        self.transport, self._process, self.stale = transport, process, stale
        self.mode, self._wait, self._begun = mode, wait, begun
        self._guard = threading.Lock()
        if heartbeat:
            threading.Thread(target=self._beat, args=(heartbeat,), daemon=True).start()

    def begin_sync(self) -> dict[str, str]:
        """The sync's first step under this lock held alone (BEGIN_SYNC's PARTIAL and RSYNC facts):
        what the lock command said when it began the sync as it
        took the lock, else the holder begins it now (one exchange over the lock's channel)."""
        begun, self._begun = self._begun, None
        if begun is not None:
            return begun
        if self.mode != EXCLUSIVE:
            raise ValueError("a sync begins only under the lock held alone")
        return self._ask(b"begin\n", ("BEGUN",)).facts

    def finish_sync(self, tree_hash: str, record: dict) -> tuple[int | None, str]:
        """The sync's last step under this lock held alone, by the lock holder: it hashes the
        deployed tree with the lock command's `hash_line` and, when the hash is `tree_hash`, stores
        `record` as the deploy record and clears the in-progress mark. (The hash line's exit
        status, None when the holder did not say in time; the tail of its output.)"""
        if self.mode != EXCLUSIVE:
            raise ValueError("a sync ends only under the lock held alone")
        with self._guard:
            if self._process is None:
                raise HostError("the lock was released", host=self.transport.host.name)
            self._process.write(f"finish {tree_hash} {json.dumps(record)}\n".encode())
            process = self._process
        host, tail = self.transport.host, ""
        for word, rest in answers(process, host, "lock command", remote.client_timeout(host.timeout("sync"))):
            if word == "OUT":
                tail = (tail + rest + "\n")[-FINISH_TAIL:]      # a host may send more than it should
            elif word == "HASHED":
                return (int(rest) if rest.strip().isdigit() else None), tail
            elif word == "UNSAFE":
                raise DestinationError(f"refusing to use remote_dir: {rest}", host=host.name)
        raise AssertionError("answers() ends only by raising")

    def _beat(self, interval: float) -> None:
        """Tell the lock holder on the host that this run is alive, every `interval` seconds."""
        released = threading.Event()
        while not released.wait(interval):
            with self._guard:
                if self._process is None:
                    return
                try:
                    self._process.write(b"alive\n")
                except (OSError, TypeError):
                    return

    @contextlib.contextmanager
    def exclusive(self):
        """Hold the lock alone for the with-block (see to_exclusive), then shared again if it was."""
        if self.mode == EXCLUSIVE:
            yield self
            return
        self.to_exclusive()
        try:
            yield self
        finally:
            self.to_shared()

    def to_exclusive(self) -> None:
        """Hold the lock alone from now on, waiting up to the lock's `wait` seconds for the other
        runs holding it shared; LockError naming them when they stay (the lock stays shared)."""
        if self.mode == EXCLUSIVE:
            return
        answer = self._ask(b"exclusive\n", ("EXCLUSIVE", "BUSY"))
        if answer.word == "BUSY":
            raise _busy(self.transport.host, answer, self._wait,
                        "is in use by other runs (the tree cannot change under them)")
        self.mode = EXCLUSIVE

    def to_shared(self) -> None:
        """Share the lock again with other runs of the same tree."""
        if self.mode == SHARED:
            return
        self._ask(b"shared\n", ("SHARED",))
        self.mode = SHARED

    def _ask(self, request: bytes, finals: tuple[str, ...]) -> "_Answer":
        with self._guard:
            if self._process is None:
                raise HostError("the lock was released", host=self.transport.host.name)
            self._process.write(request)
            process = self._process
        return _answer(process, self.transport.host, self._wait, finals)

    def release(self, timeout: float | None = None) -> None:
        """Tell the holder on the host to let go and wait for it to end, at most `timeout` seconds
        (the host's lock timeout by default): a host that hangs there never holds the run."""
        with self._guard:
            process, self._process = self._process, None
        if process is None:
            return
        try:
            process.write(b"release\n")
        except OSError:
            pass
        process.close(self.transport.host.timeout("lock") if timeout is None else timeout)

    def __enter__(self) -> "HostLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_silence(host) -> float:
    """How long the lock holder on `host` waits for the client's heartbeat before letting go."""
    return host.timeout("keepalive") * HEARTBEAT_MISSES


def lock_command(remote_dir: str, owner: Owner, silence: float | None = None, mode: str = EXCLUSIVE,
                 wait: float = 0, begin_sync: bool = False, rsync_path: str | None = None, hash_line: str = "") -> str:
    """The command that claims remote_dir (checks, marker) and holds its lock in `mode` (shared or
    exclusive, waiting up to `wait` seconds for it) until told; `silence`: it also lets go when the
    client's heartbeat stops for that many seconds (a client cut off by a network partition, whose
    closed connection the host may never hear about); `begin_sync`: once it holds the lock alone,
    it also begins a sync (BEGIN_SYNC, with the host's `rsync_path`) before it answers; `hash_line`:
    the command line that hashes the deployed tree (run in remote_dir) when told to finish a sync."""
    if begin_sync and mode != EXCLUSIVE:
        raise ValueError("a sync begins only under the lock held alone")
    return remote.script(_LOCK_SCRIPT, remote_dir, owner.to_json(), _marker_text(owner), mode,
                         remote._seconds(wait), remote._seconds(silence) if silence else "",
                         str(owner), rsync_path or "", "begin" if begin_sync else "", hash_line, timeout=None).line


def acquire(transport: Transport, owner: Owner, mode: str = EXCLUSIVE, wait: float = 0,
            begin_sync: bool = False, hash_line: str = "") -> HostLock:
    """Claim the host's remote_dir and take its lock in `mode`, waiting up to `wait` seconds for
    the runs holding it; DestinationError, or LockError naming them. `begin_sync` (exclusive
    only): the lock command begins the sync as well, its answer kept for HostLock.begin_sync.
    `hash_line`: how the holder hashes the tree when a sync finishes (sync.hash_line)."""
    host = transport.host
    process = transport.start(lock_command(host.remote_dir, owner, lock_silence(host), mode, wait,
                                           begin_sync, host.rsync_path, hash_line))
    try:
        answer = _answer(process, host, wait, ("LOCKED", "BUSY"))
    except KdError:
        process.close(timeout=1)
        raise
    if answer.word == "BUSY":
        process.close()
        raise _busy(host, answer, wait, "is locked by another run")
    return HostLock(transport, process, answer.stale, host.timeout("keepalive"), mode, wait,
                    answer.facts if begin_sync else None)


def answers(process, host, what: str, limit: float) -> Iterator[tuple[str, str]]:
    """The (word, rest of the line) answers a host-side helper prints, for as long as the caller
    reads; a helper that ends first, is still answering `limit` seconds from now (a host that
    trickles lines is no answer), or prints more than ANSWER_BYTES (a host that floods lines is no
    answer either), is a HostError naming `what`."""
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


@dataclasses.dataclass
class _Answer:
    """The lock holder's answer: its final word, the first HOLDERS_SHOWN owners of the runs
    holding the lock (`more`: how many others it named), the last STALE owner it recovered and
    BEGIN_SYNC's facts (PARTIAL, RSYNC, RSYNC_VERSION)."""

    word: str = ""
    holders: list[Owner] = dataclasses.field(default_factory=list)
    more: int = 0
    stale: Owner | None = None
    facts: dict[str, str] = dataclasses.field(default_factory=dict)


def _answer(process, host, wait: float, finals: tuple[str, ...]) -> _Answer:
    """Read the lock holder's answer up to one of `finals` (bounded: answers())."""
    answer = _Answer()
    for word, rest in answers(process, host, "lock command", wait + host.timeout("lock")):
        if word in finals:
            answer.word = word
            return answer
        if word in BEGIN_SYNC_FACTS:
            answer.facts[word] = rest.strip()
        elif word == "STALE":
            answer.stale = _owner(rest)
        elif word == "HOLDER" and len(answer.holders) < HOLDERS_SHOWN:
            answer.holders.append(_owner(rest))
        elif word == "HOLDER":
            answer.more += 1
        elif word == "UNSAFE":
            raise DestinationError(f"refusing to use remote_dir: {rest}", host=host.name)
    raise AssertionError("answers() ends only by raising")


def _owner(text: str) -> Owner:
    """The owner a HOLDER or STALE line names (one it garbled: unknown, with its first 200 characters)."""
    return Owner.parse(text) or Owner("unknown", 0, "unknown", text[:200])


def _busy(host, answer: _Answer, wait: float, what: str) -> LockError:
    """The error of a busy lock: the holders it named (the first HOLDERS_SHOWN; the others counted)."""
    names = "; ".join(map(str, answer.holders)) or "unknown owner"
    if answer.more:
        names += f"; and {answer.more} more"
    waited = f" (waited {wait:g} s: timeouts.lock)" if wait else ""
    return LockError(f"{host.remote_dir} {what}: {names}{waited}", host=host.name, owner=names)


def read_json(transport: Transport, name: str) -> dict | None:
    """A JSON document of the orchestrator's state on the host (`.kdtree/<name>`), or None."""
    try:
        data = bounded.loads(transport.read_file(f"{STATE_DIR}/{name}", RECORD_MAX_BYTES), name)
    except (FetchError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsons(transport: Transport, names: tuple[str, ...]) -> dict[str, dict | None]:
    """Several of the host's state documents (read_json's, each None when missing, not a
    mapping, not JSON or over RECORD_MAX_BYTES) in one round trip (Transport.read_files). When
    the read fails as a whole (no answer within the host's lock timeout, the bound of its other
    state-directory commands), every one is None: nothing is reused then."""
    try:
        found = transport.read_files(json_paths(names), timeout=transport.host.timeout("lock"))
    except FetchError:
        found = None
    return parse_jsons(found, names)


def json_paths(names: tuple[str, ...]) -> list[tuple[str, int]]:
    """The (path, size bound) pairs with which Transport.read_files reads these state documents."""
    return [(f"{STATE_DIR}/{name}", RECORD_MAX_BYTES) for name in names]


def parse_jsons(found: dict | None, names: tuple[str, ...]) -> dict[str, dict | None]:
    """read_jsons' documents from what Transport.read_files `found` for json_paths(names), among
    other files perhaps (None: the read failed as a whole, so every one is None)."""
    documents: dict[str, dict | None] = {}
    for name in names:
        documents[name] = None
        body = found[f"{STATE_DIR}/{name}"] if found is not None else None
        if isinstance(body, bytes):
            try:
                data = bounded.loads(body, name)
            except ValueError:
                continue
            documents[name] = data if isinstance(data, dict) else None
    return documents


def read_deploy_record(transport: Transport) -> dict | None:
    """The record of the last completed deploy on the host, or None if there is none."""
    return read_json(transport, "deploy.json")


def write_json(transport: Transport, name: str, data: dict) -> None:
    """Store a JSON document in the host's state directory, atomically (build and bundle stamps),
    within the host's lock timeout (the bound of its other state-directory commands' answers)."""
    transport.check(remote.script(_WRITE_JSON_SCRIPT, transport.host.remote_dir, name,
                                  timeout=transport.host.timeout("lock"), stdin=json.dumps(data, indent=1).encode(),
                                  what=f"writing {STATE_DIR}/{name}"))


def _marker_text(owner: Owner) -> str:
    return f"This directory is a deploy target of kdtree-orchestrator (created {owner.started} by {owner.client}).\n" \
           "Its content is replaced on every deploy (rsync --delete); .kdtree/ holds the orchestrator's state."


# The sync's first step, in .kdtree/ under the lock held alone (kd_begin_sync: host/begin_sync.sh).
BEGIN_SYNC = script_text("begin_sync")
BEGIN_SYNC_FACTS = ("PARTIAL", "RSYNC", "RSYNC_VERSION")

# The lock holder (host/lock.sh: its arguments and stdin commands).
_LOCK_SCRIPT = ownership.CHECK + BEGIN_SYNC + script_text("lock", FINISH_TAIL=FINISH_TAIL)

_WRITE_JSON_SCRIPT = ownership.guard(script_text("write_json"))
