"""Proof that two commands ran side by side, without a wall-clock bound (these machines are loaded)."""
from __future__ import annotations

from pathlib import Path


def meet(marks: Path, most: float = 20.0) -> str:
    """Shell lines that mark this process in `marks` (an empty folder) and wait, `most` seconds at
    most, until a second process has marked it too: two commands that start with them take `most`
    seconds more when run one after the other. The lines end with the test `[ both met ]`."""
    count = f"$(ls {marks} | wc -l)"
    return (f"touch {marks}/$$; n=0\n"
            f"while [ {count} -lt 2 ] && [ $n -lt {int(most * 10)} ]; do sleep 0.1; n=$((n+1)); done\n"
            f"[ {count} -ge 2 ]")
