"""Ownership, as OpenSSH's StrictModes checks it: nothing the orchestrator writes, locks, deletes,
reads back or executes may lie where another user could have put it or could swap it.

On a host (bash, run before every one of the orchestrator's commands under remote_dir):

    guard(script, "$1")          # the script with CHECK's function, called on remote_dir first
    guarded(remote_dir, line)    # a command line (an engine step) that runs only after the check

The rule, for the deploying user U (the host login's uid):
  - every parent of remote_dir is owned by root or U and not writable by group or others,
    unless it is root-owned and sticky (/tmp, /var/tmp): then nobody else can rename or replace
    what U puts in it;
  - remote_dir and everything under it (the synced tree, `.kdtree/`, `build/`) is owned by U and
    never writable by group or others; remote_dir, `.kdtree` and `build` are no symlinks, and
    nothing in `.kdtree/` is a symlink (state files are never followed through one).
"Group-writable" does not count when the group is U's private group (U's primary group, with no
other member and no other user's primary group), as Debian's OpenSSH decides: with a umask of
002 (user private groups) nobody else gains anything from it.
A refusal prints `UNSAFE <what and why>` and exits with UNSAFE_EXIT; errors.refusal(output) finds it.

On this machine, the same rule for the run directory and the orchestrator's local state:

    check_local_dir(path)        # UnsafeLocalPath unless path and its parents pass the rule
    private_dir(path)            # mkdir 0700 (checked); private_open(path) / write_private(path, data)
"""
from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shlex
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import LocalWriteError, UsageError
from .host import script_text

UNSAFE_EXIT = 86

# kd_owned DIR [new] (host/ownership.sh): refuse (UNSAFE ..., exit 86) unless DIR and the way to it
# pass the rule above; `new`: DIR need not exist yet (the lock creates it, then checks again).
CHECK = script_text("ownership")


def guard(script: str, directory: str = '"$1"') -> str:
    """`script` (one of the orchestrator's host-side bash scripts) run only once the directory
    named by the shell expression `directory` (remote_dir) passes the ownership check."""
    return f"{CHECK}kd_owned {directory}\n{script}"


def guarded(remote_dir: str, line: str) -> str:
    """A command line that runs only once remote_dir passes the ownership check."""
    check = shlex.quote(CHECK + 'kd_owned "$1"')
    return f"bash -c {check} kdtree-owner {shlex.quote(remote_dir)} && {line}"


# -- this machine --------------------------------------------------------------------------------------
class UnsafeLocalPath(UsageError):
    """A local directory the run would write to could be changed by another user."""


def check_local_dir(path: Path | str, what: str = "directory", link_ok: bool = False) -> Path:
    """`path` (an existing directory) when it and its parents pass the rule above on this machine
    (no symlink, owned by root or this user; the directory itself by this user and neither it nor
    a parent writable by group or others, unless that parent is root-owned and sticky).
    `link_ok`: `path` may be a symlink of this user's (e.g. runs/ linked to a history elsewhere);
    then what it points to must pass the rule."""
    path = Path(os.path.abspath(path))
    uid = os.geteuid()
    st = os.lstat(path)
    if link_ok and stat.S_ISLNK(st.st_mode) and st.st_uid == uid:
        check_local_dir(path.parent, f"parent of the {what}")
        return check_local_dir(os.path.realpath(path), what)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeLocalPath(f"{what} {path} is not a plain directory (a symlink or a file)")
    if st.st_uid != uid:
        raise UnsafeLocalPath(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
                              "that user could redirect what the run writes there")
    if _writable(st):
        raise UnsafeLocalPath(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    for parent in path.parents:
        st = os.lstat(parent)
        if stat.S_ISLNK(st.st_mode):
            continue        # a symlinked parent (e.g. /var/run): judged by what it points to, below
        if st.st_uid not in (0, uid):
            raise UnsafeLocalPath(f"{parent} (a parent of the {what} {path}) is owned by uid {st.st_uid}, "
                                  f"not by root or this user (uid {uid})")
        if _writable(st) and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
            raise UnsafeLocalPath(f"{parent} (a parent of the {what} {path}) is writable by group or others "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}) and not a root-owned sticky directory")
    real = Path(os.path.realpath(path))
    return path if real == path else check_local_dir(real, what)


def _writable(st: os.stat_result) -> bool:
    """Writable by others, or by a group other than this user's private group."""
    return bool(st.st_mode & 0o002 or st.st_mode & 0o020 and not _private_group(st.st_gid))


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's primary group with nobody else in it (a user private group)."""
    uid = os.geteuid()
    try:
        group, me = grp.getgrgid(gid), pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return gid == os.getegid() and set(group.gr_mem) <= {me} and \
        not any(p.pw_gid == gid and p.pw_uid != uid for p in pwd.getpwall())


def cache_home() -> Path:
    """This user's cache folder: $XDG_CACHE_HOME, else ~/.cache (RuntimeError: no home known)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def private_dir(path: Path | str, what: str = "directory", link_ok: bool = False) -> Path:
    """Create `path` (and missing parents) 0700 unless it exists, then check it (check_local_dir)."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return check_local_dir(path, what, link_ok)


def private_open(path: Path | str, mode: str = "w"):
    """Open a file of the run for writing ('w' or 'a', text, UTF-8): created 0600, never through
    a symlink (O_NOFOLLOW), refused if another user owns it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        raise UnsafeLocalPath(f"refusing to write {path}: {e.strerror}"
                              + (" (a symlink)" if os.path.islink(path) else "")) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeLocalPath(f"refusing to write {path}: owned by uid {st.st_uid} or not a regular file")
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, mode, encoding="utf-8", errors="replace")


def write_private(path: Path | str, data: str | bytes) -> Path:
    """Write a file atomically (a new 0600 file renamed over the old; rename never follows a link);
    LocalWriteError naming it when this machine cannot (a full disk)."""
    path = Path(path)
    raw = data.encode("utf-8", errors="replace") if isinstance(data, str) else data
    with writing(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """An OSError while writing `path` on this machine, as LocalWriteError naming it and why."""
    try:
        yield
    except OSError as e:
        raise LocalWriteError(path, e) from None
