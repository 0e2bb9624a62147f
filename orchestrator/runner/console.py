"""Console output: every line prefixed by its host; summary tables.

What a host sends is data, never terminal control: every line shown or logged goes through
safe_text.visible (control characters, escape sequences and lone carriage returns written as
visible escapes such as `\x1b`), so each line starts with its host's prefix; on a terminal, a line
longer than the terminal is wide is cut into pieces that each get the prefix too (the terminal's
own wrapping would start a visual line without it).

    console = Console()
    out = console.host("ct200")               # a callable: out("building ...")
    console.say("3 hosts")                    # an unprefixed line
    console.table(["host", "status"], rows)
"""
from __future__ import annotations

import shutil
import sys
import threading
import unicodedata
from typing import Callable, Sequence, TextIO

from ..safe_text import visible


class Console:
    """Thread-safe, line-buffered output shared by the hosts of a run."""

    def __init__(self, stream: TextIO | None = None, width: int = 0, columns: int | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.width = width          # host names are padded to this width
        self.columns = columns      # the terminal's width (None: asked of the terminal, 0: no wrapping)
        self._lock = threading.Lock()
        self._divert: Callable[[str], None] | None = None

    def divert(self, write: Callable[[str], None] | None) -> None:
        """Send every line to `write` instead of the stream (a live display prints them above its
        own lines: progress.Display); None: to the stream again."""
        with self._lock:
            self._divert = write

    def host(self, name: str) -> "HostOutput":
        """The output of one host: lines prefixed by its name."""
        return HostOutput(self, name)

    def say(self, text: str = "") -> None:
        """Unprefixed lines (control characters made visible)."""
        with self._lock:
            self._print(visible(str(text)))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """A plain aligned table (the summary of a run)."""
        cells = [list(map(str, header))] + [[" ".join(visible(str(c)).split()) for c in row] for row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        self.say("\n".join(lines))

    def _line(self, name: str, text: str) -> None:
        text = visible(text)
        prefix = f"[{name.ljust(self.width)}] "
        with self._lock:
            for piece in _pieces(text.expandtabs(), self._columns() - len(prefix)):
                self._print(prefix + piece)

    def _print(self, text: str) -> None:
        """One line (or several, for say's text) to the stream or where it is diverted; called under the lock."""
        if self._divert is not None:
            self._divert(text)
        else:
            print(text, file=self.stream, flush=True)

    def _columns(self) -> int:
        if self.columns is not None:
            return self.columns
        isatty = getattr(self.stream, "isatty", None)
        return shutil.get_terminal_size().columns if isatty and isatty() else 0



class HostOutput:
    """Call it with a line of text to show it as coming from one host."""

    def __init__(self, console: Console, name: str):
        self.console, self.name = console, name

    def __call__(self, text: str) -> None:
        for line in str(text).split("\n"):      # only newlines: any other line break is escaped
            self.console._line(self.name, line)


def _pieces(text: str, room: int) -> list[str]:
    """`text` cut into pieces no wider than `room` terminal columns (wide characters count 2,
    combining ones 0); room too small to be useful (or 0: not a terminal): `text` whole."""
    if room < 20 or len(text) <= room and text.isascii():
        return [text]
    if text.isascii():          # one column each: plain slices (a long line needs no per-character loop)
        return [text[i:i + room] for i in range(0, len(text), room)]
    pieces, start, used = [], 0, 0
    for i, ch in enumerate(text):
        w = 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        if used + w > room:
            pieces.append(text[start:i])
            start, used = i, 0
        used += w
    return pieces + [text[start:]]
