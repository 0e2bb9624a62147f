"""The run: one plan of steps over the selected hosts, into one run record.

pipeline.py (`Plan`, `execute`, the per-host runner, `finish`) -> run.py (`Run`: the connections,
locks, GPU claims and stop flag of one run) and parallel.py (bounded per-host threads); a step's
output goes through sink.py (bounded, to its log and the console) and progress.py (the progress
protocol and the one live display) to console.py (host-prefixed lines, the summary table).
probe.py is one bisect probe: a commit through the pipeline.
"""
