#!/usr/bin/env python3
"""Benchmark history acceptance: false alarms under load, detecting a 15 % slowdown, bisect.

    python3 benchmarks/history_acceptance.py [--parts false-alarms,detection,bisect] [--runs 20]
        [--load-jobs 4] [--quiet-runs 6] [--detect-under-load] [--steps STEPS] [--bench-args ARGS]
        [--bench-command CMD] [--slowdown work|wall] [--target METRIC] [--host local] [--inventory hosts.yaml]
        [--work-dir DIR] [--json out.json]

A script, not a test (pytest never collects it). Everything happens in a scratch clone of this
repository under the work dir (default: a new temporary directory), so the runs, the history
files and the commits it makes never touch this checkout. Each nightly is a real
`invoke nightly --host HOST --history FILE` subprocess in the clone; --steps narrows the nightly's
steps and --bench-args (KD_BENCH_ARGS, e.g. "--budgets 4,16 --moe-tokens 1") lightens the bench
in the clone's hosts.yaml, to fit the runs into the time there is (the figures say so);
--bench-command replaces the bench command, --inventory the inventory (another host: the GPU
machine's, docs/gpu-reference/history-detection.sh).

  false-alarms  --runs nightlies of the unchanged tree while --load-jobs processes compile the
                engine's sources in a loop (a parallel compile): the regressions each run reported
                (the history detector, from run.json) against what the old fixed-ratio rule (each
                metric vs the last passing nightly, 10 %) says of the same runs, with how many
                verdicts the detector left unjudged as measured under contention and the CPU
                share of the target metric. Passes when the detector raised none and the old rule
                at least one (else the load was not real).
  detection     --quiet-runs nightlies of the unchanged tree into a fresh history, then a commit
                that makes AR decoding repeat 3 of every 17 forward passes (17.65 % more work per
                decoded token: tiny_fp32.ar_decode_tokens_per_s x 0.85), then one
                nightly (with --detect-under-load, all of them under the compile loops too):
                passes when it reports tiny_fp32.ar_decode_tokens_per_s as a regression.
  bisect        a 16-commit engine history (comment-only commits, one that breaks a golden token
                at commit 6, the slowing one at commit 11): `invoke bisect --golden` and
                `invoke bisect --metric tiny_fp32.ar_decode_tokens_per_s` must name those commits with
                at most ceil(log2 16) + 2 = 6 builds each; the time of each is reported.

  replay        the false-alarms and detection parts of an earlier run in --work-dir judged
                again, night by night, by this checkout's detector; and once more with each
                bundle's ddtree_best_decode_speedup rebuilt from its two timings' samples paired
                by round (DDTree's run r over AR's run r, as the bench pairs them since), so that
                runs measured before the pairing show what it changes.

More repeats per night narrow a night's own spread: --bench-args "... --repeats 5" (the bench's
default is 3), and "--min-time-ms 400" makes each run the best of the generations of 400 ms (a
nightly's measurement); the figures in docs/benchmarks/records/2026-12-03-issue-23-benchmark-history.md say which each part used. --target names
the metric the detection part and the metric bisect must flag (the GPU machine's is
k2mini_fp32.ar_decode_tokens_per_s, docs/gpu-reference/history-detection.sh).

Prints a table per part and a summary; --json writes every figure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
TARGET = "tiny_fp32.ar_decode_tokens_per_s"   # what the slowing commit slows by 15 % on the CPU (--target)
TOLERANCE = 0.10                  # the old rule's default relative tolerance

# A real code change: AR decoding runs 3 of every 17 steps' forward pass twice (the same token at
# the same position, so the same cache rows and tokens): 17.65 % more work per decoded token, so
# tiny_fp32.ar_decode_tokens_per_s x 0.85, on the CPU and on the GPU. (A spin on the process's CPU
# clock was tried first: its clock_gettime calls slowed the multi-threaded matmuls and the bench's
# calibration probe after it as well, 0.52-0.62x per CPU second instead of 0.85.)
SLOWING_PATCH = ("engine_src/src/decode.cpp", [
    ("        model.forward(&token, &pos, 1, vis);\n        ++g.forwards;\n",
     "        model.forward(&token, &pos, 1, vis);\n        ++g.forwards;\n"
     "        if (g.forwards % 17 < 3) model.forward(&token, &pos, 1, vis);\n"),
])
# A spin of 0.1765 x each AR step's wall time (--slowdown wall, as the H200 run used): tokens/s
# x 0.85 on the wall clock where nothing else shares the machine.
WALL_SLOWING_PATCH = ("engine_src/src/decode.cpp", [
    ("    g.tokens.push_back(prefill(model, prompt));\n",
     "    g.tokens.push_back(prefill(model, prompt));\n"
     "    for (const double until = now_seconds() + 0.1765 * (now_seconds() - t0); now_seconds() < until;) {}\n"),
    ("        int32_t token = g.tokens.back();\n",
     "        const double step_start = now_seconds();\n        int32_t token = g.tokens.back();\n"),
    ("        model.backend().argmax(&token, model.logits(), 1, model.config().vocab_size);\n",
     "        model.backend().argmax(&token, model.logits(), 1, model.config().vocab_size);\n"
     "        for (const double until = now_seconds() + 0.1765 * (now_seconds() - step_start); now_seconds() < until;) {}\n"),
])
SLOWDOWNS = {"work": SLOWING_PATCH, "wall": WALL_SLOWING_PATCH}
# A golden-token change: AR's 8th token becomes the next one in the vocabulary.
GOLDEN_PATCH = ("engine_src/src/decode.cpp", [
    ("        g.tokens.push_back(token);\n    }\n    g.decode_counters = model.backend().counters() - k1;\n",
     "        if (g.tokens.size() == 7) token = (token + 1) % model.config().vocab_size;\n"
     "        g.tokens.push_back(token);\n    }\n    g.decode_counters = model.backend().counters() - k1;\n"),
])
COMMENT_FILES = ("engine_src/src/tree.cpp", "engine_src/src/bundle.cpp", "engine_src/src/json.cpp",
                 "engine_src/src/args.cpp", "engine_src/src/model.cpp")


def sh(args: list[str], cwd: Path, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, check=check, capture_output=True, text=True, **kw)


def scratch_clone(work: Path, args) -> Path:
    """A fresh clone of this repository's HEAD under the work dir, with a committer set. With
    --inventory, its hosts.yaml is that inventory with the clone's engine_src as the source; with
    --bench-args, the bench command passes them to the engine's bench; with --bench-command, it
    is that command."""
    repo = work / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    sh(["git", "clone", "--quiet", str(REPO), str(repo)], work)
    sh(["git", "config", "user.email", "bench@example.invalid"], repo)
    sh(["git", "config", "user.name", "history acceptance"], repo)
    inventory = repo / "hosts.yaml"
    data = yaml.safe_load((args.inventory or inventory).read_text())
    if args.inventory:
        data["project"]["source"] = str(repo / "engine_src")
    commands = data["project"]["commands"]
    if args.bench_command:
        commands["bench"] = commands["bench_nightly"] = args.bench_command
    elif args.bench_args:
        if commands.get("bench") != "bash scripts/bench.sh":
            raise SystemExit(f"{args.inventory or inventory}: the bench command is not `bash scripts/bench.sh`; "
                             "give --bench-command instead of --bench-args")
        # validate (bisect's probes) and nightly measure alike here
        commands["bench"] = commands["bench_nightly"] = f"KD_BENCH_ARGS={shlex.quote(args.bench_args)} bash scripts/bench.sh"
    if args.inventory or args.bench_command or args.bench_args:
        inventory.write_text(yaml.safe_dump(data, sort_keys=False))
        commit(repo, "hosts.yaml: the acceptance runs' inventory and bench")
    return repo


def patch_and_commit(repo: Path, patch: tuple[str, list[tuple[str, str]]], message: str) -> str:
    path, edits = patch
    text = (repo / path).read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{path}: the patch's anchor {old.strip()!r} is not there once; update {Path(__file__).name}")
        text = text.replace(old, new)
    (repo / path).write_text(text)
    return commit(repo, message)


def commit(repo: Path, message: str) -> str:
    sh(["git", "commit", "-qam", message], repo)
    return sh(["git", "rev-parse", "HEAD"], repo).stdout.strip()


class Load:
    """--load-jobs processes compiling the engine's sources in a loop, in their own sessions."""

    def __init__(self, jobs: int, work: Path):
        self.jobs, self.work, self.procs = jobs, work, []

    def __enter__(self) -> "Load":
        sources = " ".join(str(p) for p in sorted((REPO / "engine_src" / "src").glob("*.cpp")))
        loop = f"while :; do for f in {sources}; do g++ -O2 -std=c++17 -I{REPO / 'engine_src' / 'src'} -c \"$f\" -o /dev/null; done; done"
        for _ in range(self.jobs):
            self.procs.append(subprocess.Popen(["bash", "-c", loop], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            proc.wait()


def clone_env(repo: Path) -> dict:
    """The environment of a command in the clone: its orchestrator first on the Python path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}


def nightly(repo: Path, history: Path, host: str, steps: str | None) -> dict:
    """One `invoke nightly` in the clone; its exit code, run record, seconds and load average."""
    args = [sys.executable, "-m", "invoke", "nightly", "--host", host, "--history", str(history)]
    if steps:
        args += ["--steps", steps]
    load = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.run(args, cwd=repo, env=clone_env(repo), capture_output=True, text=True,
                          timeout=3600)
    seconds = time.monotonic() - start
    run_dir = (repo / "runs" / "latest").resolve()
    if proc.returncode not in (0, 3):
        raise SystemExit(f"nightly exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    run = json.loads((run_dir / "run.json").read_text())
    return {"rc": proc.returncode, "run": run, "seconds": round(seconds, 1), "load": round(load, 2),
            "stdout": proc.stdout}


def old_rule(runs: list[dict], host: str) -> list[list[str]]:
    """Per run, the metrics the fixed-ratio rule flags against the last passing run before it."""
    flagged, baseline = [], None
    for run in runs:
        metrics = run["hosts"][host]["bench"]["metrics"]
        worse = []
        if baseline is not None:
            for name, m in metrics.items():
                base = baseline.get(name)
                if base and base > 0:
                    ratio = m["value"] / base
                    if (ratio < 1 - TOLERANCE) if m["better"] == "higher" else (ratio > 1 + TOLERANCE):
                        worse.append(f"{name} {ratio:.2f}x")
        flagged.append(worse)
        if run["status"] == "passed":
            baseline = {name: m["value"] for name, m in metrics.items()}
    return flagged


def reported(run: dict, host: str) -> list[str]:
    return [f"{r['metric']} {r['ratio']:.2f}x" for r in run.get("regressions", []) if r["host"] == host]


def contended(history: Path, runs: list[dict], host: str,
              target: str = TARGET) -> tuple[list[int], list[float | None], list[float | None]]:
    """Per run, how many of its metrics the detector left unjudged as measured under contention
    (judged again from the history file, as nightly judged them), the target metric's CPU share and
    how much the calibration probe alone moved the target (> 0: the machine made it worse)."""
    sys.path.insert(0, str(REPO))
    from orchestrator.records import history as history_mod, regression
    counts, shares, machine = [], [], []
    with history_mod.HistoryStore.open(history) as store:
        for run in runs:
            verdicts = history_mod.judge_run(store, run, lambda metric: regression.threshold_for(metric, {}))
            counts.append(sum(1 for _, v in verdicts if v.status == "unjudged" and "under contention" in v.reason))
            shares.append(run["hosts"][host]["bench"]["metrics"].get(target, {}).get("cpu_share"))
            machine.append(next((v.calibration_change for p, v in verdicts if p.metric == target), None))
    return counts, shares, machine


def without_calibration(history: Path, runs: list[dict]) -> list[list[str]]:
    """Per run, the regressions the detector raises when the calibration probe is left out (the
    same history judged on the wall clock and per CPU second alone): what the probe changed."""
    sys.path.insert(0, str(REPO))
    import dataclasses
    from orchestrator.records import detector, history as history_mod, regression
    flagged = []
    with history_mod.HistoryStore.open(history) as store:
        for run in runs:
            found = []
            for point in history_mod.run_points(run):
                if point.reused:
                    continue
                before = store.series(point.key, point.metric, before=point.run_id, limit=30)
                verdict = detector.judge(dataclasses.replace(point.point(), cal_samples=()),
                                         [dataclasses.replace(p.point(), cal_samples=()) for p in before],
                                         regression.threshold_for(point.metric, {}), point.better)
                if verdict.regressed:
                    found.append(f"{point.metric} {verdict.ratio:.2f}x")
            flagged.append(found)
    return flagged


def false_alarms(args, work: Path) -> dict:
    repo = scratch_clone(work, args)
    history = work / "history-load.sqlite"
    results = []
    print(f"\n== false alarms: {args.runs} nightlies of an unchanged tree under {args.load_jobs} compile jobs")
    nightly(repo, work / "history-warmup.sqlite", args.host, args.steps)       # first build and bundles, not counted
    with Load(args.load_jobs, work):
        for i in range(args.runs):
            results.append(nightly(repo, history, args.host, args.steps))
            print(f"  night {i + 1:2d}: exit {results[-1]['rc']}, {results[-1]['seconds']:.0f} s, load {results[-1]['load']:.1f}, "
                  f"detector {len(reported(results[-1]['run'], args.host))}", flush=True)
    old = old_rule([r["run"] for r in results], args.host)
    unjudged, shares, machine = contended(history, [r["run"] for r in results], args.host)
    uncalibrated = without_calibration(history, [r["run"] for r in results])
    rows = []
    print(f"  {'night':>5}  {'load':>5}  {'share':>5}  {'probe':>6}  {'exit':>4}  {'detector':>8}  {'contended':>9}  "
          f"{'no probe':>8}  {'old rule':>8}  detector flagged / without the probe / old rule flagged")
    for i, (r, o, u, s, m, w) in enumerate(zip(results, old, unjudged, shares, machine, uncalibrated), 1):
        new = reported(r["run"], args.host)
        rows.append({"night": i, "load": r["load"], "cpu_share": s, "probe_change": m, "rc": r["rc"], "detector": new,
                     "contended": u, "without_probe": w, "old_rule": o, "seconds": r["seconds"]})
        share = f"{s:5.2f}" if s is not None else "    -"
        probe = f"{m:+6.1%}" if m is not None else "     -"
        print(f"  {i:5d}  {r['load']:5.1f}  {share}  {probe}  {r['rc']:4d}  {len(new):8d}  {u:9d}  {len(w):8d}  {len(o):8d}  "
              f"{', '.join(new)[:60]} / {', '.join(w)[:60]} / {', '.join(o)[:60]}")
    detector_total = sum(len(r["detector"]) for r in rows)
    old_total = sum(len(r["old_rule"]) for r in rows)
    without_total = sum(len(r["without_probe"]) for r in rows)
    ok = detector_total == 0 and old_total >= 1
    print(f"  detector: {detector_total} regressions in {sum(1 for r in rows if r['detector'])} nights, "
          f"{sum(unjudged)} verdicts unjudged as measured under contention; without the calibration probe "
          f"{without_total} in {sum(1 for r in rows if r['without_probe'])} nights; "
          f"old rule: {old_total} in {sum(1 for r in rows if r['old_rule'])} nights  -> {'PASS' if ok else 'FAIL'}")
    return {"runs": rows, "detector_regressions": detector_total, "old_rule_regressions": old_total,
            "without_probe_regressions": without_total, "contended_verdicts": sum(unjudged), "pass": ok}


def target_verdict(history: Path, run: dict, target: str) -> str:
    """The detector's verdict on the target metric of a run, judged again from the history file."""
    sys.path.insert(0, str(REPO))
    from orchestrator.records import history as history_mod, regression
    with history_mod.HistoryStore.open(history) as store:
        verdicts = history_mod.judge_run(store, run, lambda metric: regression.threshold_for(metric, {}))
    return next((f"{v.status} ({v.method}): {v.reason}" for p, v in verdicts if p.metric == target), "no verdict")


def night_median(run: dict, host: str, metric: str, key: str) -> float | None:
    """The median of a night's samples of a metric (wall clock or per CPU second), None without them."""
    samples = run["hosts"][host]["bench"]["metrics"].get(metric, {}).get(key)
    return statistics.median(samples) if samples else None


def spread(values: list[float | None]) -> str:
    """The robust spread of the nights' figures, 1.4826 x MAD / median, as a percentage."""
    kept = [v for v in values if v]
    if len(kept) < 2:
        return "-"
    med = statistics.median(kept)
    return f"{1.4826 * statistics.median(abs(v - med) for v in kept) / med:.1%}"


def detection(args, work: Path) -> dict:
    repo = scratch_clone(work, args)
    history = work / "history-detect.sqlite"
    jobs = args.load_jobs if args.detect_under_load else 0
    print(f"\n== detection: {args.quiet_runs} nightlies, then a commit that slows AR decoding 15 %, then one nightly"
          f"{f', under {jobs} compile jobs' if jobs else ''}")
    nightly(repo, work / "history-warmup.sqlite", args.host, args.steps)       # first build and bundles, not counted
    with Load(jobs, work):
        quiet = [nightly(repo, history, args.host, args.steps) for _ in range(args.quiet_runs)]
        sha = patch_and_commit(repo, SLOWDOWNS[args.slowdown],
                               f"decode: AR 15 % slower ({args.slowdown})")
        after = nightly(repo, history, args.host, args.steps)
    for i, q in enumerate(quiet, 1):
        print(f"  quiet night {i}: exit {q['rc']}, {q['seconds']:.0f} s, load {q['load']:.1f}, "
              f"regressions {', '.join(reported(q['run'], args.host)) or 'none'}")
    target = args.target
    before = [q["run"]["hosts"][args.host]["bench"]["metrics"][target]["value"] for q in quiet]
    value = after["run"]["hosts"][args.host]["bench"]["metrics"][target]["value"]
    flags = {r["metric"]: r for r in after["run"].get("regressions", []) if r["host"] == args.host}
    ok = after["rc"] == 3 and target in flags
    ratio = value / sorted(before)[len(before) // 2]
    metric = after["run"]["hosts"][args.host]["bench"]["metrics"][target]
    medians = {clock: [night_median(r["run"], args.host, target, key) for r in quiet + [after]]
               for clock, key in (("wall", "samples"), ("cpu", "cpu_samples"))}
    print(f"  {target}: the nights' medians (what the detector judges), wall clock "
          f"{' '.join(f'{v:.0f}' if v else '-' for v in medians['wall'])}, per CPU second "
          f"{' '.join(f'{v:.0f}' if v else '-' for v in medians['cpu'])} (the last after the commit); "
          f"spread of the quiet nights {spread(medians['wall'][:-1])} wall, {spread(medians['cpu'][:-1])} per CPU second")
    print(f"  {target}: quiet runs {', '.join(f'{v:.0f}' for v in before)}; after {sha[:10]}: {value:.0f} "
          f"({ratio:.3f}x of the median, CPU share {metric.get('cpu_share')}, load {after['load']}); "
          f"nightly exit {after['rc']}; flagged: {', '.join(reported(after['run'], args.host)) or 'nothing'}")
    if target in flags:
        evidence = flags[target]
        print(f"  evidence: {evidence.get('method')} rule, {(evidence.get('evidence') or {}).get('reason', '')}")
    else:
        print(f"  {target} not flagged: {target_verdict(history, after['run'], target)}")
    bisect_line = next((line for line in after["stdout"].splitlines() if "invoke bisect" in line), None)
    print(f"  bisect command printed: {bisect_line.strip() if bisect_line else 'NONE'}  -> {'PASS' if ok else 'FAIL'}")
    return {"before": before, "after": value, "ratio": ratio, "rc": after["rc"], "flagged": sorted(flags),
            "flagged_ratios": {name: r["ratio"] for name, r in sorted(flags.items())},
            "quiet_regressions": [reported(q["run"], args.host) for q in quiet], "slowdown": args.slowdown,
            "target": target, "night_medians": medians, "evidence": flags.get(target), "seconds": [q["seconds"] for q in quiet] + [after["seconds"]],
            "loads": [q["load"] for q in quiet] + [after["load"]], "load_jobs": jobs,
            "bisect_command": bisect_line, "pass": ok and bisect_line is not None}


def paired_speedups(run: dict) -> dict:
    """A copy of a run record whose bundles' ddtree_best_decode_speedup samples (wall clock, per CPU
    second, probe) are rebuilt by round from the best-decode DDTree timing's and the AR decode's
    samples: what the bench reports since it pairs them (runs measured before that can be replayed so)."""
    run = json.loads(json.dumps(run))
    for host in (run.get("hosts") or {}).values():
        metrics = (host.get("bench") or {}).get("metrics") or {}
        for bundle in {name.split(".")[0] for name in metrics}:
            speedup = metrics.get(f"{bundle}.ddtree_best_decode_speedup")
            tree, ar = metrics.get(f"{bundle}.ddtree_best_decode_tokens_per_s"), metrics.get(f"{bundle}.ar_decode_tokens_per_s")
            if not (speedup and tree and ar):
                continue
            for key in ("samples", "cpu_samples", "cal_samples"):
                over, under = tree.get(key), ar.get(key)
                if over and under and len(over) == len(under) and all(u > 0 for u in under):
                    speedup[key] = [o / u for o, u in zip(over, under)]
    return run


def replay(args, work: Path) -> dict:
    """The false-alarms and detection parts of an earlier run in --work-dir judged again, night by
    night, by this checkout's detector (what a detector change does to the same measurements), and
    with the speed-ups paired by round (paired_speedups: the runs indexed again into a scratch history)."""
    sys.path.insert(0, str(REPO))
    from orchestrator.records import history as history_mod, regression
    found = {}
    for part, name in (("false-alarms", "history-load.sqlite"), ("detection", "history-detect.sqlite")):
        history, runs_dir = work.parent / part / name, work.parent / part / "repo" / "runs"
        if not history.is_file():
            continue
        rows = []
        scratch = work / f"{part}-paired.sqlite"
        scratch.unlink(missing_ok=True)
        with history_mod.HistoryStore.open(history) as store, history_mod.HistoryStore.open(scratch) as paired_store:
            for run_json in sorted(runs_dir.glob("*/run.json")):
                if run_json.parent.is_symlink():
                    continue        # runs/latest
                run = json.loads(run_json.read_text())
                if not store.has_run(run["run_id"]):
                    continue        # the warm-up night, in its own history
                verdicts = history_mod.judge_run(store, run, lambda metric: regression.threshold_for(metric, {}))
                now = [f"{p.metric} {v.ratio:.2f}x" for p, v in verdicts if v.regressed]
                paired = paired_speedups(run)
                paired_verdicts = history_mod.judge_run(paired_store, paired, lambda metric: regression.threshold_for(metric, {}))
                paired_store.index_run(paired)
                rows.append({"run": run["run_id"], "as_run": reported(run, args.host), "replayed": now,
                             "not_judged": sum(1 for _, v in verdicts if v.status == "unjudged"),
                             "paired": [f"{p.metric} {v.ratio:.2f}x" for p, v in paired_verdicts if v.regressed]})
        print(f"\n== replay of {part}: {len(rows)} nights judged again by this checkout's detector "
              "(and with the speed-ups paired by round)")
        for i, r in enumerate(rows, 1):
            print(f"  night {i:2d} {r['run']}: as run {len(r['as_run'])}, replayed {len(r['replayed'])}, not judged "
                  f"{r['not_judged']}, paired {len(r['paired'])}  {', '.join(r['replayed'])[:80]} / {', '.join(r['paired'])[:80]}")
        print(f"  total: as run {sum(len(r['as_run']) for r in rows)}, replayed {sum(len(r['replayed']) for r in rows)} "
              f"in {sum(1 for r in rows if r['replayed'])} nights, speed-ups paired {sum(len(r['paired']) for r in rows)} "
              f"in {sum(1 for r in rows if r['paired'])} nights")
        found[part] = rows
    return found


def bisect(args, work: Path) -> dict:
    repo = scratch_clone(work, args)
    print("\n== bisect: a 16-commit engine history, golden broken at commit 6, AR 15 % slower at commit 11")
    shas = [sh(["git", "rev-parse", "HEAD"], repo).stdout.strip()]
    for i in range(1, 16):
        if i == 6:
            shas.append(patch_and_commit(repo, GOLDEN_PATCH, "decode: the 8th AR token moves (golden breaks)"))
        elif i == 11:
            shas.append(patch_and_commit(repo, SLOWDOWNS[args.slowdown],
                                         f"decode: AR 15 % slower ({args.slowdown})"))
        else:
            path = repo / COMMENT_FILES[i % len(COMMENT_FILES)]
            path.write_text(path.read_text() + f"// history acceptance: comment-only commit {i}\n")
            shas.append(commit(repo, f"comment-only commit {i}"))
    results = {}
    modes = (("golden", ["--golden"], shas[6]), ("metric", ["--metric", args.target], shas[11]))
    for mode, flag, guilty in (m for m in modes if m[0] in args.bisect_modes.split(",")):
        args_ = [sys.executable, "-m", "invoke", "bisect", "--host", args.host, "--good", shas[0], "--bad", shas[15], *flag]
        start = time.monotonic()
        proc = subprocess.run(args_, cwd=repo, env=clone_env(repo), capture_output=True,
                              text=True, timeout=7200)
        seconds = time.monotonic() - start
        lines = proc.stdout.strip().splitlines()
        last = lines[-1] if lines else ""
        probes = len([line for line in lines if re.match(r"^probe \d+/\d+:", line)])
        builds = len([line for line in lines if re.match(r"^probe \d+/\d+:", line) and "cached build" not in line])
        again = len([line for line in lines if "measuring again" in line])
        found = last.split()[3] if last.startswith("first bad commit: ") else None
        ok = proc.returncode == 0 and found == guilty and builds <= math.ceil(math.log2(16)) + 2
        print(f"  --{mode}: {probes} probes ({again} measured again), {builds} builds, {seconds:.0f} s, load "
              f"{os.getloadavg()[0]:.1f} at the end; {last}  (expected {guilty[:10]}) "
              f"-> {'PASS' if ok else 'FAIL'}")
        if not ok:
            print(proc.stdout[-3000:], proc.stderr[-2000:])
        print("\n".join(f"    {line}" for line in lines if line.startswith(("probe ", "  "))))
        results[mode] = {"probes": probes, "again": again, "builds": builds, "seconds": round(seconds, 1), "found": found,
                         "guilty": guilty, "rc": proc.returncode, "pass": ok}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="false-alarms,detection,bisect")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load-jobs", type=int, default=4)
    parser.add_argument("--quiet-runs", type=int, default=6)
    parser.add_argument("--detect-under-load", action="store_true",
                        help="run the detection part's nightlies under --load-jobs compile loops too")
    parser.add_argument("--steps", default=None, help="nightly --steps (default: every step)")
    parser.add_argument("--bench-args", default=None, help="KD_BENCH_ARGS for the engine's bench in the clone")
    parser.add_argument("--bench-command", default=None, help="the clone's bench command instead (e.g. the engine's "
                        "bench alone on a GPU host, without the GPU kernel benchmarks)")
    parser.add_argument("--inventory", type=Path, default=None,
                        help="the inventory to use in the clone (its source becomes the clone's engine_src)")
    parser.add_argument("--slowdown", choices=sorted(SLOWDOWNS), default="work",
                        help="the slowing commit repeats 3 of every 17 AR forward passes (work) or spins 0.1765 x "
                             "each AR step's wall time (wall)")
    parser.add_argument("--target", default=TARGET, help="the metric the detection part and the metric bisect "
                        "must flag (default: %(default)s; the GPU machine's: k2mini_fp32.ar_decode_tokens_per_s)")
    parser.add_argument("--host", default="local")
    parser.add_argument("--bisect-modes", default="golden,metric", help="the bisect part's searches (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kdtree-history-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = {"false-alarms": false_alarms, "detection": detection, "bisect": bisect, "replay": replay}
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        parser.error(f"--parts: unknown part {unknown[0]!r} (parts: {', '.join(parts)})")
    figures = {"host": args.host, "cpus": os.cpu_count(), "steps": args.steps, "bench_args": args.bench_args,
               "work_dir": str(work)}
    for part in chosen:
        (work / part).mkdir(parents=True, exist_ok=True)
        figures[part] = parts[part](args, work / part)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
