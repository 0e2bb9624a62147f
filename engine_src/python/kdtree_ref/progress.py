"""Progress reports: lines of one fixed shape on a long command's output (build.sh,
gen_model.py, run_tests.sh print them), which the orchestrator shows live instead of printing:

    ::kdtree-progress done=N [total=N] unit=WORD [bytes=N] [what=TEXT]

the fields in this order, one space apart; N 1 to 15 decimal digits, done <= total; WORD 1 to 16
lowercase letters (files, bundles, tests, bytes); TEXT the rest of the line, what the command is
at; the whole line at most 512 characters. A line of another shape is ordinary output.

    report(2, 6, "bundles", "wrote model_tiny2_fp32.kdtr", nbytes=1_234_567)
    # ::kdtree-progress done=2 total=6 unit=bundles bytes=1234567 what=wrote model_tiny2_fp32.kdtr
"""
from __future__ import annotations

import sys
from typing import TextIO


def report(done: int, total: int | None, unit: str, what: str = "", nbytes: int | None = None,
           file: TextIO | None = None) -> None:
    """Print one progress report: `done` of `total` (None: unknown) `unit`s (a lowercase word),
    `nbytes` written so far, `what` the command is at (one line); flushed, so it shows now."""
    line = f"::kdtree-progress done={done}"
    line += f" total={total}" if total is not None else ""
    line += f" unit={unit}"
    line += f" bytes={nbytes}" if nbytes is not None else ""
    text = " ".join(what.split())[:400]      # the whole line within 512 characters
    line += f" what={text}" if text else ""
    print(line, file=file if file is not None else sys.stdout, flush=True)
