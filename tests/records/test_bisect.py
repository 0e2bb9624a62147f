"""Bisect's range, search and worktree on a real git repository with a synthetic engine history
(the probe reads the engine's files at each commit, checked out in the bisect worktree)."""
from __future__ import annotations

import dataclasses
import random
import subprocess
from pathlib import Path

import pytest

from orchestrator.records.bisect import (BisectError, Commit, MetricJudge, ProbeResult, Worktree, command_for,
                                         commit_range, max_probes, search)
from orchestrator.errors import UsageError
from orchestrator.runner.probe import golden_verdict
from orchestrator.records.record import GoldenRecord, HostRecord, StepRecord


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[Path, list[str]]:
    """A repository whose engine_src/speed.txt is 1000 for 16 commits, then 850 from commit 11
    (0-based) on; engine_src/golden.txt changes at commit 5; docs-only commits between."""
    repo = tmp_path_factory.mktemp("bisect") / "repo"
    (repo / "engine_src").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.email", "t@example.invalid")
    git(repo, "config", "user.name", "t")
    shas = []
    for i in range(16):
        (repo / "engine_src" / "speed.txt").write_text("850\n" if i >= 11 else "1000\n")
        (repo / "engine_src" / "golden.txt").write_text("1,2,4\n" if i >= 5 else "1,2,3\n")
        (repo / "engine_src" / "version.txt").write_text(f"{i}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"engine change {i}")
        shas.append(git(repo, "rev-parse", "HEAD"))
        if i in (3, 9):
            (repo / "NOTES.md").write_text(f"notes {i}\n")
            git(repo, "add", "-A")
            git(repo, "commit", "-qm", f"docs only {i}")
    return repo, shas


def test_the_range_is_one_commit_per_distinct_engine_tree(history):
    repo, shas = history
    commits = commit_range(repo, shas[0], "main")
    assert [c.sha for c in commits] == shas
    assert commits[11].subject == "engine change 11" and len({c.tree for c in commits}) == 16
    assert max_probes(len(commits)) == 6


def test_bad_ranges_are_refused_with_the_flag_named(history):
    repo, shas = history
    with pytest.raises(UsageError, match="--good 'nope' is no commit"):
        commit_range(repo, "nope", "main")
    with pytest.raises(UsageError, match="--bad '--all' is not a revision"):
        commit_range(repo, shas[0], "--all")
    with pytest.raises(UsageError, match="is not an ancestor of --bad"):
        commit_range(repo, shas[5], shas[2])
    with pytest.raises(UsageError, match="same commit"):
        commit_range(repo, shas[3], shas[3])
    docs_only = git(repo, "rev-parse", f"{shas[3]}~0")
    with pytest.raises(UsageError, match="nothing to bisect"):
        commit_range(repo, docs_only, git(repo, "log", "--format=%H", "-1", "--grep", "docs only 3"))


def read_probe(tree: Worktree, calls: list[str]):
    """A golden probe: bad when golden.txt is not the original tokens; values from speed.txt."""
    def probe(commit):
        path = tree.checkout(commit.sha)
        calls.append(commit.sha)
        golden = (path / "engine_src" / "golden.txt").read_text().strip()
        speed = float((path / "engine_src" / "speed.txt").read_text())
        rng = random.Random(commit.sha)
        samples = tuple(speed * rng.gauss(1, 0.01) for _ in range(5))
        return ProbeResult(golden != "1,2,3", f"golden {golden}", speed, samples)
    return probe


def test_golden_bisect_finds_the_guilty_commit_within_the_budget_and_leaves_the_checkout_alone(history):
    repo, shas = history
    (repo / "NOTES.md").write_text("my uncommitted edit\n")
    before = (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "branch", "--show-current"))
    calls: list[str] = []
    lines: list[str] = []
    with Worktree(repo) as tree:
        assert tree.path is not None and not str(tree.path).startswith(str(repo))
        result = search(commit_range(repo, shas[0], shas[-1]), read_probe(tree, calls), log=lines.append)
    assert result.first_bad.sha == shas[5] and result.last_good.sha == shas[4]
    assert result.last_line() == f"first bad commit: {shas[5]} engine change 5"
    assert len(calls) <= 6 and calls[:2] == [shas[-1], shas[0]]
    assert lines[0].startswith("probe 1/6: ") and "BAD" in lines[0] and "good" in lines[1]
    assert (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain"), git(repo, "branch", "--show-current")) == before
    assert (repo / "NOTES.md").read_text() == "my uncommitted edit\n"
    assert git(repo, "worktree", "list").count("\n") == 0      # the bisect worktree is gone
    assert not tree.parent.exists()
    git(repo, "checkout", "-q", "--", "NOTES.md")


def test_metric_bisect_finds_the_slowing_commit(history):
    repo, shas = history
    calls: list[str] = []
    with Worktree(repo) as tree:
        result = search(commit_range(repo, shas[0], shas[-1]), read_probe(tree, calls),
                        classify=lambda good, bad: MetricJudge(good, bad, "higher"))
    assert result.first_bad.sha == shas[11] and len(calls) <= 6
    assert all(p.value is not None for _, p in result.probes)


def test_ends_that_are_not_what_they_were_said_to_be_stop_the_search(history):
    repo, shas = history
    with Worktree(repo) as tree:
        with pytest.raises(BisectError, match="is not bad: golden 1,2,3"):
            search(commit_range(repo, shas[0], shas[4]), read_probe(tree, []), log=lambda _: None)
        with pytest.raises(BisectError, match="is not worse than the good end"):
            search(commit_range(repo, shas[0], shas[9]), read_probe(tree, []),
                   classify=lambda good, bad: MetricJudge(good, bad, "higher"), log=lambda _: None)


def test_metric_judge_needs_a_step_beyond_the_noise():
    good = ProbeResult(False, "", 1000.0, (990.0, 1000.0, 1010.0))
    assert MetricJudge(good, ProbeResult(False, "", 850.0, (845.0, 850.0, 855.0)), "higher")(
        ProbeResult(False, "", 900.0)) is True
    with pytest.raises(BisectError, match="beyond 3 x"):
        MetricJudge(good, ProbeResult(False, "", 980.0, (900.0, 980.0, 1060.0)), "higher")
    slower = MetricJudge(ProbeResult(False, "", 2.0), ProbeResult(False, "", 2.6), "lower")
    assert slower(ProbeResult(False, "", 2.4)) and not slower(ProbeResult(False, "", 2.1))


def test_metric_judge_compares_per_cpu_second_when_the_ends_report_it():
    good = ProbeResult(False, "", 1000.0, (990.0, 1000.0, 1010.0), cpu_samples=(1999.0, 2000.0, 2001.0))
    bad = ProbeResult(False, "", 850.0, (845.0, 850.0, 855.0), cpu_samples=(1699.0, 1700.0, 1701.0))
    judge = MetricJudge(good, bad, "higher")
    starved = ProbeResult(False, "", 500.0, (480.0, 500.0, 520.0), cpu_samples=(1990.0, 2000.0, 2010.0))
    assert judge(starved) is False and not judge.unsure(starved)        # slow on the wall clock only
    assert judge(ProbeResult(False, "", 990.0, cpu_samples=(1710.0, 1700.0, 1690.0))) is True
    assert judge.unsure(ProbeResult(False, "", 900.0, cpu_samples=(1860.0, 1850.0, 1840.0)))
    with pytest.raises(BisectError, match="no figures per CPU second"):
        judge(ProbeResult(False, "", 1000.0))


def test_metric_judge_takes_the_best_run_per_cpu_second_from_five_runs_as_the_detector_does():
    """Under load most runs of a probe are slowed by varying amounts: the medians of these ends
    (1500 and 1300, MAD 200 each) cannot separate a 15 % step, their best runs can (2000 and 1700;
    the better halves' MAD 10). With fewer than Policy.best_of runs, or for a speed-up, the median."""
    good = ProbeResult(False, "", 900.0, cpu_samples=(2000.0, 1500.0, 1400.0, 1990.0, 1300.0))
    bad = ProbeResult(False, "", 800.0, cpu_samples=(1700.0, 1690.0, 1200.0, 1100.0, 1300.0))
    judge = MetricJudge(good, bad, "higher")
    assert judge.threshold == 1850.0
    assert judge(ProbeResult(False, "", 0.0, cpu_samples=(1710.0, 1000.0, 1100.0, 1200.0, 1300.0)))
    assert not judge(ProbeResult(False, "", 0.0, cpu_samples=(1995.0, 1000.0, 1100.0, 1200.0, 1300.0)))
    with pytest.raises(BisectError, match="beyond 3 x"):     # a speed-up: the medians
        MetricJudge(dataclasses.replace(good, ratio=True), dataclasses.replace(bad, ratio=True), "higher")
    with pytest.raises(BisectError, match="beyond 3 x"):     # four runs: the medians
        MetricJudge(dataclasses.replace(good, cpu_samples=good.cpu_samples[:4]),
                    dataclasses.replace(bad, cpu_samples=bad.cpu_samples[:4]), "higher")
    slower = MetricJudge(ProbeResult(False, "", 0.0, cpu_samples=(2.0, 2.5, 2.6, 2.01, 2.7)),
                         ProbeResult(False, "", 0.0, cpu_samples=(2.4, 2.41, 3.0, 3.1, 2.9)), "lower")
    assert slower.threshold == 2.2


def test_a_probe_too_close_to_call_is_measured_again_and_pooled():
    commits = [Commit(f"{i:040x}", f"commit {i}", f"tree{i}") for i in range(16)]
    disturbed = {7: [920.0]}        # commit 7 is good, but its first measurement was disturbed
    calls: list[int] = []
    lines: list[str] = []

    def probe(commit):
        i = commits.index(commit)
        calls.append(i)
        value = disturbed[i].pop() if disturbed.get(i) else (850.0 if i >= 11 else 1000.0)
        return ProbeResult(False, f"{value:g}", value, (value - 2, value, value + 2), built=calls.count(i) == 1)

    result = search(commits, probe, classify=lambda good, bad: MetricJudge(good, bad, "higher"), log=lines.append)
    assert result.first_bad == commits[11] and calls.count(7) == 2
    assert any("too close to call: measuring again" in line for line in lines)
    assert result.builds <= max_probes(16)                            # measuring again built nothing
    pooled = next(p for c, p in result.probes if c == commits[7])
    assert pooled.value == 1000.0 and len(pooled.samples) == 6 and "again: 1000" in pooled.evidence


def test_the_bisect_command_is_exact_and_quoted():
    assert command_for("ct200", "tiny_fp32.ar_tokens_per_s", "a" * 40, "b" * 40) == \
        f"invoke bisect --host ct200 --good {'a' * 40} --bad {'b' * 40} --metric tiny_fp32.ar_tokens_per_s"
    assert command_for("h", "odd metric;rm", "a", "b").endswith("--metric 'odd metric;rm'")
    assert command_for("h", "m", None, "b") is None and command_for("h", "m", "a", "a") is None


def test_a_golden_probe_whose_outputs_were_reused_and_checked_again_is_judged_by_the_checks():
    """A commit whose executables equal an earlier probe's gets a `cached` golden step (the
    outputs reused, the checks made again against its own expected manifest): good when they
    pass, saying the outputs were reused; bad when a bundle differs. (A bisect under load named a
    good comment-only commit bad when `cached` counted as a failure.)"""
    def host(step: str, *bundles: str) -> HostRecord:
        return HostRecord(steps={"golden": StepRecord(step, reused_from="20261202-064619-059b" if step == "cached" else None,
                                                      message="a message")},
                          golden={name: GoldenRecord(status) for name, status in zip(("tiny", "tiny2"), bundles)})
    reused = golden_verdict(host("cached", "passed", "passed"), built=True)
    assert not reused.bad and reused.evidence == \
        "golden tokens of 2 bundle(s) match (the engine's outputs reused from run 20261202-064619-059b)"
    assert golden_verdict(host("cached", "passed", "failed"), built=False).bad
    assert golden_verdict(host("passed", "passed", "passed"), built=True).evidence == "golden tokens of 2 bundle(s) match"
    failed = golden_verdict(host("failed", "passed", "passed"), built=True)
    assert failed.bad and failed.evidence == "golden step failed: a message"
