"""The orchestrator's state on a host, in `<remote_dir>/.kdtree/` (excluded from every sync, so
rsync --delete spares it): the ownership marker, the lock, the deploy record.

    with state.acquire(transport, state.Owner.now("deploy")) as lock:   # one run at a time
        lock.stale        # the owner of a lock left by a dead run, now recovered (or None)
        ...
    state.read_deploy_record(transport)                  # what the last deploy recorded
    state.read_json(transport, name) / state.write_json(transport, name, data)   # build/bundle stamps
    state.read_jsons(transport, state.STAMPS)            # several at once: {name: document or None}

acquire() also guards the destination: remote_dir must not be a symlink or resolve elsewhere,
nor be the home directory, and a non-empty remote_dir must carry the marker (so rsync --delete
never empties a directory the orchestrator did not create), and it makes remote_dir the user's alone
(0700; an earlier version's 0755 deploy once, whole), so that no other user of the host can open the
lock (a read-only handle is all flock needs to keep every run out). The lock is a flock held by a
process on the host (host/lock.sh, through host/client.py) for as long as the run lasts: if the run
dies, the kernel releases it and the next run recovers it and says whose it was. The lock command
takes and releases the lock; while held alone it also runs, when told, the sync's first and last
steps (host/begin_sync.sh and finish_sync.sh, which the client hands it as it starts:
HostLock.begin_sync, HostLock.finish_sync), so that they take no session of their own.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import threading

from . import bounded
from .errors import DestinationError, FetchError, HostError, KdError, LockError
from .host import client
from .steps import STEPS
from .connectors.base import Transport

STATE_DIR = ".kdtree"
MARKER = f"{STATE_DIR}/marker"
DEPLOY_RECORD = f"{STATE_DIR}/deploy.json"
RECORD_MAX_BYTES = 1 << 20
# The state files a validate reads: the deploy record (the sync's) and the stamps of the steps that reuse results
STAMPS = tuple(s.stamp for s in STEPS.values() if s.stamp)
HEARTBEAT_MISSES = 3        # the host lets go of the lock after this many keepalive intervals without a heartbeat
SHARED, EXCLUSIVE = "shared", "exclusive"   # runs that use the deployed tree share it; one that changes it holds it alone
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
                 mode: str = EXCLUSIVE, wait: float = 0, owner: Owner | None = None):
        self.transport, self._process, self.stale = transport, process, stale
        self.owner = owner          # who holds it (None: unknown to this object; no sync runs under it)
        self.mode, self._wait = mode, wait
        self._guard = threading.Lock()
        if heartbeat:
            threading.Thread(target=self._beat, args=(heartbeat,), daemon=True).start()

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

    def begin_sync(self, ask_rsync: bool = True) -> dict[str, str]:
        """The sync's first step, run by the lock holder on the host (told: no session of its own)
        while this run holds the lock alone: the sync marked as in progress; its facts
        (client.begun: what a broken sync's mark said and, if `ask_rsync`, where rsync is and its version)."""
        host = self.transport.host
        return client.begun(self._tell(client.begin_sync_request(self._alone(), host.rsync_path, ask_rsync)), host)

    def finish_sync(self, *, tree_hash: str, record: dict, hash_line: str) -> tuple[int | None, str]:
        """The sync's last step, run by the lock holder on the host (told: no session of its own)
        while this run holds the lock alone: remote_dir checked again, the tree hashed with
        `hash_line` and, when that gives `tree_hash`, `record` stored as the deploy record and the
        sync's mark cleared. (The hash command's exit status, the tail of its output: client.finished.)"""
        self._alone()
        request = client.finish_sync_request(tree_hash=tree_hash, record=record, hash_line=hash_line)
        return client.finished(self._tell(request), self.transport.host)

    def _alone(self) -> Owner:
        """The lock's owner; ValueError unless it is the tree lock (state.acquire's) held alone (a
        sync runs only so)."""
        if self.mode != EXCLUSIVE or self.owner is None:
            raise ValueError("a sync runs only under the tree lock held alone")
        return self.owner

    def _ask(self, request: bytes, finals: tuple[str, ...]) -> "_Answer":
        return _answer(self._tell(request), self.transport.host, self._wait, finals)

    def _tell(self, request: bytes):
        """Send `request` to the lock holder on the host; its process, whose answer follows."""
        with self._guard:
            if self._process is None:
                raise HostError("the lock was released", host=self.transport.host.name)
            self._process.write(request)
            return self._process

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


def acquire(transport: Transport, owner: Owner, mode: str = EXCLUSIVE, wait: float = 0) -> HostLock:
    """Claim the host's remote_dir and take its lock in `mode`, waiting up to `wait` seconds for
    the runs holding it; DestinationError, or LockError naming them."""
    host = transport.host
    process = transport.start(client.lock(host, owner, mode=mode, wait=wait, silence=lock_silence(host)).line)
    try:
        answer = _answer(process, host, wait, ("LOCKED", "BUSY"))
    except KdError:
        process.close(timeout=1)
        raise
    if answer.word == "BUSY":
        process.close()
        raise _busy(host, answer, wait, "is locked by another run")
    return HostLock(transport, process, answer.stale, host.timeout("keepalive"), mode, wait, owner)


@dataclasses.dataclass
class _Answer:
    """The lock holder's answer: its final word, the first HOLDERS_SHOWN owners of the runs
    holding the lock (`more`: how many others it named) and the last STALE owner it recovered."""

    word: str = ""
    holders: list[Owner] = dataclasses.field(default_factory=list)
    more: int = 0
    stale: Owner | None = None


def _answer(process, host, wait: float, finals: tuple[str, ...]) -> _Answer:
    """Read the lock holder's answer up to one of `finals` (bounded: client.answers)."""
    answer = _Answer()
    for word, rest in client.answers(process, host, "lock command", wait + host.timeout("lock")):
        if word in finals:
            answer.word = word
            return answer
        if word == "STALE":
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
    """Store a JSON document in the host's state directory, atomically (build and bundle stamps)."""
    client.write_json(transport, name=name, data=data)
