"""The records and their history: what a run learned and everything read from it afterwards.

record.py (run.json's schema) <- result_files.py, golden.py (the engine's results and the golden
matrix, parsed into it) <- run_store.py (run directories: run.json written, redacted by
redaction.py, read back) <- run_view.py (a record made safe for rendering) <- report.py
(Markdown, HTML, JUnit; templates/), regression.py (baselines, comparisons); history.py (the
benchmark history, SQLite) <- detector.py (verdicts, pure functions) <- dashboard.py; bisect.py
(the search over commits). ranges.py checks every benchmark figure where it enters.
Nothing here runs a host command: the runner fills the records, these modules only read them.
"""
