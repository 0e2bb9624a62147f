"""Live progress of long steps: the protocol the engine's scripts report by, and the one display
every running step reports to.

The protocol: a line of a step's output of exactly this shape (fields in this order, one space
between them) is a progress report, not output:

    ::kdtree-progress done=N [total=N] unit=WORD [bytes=N] [what=TEXT]

N is 1 to 15 decimal digits (done <= total when total is given), WORD 1 to 16 lowercase letters
(files, bundles, tests, bytes, ...), TEXT the rest of the line (what the step is at: `compiled
src/model.cpp`). A line of another shape, or longer than MAX_LINE characters, is ordinary output.
What a host sends is hostile: the numbers are bounded by the shape, TEXT is shown escaped
(safe_text.visible), on one line, cut to WHAT_SHOWN characters, with the host's secrets redacted
wherever it is shown or logged; a flood of reports keeps only the last one.

    display = Display(console)              # live lines on a terminal, plain periodic lines otherwise
    with display:
        step = display.step("ct200", "build", log=to_log, show=to_console, secrets=())
        update = parse(line)                # an Update, or None: the line is output
        if update is not None:
            step.report(update)             # the one interface a step reports through
        step.close()

On a terminal (console.stream.isatty()), the display keeps one live line per running host and
step, with the step's elapsed time and its last report (rich's Live: it redraws in place, and the
console's lines are printed above it). Elsewhere (CI logs) it prints a plain line per running
step at most every PLAIN_INTERVAL seconds, and none for a step shorter than that. In both cases
the step's log gets the same plain line at that rate, and the last report when the step ends.
"""
from __future__ import annotations

import os
import re
import threading
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

from .console import Console
from ..records.redaction import redact
from ..safe_text import visible

if TYPE_CHECKING:
    from rich.live import Live

PREFIX = "::kdtree-progress "
MAX_LINE = 512              # a longer line is output, never a report
WHAT_SHOWN = 80             # characters of TEXT shown
PLAIN_INTERVAL = 30.0       # seconds between two plain lines of a step (not a terminal), and between two log lines
LIVE_AFTER = 1.0            # a step shows a live line once it has run this long (no flicker of quick steps)
TICK = 0.5                  # how often the display looks at its steps (plain lines and log lines are due)

_SHAPE = re.compile(r"::kdtree-progress done=(\d{1,15})(?: total=(\d{1,15}))? unit=([a-z]{1,16})"
                    r"(?: bytes=(\d{1,15}))?(?: what=(.*))?")


class Update(NamedTuple):
    """One progress report: `done` of `total` (None: unknown) `unit`s, `bytes` written so far
    (None: not reported), and what the step is at. (A tuple: made for every report of a flood.)"""

    done: int
    total: int | None
    unit: str
    bytes: int | None = None
    what: str = ""


def parse(line: str) -> Update | None:
    """The report a line of output carries, or None when it is not a well-formed report."""
    if not line.startswith(PREFIX) or len(line) > MAX_LINE:
        return None
    match = _SHAPE.fullmatch(line)
    if match is None:
        return None
    done, total, unit, size, what = match.groups()
    if total is not None and int(done) > int(total):
        return None
    return Update(int(done), None if total is None else int(total), unit,
                  None if size is None else int(size), what or "")


def describe(update: Update) -> str:
    """An update in words, on one line: `12/20 files, 1.2 GB: compiled src/model.cpp`."""
    if update.unit == "bytes":
        count = _size(update.done) + (f" of {_size(update.total)}" if update.total is not None else "")
    else:
        count = f"{update.done}{f'/{update.total}' if update.total is not None else ''} {update.unit}"
    if update.bytes is not None:
        count += f", {_size(update.bytes)}"
    what = " ".join(visible(update.what).split())
    if len(what) > WHAT_SHOWN:
        what = what[:WHAT_SHOWN - 3] + "..."
    return f"{count}: {what}" if what else count


