"""A step's output, bounded: its log file and the console get the first HEAD_BYTES of it as it
comes and its last TAIL_BYTES when the step ends, with what was left out between them said in
both places and counted for the run record. A host that prints gigabytes leaves a few MB on disk
and on the console, and this process holds at most the tail in memory.

    sink = BoundedSink(log_file, log_path, lambda line: out(f"bench | {line}"))
    sink("a line of output")        # every line of the step, in order (several threads may call it)
    sink("progress: ...", show=False)   # a line for the log alone (the console shows it otherwise)
    cut = sink.close()              # None, or {"bytes", "lines", "left_out_bytes", "left_out_lines"}
    sink.error                      # None, or the LocalWriteError that stopped the log (a full disk)

Lines go to the log file as safe_text.visible writes them (the console escapes its own). A log
that cannot be written (a full disk) is written no further; the console says so and goes on.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from pathlib import Path
from typing import Callable, TextIO

from ..errors import LocalWriteError
from ..safe_text import visible

HEAD_BYTES = 1 << 20       # of a step's output, written as it comes
TAIL_BYTES = 1 << 20       # and the last of it, written when the step ends


class BoundedSink:
    """One step's output lines to its log file and its console output, head and tail kept."""

    def __init__(self, log: TextIO, path: Path, console: Callable[[str], None], head: int = HEAD_BYTES,
                 tail: int = TAIL_BYTES):
        self.log, self.path, self.console, self.head, self.tail = log, path, console, head, tail
        self.error: LocalWriteError | None = None
        self._lock = threading.Lock()
        self._held: collections.deque[tuple[str, int, bool]] = collections.deque()  # the tail: (line, bytes, show)
        self._held_bytes = 0
        self.bytes = self.lines = 0                 # everything that came
        self.left_out_bytes = self.left_out_lines = 0

    def __call__(self, text: str, show: bool = True) -> None:
        """One line of the step's output (without its newline); `show`: on the console too."""
        line = visible(text)
        size = len(line.encode(errors="replace")) + 1
        with self._lock:
            self.bytes += size
            self.lines += 1
            if self.bytes <= self.head:
                self._write(text, line, show)
                return
            if self.bytes - size <= self.head:     # the first line past the head: say why the rest waits
                self.console(f"[output past its first {self.head} bytes: its last {self.tail} bytes follow when "
                             "the step ends]")
            self._held.append((text, size, show))
            self._held_bytes += size
            while self._held_bytes > self.tail and len(self._held) > 1:
                _, dropped, _ = self._held.popleft()
                self._held_bytes -= dropped
                self.left_out_bytes += dropped
                self.left_out_lines += 1

    def close(self) -> dict | None:
        """Write the tail held back, after a line saying what was left out before it; what was
        left out, for the run record (None when nothing was)."""
        with self._lock:
            if self.left_out_lines:
                note = (f"[{self.left_out_bytes} bytes in {self.left_out_lines} lines of output left out here: "
                        f"{self.bytes} bytes in {self.lines} lines came, the log keeps the first {self.head} "
                        f"and the last {self.tail} bytes]")
                self._write(note, note, True)
            while self._held:
                text, _, show = self._held.popleft()
                self._write(text, visible(text), show)
            self._held_bytes = 0
            if self.error is not None:          # what the log still buffers cannot be written either
                with contextlib.suppress(OSError):
                    self.log.close()
            if not self.left_out_lines:
                return None
            return {"bytes": self.bytes, "lines": self.lines, "left_out_bytes": self.left_out_bytes,
                    "left_out_lines": self.left_out_lines}

    def _write(self, text: str, line: str, show: bool) -> None:
        if self.error is None:
            try:
                self.log.write(f"{line}\n")
                self.log.flush()
            except OSError as e:
                self.error = LocalWriteError(self.path, e)
                self.console(f"[{self.error.message}: the rest of this step's output is not logged]")
        if show:
            self.console(text)
