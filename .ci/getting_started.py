"""Run the shell blocks of docs/getting-started.md as a reader would, and fail when one fails.

Every ```bash block of the page runs, in order, in one bash session (`set -euo pipefail`), in a
copy of this checkout (its tracked and untracked, not ignored, files, and its build/ caches), with
the checkout's `.venv` activated. A block the page marks with `<!-- ci: skip -->` on the line above
its fence is not run; the page says why beside it (.ci/run already runs the first-validate command
itself). The loopback sshd the page starts is stopped at the end whatever happened, by its pid
file.

    python3 .ci/getting_started.py [--keep]      # from the checkout, with .venv built
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "getting-started.md"
SKIP = "<!-- ci: skip -->"
FENCE = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, bool]]:
    """The page's bash blocks in order, each with whether CI runs it."""
    found = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((m.group(1), before.strip() != SKIP))
    return found


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked and untracked (not ignored) files, as they are now, into dest, with
    its build/: the orchestrator's caches (this machine's bundle regeneration among them) that a
    reader's checkout holds after the page's first validate, which .ci/run has just run here."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file() or src.is_symlink():     # a tracked file deleted in the work tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    if (REPO / "build").is_dir():
        shutil.copytree(REPO / "build", dest / "build", symlinks=True)


def stop_sshd(pid_file: Path) -> None:
    """Stop the sshd the page started (the one its pid file names), if it still runs."""
    try:
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
    except (OSError, ValueError, IndexError):
        pass


def show_lab_logs(lab: Path, lines: int = 20) -> None:
    """Print the last lines of each log the page's commands wrote in the lab (a failed block's evidence)."""
    for log in sorted(lab.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"== getting started: the last {len(tail)} lines of .lab/{log.name}")
        for line in tail:
            print("   " + "".join(c if c.isprintable() else "?" for c in line[:300]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    args = parser.parse_args()
    venv = REPO / ".venv" / "bin" / "activate"
    if not venv.is_file():
        print(f"getting-started check: {venv} is missing: build the README's .venv first", file=sys.stderr)
        return 2
    found = blocks(PAGE.read_text())
    run = [code for code, runs in found if runs]
    print(f"== getting started: {len(run)} of {len(found)} shell blocks of {PAGE.relative_to(REPO)} run here "
          f"({len(found) - len(run)} marked ci: skip)")
    work = Path(tempfile.mkdtemp(prefix="kdtree-getting-started-"))
    copy = work / "checkout"
    copy.mkdir()
    copy_checkout(copy)
    # The lab's warm connections get a socket directory of their own, ended with the copy.
    env = {**os.environ, "KDTREE_CONTROL_DIR": str(work / "ctl")}
    script = "\n".join([f". {venv}", "set -euo pipefail", "set -x", *run])
    started = time.monotonic()
    code = 1
    try:
        code = subprocess.run(["bash", "-c", script], cwd=copy, env=env).returncode
        if code != 0:
            show_lab_logs(copy / ".lab")
    finally:
        subprocess.run([str(REPO / ".venv" / "bin" / "invoke"), "connections", "--close"], cwd=copy, env=env,
                       capture_output=True)
        stop_sshd(copy / ".lab" / "sshd.pid")
        if args.keep:
            print(f"getting-started check: the copy is kept in {copy}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    verdict = "passed" if code == 0 else f"FAILED (exit {code})"
    print(f"== getting started: {verdict} in {time.monotonic() - started:.0f} s")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
