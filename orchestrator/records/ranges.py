"""The range of every benchmark number a host reports, checked where the number enters: the
engine's bench report (a number outside its range fails that host's bench step), and the records
and history read back (a run.json or a history file written before these checks: the number is
left out, never judged or plotted).

    FIGURE.number(1e308)            # None: outside 0 or 1e-09 to 1e+12
    FIGURE.check(x, "tiny.ar_tokens_per_s value")    # x as a float, else OutOfRange naming it
    FIGURE.read(x, "...")           # the same, but None when x is no finite number (null, text)

A benchmark figure is a count, a rate, a time or a ratio of two of them: zero, or between 1e-9 and
1e12. Within those bounds every sum, ratio and spread the detector and the dashboard compute stays
finite and away from zero (a figure of 5e-324, a denormal, made the noise floor 0.5 % of it round
to 0; 1e308 over 1e-300 made the ratio infinite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def finite_number(value: object) -> float | None:
    """``value`` as a finite float; None for bools, non-numbers, NaN, infinities, huge ints."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class OutOfRange(ValueError):
    """A host's number is outside its field's range; the message names the field, value and range."""


@dataclass(frozen=True)
class Range:
    """A field's range: `low` to `high`, and zero when `zero`."""

    low: float
    high: float
    zero: bool = False

    def number(self, value: object) -> float | None:
        """`value` as a float when it is a number inside the range, else None (bools are no numbers)."""
        number = finite_number(value)
        if number is not None and (self.low <= number <= self.high or self.zero and number == 0):
            return number
        return None

    def read(self, value: object, what: str) -> float | None:
        """A host's field: None when `value` is no finite number (null, text, a bool; NaN and the
        infinities, which the bounded reader makes null anyway), the number when it is inside the
        range, else OutOfRange naming `what`."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        try:
            if not math.isfinite(float(value)):
                return None
        except OverflowError:
            return None
        return self.check(value, what)

    def check(self, value: float | int, what: str) -> float:
        """`value` (a number) as a float, or OutOfRange naming `what`, the value and the range."""
        number = self.number(value)
        if number is None:
            shown = f"{value:.6g}" if isinstance(value, float) else (f"{value}" if len(str(value)) <= 40 else "a huge integer")
            raise OutOfRange(f"{what} {shown} is outside its range ({self})")
        return number

    def __str__(self) -> str:
        return f"{'0 or ' if self.zero else ''}{self.low:g} to {self.high:g}"


FIGURE = Range(1e-9, 1e12, zero=True)          # a metric's value, samples, median and MAD
POSITIVE = Range(1e-9, 1e12)                   # per CPU second, the calibration probe: divided by
CPU_SHARE = Range(1e-6, 1e4)                   # CPU seconds per wall second (at most the cores)