def elapsed(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _size(n: int) -> str:
    """Bytes in decimal units: `512 B`, `1.2 MB`, `13.5 GB`."""
    value, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB", "TB", "PB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


class Reporter(Protocol):
    """What a step reports its progress to."""

    def report(self, update: Update) -> None: ...


class Ignored:
    """A reporter that keeps nothing (a step run outside a pipeline's display)."""

    def report(self, update: Update) -> None:
        """Nothing."""


class StepProgress:
    """One running step's place in the display: its last report and when it was last written out."""

    def __init__(self, display: "Display", host: str, step: str, log: Callable[[str], None],
                 show: Callable[[str], None], secrets: tuple[str, ...]):
        self.display, self.host, self.step = display, host, step
        self.log, self.show, self.secrets = log, show, secrets
        self.started = self.written = display.clock()
        self.last: Update | None = None
        self._unwritten = False
        self._closed = False
        self._writing = threading.Lock()     # a plain line being written; close() waits for it (the log then closes)

    def report(self, update: Update) -> None:
        """Take `update` as the step's progress (shown at the display's next refresh)."""
        with self.display.lock:
            self.last, self._unwritten = update, True

    def line(self, now: float) -> str:
        """The step's progress in words: `3m05s: 12/20 files: compiled src/model.cpp`, secrets
        redacted (here, not as reports come: a flood of them costs one redaction a refresh)."""
        last = self.last
        if last is not None and self.secrets and last.what:
            last = last._replace(what=redact(last.what, self.secrets))
        return elapsed(now - self.started) + (f": {describe(last)}" if last is not None else "")

    def close(self) -> None:
        """The step ended: leave the display; its last report, not yet logged, goes to its log."""
        with self._writing:
            with self.display.lock:
                self.display.steps.remove(self)
                unwritten, now = self._unwritten, self.display.clock()
            self._closed = True
            if unwritten:
                self.log(f"progress: {self.line(now)}")
        self.display.refresh()

    def write(self, line: str, show: bool) -> None:
        """Write a plain line to the step's log (and, `show`, to the console), unless it has ended."""
        with self._writing:
            if self._closed:
                return
            self.log(f"progress: {line}")
            if show:
                self.show(f"{self.step:9} ... {line}")

    def _due(self, now: float, interval: float) -> str | None:
        """The plain line to write now (called under the display's lock), or None if none is due."""
        if now - self.written < interval:
            return None
        self.written, self._unwritten = now, False
        return self.line(now)


class Display:
    """The progress of every running step of a run, on one console (see the module's docstring).
    `live`: whether to draw live lines (default: when the console's stream is a terminal)."""

    def __init__(self, console: Console, *, live: bool | None = None, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.console, self.clock = console, clock
        self.live = _is_terminal(console.stream) if live is None else live
        self.interval = PLAIN_INTERVAL if interval is None else interval
        self.lock = threading.Lock()
        self.steps: list[StepProgress] = []
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._live: Live | None = None      # while drawing

    def step(self, host: str, step: str, log: Callable[[str], None], show: Callable[[str], None],
             secrets: tuple[str, ...] = ()) -> StepProgress:
        """A running step's reporter (close() it when the step ends): `log` writes a line to its
        log, `show` one to the console (plain mode); `secrets` are redacted from what it reports."""
        entry = StepProgress(self, host, step, log, show, secrets)
        with self.lock:
            self.steps.append(entry)
        return entry

    def __enter__(self) -> "Display":
        if self.live:
            self._start_live()
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="progress")
        self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._live is not None:
            self.console.divert(None)
            self._live.stop()
            self._live = None

    def refresh(self) -> None:
        """Draw the live lines again now (a step ended: its line goes before the console's next line)."""
        live = self._live
        if live is not None:
            live.refresh()

    def _start_live(self) -> None:
        # rich draws the live lines (cursor movement, redraw, terminal width) and prints the
        # console's lines above them: imported here, as a run that is not on a terminal needs none of it
        from rich.console import Console as RichConsole
        from rich.live import Live
        from rich.text import Text

        terminal = RichConsole(file=self.console.stream, force_terminal=True, highlight=False, emoji=False)
        self._live = live = Live(console=terminal, get_renderable=self._render, refresh_per_second=4, transient=True)
        live.start()
        # the console's lines (already escaped and cut to the terminal's width) go above the live lines
        self.console.divert(lambda text: terminal.print(Text(text), soft_wrap=True))

    def _render(self):
        from rich.console import Group
        from rich.text import Text
        now = self.clock()
        with self.lock:
            shown = [(s.host, s.step, s.line(now)) for s in self.steps if now - s.started >= LIVE_AFTER]
        width = self.console.width
        return Group(*(Text(f"[{host.ljust(width)}] {step:9} ... {line}", no_wrap=True, overflow="ellipsis")
                       for host, step, line in shown))

    def _tick(self) -> None:
        """Every TICK seconds: each step whose plain line is due writes it to its log (and, not on
        a terminal, to the console)."""
        while not self._stop.wait(TICK):
            now = self.clock()
            with self.lock:
                due = [(s, line) for s in self.steps if (line := s._due(now, self.interval)) is not None]
            for entry, line in due:
                entry.write(line, show=not self.live)


def _is_terminal(stream) -> bool:
    """Whether `stream` is a terminal that can redraw a line (not TERM=dumb)."""
    if os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:          # a closed stream
        return False
