"""The orchestrator's state on a host, in `<remote_dir>/.kdtree/` (excluded from every sync, so
rsync --delete spares it): the ownership marker, the lock, the deploy record.

    with state.acquire(transport, state.Owner.now("deploy")) as lock:   # one run at a time
        lock.stale        # the owner of a lock left by a dead run, now recovered (or None)
        ...
    state.read_deploy_record(transport)                  # what the last deploy recorded
    state.read_json(transport, name) / state.write_json(transport, name, data)   # build/bundle stamps

acquire() also guards the destination: remote_dir must not be a symlink or resolve elsewhere,
nor be the home directory, and a non-empty remote_dir must carry the marker (so rsync --delete
never empties a directory the orchestrator did not create). The lock is a flock held by a
process on the host for as long as the run lasts: if the run dies, the kernel releases it and
the next run recovers it and says whose it was.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading

from . import remote
from .errors import DestinationError, FetchError, HostError, LockError
from .transport import Transport

STATE_DIR = ".kdtree"
MARKER = f"{STATE_DIR}/marker"
DEPLOY_RECORD = f"{STATE_DIR}/deploy.json"
RECORD_MAX_BYTES = 1 << 20
HEARTBEAT_MISSES = 3        # the host lets go of the lock after this many keepalive intervals without a heartbeat


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
        except (ValueError, KeyError, TypeError):
            return None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def __str__(self) -> str:
        return f"{self.command} by pid {self.pid} on {self.client}, started {self.started}"


class HostLock:
    """A held lock; release() (or leaving the with-block) frees it and removes its owner file."""

    def __init__(self, transport: Transport, process, stale: Owner | None, heartbeat: float | None = None):
        self.transport, self._process, self.stale = transport, process, stale
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

    def release(self, timeout: float = 30) -> None:
        with self._guard:
            process, self._process = self._process, None
        if process is None:
            return
        try:
            process.write(b"release\n")
        except OSError:
            pass
        process.close(timeout)

    def __enter__(self) -> "HostLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_silence(host) -> float:
    """How long the lock holder on `host` waits for the client's heartbeat before letting go."""
    return host.timeout("keepalive") * HEARTBEAT_MISSES


def lock_command(remote_dir: str, owner: Owner, silence: float | None = None) -> str:
    """The command that claims remote_dir (checks, marker) and holds the lock until told;
    `silence`: it also lets go when the client's heartbeat stops for that many seconds (a client
    cut off by a network partition, whose closed connection the host may never hear about)."""
    extra = [remote._seconds(silence)] if silence else []
    return remote.script_command(_LOCK_SCRIPT, remote_dir, owner.to_json(), _marker_text(owner), *extra, timeout=None)


def acquire(transport: Transport, owner: Owner) -> HostLock:
    """Claim the host's remote_dir and take its lock, or raise DestinationError / LockError."""
    host = transport.host
    beat = host.timeout("keepalive")
    process = transport.start(lock_command(host.remote_dir, owner, lock_silence(host)))
    stale = None
    try:
        while True:
            line = process.readline(timeout=host.timeout("lock"))
            if line is None:
                result = process.close()
                raise HostError("the lock command ended without an answer", host=host.name,
                                command=result.command if result else None,
                                exit_status=result.exit_code if result else None, tail=result.tail if result else "")
            word, _, rest = line.partition(" ")
            if word == "LOCKED":
                return HostLock(transport, process, stale, beat)
            if word == "STALE":
                stale = Owner.parse(rest) or Owner("unknown", 0, "unknown", rest[:200])
            elif word == "BUSY":
                holder = Owner.parse(rest)
                process.close()
                raise LockError(f"{host.remote_dir} is locked by another run: {holder or 'unknown owner'}",
                                host=host.name, owner=str(holder))
            elif word == "UNSAFE":
                process.close()
                raise DestinationError(f"refusing to use remote_dir: {rest}", host=host.name)
    except TimeoutError:
        process.close(timeout=1)
        raise HostError(f"no answer from the lock command within {host.timeout('lock')} s",
                        host=host.name) from None


def read_json(transport: Transport, name: str) -> dict | None:
    """A JSON document of the orchestrator's state on the host (`.kdtree/<name>`), or None."""
    try:
        data = json.loads(transport.read_file(f"{STATE_DIR}/{name}", RECORD_MAX_BYTES))
    except (FetchError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_deploy_record(transport: Transport) -> dict | None:
    """The record of the last completed deploy on the host, or None if there is none."""
    return read_json(transport, "deploy.json")


def write_json(transport: Transport, name: str, data: dict) -> None:
    """Store a JSON document in the host's state directory, atomically (build and bundle stamps)."""
    transport.check(remote.script(_WRITE_JSON_SCRIPT, transport.host.remote_dir, name, timeout=60,
                                  stdin=json.dumps(data, indent=1).encode(), what=f"writing {STATE_DIR}/{name}"))


def _marker_text(owner: Owner) -> str:
    return f"This directory is a deploy target of kdtree-orchestrator (created {owner.started} by {owner.client}).\n" \
           "Its content is replaced on every deploy (rsync --delete); .kdtree/ holds the orchestrator's state."


_LOCK_SCRIPT = r'''
d=$1
unsafe() { printf 'UNSAFE %s\n' "$*"; exit 3; }
case $d in /*) ;; *) unsafe "$d is not an absolute path";; esac
[ -L "$d" ] && unsafe "$d is a symlink"
real=$(realpath -m -- "$d") || unsafe "cannot resolve $d"
[ "$real" = "$d" ] || unsafe "$d resolves to $real (a symlink on the way)"
[ "$real" = "$(cd ~ 2>/dev/null && pwd -P)" ] && unsafe "$d is the home directory"
[ -e "$d" ] && [ ! -d "$d" ] && unsafe "$d exists and is not a directory"
[ -L "$d/.kdtree" ] && unsafe "$d/.kdtree is a symlink"
if [ -d "$d" ] && [ ! -f "$d/.kdtree/marker" ] && [ -n "$(ls -A -- "$d")" ]; then
  unsafe "$d is not empty and was not created by the orchestrator (no .kdtree/marker); empty it or choose another remote_dir"
fi
command -v flock >/dev/null || unsafe "flock (util-linux) is missing on the host"
mkdir -p -- "$d/.kdtree" || unsafe "cannot create $d/.kdtree"
[ -f "$d/.kdtree/marker" ] || printf '%s\n' "$3" > "$d/.kdtree/marker" || unsafe "cannot write $d/.kdtree/marker"
cd -- "$d/.kdtree" || unsafe "cannot enter $d/.kdtree"
exec 9>>lock.flock
if ! flock -n 9; then printf 'BUSY %s\n' "$(head -c 2000 owner 2>/dev/null)"; exit 75; fi
[ -s owner ] && printf 'STALE %s\n' "$(head -c 2000 owner)"
printf '%s\n' "$2" > owner
echo LOCKED
wait=(); [ -n "$4" ] && wait=(-t "$4")
while IFS= read -r "${wait[@]}" reply; do
  [ "$reply" = release ] && { rm -f owner; exit 0; }
done
exit 0
'''

_WRITE_JSON_SCRIPT = r'''
cd -- "$1/.kdtree" && cat > "$2.tmp" && mv -f -- "$2.tmp" "$2"
'''
