"""Host side of steps.inputs: run on the host by the host's own Python (`python -I -S -c`, in
remote_dir, after the ownership check), standard library only; never imported by the client.

    python -I -S -c "$(cat hash_inputs.py)" TREE     # prints `x <sha256> build/kdtree` lines
                                                        # and `f <sha256> scripts/bench.sh` lines
    python -I -S -c "$(cat hash_inputs.py)" TREE if-built   # the same, or `not built` when the
                                                        # build stamp names another tree

x: every top-level regular executable under build/, hashed with each occurrence of TREE (the
deployed tree hash, or empty) replaced by zeros; f: every regular file and symlink of the tree
outside the top-level build/ and any .git/, .kdtree/, __pycache__/, except *.pyc (a symlink is
hashed by its target, so retargeting one changes what results depend on). Names are sorted by bytes;
a newline or backslash in a name is written escaped (`\\n`, `\\\\`) so the line still parses.

A file's hash is reused from .kdtree/inputs-cache.json when its device, inode, size, mtime and
ctime are those it was hashed with, as git's index does (ctime cannot be set back by a user, so a
rewrite that restores the mtime still shows). A file changed within RACY_NS of a hashing may have
kept its timestamps through the change: its hash is never cached, and it is hashed again the next
time. Only the deploying user can write remote_dir (the ownership check), so only that user's
writes can change a file there.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time

CACHE = ".kdtree/inputs-cache.json"
BUILD_STAMP = ".kdtree/build.json"      # steps/build.py's stamp: {"key": {"tree": TREE, ...}, ...}
CACHE_MAX_BYTES = 64 << 20
RACY_NS = 2_000_000_000          # timestamps coarser than this are not trusted to show a change
CHUNK = 1 << 20
ZEROS = b"0" * 64
PRUNED = (b".git", b".kdtree", b"__pycache__")


def load_cache(mask: str) -> tuple[dict, dict]:
    """The cached (files, executables) hashes; executables only when hashed with the same mask."""
    try:
        if os.lstat(CACHE).st_size > CACHE_MAX_BYTES:
            return {}, {}
        with open(CACHE, "rb") as f:
            data = json.load(f)
        files, execs = data["f"], data["x"] if data["mask"] == mask else {}
        return (files, execs) if isinstance(files, dict) and isinstance(execs, dict) else ({}, {})
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return {}, {}


def tree_files() -> list[bytes]:
    """The tree's files and symlinks (relative names), all but the top-level build/, any .git/,
    .kdtree/, __pycache__/ and *.pyc; a symlink to a directory is listed, never followed."""
    found = []
    for root, dirs, names in os.walk(b"."):
        dirs[:] = [d for d in dirs if d not in PRUNED and not (root == b"." and d == b"build")]
        names += [d for d in dirs if os.path.islink(os.path.join(root, d))]
        found += [os.path.join(root, n)[2:] for n in names if not n.endswith(b".pyc")]
    return sorted(found)


def executables() -> list[bytes]:
    """The top-level files of build/ with an execute bit."""
    try:
        names = os.listdir(b"build")
    except OSError:
        return []
    return sorted(os.path.join(b"build", n) for n in names)


def sha256(path: bytes, mask: bytes) -> str:
    """The file's sha256, each occurrence of `mask` read as zeros (none when mask is empty)."""
    h, carry = hashlib.sha256(), b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not mask:
                if not chunk:
                    return h.hexdigest()
                h.update(chunk)
                continue
            buf = (carry + chunk).replace(mask, ZEROS)
            if not chunk:
                h.update(buf)
                return h.hexdigest()
            # the last len(mask)-1 bytes may begin an occurrence that the next chunk completes
            keep = len(mask) - 1
            h.update(buf[:-keep])
            carry = buf[-keep:]


def hash_all(paths: list[bytes], cached: dict, mask: bytes, executable: bool, start_ns: int, kept: dict):
    """(name, sha256) for each regular file of `paths` (with an execute bit when `executable`),
    reusing `cached` hashes whose stat matches, and, unless `executable`, for each symlink (the
    sha256 of b"symlink\\0" + its target, never followed); fills `kept` with what the next run may reuse.
    A file that cannot be read (gone meanwhile, no permission) is left out, as absent."""
    for path in paths:
        try:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) and not executable:
                yield path, hashlib.sha256(b"symlink\0" + os.readlink(path)).hexdigest()
                continue
            if not stat.S_ISREG(st.st_mode) or (executable and not st.st_mode & 0o111):
                continue
            name = os.fsdecode(path)
            sig = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
            entry = cached.get(name)
            digest = entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[0] == sig else sha256(path, mask)
        except OSError:
            continue
        if max(st.st_mtime_ns, st.st_ctime_ns) < start_ns - RACY_NS:
            kept[name] = [sig, digest]
        yield path, digest


def escaped(path: bytes) -> bytes:
    return path.replace(b"\\", b"\\\\").replace(b"\n", b"\\n")


def built(tree: str) -> bool:
    """Whether the build stamp names `tree` (a run that will rebuild has no use for the hashes)."""
    try:
        with open(BUILD_STAMP, "rb") as f:
            return json.load(f)["key"]["tree"] == tree
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False


def main() -> None:
    mask = sys.argv[1] if len(sys.argv) > 1 else ""
    if sys.argv[2:] == ["if-built"] and not built(mask):
        print("not built")
        return
    start_ns = time.time_ns()
    files, execs = load_cache(mask)
    kept: dict = {"mask": mask, "f": {}, "x": {}}
    out = sys.stdout.buffer
    for kind, paths, cached, executable in ((b"x", executables(), execs, True), (b"f", tree_files(), files, False)):
        for path, digest in hash_all(paths, cached, mask.encode() if executable else b"", executable, start_ns,
                                     kept[kind.decode()]):
            out.write(b"%s %s %s\n" % (kind, digest.encode(), escaped(path)))
    out.flush()
    if kept["f"] != files or kept["x"] != execs:
        tmp = f"{CACHE}.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(kept, f)
            os.replace(tmp, CACHE)
        except OSError:
            pass                # no cache: the next run hashes everything again


main()
